"""A learner whose budget is spent delivers its last contributions: a real learner process
against a shard. Every fragment gets the steps trained since its last sync; against a shard
whose disk is full when training ends, the learner pushes again while the shard asks it to
retry, for up to trainer.final_delivery_seconds, and what is still undelivered then is said
loudly, in its log and its report."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import pytest

from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.config import dump_config
from diloco.services.contract.tls import certs_dir
from diloco.syncer.service import start_shard
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until

pytestmark = pytest.mark.slow

STEPS = 30


def shard_with_a_full_disk(cfg, tmp_path):
    """Shard 0 of `cfg` in this process, its state folder full for contributions (seeds, written
    whole, still fit) until the event it returns is cleared."""
    handle = start_shard(cfg, 0, listen=cfg.shards[0].address, state_dir=tmp_path / "state")
    full = threading.Event()
    full.set()
    write = handle.store.append

    def append(*args):
        if full.is_set():
            raise OSError(28, "No space left on device")
        return write(*args)
    handle.store.append = append
    return handle, full


def learner(cfg, tmp_path) -> subprocess.Popen:
    config = tmp_path / "cluster.yaml"
    config.write_text(dump_config(cfg))
    member = cfg.learners[0]
    return subprocess.Popen([sys.executable, "-m", "diloco", "learner", "--config", str(config),
                             "--learner-id", member.id, "--region", member.region, "--catch-up-seconds", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def config(tmp_path, final_delivery_seconds: float, steps: int = STEPS, overlap_steps: int = 1,
           interval_steps: int = 10):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, steps=steps,
                       sync={"fragments": 2, "interval_steps": interval_steps, "overlap_steps": overlap_steps,
                             "codec": "int4"},
                       trainer={"final_delivery_seconds": final_delivery_seconds, "checkpoint_every": 1000})
    issue_cluster_certs(cfg, certs_dir(cfg))
    return cfg


def report(cfg) -> dict:
    return json.loads((pathlib.Path(cfg.run.state_dir) / f"learner-{cfg.learners[0].id}" / "report.json").read_text())


def run_until_training_ends(cfg, tmp_path):
    """The learner trains its budget with every push refused; returns the shard, the disk's
    event and the learner process, the learner now in its final delivery."""
    handle, full = shard_with_a_full_disk(cfg, tmp_path)
    process = learner(cfg, tmp_path)

    def trained_its_budget():
        if process.poll() is not None:
            raise AssertionError(f"the learner exited with {process.returncode}:\n{process.stdout.read()}")
        return any(learner.step >= STEPS for learner in handle.core.status().learners)
    wait_until(trained_its_budget, 120, "the learner to train its budget")
    return handle, full, process


def test_every_fragment_gets_the_steps_trained_since_its_last_sync_when_the_budget_is_spent(tmp_path):
    # 33 steps, H=3 over 2 fragments (offsets 0 and 1): the budget ends a step or two after each
    # fragment's last sync, and H < 2P leaves the schedule no hold to move them by. With tau = 0
    # no sync is in flight then, so a round that closes after training ended holds a
    # contribution pushed after it: the learner's last one.
    cfg = config(tmp_path, final_delivery_seconds=60.0, steps=33, overlap_steps=0, interval_steps=3)
    handle = start_shard(cfg, 0, listen=cfg.shards[0].address, state_dir=tmp_path / "state")
    process = learner(cfg, tmp_path)
    try:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out
        ended = report(cfg)["incarnations"][-1]["training_ended_at"]
        fragments = handle.core.status().fragments
        assert [f.last_round.closed_unix_seconds > ended for f in fragments] == [True, True], out
        # Marked as the learner's last: its round took it plainly (the learner's final model).
        assert [f.committed.last_round.final_share for f in handle.core.fragments.values()] == [1.0, 1.0]
    finally:
        process.kill()
        handle.stop()


def test_a_push_the_shard_asked_to_retry_is_delivered_once_it_can_take_it(tmp_path):
    cfg = config(tmp_path, final_delivery_seconds=60.0)
    handle, full, process = run_until_training_ends(cfg, tmp_path)
    try:
        assert all(f.version == 0 for f in handle.core.status().fragments)  # every push so far refused
        full.clear()
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out
        assert all(f.version >= 1 for f in handle.core.status().fragments), out  # the last contributions merged
        assert "not delivered" not in out
        assert report(cfg)["incarnations"][-1]["undelivered"] == {}
    finally:
        process.kill()
        handle.stop()


def test_what_is_still_undelivered_when_the_time_is_up_is_said_loudly(tmp_path):
    cfg = config(tmp_path, final_delivery_seconds=1.0)
    handle, full, process = run_until_training_ends(cfg, tmp_path)
    try:
        out, _ = process.communicate(timeout=120)
        assert "ERROR" in out and "were not delivered" in out and "RESOURCE_EXHAUSTED" in out, out
        assert set(report(cfg)["incarnations"][-1]["undelivered"]) == {"0", "1"}
    finally:
        process.kill()
        handle.stop()
