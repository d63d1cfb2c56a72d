"""examples/own_loop/train.py run as a user runs it: the example's cluster.yaml on free ports,
the shards, one script process per learner, and what every script must end holding."""
from __future__ import annotations

import pathlib
import sys

from diloco.localcluster.cluster import LocalCluster
from diloco.localcluster.processes import Proc, free_ports
from diloco.services.contract.config import load_config, parse_config
from tests.cluster_watch import (held_fragments, read_report, rounds_closed, served_fragments, shard_fragments,
                                 wait_until)

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
        wait_until(lambda: rounds_closed(self.cfg), 30, "the shards' open rounds to close")
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


def assert_every_script_holds_the_shards_bits(run: OwnLoopRun, reports: dict[str, dict]) -> None:
    shards = shard_fragments(run.cfg)
    assert len(shards) == run.cfg.sync.fragments and all(version > 0 for version, _ in shards.values())
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == run.cfg.trainer.max_steps
        assert held_fragments(report) == served_fragments(run.cfg, learner_id), \
            f"{learner_id} does not hold the bits the shards served it"
