"""Watching a cluster of real processes from a test: waiting for a condition, the learners'
reports, and the fragments the shards hold against those a learner's report says it holds."""
from __future__ import annotations

import json
import time

from diloco.localcluster.cluster import LocalCluster
from diloco.services.client import ShardClient
from diloco.services.contract.tls import OPERATOR, load_identity

TIMEOUT = 240  # seconds any one cluster may run before the test gives up


def wait_until(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def read_report(cluster: LocalCluster, learner_id: str) -> dict:
    try:
        return json.loads(cluster.learner_report_path(learner_id).read_text())
    except (OSError, ValueError):
        return {}


def operator(cfg):
    return load_identity(cfg, OPERATOR)


def shard_fragments(cfg) -> dict[str, tuple[int, str]]:
    state = {}
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=operator(cfg)) as client:
            for fragment in client.status(timeout=5).fragments:
                state[str(fragment.fragment_id)] = (fragment.version, fragment.state_hash)
    return state


def served_fragments(cfg, learner_id: str) -> dict[str, tuple[int, str]]:
    """What the shards last served `learner_id` of each fragment (docs/protocol.md, "The
    downlink"): the anchor they recorded for it, or the fragment's value where they have none."""
    state = {}
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=operator(cfg)) as client:
            for fragment in client.status(timeout=5).fragments:
                served = {a.learner_id: (a.version, a.state_hash) for a in fragment.served}
                state[str(fragment.fragment_id)] = served.get(learner_id, (fragment.version, fragment.state_hash))
    return state


def rounds_closed(cfg) -> bool:
    """No fragment of any shard holds a contribution in an open round (every learner that
    finished has left, so a round that still holds one closes within its grace window)."""
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=operator(cfg)) as client:
            if any(fragment.pending_contributions for fragment in client.status(timeout=5).fragments):
                return False
    return True


def held_fragments(report: dict) -> dict[str, tuple[int, str]]:
    return {fid: (f["version"], f["state_hash"]) for fid, f in report["fragments"].items()}


def wait_for_budgets_spent(cluster: LocalCluster) -> None:
    """Until every learner reports its budget spent (its catch-up may still run)."""
    wait_until(lambda: all(read_report(cluster, p.name).get("phase") in ("catching_up", "done")
                           for p in cluster.learners), TIMEOUT, "learners to spend their budget")


def wait_for_learners_to_finish(cluster: LocalCluster) -> dict[str, dict]:
    """Budget spent, then SIGTERM ends their catch-up with a final pull, as `diloco sim` does."""
    wait_for_budgets_spent(cluster)
    wait_until(lambda: rounds_closed(cluster.cfg), 30, "the shards' open rounds to close")
    cluster.stop_learners()
    for proc in cluster.learners:
        assert proc.returncode == 0, f"{proc.name} exited with {proc.returncode}: see {proc.log_path}"
    return {p.name: read_report(cluster, p.name) for p in cluster.learners}
