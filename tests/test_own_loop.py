"""examples/own_loop/train.py, a user's own PyTorch loop around `DecoupledDiLoCo`, as three real
learner processes against two real shards: the run trains and every script ends holding the
shards' exact bits, also one SIGKILLed and restarted from its own checkpoint."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from diloco.services.client import ShardClient
from diloco.localcluster.cluster import LocalCluster, Proc, free_ports
from diloco.services.contract.config import dump_config, load_config, parse_config
from tests.test_learner_cluster import held_fragments, read_report, shard_fragments, wait_until

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "own_loop"
TIMEOUT = 90  # seconds any one wait of a test may take


def own_loop_config(state_dir: pathlib.Path, steps: int, example: pathlib.Path = EXAMPLE):
    """The example's cluster.yaml on free ports, with its own state folder and step budget."""
    data = load_config(example / "cluster.yaml").model_dump(mode="json")
    ports = free_ports(len(data["shards"]))
    data["shards"] = [{**shard, "address": f"127.0.0.1:{port}"} for shard, port in zip(data["shards"], ports)]
    data["run"]["state_dir"] = str(state_dir)
    data["trainer"]["max_steps"] = steps
    return parse_config(data, source="own_loop test config")


class OwnLoopRun:
    """The shards of a LocalCluster (which writes the config copy the scripts read) and one
    train.py process per learner, each with its checkpoint and losses file in `folder`."""

    def __init__(self, cfg, folder: pathlib.Path):
        self.cfg = cfg
        self.folder = folder
        self.cluster = LocalCluster(cfg, folder / "run")
        self.scripts = {learner.id: Proc(learner.id, self.argv(learner.id), folder / "run" / "logs" / f"{learner.id}.log")
                        for learner in cfg.learners}

    def argv(self, learner_id: str) -> list[str]:
        # A catch-up that only SIGTERM ends: a script that finished first follows the global
        # model until the last one has finished too (finish_all).
        return [sys.executable, str(EXAMPLE / "train.py"), "--config", str(self.cluster.config_path),
                "--learner-id", learner_id, "--checkpoint", str(self.checkpoint(learner_id)),
                "--checkpoint-every", "20", "--losses", str(self.losses_path(learner_id)),
                "--catch-up-seconds", "600"]

    def checkpoint(self, learner_id: str) -> pathlib.Path:
        return self.folder / f"{learner_id}.pt"

    def losses_path(self, learner_id: str) -> pathlib.Path:
        return self.folder / f"{learner_id}-losses.json"

    def report(self, learner_id: str) -> dict:
        return read_report(self.cluster, learner_id)

    def finish_all(self) -> dict[str, dict]:
        """Every script spends its budget, then SIGTERM ends its catch-up; each must exit 0."""
        wait_until(lambda: all(self.report(i).get("phase") in ("catching_up", "done") for i in self.scripts),
                   TIMEOUT, "every script to spend its step budget")
        time.sleep(1.0)  # rounds in their grace window close
        for script in self.scripts.values():
            script.request_stop()
        for script in self.scripts.values():
            script.wait_or_kill(TIMEOUT)
            assert script.returncode == 0, f"{script.name} exited with {script.returncode}: see {script.log_path}"
        return {learner_id: self.report(learner_id) for learner_id in self.scripts}

    def start(self) -> OwnLoopRun:
        self.cluster.start_shards()
        for script in self.scripts.values():
            script.start()
        return self

    def stop(self) -> None:
        for script in self.scripts.values():
            script.kill()
        self.cluster.stop(timeout=10)


@pytest.fixture
def own_loop_run(tmp_path):
    runs: list[OwnLoopRun] = []

    def start(steps: int) -> OwnLoopRun:
        runs.append(OwnLoopRun(own_loop_config(tmp_path / "state", steps), tmp_path))
        return runs[-1].start()

    yield start
    for run in runs:
        run.stop()


def assert_every_script_holds_the_shards_bits(run: OwnLoopRun, reports: dict[str, dict]) -> None:
    shards = shard_fragments(run.cfg)
    assert len(shards) == run.cfg.sync.fragments and all(version > 0 for version, _ in shards.values())
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == run.cfg.trainer.max_steps
        assert held_fragments(report) == shards, f"{learner_id} does not hold the shards' bits"


def test_three_user_scripts_train_and_end_bit_identical_with_the_shards(own_loop_run):
    run = own_loop_run(steps=150)
    reports = run.finish_all()

    assert_every_script_holds_the_shards_bits(run, reports)
    for learner_id in run.scripts:
        losses = json.loads(run.losses_path(learner_id).read_text())
        assert [step for step, _ in losses["train"]] == list(range(1, 151))
        validation = losses["validation"]
        assert validation["end"] < validation["start"], f"{learner_id} did not learn: {validation}"


def checkpoint_step(path: pathlib.Path) -> int:
    return torch.load(path, weights_only=True)["step"] if path.exists() else 0


def heartbeat_step(cfg, learner_id: str) -> int:
    """The learner's step as the shards last heard it in a heartbeat (0: not yet)."""
    steps = [0]
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=None) as client:
            steps += [l.last_step for l in client.status(timeout=5).learners if l.learner_id == learner_id]
    return max(steps)


def test_a_user_script_killed_and_restarted_from_its_own_checkpoint_rejoins(own_loop_run):
    run = own_loop_run(steps=200)
    victim = run.scripts["us-west-0"]
    checkpoint = run.checkpoint(victim.name)
    wait_until(lambda: 0 < checkpoint_step(checkpoint) < heartbeat_step(run.cfg, victim.name),
               TIMEOUT, "the victim to train past its first checkpoint", poll=0.05)
    victim.kill()
    saved_step = checkpoint_step(checkpoint)  # the last one it wrote before it died
    assert saved_step < run.cfg.trainer.max_steps, "the victim finished before it was killed"
    victim.start()
    reports = run.finish_all()

    lives = reports[victim.name]["incarnations"]
    assert len(lives) == 2 and lives[1]["incarnation"] != lives[0]["incarnation"]
    assert lives[1]["restored_step"] == saved_step > 0
    assert lives[1]["versions_behind_at_join"] >= 0
    # The restarted script recorded every step once: its losses resume where the checkpoint was.
    losses = json.loads(run.losses_path(victim.name).read_text())
    assert [step for step, _ in losses["train"]] == list(range(1, 201))
    assert_every_script_holds_the_shards_bits(run, reports)


def test_the_same_script_under_torchrun_is_the_data_parallel_baseline(tmp_path):
    """No shard runs: one process per learner, gradients averaged by DDP, one model."""
    cfg = own_loop_config(tmp_path / "state", steps=60)
    data = cfg.model_dump(mode="json")
    data["syncer"]["max_tokens_per_step"] *= len(cfg.learners)  # one step of the job: every rank's tokens
    cfg = parse_config(data, source="own_loop data-parallel config")
    config = tmp_path / "cluster.yaml"
    config.write_text(dump_config(cfg))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    result = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(len(cfg.learners)),
                             str(EXAMPLE / "train.py"), "--config", str(config), "--learner-id", cfg.learners[0].id,
                             "--data-parallel", "--losses", str(tmp_path / "losses.json")],
                            capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for learner in cfg.learners:  # each rank read its learner's text
        assert f"{learner.id}: validation loss" in result.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["train"]) == 60
    assert losses["validation"]["end"] < losses["validation"]["start"]
