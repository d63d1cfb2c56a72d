"""Islands of replica groups as real processes (learner/replica_groups.py, torchft over gloo on
loopback): SIGKILL a group other than the leader and the island trains on without it within
seconds, the other learner never waits, the group rejoins with the island's state after its
restart, and every group and the shards agree on the bits at the end; an island whose every
group dies is a learner failure, restarted from its checkpoint as any learner is."""
from __future__ import annotations

import time

import pytest

from tests.cluster_config import tiny_cluster
from tests.cluster_watch import (TIMEOUT, held_fragments, read_report, served_fragments, wait_for_learners_to_finish,
                                 wait_until)
from tests.test_learner_cluster import _step_of

pytestmark = pytest.mark.slow

PAUSE_BOUND = 10.0  # seconds: the lighthouse drops a silent group after island.heartbeat_timeout_seconds (2)


def island_cluster(tmp_path, cluster_factory, steps: int):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=steps,
                       trainer={"checkpoint_every": 25, "eval_every": 250},
                       island={"replica_groups": 2, "heartbeat_timeout_seconds": 2.0})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    return cfg, cluster


def test_an_island_trains_on_without_a_killed_group_which_rejoins_with_its_state(tmp_path, cluster_factory):
    cfg, cluster = island_cluster(tmp_path, cluster_factory, steps=900)
    island, other = cluster.learners
    group = cluster.islands.groups[0]  # us-east-0's group 1
    assert group.name == f"{island.name}-group-1"
    wait_until(lambda: _step_of(cfg, island.name) >= 60, TIMEOUT, "the island to pass step 60")
    group.kill()
    killed_at, step_at_kill, other_at_kill = time.time(), _step_of(cfg, island.name), _step_of(cfg, other.name)
    # The leader goes on without it: its steps move on within the bound, and the other learner
    # trained through the island's pause.
    wait_until(lambda: _step_of(cfg, island.name) >= step_at_kill + 10, PAUSE_BOUND, "the island to train on")
    assert island.running and other.running
    assert _step_of(cfg, other.name) > other_at_kill + 10
    time.sleep(1.0)
    group.start()  # repaired: it heals from the leader and trains with it again
    wait_until(lambda: [c for c in read_report(cluster, island.name).get("island", {}).get("changes", [])
                        if c["time"] > killed_at and c["groups"] == 2], TIMEOUT, "the group to rejoin")
    reports = wait_for_learners_to_finish(cluster)
    wait_until(lambda: group.returncode is not None, 30, "the group to end with its island")
    assert group.returncode == 0, f"the rejoined group failed: see {group.log_path}"

    record = reports[island.name]["island"]
    fewer = next(c for c in record["changes"] if c["time"] > killed_at and c["groups"] == 1)
    assert fewer["time"] - killed_at < PAUSE_BOUND
    assert record["verified"]["groups"] == 2  # both groups ended holding the same bits
    assert len(reports[island.name]["incarnations"]) == 1  # the learner never restarted
    # Tokens pushed are those trained: one group's for the steps it trained alone, two otherwise.
    per_group = cfg.tokens_per_step()
    assert per_group * 900 < reports[island.name]["tokens"] < 2 * per_group * 900
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == 900
        assert held_fragments(report) == served_fragments(cfg, learner_id)


def test_an_island_whose_every_group_dies_is_a_learner_failure(tmp_path, cluster_factory):
    cfg, cluster = island_cluster(tmp_path, cluster_factory, steps=500)
    island, _ = cluster.learners
    group = cluster.islands.groups[0]
    wait_until(lambda: _step_of(cfg, island.name) >= 60, TIMEOUT, "the island to pass step 60")
    island.kill()
    group.kill()
    island.start()  # as a learner is restarted: from its checkpoint
    group.start()
    reports = wait_for_learners_to_finish(cluster)
    wait_until(lambda: group.returncode is not None, 30, "the group to end with its island")
    assert group.returncode == 0, f"see {group.log_path}"
    lives = reports[island.name]["incarnations"]
    assert len(lives) == 2 and lives[1]["restored_step"] >= 50
    assert reports[island.name]["island"]["verified"]["groups"] == 2
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == 500
        assert held_fragments(report) == served_fragments(cfg, learner_id)
