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

import pytest
import torch

from diloco.services.client import ShardClient
from diloco.services.contract.config import dump_config, parse_config
from tests.cluster_watch import wait_until
from tests.own_loop_run import (EXAMPLE, TIMEOUT, OwnLoopRun, assert_every_script_holds_the_shards_bits,
                                own_loop_config)

pytestmark = pytest.mark.slow


@pytest.fixture
def own_loop_run(tmp_path):
    runs: list[OwnLoopRun] = []

    def start(steps: int) -> OwnLoopRun:
        runs.append(OwnLoopRun(own_loop_config(tmp_path / "state", steps), tmp_path))
        return runs[-1].start()

    yield start
    for run in runs:
        run.stop()


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
