"""Learners and shards as real processes: the run trains, every learner ends holding the
shards' exact bits, a SIGKILLed learner rejoins while the others go on, and an island of
two processes stays identical across ranks."""
from __future__ import annotations

import contextlib
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from diloco.localcluster.processes import free_ports
from diloco.services.client import ShardClient
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import (TIMEOUT, held_fragments, operator, read_report, served_fragments, shard_fragments,
                                 wait_for_learners_to_finish, wait_until)

pytestmark = pytest.mark.slow


def test_cluster_trains_and_every_learner_holds_the_bits_the_shards_served_it(tmp_path, cluster_factory):
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=3, steps=200)
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    reports = wait_for_learners_to_finish(cluster)

    shards = shard_fragments(cfg)
    assert len(shards) == cfg.sync.fragments
    assert all(version > 0 for version, _ in shards.values())
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == 200
        # Against the untrained model's loss (ln 256 for bytes): a learner that joins late
        # starts from the already trained global model, so its own first evaluation is lower.
        last = report["evaluations"][-1][3]
        assert last < 0.6 * math.log(256), f"{learner_id}: final validation loss {last:.3f}"
        assert held_fragments(report) == served_fragments(cfg, learner_id), \
            f"{learner_id} does not hold the bits the shards served it"
        life = report["incarnations"][-1]
        assert life["syncs_applied"] > 0 and life["bytes_up"] > 0


def test_killed_learner_rejoins_reports_staleness_and_the_others_never_stop(tmp_path, cluster_factory):
    # A budget long enough that the others are still training after the victim's lease expires
    # (they were at steps 94-134 when a round had closed without it, here).
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=3, steps=500,
                       trainer={"checkpoint_every": 25, "eval_every": 250})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    victim, others = cluster.learners[0], cluster.learners[1:]
    # Kill it after its first checkpoint, mid-run.
    wait_until(lambda: _step_of(cfg, victim.name) >= 60, TIMEOUT, "the victim to pass step 60")
    victim.kill()
    assert read_report(cluster, victim.name)["steps"] >= 50  # written with its last checkpoint
    # No shard counts it any more, and the others go on syncing: a round closes without it.
    versions_at_kill = {fid: version for fid, (version, _) in shard_fragments(cfg).items()}
    wait_until(lambda: not _alive_anywhere(cfg, victim.name), TIMEOUT, "the shards to stop counting the victim")
    wait_until(lambda: any(version > versions_at_kill[fid] for fid, (version, _) in shard_fragments(cfg).items()),
               TIMEOUT, "a round to close without the victim")
    assert all(p.running for p in others)
    steps_while_down = {p.name: _step_of(cfg, p.name) for p in others}
    wait_until(lambda: all(_step_of(cfg, name) > step for name, step in steps_while_down.items()), 30,
               "the other learners to train on while one is down")
    victim.start()
    reports = wait_for_learners_to_finish(cluster)

    lives = reports[victim.name]["incarnations"]
    assert len(lives) == 2 and lives[1]["incarnation"] != lives[0]["incarnation"]
    assert lives[1]["restored_step"] >= 50  # it resumed from its checkpoint, not from scratch
    assert lives[1]["versions_behind_at_join"] > 0  # the run moved on while it was down
    assert all(r["steps"] == 500 for r in reports.values())
    for learner_id, report in reports.items():
        assert held_fragments(report) == served_fragments(cfg, learner_id)


def test_a_learner_trains_on_while_its_rounds_wait_for_a_frozen_member(tmp_path, cluster_factory):
    """Quorum 2 of 2 and a lease longer than the test: while one learner is frozen (SIGSTOP)
    no round can close, yet the other trains on through several sync periods, waiting at
    most sync.max_block_seconds per sync; once the frozen one resumes, every round closes
    and both end holding the shards' bits."""
    # Enough steps that the worker is still training when the frozen one resumes: it then
    # applies the results that were out (late).
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=600,
                       syncer={"quorum": 2, "lease_seconds": 600.0},
                       sync={"max_block_seconds": 0.5})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    worker, frozen = cluster.learners
    wait_until(lambda: _step_of(cfg, frozen.name) >= 10 and _step_of(cfg, worker.name) >= 10,
               TIMEOUT, "both learners to pass step 10")
    os.killpg(frozen.popen.pid, signal.SIGSTOP)
    try:
        since = _step_of(cfg, worker.name)
        # Its heartbeats, or its report once it finished (it leaves then: heartbeats stop).
        wait_until(lambda: max(_step_of(cfg, worker.name), read_report(cluster, worker.name).get("steps", 0))
                   >= since + 3 * cfg.sync.interval_steps, TIMEOUT,
                   "the worker to train through three sync periods while rounds cannot close")
    finally:
        os.killpg(frozen.popen.pid, signal.SIGCONT)
    reports = wait_for_learners_to_finish(cluster)

    assert reports[worker.name]["incarnations"][-1]["syncs_late"] > 0
    for learner_id, report in reports.items():
        assert report["steps"] == 600 and held_fragments(report) == served_fragments(cfg, learner_id)


def test_sigterm_ends_a_learner_blocked_on_a_round_that_waits_for_a_dead_one(tmp_path, cluster_factory):
    # Synchronous (data-parallel) rounds wait for every learner, also one that is down: a
    # learner waiting on such a round must still stop when asked, writing its report.
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=100_000,
                       sync={"fragments": 1, "interval_steps": 1, "overlap_steps": 0, "codec": "fp32"},
                       syncer={"quorum": 2, "wait_for_all": True, "merge": "mean", "max_staleness": 0})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    waiting, dead = cluster.learners
    wait_until(lambda: _step_of(cfg, waiting.name) >= 5, TIMEOUT, "both learners to train")
    dead.kill()
    # The next round cannot close now: it holds one contribution (the waiting learner's; the
    # dead one's last is the other state it could be in, for no longer than a step, hence the
    # half second without a round closed) and waits for the dead one.
    wait_until(lambda: _stuck_round(cfg), TIMEOUT, "a round to wait for the dead learner")
    waiting.request_stop()
    waiting.wait_or_kill(timeout=30)  # SIGKILL, exit code -9, if it did not stop by itself
    assert waiting.returncode == 0, f"see {waiting.log_path}"
    assert read_report(cluster, waiting.name)["phase"] == "training"


def _alive_anywhere(cfg, learner_id: str) -> bool:
    """Whether any shard counts the learner as live."""
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=operator(cfg)) as client:
            if any(l.learner_id == learner_id and l.alive for l in client.status(timeout=5).learners):
                return True
    return False


def _stuck_round(cfg) -> bool:
    """The (only) fragment's open round holds one contribution, and none closed for half a second."""
    with ShardClient(cfg.shards[0].address, cfg.rpc, identity=operator(cfg)) as client:
        (fragment,) = client.status(timeout=5).fragments
    return fragment.pending_contributions == 1 and time.time() - fragment.last_round.closed_unix_seconds > 0.5


def _step_of(cfg, learner_id: str) -> int:
    """The learner's step as the shards last heard it in a heartbeat."""
    best = 0
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=operator(cfg)) as client:
            for learner in client.status(timeout=5).learners:
                if learner.learner_id == learner_id:
                    best = max(best, learner.last_step)
    return best


def test_island_of_two_processes_stays_identical_after_every_applied_fragment(tmp_path, cluster_factory):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun (installed with torch) not found"
    # Two processes: twice the tokens per step of one (batch_size 8 x seq_len 32) to claim.
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, steps=80,
                       sync={"fragments": 2, "interval_steps": 10, "overlap_steps": 1},
                       syncer={"max_tokens_per_step": 2 * 8 * 32})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    learner = cfg.learners[0]
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "diloco", "learner",
               "--config", str(cluster.config_path), "--learner-id", learner.id, "--region", learner.region,
               "--verify-island", "--catch-up-seconds", "0.5"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(cluster, learner.id)
    assert report["world_size"] == 2 and report["steps"] == 80
    applied = report["incarnations"][-1]["syncs_applied"]
    assert applied >= 12  # 2 fragments, every 10 steps, 80 steps
    # Every sync applied inside the training loop was checked identical on both ranks (the
    # last in-flight ones are applied on rank 0 after the loop, when rank 1 has stopped).
    assert applied - cfg.sync.fragments <= report["island_checks"] <= applied
    # Each rank read its own batches: an island trains on twice the tokens of one process.
    assert report["tokens"] == 2 * 80 * cfg.trainer.batch_size * cfg.model.seq_len
    assert held_fragments(report) == shard_fragments(cfg)


def listening_hosts(pid: int) -> set[str]:
    """The local addresses of the TCP sockets process `pid` listens on, from /proc: "127.0.0.1",
    "0.0.0.0", or "::" / "::1" / "ipv6" for IPv6 ones."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[8:-1])
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in sockets:  # 0A: LISTEN
                continue
            address = fields[1].split(":")[0]
            if len(address) == 8 or address.startswith("0000000000000000FFFF0000"):  # IPv4, or mapped
                hosts.add(socket.inet_ntoa(bytes.fromhex(address[-8:])[::-1]))
            else:
                hosts.add({"0" * 32: "::", "0" * 24 + "01000000": "::1"}.get(address, "ipv6"))
    return hosts


def test_a_local_cluster_listens_on_loopback_only(tmp_path, cluster_factory):
    """gRPC, the plaintext health port and /metrics of a shard of a local cluster (what
    `diloco sim` starts) are not reachable from other machines."""
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1)
    metrics_port, health_port = free_ports(2)
    cfg = cfg.model_copy(update={"shards": [cfg.shards[0].model_copy(
        update={"metrics_port": metrics_port, "health_port": health_port})]})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    wait_until(lambda: len(listening_hosts(cluster.shards[0].popen.pid)) > 0, 30, "the shard to listen")
    assert listening_hosts(cluster.shards[0].popen.pid) == {"127.0.0.1"}
