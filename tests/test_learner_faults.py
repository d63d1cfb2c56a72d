"""The learner's sync through faults, against real `diloco syncer` processes: a shard killed
while a round holds the learner's contribution, a shard that stops answering, a shard that
lost its state, and settings or answers that do not match the learner's."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from diloco.learner.sync.streaming import StreamingSync
from diloco.services.client import ShardClient
from diloco.localcluster.cluster import LocalCluster
from diloco.services.contract.config import dump_config, parse_config
from diloco.services.contract.fragments import plan_for_config
from diloco.services.contract.state import state_hash
from diloco.syncer.store_format import shard_state_dir
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until

pytestmark = pytest.mark.slow

MANIFEST = [("a", (128,)), ("b", (128,))]
TIMEOUT = 30.0  # seconds any one wait of a test may take


def fault_config(tmp_path, shards: int = 1, **sections):
    """One learner "us-east-0" syncing the MANIFEST's model, one fragment per shard, in fp32
    every 4 steps, in plaintext; a second config learner ("us-west-0") that only joins holds
    rounds open. The learner trains until a test has seen what it waits for, so its step budget
    (which bounds the steps a shard believes it claims) is far away."""
    sections.setdefault("syncer", {})
    return tiny_cluster(tmp_path / "state", shards=shards, learners=2, steps=1_000_000, tls={"mode": "plaintext"},
                        sync={"fragments": shards, "interval_steps": 4, "overlap_steps": 1, "codec": "fp32",
                              "max_block_seconds": 0.05, **sections.pop("sync", {})},
                        syncer={"quorum": 2, "lease_seconds": 30.0, "max_staleness": 16,
                                "grace": {"mode": "fixed", "seconds": 0.2}, **sections.pop("syncer")},
                        **sections)


@pytest.fixture
def cluster(tmp_path):
    clusters: list[LocalCluster] = []

    def start(cfg) -> LocalCluster:
        clusters.append(LocalCluster(cfg, tmp_path / f"run-{len(clusters)}"))
        clusters[-1].start_shards()
        return clusters[-1]

    yield start
    for c in clusters:
        c.stop(timeout=10)


@pytest.fixture
def learners():
    started: list[StreamingSync] = []

    def start(cfg, params: dict[str, torch.Tensor], restored: dict | None = None) -> StreamingSync:
        learner = cfg.learners[0]
        sync = StreamingSync(cfg, learner.id, learner.region, params, plan_for_config(cfg, MANIFEST),
                             identity=None)
        started.append(sync)
        sync.start(restored)
        return sync

    yield start
    for sync in started:
        sync.close(leave=False)


def model() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in MANIFEST}


def shard_status(cfg, index: int = 0):
    with ShardClient(cfg.shards[index].address, cfg.rpc, identity=None) as client:
        return client.status(timeout=5)


def learner_status(cfg, learner_id: str):
    return next(l for l in shard_status(cfg).learners if l.learner_id == learner_id)


def fragment_status(cfg, index: int = 0):
    return shard_status(cfg, index).fragments[0]


def hold_rounds_open(cfg) -> None:
    """The config's second learner joins and never pushes: with quorum 2 a round holding only
    the first learner's contribution stays open for the second one's lease (30 s)."""
    other = cfg.learners[1]
    with ShardClient(cfg.shards[0].address, cfg.rpc, other.id, time.time_ns(), identity=None) as client:
        client.join(other.region, MANIFEST)


def train(sync: StreamingSync, params, until, what: str, first_step: int = 0) -> int:
    """Inner steps that nudge every weight, until `until()`; returns the next step."""
    step = first_step
    deadline = time.monotonic() + TIMEOUT
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for i, value in enumerate(params.values()):
            value += 0.01 * torch.randn(value.numel(), generator=torch.Generator().manual_seed(step + i))
        sync.after_step(step, tokens=256, step_seconds=0.01)
        step += 1
        time.sleep(0.01)
    return step


def assert_holds_the_shards_bits(sync: StreamingSync, cfg) -> None:
    sync.catch_up(quiet_seconds=0.5)
    shards = {f.fragment_id: (f.version, f.state_hash)
              for i in range(len(cfg.shards)) for f in shard_status(cfg, i).fragments}
    assert sync.fragment_hashes() == shards


def test_a_push_accepted_before_a_shard_kill_is_delivered_and_the_fragment_keeps_advancing(
        tmp_path, cluster, learners, caplog):
    cfg = fault_config(tmp_path)
    shards = cluster(cfg)
    hold_rounds_open(cfg)
    params = model()
    sync = learners(cfg, params)
    # The learner's first contribution waits in round 1 for the other learner.
    step = train(sync, params, lambda: fragment_status(cfg).pending_contributions == 1,
                 "the learner's push to be held in an open round")
    caplog.set_level(logging.WARNING, logger="diloco.learner.sync.shard_errors")
    caplog.clear()
    shards.shards[0].kill()
    # The learner's pull for the round's result fails meanwhile (and is retried).
    wait_until(lambda: any("unreachable" in r.getMessage() for r in caplog.records), TIMEOUT,
               "the learner to find shard 0 unreachable", poll=0.05)
    shards.restart_shard(0)
    # Restarted, the shard has forgotten the other learner: the round closes on the learner's
    # own contribution (replayed from the shard's log), and every later round too.
    train(sync, params, lambda: sync.fragments[0].version >= 3,
          "the fragment to advance past the restart", first_step=step)
    assert sync.stats.syncs_applied >= 3
    assert_holds_the_shards_bits(sync, cfg)


def test_a_shard_that_stops_answering_does_not_expire_the_learner_on_the_others(tmp_path, cluster, learners):
    cfg = fault_config(tmp_path, shards=2, syncer={"lease_seconds": 1.5})
    shards = cluster(cfg)
    learners(cfg, model())
    learner_id = cfg.learners[0].id
    frozen = shards.shards[1].popen.pid
    os.killpg(frozen, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 3 * cfg.syncer.lease_seconds
        while time.monotonic() < deadline:
            status = shard_status(cfg, 0)
            assert [(l.learner_id, l.alive) for l in status.learners] == [(learner_id, True)]
            assert status.counters["learners.expired"] == 0
            time.sleep(0.1)
    finally:
        os.killpg(frozen, signal.SIGCONT)
    # Shard 1 answers again: the learner is still (or again) live there too.
    wait_until(lambda: [(l.learner_id, l.alive) for l in shard_status(cfg, 1).learners] == [(learner_id, True)],
               TIMEOUT, "shard 1 to hear the learner again", poll=0.05)


def restart_without_state(shards: LocalCluster, cfg) -> None:
    """SIGKILL shard 0, delete its state folder, start it again: a shard that lost its state."""
    shards.shards[0].kill()
    shutil.rmtree(shard_state_dir(cfg.run.state_dir, 0))
    shards.restart_shard(0)


def rounds_closed(cfg, index: int = 0) -> int:
    """Rounds the shard process closed since it started."""
    counters = shard_status(cfg, index).counters
    return sum(count for name, count in counters.items() if name.startswith("rounds."))


def test_a_shard_restarted_without_its_state_takes_up_the_run_again_and_the_learner_ends_with_its_bits(
        tmp_path, cluster, learners):
    cfg = fault_config(tmp_path)
    shards = cluster(cfg)
    params = model()
    sync = learners(cfg, params)
    step = train(sync, params, lambda: sync.fragments[0].version >= 3, "three rounds")
    held = sync.fragments[0].version
    restart_without_state(shards, cfg)
    # The learner gives the shard its value back (RESTORE), and the fragment goes on from the
    # version the learner held: pushes are no longer refused, rounds close again.
    train(sync, params, lambda: rounds_closed(cfg) >= 2, "rounds to close on the restarted shard", first_step=step)
    assert shard_status(cfg).counters.get("fragments.restored", 0) == 1 and sync.stats.reanchored == 0
    assert fragment_status(cfg).version >= held + 2
    assert_holds_the_shards_bits(sync, cfg)


def test_a_learner_restarting_from_a_checkpoint_ahead_of_a_shard_that_lost_its_state_gives_it_the_runs_value(
        tmp_path, cluster, learners):
    cfg = fault_config(tmp_path)
    shards = cluster(cfg)
    params = model()
    first = learners(cfg, params)
    train(first, params, lambda: first.fragments[0].version >= 3, "three rounds")
    checkpoint = first.state_dict()
    first.close(leave=True)
    restart_without_state(shards, cfg)
    second = learners(cfg, model(), restored=checkpoint)
    # The shard continues from the run's value the learner held, at its version, never from a
    # learner's local weights.
    shard = fragment_status(cfg)
    assert (shard.version, shard.state_hash) == (checkpoint["fragments"][0]["version"],
                                                 state_hash(checkpoint["fragments"][0]["anchor"]))
    assert second.fragment_hashes() == {0: (shard.version, shard.state_hash)}
    assert shard_status(cfg).counters.get("fragments.restored", 0) == 1 and second.stats.reanchored == 0


def test_a_checkpoint_whose_anchor_the_shard_did_not_serve_pulls_a_snapshot(tmp_path, cluster, learners):
    cfg = fault_config(tmp_path)
    cluster(cfg)
    params = model()
    first = learners(cfg, params)
    step = train(first, params, lambda: first.fragments[0].version >= 1, "a first round")
    # A checkpoint whose anchor is not the value the shard served at its version (a damaged
    # base): no delta from it can give the value the shard holds, so the shard sends the value.
    damaged_anchor = first.fragments[0].anchor.clone()
    damaged_anchor[7] += 0.5
    checkpoint = {"fragments": {0: {"version": first.fragments[0].version, "anchor": damaged_anchor,
                                    "residual": torch.zeros(256)}}}
    # One round more: the shard's history is one fp32 update (a chain never outgrows a snapshot).
    train(first, params, lambda: first.fragments[0].version >= checkpoint["fragments"][0]["version"] + 1,
          "one more round", first_step=step)
    first.close(leave=True)
    second = learners(cfg, model(), restored=checkpoint)
    shard = fragment_status(cfg)
    assert second.fragment_hashes() == {0: (shard.version, shard.state_hash)}
    assert second.stats.hash_mismatches == 0  # known before the pull, by the anchor's hash


def test_a_learner_that_missed_rounds_ends_holding_the_shards_exact_bits(tmp_path, cluster, learners):
    cfg = fault_config(tmp_path, sync={"codec": "int4"}, syncer={"quorum": 1})
    cluster(cfg)
    learner = learners(cfg, model())  # seeds the fragment, holds version 0
    other = cfg.learners[1]
    with ShardClient(cfg.shards[0].address, cfg.rpc, other.id, time.time_ns(), identity=None) as client:
        client.join(other.region, MANIFEST)
        for version in range(3):  # three rounds of the other learner's alone (quorum 1, then grace)
            client.push(0, 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(version)), codec="int4",
                        block_size=cfg.sync.codec_block_size, base_version=version, c_steps=4, c_tokens=1024,
                        step_seconds=0.01)
            wait_until(lambda: fragment_status(cfg).version > version, TIMEOUT, f"round {version + 1} to close")
    # Its catch-up pull is one int4 delta from version 0 to 3 (off the shards' lineage by that
    # delta's encoding error); the learner then takes the shards' exact value.
    assert_holds_the_shards_bits(learner, cfg)


# ---- the `diloco learner` command: what it cannot work with, it says in one line and exits 1 ----

def edited(cfg, **sections):
    """The config with these sections updated (dicts merged into the section)."""
    data = cfg.model_dump(mode="json")
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return parse_config(data, source="test config")


def run_learner(cfg, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """`diloco learner` for the config's first learner, with its own copy of the config."""
    path = tmp_path / "learner.yaml"
    path.write_text(dump_config(cfg))
    learner = cfg.learners[0]
    return subprocess.run([sys.executable, "-m", "diloco", "learner", "--config", str(path),
                           "--learner-id", learner.id, "--region", learner.region, "--catch-up-seconds", "0.5",
                           *extra], capture_output=True, text=True, timeout=120)


def assert_failed_saying(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if " ERROR " in line] == \
        [line for line in result.stderr.splitlines() if message in line], result.stderr[-3000:]


def learner_config(tmp_path, **sections):
    """The fault config training the tiny GPT for 20 steps."""
    return fault_config(tmp_path, trainer={"max_steps": 20, "eval_every": 1000, "checkpoint_every": 1000},
                        **sections)


def test_a_learner_whose_shard_runs_another_codec_stops_naming_the_setting(tmp_path, cluster):
    shard_cfg = learner_config(tmp_path, sync={"codec": "int8"})
    cluster(shard_cfg)
    result = run_learner(edited(shard_cfg, sync={"codec": "int4"}), tmp_path)
    assert_failed_saying(result, "sync.codec: shard 0 uses int8, this learner int4")


def test_a_learner_whose_every_sync_is_refused_does_not_report_success(tmp_path, cluster):
    # The shard refuses every outer gradient (norm bound); nothing the join compares differs.
    shard_cfg = learner_config(tmp_path, syncer={"max_update_norm": 1e-12})
    cluster(shard_cfg)
    result = run_learner(edited(shard_cfg, syncer={"max_update_norm": 1.0e4}), tmp_path)
    assert_failed_saying(result, "the shards refused its syncs")


def test_a_learner_whose_metrics_port_is_taken_stops_naming_it(tmp_path):
    cfg = learner_config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mine = {**cfg.learners[0].model_dump(mode="json"), "metrics_port": port}
        result = run_learner(edited(cfg, learners=[mine, cfg.learners[1].model_dump(mode="json")]), tmp_path)
    assert_failed_saying(result, f"cannot serve metrics on port {port}")


def test_a_learner_that_cannot_write_its_state_folder_stops_naming_it(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("where the learner's state folder should be")
    result = run_learner(learner_config(tmp_path), tmp_path, "--state-dir", str(in_the_way / "learner"))
    assert_failed_saying(result, f"cannot write its state folder {in_the_way / 'learner'}")


def test_a_learner_removed_from_the_shards_config_stops_naming_the_refusal(tmp_path, cluster):
    cfg = learner_config(tmp_path)
    cluster(edited(cfg, learners=[cfg.learners[1].model_dump(mode="json")], syncer={"quorum": 1}))
    result = run_learner(cfg, tmp_path)
    assert_failed_saying(result, "shard 0 refused this learner: PERMISSION_DENIED")


def test_a_learner_with_another_model_than_the_runs_stops_naming_the_refusal(tmp_path, cluster):
    cfg = learner_config(tmp_path)
    cluster(cfg)
    hold_rounds_open(cfg)  # the other learner's join fixed the run's model: MANIFEST, not the GPT
    result = run_learner(cfg, tmp_path)
    assert_failed_saying(result, "shard 0 refused this learner: FAILED_PRECONDITION manifest differs")


ATTENDING_LEARNER = """
import sys, time
from diloco.services.client import ShardClient
from diloco.services.contract.config import load_config
cfg = load_config(sys.argv[1])
client = ShardClient(cfg.shards[0].address, cfg.rpc, "us-west-0", 1, identity=None)
client.join(cfg.learners[1].region, [("a", (128,)), ("b", (128,))])
call = client.attend()
print("attending", flush=True)
time.sleep(600)
"""


def test_a_learner_whose_process_dies_stops_counting_at_once_not_a_lease_later(tmp_path, cluster):
    cfg = fault_config(tmp_path)  # leases of 30 s
    shards = cluster(cfg)
    learner = subprocess.Popen([sys.executable, "-c", ATTENDING_LEARNER, str(shards.config_path)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert learner.stdout.readline().strip() == "attending"
        assert learner_status(cfg, "us-west-0").alive
        learner.kill()  # SIGKILL: the kernel closes its connection
        learner.wait()
        wait_until(lambda: not learner_status(cfg, "us-west-0").alive, 10, "the shard to stop counting it")
        assert shard_status(cfg).counters["learners.disconnected"] == 1
    finally:
        learner.kill()
        learner.wait()


def test_a_learner_waiting_for_one_fragments_result_does_not_hold_the_others_rounds(tmp_path, cluster, learners):
    # The config's second learner joins both shards and pushes only fragment 1: fragment 0's
    # round waits for it, and our learner waits for fragment 0's result (up to 30 s). Its
    # heartbeats say so, and fragment 1's round, which our learner has yet to reach, closes
    # without it instead of holding the second learner the same way.
    cfg = fault_config(tmp_path, shards=2, sync={"max_block_seconds": 30.0})
    cluster(cfg)
    params = model()
    other = cfg.learners[1]
    incarnation = time.time_ns()
    with ShardClient(cfg.shards[0].address, cfg.rpc, other.id, incarnation, identity=None) as shard_0, \
            ShardClient(cfg.shards[1].address, cfg.rpc, other.id, incarnation, identity=None) as shard_1:
        shard_0.join(other.region, MANIFEST)
        shard_1.join(other.region, MANIFEST)
        sync = learners(cfg, params)  # seeds both fragments
        shard_1.push(1, torch.full((128,), 0.01), codec="fp32", block_size=cfg.sync.codec_block_size,
                     c_steps=4, c_tokens=4, step_seconds=0.01)
        released = []
        trainer = threading.Thread(target=train, args=(sync, params, lambda: bool(released), "the test"))
        started_at = time.time()
        trainer.start()
        try:
            wait_until(lambda: fragment_status(cfg, 1).version == 1, 10, "fragment 1's round to close")
            assert fragment_status(cfg, 1).last_round.close_reason == "others_waiting"
            assert fragment_status(cfg, 0).version == 0  # still waiting for the second learner
            assert sync.stats.blocked_seconds == 0.0  # the wait has not ended
        finally:
            released.append(True)
            shard_0.push(0, torch.full((128,), 0.01), codec="fp32", block_size=cfg.sync.codec_block_size,
                         c_steps=4, c_tokens=4, step_seconds=0.01)
            trainer.join(TIMEOUT)
    assert not trainer.is_alive() and sync.stats.blocked_seconds > 0
    # The long wait is recorded one by one: when it began, for which fragment, how long, result in.
    began, fragment_id, seconds, result_in = max(sync.stats.waits, key=lambda wait: wait[2])
    assert fragment_id == 0 and result_in and started_at <= began and seconds >= 0.1


def test_a_joined_learners_first_step_takes_the_others_phase_from_their_heartbeats_just_before_it(tmp_path, cluster,
                                                                                                    learners):
    # The other learner reports schedule step 5 with a 10 s step time, then step 9 while this
    # one pulls and restores: extrapolated from the join, this learner's first step would be
    # their 5; heard again just before it, it is their 9 (each heartbeat half a step in: 9.5).
    cfg = fault_config(tmp_path, sync={"interval_steps": 16})
    cluster(cfg)
    other = cfg.learners[1]
    with ShardClient(cfg.shards[0].address, cfg.rpc, other.id, time.time_ns(), identity=None) as shard:
        shard.join(other.region, MANIFEST)
        shard.heartbeat(step=5, step_seconds=10.0)
        sync = learners(cfg, model())
        assert sync.schedule.first_step_pending
        shard.heartbeat(step=9, step_seconds=10.0)
        sync.after_step(0, tokens=256, step_seconds=0.01)
    assert not sync.schedule.first_step_pending and sync.schedule.sync_offset == 9
