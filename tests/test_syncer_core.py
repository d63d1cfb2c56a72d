"""The shard's decisions, driven directly with a fake clock: round closing, merging, staleness,
the outer step, error feedback, membership and seeding. No gRPC, no sleeping."""
import contextlib
import copy
import errno
import math
import random

import pytest
import torch

from diloco.services.contract.state import apply_update, state_hash
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import ConfigError, parse_config
from diloco.services.contract.payload import decode_payload, describe, iter_chunks
from diloco.services.contract.wire import pb
from diloco.syncer.core import ShardCore
from diloco.syncer.counters import Counters
from diloco.syncer.journal import NullJournal, Restored
from diloco.syncer.grace import GraceWindow
from diloco.syncer.membership import Membership
from diloco.syncer.merge import RoundAccumulator, contribution_weight
from diloco.syncer.refusal import Refusal
from tests.shard_harness import LEARNERS, MANIFEST, Shard, delta, make_config


@contextlib.contextmanager
def refused(status, reason):
    """pytest.raises for a Refusal with this status and reason."""
    with pytest.raises(Refusal) as info:
        yield info
    assert (info.value.status, info.value.reason) == (status, reason), info.value


# ---- closing rounds ---------------------------------------------------------------------

def test_round_closes_at_once_when_every_live_learner_contributed():
    shard = Shard(make_config(quorum=1))
    for i, learner in enumerate(LEARNERS):
        assert shard.version() == 0
        reply = shard.push(learner, 0, delta(i, shard.numel()))
        assert (reply.result, reply.round, reply.current_version) == (pb.PUSH_RESULT_ACCEPTED, 1, 0)
    assert shard.version() == 1 and reply.committed
    assert shard.core.fragments[0].committed.last_round.close_reason == "all"
    assert shard.core.counters.snapshot()["rounds.all"] == 1


def test_run_tokens_count_every_learner_live_or_gone():
    shard = Shard(make_config(quorum=3, lease_seconds=10.0))
    core = shard.core
    core.heartbeat("a", 1, step=10, tokens=1000, tokens_per_second=100.0, step_seconds=1.0)
    core.heartbeat("b", 1, step=5, tokens=500, tokens_per_second=50.0, step_seconds=2.0)
    assert core.run_tokens() == (1500, 150.0)  # c joined, never reported
    shard.clock.advance(2.0)  # live learners have trained on at their rate since
    assert core.run_tokens() == (1500 + 2 * 150, 150.0)
    core.leave("b", 1)  # gone: its tokens still count, no longer growing
    assert core.run_tokens() == (1000 + 2 * 100 + 500, 100.0)


def test_quorum_closes_only_after_the_grace_window():
    shard = Shard(make_config(quorum=2, grace={"mode": "fixed", "seconds": 1.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.clock.advance(3.0)  # one contribution is below quorum, however long it waits
    assert shard.core.tick() == [] and shard.version() == 0
    shard.push("b", 0, delta(2, shard.numel()))  # K reached: grace starts now
    shard.clock.advance(0.9)
    assert shard.core.tick() == [] and shard.version() == 0
    shard.clock.advance(0.1)
    assert shard.core.tick() == [0] and shard.version() == 1
    last = shard.core.fragments[0].committed.last_round
    assert (last.close_reason, last.contributors, last.duration_seconds) == ("quorum_grace", 2, pytest.approx(4.0))


def adaptive_shard_after_slow_steps():
    """A shard whose adaptive grace, from one round of 10-second steps, waits seconds."""
    shard = Shard(make_config(quorum=1, grace={"mode": "adaptive", "seconds": 60.0}))
    for learner in LEARNERS:
        shard.push(learner, 0, delta(1, shard.numel()), step_seconds=10.0)
    assert shard.version() == 1 and shard.core.fragments[0].grace.seconds() > 4
    return shard


def test_a_round_closes_in_time_for_the_contributors_already_in_it():
    shard = adaptive_shard_after_slow_steps()
    # A fast learner (2 s steps, tau = 1, 0.2 s on the wire each way) needs the close by
    # gamma * (2 - 2 * 0.2 - 0) = 0.8 s after its push arrived, whatever the averages say.
    shard.core.push(*shard.push_parts("a", 0, delta(2, shard.numel()), base=1, step_seconds=2.0),
                    transfer_seconds=0.2)
    shard.clock.advance(0.79)
    assert shard.core.tick() == [] and shard.version() == 1
    shard.clock.advance(0.02)
    assert shard.core.tick() == [0] and shard.version() == 2


def test_a_contributor_whose_own_link_outlasts_the_overlap_sets_no_deadline():
    shard = adaptive_shard_after_slow_steps()
    # 1.5 s on the wire each way against 2 s of overlap: late whatever the round does.
    shard.core.push(*shard.push_parts("b", 0, delta(2, shard.numel()), base=1, step_seconds=2.0),
                    transfer_seconds=1.5)
    shard.clock.advance(1.0)
    assert shard.core.tick() == [] and shard.version() == 1  # the window the averages give
    shard.clock.advance(shard.core.fragments[0].grace.seconds())
    assert shard.core.tick() == [0]


def shard_whose_round_closed_without_c(quorum: int) -> Shard:
    """Adaptive grace; round 1 closed on its quorum (a, or a and b) without c, which pushes
    from version 0 now: a push that missed its round by a moment, with 0.8 s of slack (as above)."""
    shard = Shard(make_config(quorum=quorum, lease_seconds=600.0, grace={"mode": "adaptive", "seconds": 60.0}))
    for learner in "ab"[:quorum]:
        shard.push(learner, 0, delta(1, shard.numel()))
    shard.clock.advance(60.0)
    assert shard.core.tick() == [0]
    reply = shard.core.push(*shard.push_parts("c", 0, delta(2, shard.numel()), base=0, step_seconds=2.0),
                            transfer_seconds=0.2)
    assert (reply.result, reply.round) == (pb.PUSH_RESULT_STALE_MERGED, 2)
    return shard


def test_a_push_that_missed_its_round_counts_towards_the_next_quorum_only_until_its_deadline():
    shard = shard_whose_round_closed_without_c(quorum=2)
    shard.clock.advance(10.0)  # a sync period: the others push the fragment again
    shard.push("a", 0, delta(3, shard.numel()), base=1)
    shard.clock.advance(1.0)
    # c's push opened the round long ago: counted, it would close the round before b is in.
    assert shard.core.tick() == [] and shard.version() == 1
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    last = shard.core.fragments[0].committed.last_round
    assert shard.version() == 2 and (last.close_reason, last.contributors) == ("all", 3)


def test_a_stale_push_within_its_deadline_counts_towards_the_quorum():
    # With K = 1 most pushes are stale (others' rounds closed since their base): each still closes one.
    shard = shard_whose_round_closed_without_c(quorum=1)
    shard.clock.advance(shard.core.fragments[0].grace.seconds())
    assert shard.core.tick() == [0]
    assert shard.core.fragments[0].committed.last_round.close_reason == "quorum_grace"


def test_dead_learner_is_not_waited_for():
    shard = Shard(make_config(quorum=1, lease_seconds=2.0, grace={"mode": "fixed", "seconds": 60.0}))
    shard.clock.advance(1.5)
    shard.core.heartbeat("a", 1)
    shard.core.leave("b", 1)  # a clean goodbye ends the lease at once
    shard.clock.advance(1.0)  # c never heartbeats: its lease has expired
    reply = shard.push("a", 0, delta(1, shard.numel()))
    assert reply.committed and shard.core.fragments[0].committed.last_round.close_reason == "all"
    counters = shard.core.counters.snapshot()
    assert counters["learners.left"] == 1 and counters["learners.expired"] == 1
    with refused("FAILED_PRECONDITION", "not_live"):
        shard.push("c", 0, delta(2, shard.numel()), base=1)
    shard.core.join("c", 1, "r", MANIFEST)  # rejoining makes it live again
    assert shard.push("c", 0, delta(2, shard.numel()), base=1).result == pb.PUSH_RESULT_ACCEPTED


def test_a_learner_whose_attend_call_ends_is_not_waited_for_from_then_on():
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    attendance = shard.core.attend("c", 1)
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    assert shard.core.tick() == []  # c's lease runs for a minute yet
    shard.core.absent("c", 1, attendance)  # its process died: its connection closed
    assert shard.core.tick() == [0] and shard.core.fragments[0].committed.last_round.close_reason == "all"
    assert shard.core.counters.snapshot()["learners.disconnected"] == 1
    with refused("FAILED_PRECONDITION", "not_live"):
        shard.core.heartbeat("c", 1)  # alive after all (a connection that dropped): it joins again
    shard.core.join("c", 1, "r", MANIFEST)
    shard.core.heartbeat("c", 1)


def test_an_attend_call_that_was_replaced_or_outlived_a_leave_or_a_rejoin_changes_nothing():
    shard = Shard(make_config(lease_seconds=60.0))
    first = shard.core.attend("a", 1)
    second = shard.core.attend("a", 1)  # the learner rejoined and opened another
    shard.core.absent("a", 1, first)  # the first one's end reaches the shard late
    shard.core.heartbeat("a", 1)
    shard.core.join("a", 1, "r", MANIFEST)  # a rejoin: no Attend open for it yet
    shard.core.absent("a", 1, second)
    shard.core.heartbeat("a", 1)
    third = shard.core.attend("b", 1)
    shard.core.leave("b", 1)
    shard.core.absent("b", 1, third)  # the call a learner ends after its Leave
    counters = shard.core.counters.snapshot()
    assert "learners.disconnected" not in counters and counters["learners.left"] == 1
    with refused("FAILED_PRECONDITION", "not_joined"):
        shard.core.attend("a", 2)


def test_a_round_does_not_wait_for_a_learner_that_rejoined_after_it_opened():
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.clock.advance(0.5)
    shard.core.join("c", 2, "r", MANIFEST)  # c restarted: its next push of fragment 0 is a period away
    shard.push("b", 0, delta(2, shard.numel()))
    assert shard.version() == 1 and shard.core.fragments[0].committed.last_round.close_reason == "all"
    shard.push("a", 0, delta(3, shard.numel()), base=1)  # the next round waits for c again
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    assert shard.core.tick() == [] and shard.version() == 1
    shard.push("c", 0, delta(5, shard.numel()), base=1, incarnation=2)
    assert shard.version() == 2


def test_a_learner_that_rejoined_a_run_in_progress_is_awaited_by_rounds_opened_after_its_first_heartbeat():
    # c restarted while a and b trained: it takes their phase, and a round they opened just
    # after its join is one whose turn it passed while it restored. Heard from, it is placed.
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    for learner_id in ("a", "b", "c"):
        shard.core.heartbeat(learner_id, 1, step=40)
    shard.core.join("c", 2, "r", MANIFEST)
    shard.clock.advance(0.01)
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    assert shard.version() == 1 and shard.core.fragments[0].committed.last_round.close_reason == "all"
    shard.core.heartbeat("c", 2, step=12)
    shard.clock.advance(0.01)
    shard.push("a", 0, delta(3, shard.numel()), base=1)
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    assert shard.core.tick() == [] and shard.version() == 1  # this round waits for c
    shard.push("c", 0, delta(5, shard.numel()), base=1, incarnation=2)
    assert shard.version() == 2


def test_at_a_runs_start_rounds_wait_for_every_learner_that_joined_before_they_opened():
    # Nobody has trained yet: each learner starts on its own step, in phase with the others.
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    assert shard.core.tick() == [] and shard.version() == 0  # c joined, not heard from: still awaited


def test_a_round_does_not_wait_for_a_learner_whose_training_waits_for_another_fragment():
    # c waits for fragment 1's round, which waits for a and b, who wait for this one: without
    # the rule all three would sit out sync.max_block_seconds.
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    shard.core.heartbeat("c", 1, waiting_for=0)  # waiting for this fragment: it pushed it, or will
    assert shard.core.tick() == [] and shard.version() == 0
    shard.core.heartbeat("c", 1, waiting_for=1)
    assert shard.core.tick() == [0] and shard.version() == 1
    assert shard.core.fragments[0].committed.last_round.close_reason == "others_waiting"
    assert shard.core.counters.snapshot()["rounds.others_waiting"] == 1
    shard.core.heartbeat("c", 1)  # its wait ended: the next round waits for it again
    shard.push("a", 0, delta(3, shard.numel()), base=1)
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    assert shard.core.tick() == [] and shard.version() == 1
    shard.push("c", 0, delta(5, shard.numel()), base=0)  # its push of this fragment, now a round late
    assert shard.version() == 2 and shard.core.fragments[0].committed.last_round.close_reason == "all"


def test_a_round_does_not_wait_for_a_learner_whose_island_stands_still():
    # c's island regroups after losing a replica group: it pushes nothing until it trains again.
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    assert shard.core.tick() == [] and shard.version() == 0
    shard.core.heartbeat("c", 1, standing_still=True)
    assert shard.core.tick() == [0] and shard.core.fragments[0].committed.last_round.close_reason == "others_waiting"
    shard.core.heartbeat("c", 1)  # it trains again: the next round waits for it
    shard.push("a", 0, delta(3, shard.numel()), base=1)
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    assert shard.core.tick() == [] and shard.version() == 1


def test_a_round_does_not_wait_for_a_learner_that_skips_it_and_the_other_fragments_do():
    # c's push of fragment 0 was refused (or its model went NaN): its next one is a period away.
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}))
    for fid in (0, 1):
        shard.push("a", fid, delta(1, shard.numel(fid)))
        shard.push("b", fid, delta(2, shard.numel(fid)))
    shard.core.heartbeat("c", 1, skipped=frozenset({0}))
    assert shard.core.tick() == [0] and shard.core.fragments[0].committed.last_round.close_reason == "others_waiting"
    assert shard.version(1) == 0  # fragment 1 still waits for c's push
    shard.core.heartbeat("c", 1)  # it delivered again: fragment 0's next round waits for it
    shard.push("a", 0, delta(3, shard.numel()), base=1)
    shard.push("b", 0, delta(4, shard.numel()), base=1)
    assert shard.core.tick() == [] and shard.version() == 1


def test_a_round_with_some_of_the_live_learners_counts_for_their_share():
    # Learners out of lockstep: each of one period's three contributions closes its own round.
    sgd = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    shard = Shard(make_config(quorum=1, merge="mean", outer_optimizer=sgd,
                              grace={"mode": "fixed", "seconds": 0.5}))
    n, start = shard.numel(), shard.seeds[0].clone()
    deltas = [delta(i, n, scale=0.1) for i in range(3)]
    for version, (learner, d) in enumerate(zip(LEARNERS, deltas)):
        shard.push(learner, 0, d, base=version)
        shard.clock.advance(0.5)
        assert shard.core.tick() == [0] and shard.version() == version + 1
    # Three rounds of one third each: one step on the mean, not three full steps.
    expected = start - sum(deltas) / 3
    assert torch.allclose(shard.value(), expected, atol=1e-6)


def test_a_round_of_last_contributions_ends_at_their_plain_average_and_leaves_momentum_alone():
    nesterov = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    shard = Shard(make_config(merge="rda", outer_optimizer=nesterov))
    n = shard.numel()
    for learner in LEARNERS:  # one ordinary round: momentum is not zero
        shard.push(learner, 0, delta(LEARNERS.index(learner), n, scale=0.1), base=0)
    momentum, value = shard.core.fragments[0].committed.momentum.clone(), shard.value()
    last = [delta(10 + i, n, scale=0.05) for i in range(len(LEARNERS))]
    for learner, d in zip(LEARNERS, last):
        shard.push(learner, 0, d, base=1, final=True)
    assert shard.version() == 2
    # Not rda's norm, no lr 0.7, no momentum: the learners' final models averaged.
    assert torch.allclose(shard.value(), value - sum(last) / len(last), atol=1e-6)
    assert torch.equal(shard.core.fragments[0].committed.momentum, momentum)


def test_last_contributions_in_rounds_of_their_own_add_up_to_the_average_of_the_final_models():
    # Learners whose budgets end apart: each last contribution closes a round after the others left.
    shard = Shard(make_config(quorum=1, merge="mean", grace={"mode": "fixed", "seconds": 0.5}))
    n, start = shard.numel(), shard.seeds[0].clone()
    last = [delta(i, n, scale=0.1) for i in range(len(LEARNERS))]
    for version, (learner, d) in enumerate(zip(LEARNERS, last)):
        shard.push(learner, 0, d, base=version, final=True)
        shard.clock.advance(0.5)
        shard.core.tick()
        assert shard.version() == version + 1
        shard.core.leave(learner, 1)
    # Each counts for its share of every learner of the run, not of those still in it.
    assert torch.allclose(shard.value(), start - sum(last) / len(last), atol=1e-6)


def test_a_round_with_ordinary_and_last_contributions_steps_on_each_by_its_share():
    sgd = {"lr": 0.5, "momentum": 0.0, "nesterov": False}
    shard = Shard(make_config(merge="mean", outer_optimizer=sgd))
    n, start = shard.numel(), shard.seeds[0].clone()
    ordinary, last = delta(0, n, scale=0.1), delta(1, n, scale=0.1)
    shard.core.leave(LEARNERS[2], 1)
    shard.push(LEARNERS[0], 0, ordinary, base=0)
    shard.push(LEARNERS[1], 0, last, base=0, final=True)
    assert shard.version() == 1
    # The ordinary one: the outer step for its share of the live learners (one of two, the
    # last one's learner still in); the last one: plainly, for its share of the run's three.
    expected = start - 0.5 * ordinary / 2 - last / 3
    assert torch.allclose(shard.value(), expected, atol=1e-6)


def test_wait_for_all_waits_for_a_learner_that_is_down_but_not_for_one_that_left():
    shard = Shard(make_config(quorum=3, wait_for_all=True, lease_seconds=2.0,
                              grace={"mode": "fixed", "seconds": 0.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))
    shard.clock.advance(30.0)  # c's lease expired long ago: it is down, still in the run
    assert shard.core.tick() == [] and shard.version() == 0
    shard.core.join("c", 2, "r", MANIFEST)  # back with a new incarnation
    assert shard.push("c", 0, delta(3, shard.numel()), incarnation=2).committed
    assert shard.version() == 1
    # A learner whose budget is spent says goodbye: the next rounds no longer wait for it.
    shard.core.leave("c", 2)
    shard.core.join("a", 2, "r", MANIFEST)
    shard.core.join("b", 2, "r", MANIFEST)
    shard.push("a", 0, delta(4, shard.numel()), base=1, incarnation=2)
    assert shard.push("b", 0, delta(5, shard.numel()), base=1, incarnation=2).committed


def test_a_round_whose_contributors_all_left_the_run_closes_once_nobody_is_left_in_it():
    """a's last contribution is short of the quorum; a and then b, c leave (their budgets
    spent): nobody will add to the round, so it closes rather than keep a's steps unmerged."""
    shard = Shard(make_config(quorum=2, grace={"mode": "fixed", "seconds": 0.0}))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.core.leave("a", 1)
    shard.clock.advance(1.0)
    assert shard.core.tick() == [] and shard.version() == 0  # b and c are still in the run
    shard.core.leave("b", 1)
    shard.core.leave("c", 1)
    assert shard.core.tick() == [0] and shard.version() == 1
    assert shard.core.counters_snapshot()["rounds.all_left"] == 1


def test_wait_for_all_does_not_start_before_k_learners_joined():
    shard = Shard(make_config(quorum=3, wait_for_all=True, grace={"mode": "fixed", "seconds": 0.0}),
                  joined=("a", "b"))
    shard.push("a", 0, delta(1, shard.numel()))
    shard.push("b", 0, delta(2, shard.numel()))  # every member contributed, but only 2 of K=3
    assert shard.core.tick() == [] and shard.version() == 0
    shard.core.join("c", 1, "r", MANIFEST)
    assert shard.push("c", 0, delta(3, shard.numel())).committed


def test_adaptive_grace_fits_into_the_overlap_slack():
    grace = GraceWindow("adaptive", cap_seconds=10.0, gamma=0.5, overlap_steps=2)
    assert grace.seconds() == 10.0  # no measurements yet: the cap
    grace.step_seconds.observe(3.0)
    grace.quorum_seconds.observe(1.0)
    grace.sync_seconds.observe(2.0)
    assert grace.seconds() == pytest.approx(0.5 * (2 * 3.0 - 1.0 - 2.0))
    grace.quorum_seconds.observe(21.0)  # moving average: 1 + 0.2 * 20 = 5 -> no slack left
    assert grace.seconds() == 0.0
    assert GraceWindow("fixed", 0.25, 0.5, 2).seconds() == 0.25


# ---- merging ----------------------------------------------------------------------------

def test_rda_keeps_the_norm_of_orthogonal_inputs_and_the_mean_shrinks_it():
    m = 4
    inputs = [2.0 * torch.eye(16)[i] for i in range(m)]  # orthogonal, norm 2
    merged = {}
    for method in ("rda", "mean"):
        accumulator = RoundAccumulator(16, method)
        for x in inputs:
            accumulator.add(x.clone(), weight=1.0, norm=float(x.norm()))  # add() may overwrite its input
        merged[method] = accumulator.merged()
    assert merged["rda"].norm() == pytest.approx(2.0)
    assert merged["mean"].norm() == pytest.approx(2.0 / math.sqrt(m))
    # Same direction either way: only the length differs.
    assert torch.allclose(merged["rda"] / merged["rda"].norm(), merged["mean"] / merged["mean"].norm())


def test_a_merge_decoded_into_the_accumulators_scratch_has_the_bits_of_a_sum_from_zeros():
    numel, generator = 1000, torch.Generator().manual_seed(7)
    deltas = [torch.randn(numel, generator=generator) for _ in range(3)]
    for method in ("rda", "mean"):
        for weights in ([1.0], [0.5, 0.3, 0.2]):
            accumulator, expected = RoundAccumulator(numel, method), torch.zeros(numel)
            for x, w in zip(deltas, weights):
                norm = float(x.norm())
                expected.add_(x / norm if method == "rda" else x, alpha=w)
                accumulator.add(accumulator.scratch().copy_(x), weight=w, norm=norm)
            if method == "rda":
                expected.mul_(sum(w * float(x.norm()) for x, w in zip(deltas, weights))
                              / sum(weights) / float(expected.norm()))
            else:
                expected.div_(sum(weights))
            assert torch.equal(accumulator.merged(), expected), (method, weights)


def test_rda_counts_a_zero_outer_gradient_in_the_norm_without_nan():
    zero_only, accumulator = RoundAccumulator(8, "rda"), RoundAccumulator(8, "rda")
    for a in (zero_only, accumulator):
        a.add(torch.zeros(8), weight=1.0, norm=0.0)
    assert torch.equal(zero_only.merged(), torch.zeros(8))
    x = torch.full((8,), 0.5)
    accumulator.add(x.clone(), weight=1.0, norm=float(x.norm()))
    merged = accumulator.merged()
    assert torch.isfinite(merged).all()
    assert torch.allclose(merged, x / 2)  # direction of x, half its norm


def test_weights_are_quantity_times_quality_and_decay_with_staleness():
    assert contribution_weight(c_tokens=1000, c_steps=10, staleness=0, stale_weight_decay=0.5) == 100_000
    assert contribution_weight(c_tokens=1000, c_steps=10, staleness=2, stale_weight_decay=0.5) == 25_000
    # End to end: lr 1, no momentum, fp32, mean merge -> the update is minus the weighted mean.
    shard = Shard(make_config(merge="mean", outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False}))
    n = shard.numel()
    x, y = delta(1, n), delta(2, n)
    shard.push("a", 0, x, c_tokens=1000, c_steps=10)  # w = 100000
    shard.push("b", 0, y, c_tokens=2000, c_steps=10)  # w = 400000 (twice the tokens, same speed)
    shard.push("c", 0, torch.zeros(n), c_tokens=1000, c_steps=40)  # w = 25000 (4x slower)
    w = torch.tensor([100_000.0, 400_000.0, 25_000.0])
    expected = -(w[0] * x + w[1] * y) / w.sum()
    assert torch.allclose(shard.value() - shard.seeds[0], expected, atol=1e-6)


def test_staleness_merges_within_the_bound_and_refuses_beyond_it():
    cfg = make_config(max_staleness=1, stale_weight_decay=0.5, merge="mean",
                      outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
    shard = Shard(cfg, joined=("b",))
    n = shard.numel()
    for version in range(2):  # b alone is live: each push closes a round
        shard.push("b", 0, delta(version, n), base=version)
    assert shard.version() == 2
    shard.core.join("a", 1, "r", MANIFEST)  # a still holds version 0 or 1
    before = shard.value().clone()
    reply = shard.push("a", 0, delta(5, n), base=0)
    assert (reply.result, reply.current_version, reply.staleness) == (pb.PUSH_RESULT_REFUSED_STALE, 2, 2)
    assert shard.core.fragments[0].round.count == 0
    x, y = delta(6, n), delta(7, n)
    reply = shard.push("a", 0, x, base=1)
    assert (reply.result, reply.staleness, reply.round) == (pb.PUSH_RESULT_STALE_MERGED, 1, 3)
    shard.push("b", 0, y, base=2)
    expected = -(0.5 * x + y) / 1.5  # the stale one counts half
    assert torch.allclose(shard.value() - before, expected, atol=1e-6)
    counters = shard.core.counters.snapshot()
    assert (counters["contributions.refused_stale"], counters["contributions.stale_merged"]) == (1, 1)


# ---- the outer step and the downlink ----------------------------------------------------

def test_nesterov_outer_step_matches_a_hand_computed_reference():
    lr, mu = 0.7, 0.9
    shard = Shard(make_config(merge="mean", outer_optimizer={"lr": lr, "momentum": mu, "nesterov": True}),
                  joined=("a",))
    n = shard.numel()
    value, buf = shard.seeds[0].double(), torch.zeros(n, dtype=torch.float64)
    for version in range(3):
        d = delta(version, n, scale=0.1)
        shard.push("a", 0, d, base=version)
        buf = mu * buf + d.double()
        value = value - lr * (d.double() + mu * buf)
        assert torch.allclose(shard.value().double(), value, atol=1e-6), version
    assert torch.allclose(shard.core.fragments[0].committed.momentum.double(), buf, atol=1e-6)


def test_a_replica_applying_the_decoded_updates_holds_the_shards_bits():
    """int4 with error feedback: a learner that applies each pulled update with apply_update
    ends with exactly the shard's value, and what int4 dropped waits in the residual."""
    cfg = make_config(codec="int4", merge="mean", outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
    shard = Shard(cfg, joined=("a",))
    n = shard.numel()
    plan = shard.core.pull(0, None)
    assert plan.snapshot
    value = decode_payload(plan.items[0].header, plan.items[0].payload)
    delivered, asked = torch.zeros(n), torch.zeros(n)
    for version in range(6):
        d = delta(version, n, scale=0.1)
        shard.push("a", 0, d, base=version)
        asked -= get_codec("int4").decode(get_codec("int4").encode(d, 128), n, 128)  # u = -merged
        plan = shard.core.pull(0, version)
        assert not plan.snapshot and [u.version for u in plan.items] == [version + 1]
        update = decode_payload(plan.items[0].header, plan.items[0].payload)
        apply_update(value, update)
        delivered += update
        assert torch.equal(value, shard.value()) and state_hash(value) == plan.state_hash
    residual = shard.core.fragments[0].committed.residual
    assert residual.abs().max() > 0  # int4 dropped something on the way down...
    assert torch.allclose(delivered + residual, asked, atol=1e-5)  # ...and nothing is lost for good


def test_history_holds_only_a_chain_of_updates_smaller_than_the_snapshot_a_learner_pulls_instead():
    shard = Shard(make_config(codec="int4", history_versions=32), joined=("a",))
    n = shard.numel()
    for version in range(12):
        shard.push("a", 0, delta(version, n), base=version)
    history = shard.core.fragments[0].committed.history
    update_bytes, snapshot_bytes = len(history[-1].payload), 4 * n
    assert len(history) == snapshot_bytes // update_bytes < 12
    oldest = 12 - len(history)
    assert [u.version for u in shard.core.pull(0, oldest).items] == list(range(oldest + 1, 13))
    plan = shard.core.pull(0, oldest - 1)  # one version further behind: the whole value, bit for bit
    assert plan.snapshot and torch.equal(decode_payload(plan.items[0].header, plan.items[0].payload), shard.value())


def test_pull_sends_a_snapshot_when_the_history_no_longer_reaches_back():
    shard = Shard(make_config(codec="int4", history_versions=2), joined=("a",))
    for version in range(3):
        shard.push("a", 0, delta(version, shard.numel()), base=version)
    assert [u.version for u in shard.core.pull(0, 1).items] == [2, 3]
    plan = shard.core.pull(0, 0)  # update 1 is no longer kept
    assert plan.snapshot and plan.items[0].version == 3
    assert torch.equal(decode_payload(plan.items[0].header, plan.items[0].payload), shard.value())
    assert shard.core.pull(0, 3).items == ()
    with refused("FAILED_PRECONDITION", "future_base_version"):
        shard.core.pull(0, 4)


def test_snapshot_pulls_of_a_version_serve_the_values_own_bytes_described_once():
    shard = Shard(make_config(), joined=("a",))
    first = shard.core.pull(0, None).items[0]
    assert shard.core.pull(0, None).items[0] is first  # its checksum is not computed again
    assert bytes(first.payload) == shard.value().numpy().tobytes()
    shard.push("a", 0, delta(1, shard.numel()))
    second = shard.core.pull(0, None).items[0]
    assert second.version == 1 and bytes(second.payload) == shard.value().numpy().tobytes()
    assert torch.equal(decode_payload(second.header, second.payload), shard.value())


def test_kept_compute_counts_the_fragments_share_of_accepted_steps():
    shard = Shard(make_config(), joined=("a", "b"))
    model_numel = sum(math.prod(shape) for _, shape in MANIFEST)
    shard.push("a", 0, delta(1, shard.numel()), c_steps=10, step_seconds=0.5)
    expected = 10 * 0.5 * shard.numel() / model_numel
    assert shard.core.counters.snapshot()["kept_compute_seconds"] == pytest.approx(expected)


# ---- membership, duplicates, seeds ------------------------------------------------------

def test_membership_refuses_strangers_zombies_and_the_unjoined():
    shard = Shard(make_config(), joined=("a",))
    with refused("PERMISSION_DENIED", "unknown_learner_id"):
        shard.core.join("mallory", 1, "r", MANIFEST)
    with refused("FAILED_PRECONDITION", "not_joined"):
        shard.core.heartbeat("b", 1)
    shard.core.join("a", 2, "r", MANIFEST)  # a restarted: incarnation 1 is now a zombie
    with refused("FAILED_PRECONDITION", "old_incarnation"):
        shard.push("a", 0, delta(1, shard.numel()), incarnation=1)
    with refused("FAILED_PRECONDITION", "old_incarnation"):
        shard.core.join("a", 1, "r", MANIFEST)
    with refused("FAILED_PRECONDITION", "manifest_mismatch") as info:
        shard.core.join("b", 1, "r", MANIFEST[:-1] + [("embed.w", (33,))])
    assert "embed.w" in info.value.message
    counters = shard.core.counters.snapshot()
    assert counters["refusals.old_incarnation"] == 2 and counters["refusals.unknown_learner_id"] == 1


def test_who_is_live_follows_every_join_renewal_leave_and_lease_end():
    # Membership keeps its answers between changes: a plain model of the leases (live: joined,
    # not left, renewed less than a lease ago, its Attend call not ended) must agree after every
    # call, expiries counted once.
    rng = random.Random(3)
    counters = Counters()
    membership = Membership(LEARNERS, 10.0, counters)
    now, incarnation, lease_end, left, expired, expiries = 0.0, {}, {}, set(), set(), 0
    for _ in range(3000):
        learner, action = rng.choice(LEARNERS), rng.random()
        if action < 0.1:
            incarnation[learner] = incarnation.get(learner, 0) + 1
            membership.join(learner, incarnation[learner], "r", now)
            lease_end[learner] = now + 10.0
            left.discard(learner)
            expired.discard(learner)
        elif action < 0.15 and learner in incarnation:
            membership.leave(learner, incarnation[learner], now)
            left.add(learner)
        elif action < 0.55 and learner in incarnation:
            with contextlib.suppress(Refusal):
                membership.authenticate(learner, incarnation[learner], now)
                assert learner not in left | expired
                lease_end[learner] = now + 10.0
        elif action < 0.6 and learner in incarnation:
            with contextlib.suppress(Refusal):  # its process died: its Attend call ended
                membership.absent(learner, incarnation[learner], membership.attend(learner, incarnation[learner], now),
                                  now)
                assert learner not in left | expired
                expired.add(learner)
        else:
            now += rng.choice((0.0, 0.5, 3.0, 7.0))
            ended = {l for l in incarnation if l not in left | expired and lease_end[l] <= now}
            expired, expiries = expired | ended, expiries + len(ended)
        assert membership.awaited_ids(now, None) == set(incarnation) - left - expired
        assert membership.member_ids() == set(incarnation) - left and membership.departed_ids() == left
    assert counters.snapshot()["learners.expired"] == expiries > 10


def test_duplicates_are_refused_in_the_open_round_and_after_the_merge():
    shard = Shard(make_config(), joined=("a", "b"))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    with refused("ALREADY_EXISTS", "duplicate"):
        shard.push("a", 0, delta(2, n))
    shard.push("b", 0, delta(3, n))  # closes round 1
    with refused("ALREADY_EXISTS", "duplicate"):
        shard.push("b", 0, delta(3, n))
    shard.core.join("b", 2, "r", MANIFEST)  # a new process may contribute from the same base
    assert shard.push("b", 0, delta(4, n), incarnation=2).result == pb.PUSH_RESULT_STALE_MERGED
    # A retried push that was merged already is no refused contribution.
    assert "contributions.refused" not in shard.core.counters.snapshot()


def test_the_first_seed_wins_and_unseeded_fragments_take_no_gradients():
    shard = Shard(make_config(), seed=False)
    n = shard.numel()
    with refused("FAILED_PRECONDITION", "unseeded"):
        shard.push("a", 0, delta(1, n))
    bf16 = get_codec("bf16")
    payload = bf16.encode(delta(1, n), 128)
    header = pb.PushHeader(learner_id="a", incarnation=1, fragment_id=0, kind=pb.PUSH_KIND_SEED,
                           payload=describe(bf16, n, payload, 128))
    with refused("INVALID_ARGUMENT", "wrong_codec"):  # seeds are fp32: every learner starts from the same bits
        shard.core.push(header, iter_chunks(payload))
    first, second = delta(1, n, scale=1.0), delta(2, n, scale=1.0)
    assert shard.push("b", 0, first, kind=pb.PUSH_KIND_SEED).result == pb.PUSH_RESULT_SEEDED
    with refused("ALREADY_EXISTS", "already_seeded"):
        shard.push("c", 0, second, kind=pb.PUSH_KIND_SEED)
    assert torch.equal(shard.value(), first) and shard.version() == 0
    # The outer gradient pushed before any seed was a refused contribution; the seeds were not.
    assert shard.core.counters.snapshot()["contributions.refused"] == 1
    assert shard.core.status().fragments[0].state_hash == state_hash(first)


def test_a_seed_still_streaming_in_when_another_lands_is_refused_before_its_remaining_chunks():
    # A learner on a slow link stops uploading a fragment the shard no longer needs.
    shard = Shard(make_config(), seed=False)
    n = shard.numel()
    fp32 = get_codec("fp32")
    slow, fast = delta(1, n, scale=1.0), delta(2, n, scale=1.0)
    payload = fp32.encode(slow, 128)
    chunk_bytes = -(-len(payload) // 4)
    header = pb.PushHeader(learner_id="a", incarnation=1, fragment_id=0, kind=pb.PUSH_KIND_SEED,
                           payload=describe(fp32, n, payload, 128, chunk_bytes))
    sent = []

    def slow_chunks():
        for chunk in iter_chunks(payload, chunk_bytes):
            sent.append(chunk.index)
            yield chunk
            if len(sent) == 1:  # another learner's seed lands meanwhile
                assert shard.push("b", 0, fast, kind=pb.PUSH_KIND_SEED).result == pb.PUSH_RESULT_SEEDED

    with refused("ALREADY_EXISTS", "already_seeded"):
        shard.core.push(header, slow_chunks())
    assert sent == [0, 1]  # of 4: the check before taking each chunk refused the second
    assert torch.equal(shard.value(), fast) and shard.version() == 0


# ---- what a learner may claim (syncer/claims.py) ------------------------------------------
# make_config: trainer.batch_size 8 x model.seq_len 128 -> at most T = 1024 tokens per step;
# trainer.max_steps 1000; sync.interval_steps H = 4.

T = 8 * 128


class KeepingJournal(NullJournal):
    """Keeps in memory what a ShardStore keeps on disk, and reads it back as after a restart."""

    def __init__(self):
        self.manifest, self.plan_digest = None, ""
        self.snapshots, self.log = {}, {}

    def fix_manifest(self, manifest, plan_digest):
        self.manifest, self.plan_digest = manifest, plan_digest

    def append(self, fragment_id, contribution, spool):
        self.log.setdefault(fragment_id, []).append(contribution)

    def close_round(self, fragment_id, close):
        self.log.setdefault(fragment_id, []).append(close)

    def commit(self, snapshot):
        self.snapshots[snapshot.fragment_id] = copy.deepcopy(snapshot)  # the core advances its buffers in place
        self.log[snapshot.fragment_id] = []

    def restored(self):
        return Restored(self.manifest, self.plan_digest, copy.deepcopy(self.snapshots),
                        {fid: list(logged) for fid, logged in self.log.items()})


HONEST_HEARTBEAT = {"step": 10, "step_seconds": 0.5, "tokens_per_second": T / 0.5, "tokens": 10 * T, "sync_step": 11}


@pytest.mark.parametrize("field, value", [
    ("step_seconds", float("nan")), ("step_seconds", float("inf")), ("step_seconds", -1.0),
    ("step_seconds", 1e300), ("step_seconds", 5e-324),
    ("tokens_per_second", float("inf")), ("tokens_per_second", float("nan")), ("tokens_per_second", -1.0),
    ("tokens_per_second", 10 * T / 0.5),  # ten steps' tokens in one step's time
    ("tokens", 2**64 - 1), ("tokens", 10**9), ("tokens", 10 * T + 1),
    ("step", 1001), ("sync_step", 2**63), ("waiting_for", 2),
])
def test_a_heartbeat_number_out_of_range_is_refused_naming_it_and_changes_nothing(field, value):
    shard = Shard(make_config(lease_seconds=10.0), joined=("a", "b"))
    core = shard.core
    core.heartbeat("a", 1, **HONEST_HEARTBEAT)
    shard.clock.advance(1.0)
    before = core.status()
    with refused("INVALID_ARGUMENT", f"bad_{field}") as info:
        core.heartbeat("a", 1, **{**HONEST_HEARTBEAT, field: value})
    assert field in info.value.message
    after = core.status()  # still answers, with what the last good heartbeat said
    assert after.learners == before.learners and core.run_tokens()[0] < 10**6
    assert core.counters.snapshot()[f"refusals.bad_{field}"] == 1
    # The refused heartbeat renewed nothing: not even a's lease.
    assert after.learners[0].seconds_since_heartbeat == pytest.approx(1.0)


def test_a_push_renews_the_lease_but_does_not_make_the_step_report_look_fresher():
    # A rejoining learner advances the others' sync_step by seconds_since_heartbeat /
    # step_seconds: measured from a push, it would land out of phase with them.
    shard = Shard(make_config(lease_seconds=10.0), joined=("a", "b"))
    shard.core.heartbeat("a", 1, **HONEST_HEARTBEAT)
    shard.clock.advance(2.0)
    shard.push("a", 0, delta(0, shard.numel()), c_steps=4, c_tokens=4 * T)
    shard.clock.advance(0.5)
    a = next(l for l in shard.core.status().learners if l.id == "a")
    assert a.seconds_since_heartbeat == pytest.approx(2.5) and a.sync_step == HONEST_HEARTBEAT["sync_step"]


def test_heartbeat_tokens_grow_no_faster_than_the_claimed_rate_allows():
    shard = Shard(make_config(lease_seconds=2.0), joined=("a",))
    core = shard.core
    core.heartbeat("a", 1, step=10, step_seconds=0.5, tokens_per_second=T / 0.5, tokens=10 * T)
    shard.clock.advance(1.0)  # at 2 steps a second: 2 steps, and the lease's 2 s of slack, 4 more
    with refused("INVALID_ARGUMENT", "bad_tokens") as info:
        core.heartbeat("a", 1, step=20, step_seconds=0.5, tokens_per_second=T / 0.5, tokens=20 * T)
    assert "grew by" in info.value.message
    core.heartbeat("a", 1, step=16, step_seconds=0.5, tokens_per_second=T / 0.5, tokens=16 * T)
    assert core.status().learners[0].tokens == 16 * T


def test_the_run_token_count_counts_no_learner_beyond_its_budget():
    shard = Shard(make_config(lease_seconds=10.0), joined=("a",))
    core = shard.core
    budget = 1000 * T  # trainer.max_steps at T tokens per step
    core.heartbeat("a", 1, step=1000, step_seconds=1e-6, tokens_per_second=T / 1e-6, tokens=budget)
    shard.clock.advance(5.0)  # a rate of a billion tokens a second, extrapolated
    assert core.run_tokens()[0] == budget


@pytest.mark.parametrize("claims, reason", [
    ({"step_seconds": float("nan")}, "bad_step_seconds"), ({"step_seconds": float("inf")}, "bad_step_seconds"),
    ({"step_seconds": -1.0}, "bad_step_seconds"), ({"step_seconds": 1e300}, "bad_step_seconds"),
    ({"c_tokens": 10 * 10 * T}, "bad_c_tokens"),  # ten times the honest tokens of 10 steps
    ({"c_tokens": 2**64 - 1}, "bad_c_tokens"), ({"c_steps": 1001, "c_tokens": 1001}, "bad_c_steps"),
])
def test_a_push_claiming_out_of_range_numbers_is_refused_before_it_is_logged(claims, reason):
    journal = KeepingJournal()
    shard = Shard(make_config(), journal=journal)
    field = reason.removeprefix("bad_")
    with refused("INVALID_ARGUMENT", reason) as info:
        shard.push("a", 0, delta(1, shard.numel()), **claims)
    assert field in info.value.message
    assert not any(journal.log.values()) and shard.core.fragments[0].round.count == 0
    counters = shard.core.counters.snapshot()
    assert counters[f"refusals.{reason}"] == 1 and counters["contributions.refused"] == 1
    assert "kept_compute_seconds" not in counters
    shard.push("a", 0, delta(1, shard.numel()), c_steps=10, c_tokens=10 * T)  # the honest claim
    assert len(journal.log[0]) == 1


def test_no_contribution_weighs_more_than_one_sync_period_at_the_most_tokens_per_step():
    # b claims 100 steps at T tokens each: honest after failed syncs, or a learner inflating
    # its share. Either way it weighs as a max-rate learner's one period of H = 4 steps.
    sgd = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    shard = Shard(make_config(merge="mean", outer_optimizer=sgd), joined=("a", "b"))
    n = shard.numel()
    x, y = delta(1, n), delta(2, n)
    shard.push("a", 0, x, c_steps=4, c_tokens=4 * T)  # w = 4 T^2
    shard.push("b", 0, y, c_steps=100, c_tokens=100 * T)  # w = 100 T^2, capped to 4 T^2
    assert torch.allclose(shard.value() - shard.seeds[0], -(x + y) / 2, atol=1e-6)
    # And it adds one period's tokens, not a hundred steps', to the run's count.
    assert shard.core.status().fragments[0].merged_tokens == 4 * T + 4 * T


def test_the_merge_stays_finite_for_any_weight_and_any_norm():
    assert contribution_weight(2**64 - 1, 1, 0, 1.0) == pytest.approx(float(2**64 - 1) ** 2)
    for method in ("rda", "mean"):
        accumulator = RoundAccumulator(8, method)
        tiny = torch.full((8,), 1e-40)  # subnormal: weight / norm overflows float32
        accumulator.add(tiny, weight=0.5, norm=float(tiny.double().norm()))
        accumulator.add(torch.ones(8), weight=0.5, norm=float(torch.ones(8).norm()))
        assert torch.isfinite(accumulator.merged()).all(), method


def test_a_logged_contribution_out_of_range_is_merged_with_its_claims_clamped_on_restart(caplog):
    """A round.log written before the claims were checked: 2^64-1 tokens made every close fail,
    after every restart."""
    cfg = make_config(merge="mean", outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
    journal = KeepingJournal()
    shard = Shard(cfg, journal=journal, joined=("a", "b"))
    n = shard.numel()
    x, y = delta(1, n), delta(2, n)
    shard.push("a", 0, x, c_steps=4, c_tokens=4 * T)
    logged = journal.log[0][0]
    logged.header.c_tokens, logged.header.step_seconds = 2**64 - 1, float("nan")  # as an old shard took it
    restarted = ShardCore(cfg, 0, clock=shard.clock, journal=NullJournal())
    restarted.restore(journal.restored())
    assert "claim out of range" in caplog.text and restarted.counters.snapshot()["contributions.clamped"] == 1
    restarted.join("a", 1, "r", MANIFEST)
    restarted.join("b", 1, "r", MANIFEST)
    header = pb.PushHeader(learner_id="b", incarnation=1, fragment_id=0, kind=pb.PUSH_KIND_OUTER_GRADIENT,
                           c_steps=4, c_tokens=4 * T, step_seconds=0.5,
                           payload=describe(get_codec("fp32"), n, get_codec("fp32").encode(y, 128), 128))
    assert restarted.push(header, iter_chunks(get_codec("fp32").encode(y, 128))).committed
    state = restarted.fragments[0].committed
    assert torch.allclose(state.value - shard.seeds[0], -(x + y) / 2, atol=1e-6)  # a's weight: one period
    assert state.merged_tokens == 4 * T + 4 * T
    assert restarted.status().counters  # and Status answers


def test_a_config_with_a_model_factory_must_give_the_tokens_per_step_bound():
    data = {"shards": [{"address": "127.0.0.1:1"}], "learners": [{"id": "a", "region": "r"}],
            "model": "tests.user_plugins:make_model"}
    with pytest.raises(ConfigError, match="syncer.max_tokens_per_step: required with a model factory"):
        parse_config(data)
    core = ShardCore(parse_config({**data, "syncer": {"max_tokens_per_step": 128}}), 0)
    assert core.claims.tokens_per_step == 128


# ---- RESTORE: a shard that lost its state continues from a learner's copy ------------------

def restore(shard, learner, fid, values, version, *, hash_of=None):
    payload = get_codec("fp32").encode(values, 128)
    header = pb.PushHeader(learner_id=learner, incarnation=1, fragment_id=fid, kind=pb.PUSH_KIND_RESTORE,
                           base_version=version, state_hash=state_hash(values if hash_of is None else hash_of),
                           payload=describe(get_codec("fp32"), values.numel(), payload, 128))
    return shard.core.push(header, iter_chunks(payload))


def test_an_empty_shard_takes_a_restore_and_continues_from_it():
    shard = Shard(make_config(), seed=False)
    n = shard.numel()
    value = delta(7, n, scale=1.0)
    reply = restore(shard, "a", 0, value, 5)
    assert (reply.result, reply.current_version, reply.committed) == (pb.PUSH_RESULT_RESTORED, 5, True)
    assert shard.version() == 5 and torch.equal(shard.value(), value)
    committed = shard.core.fragments[0].committed
    assert not committed.momentum.any() and not committed.residual.any()
    assert shard.core.status().fragments[0].state_hash == state_hash(value)
    assert shard.core.counters.snapshot()["fragments.restored"] == 1
    # A learner a version behind is stale-merged as usual; one further behind is refused.
    assert shard.push("b", 0, delta(1, n), base=4).result == pb.PUSH_RESULT_STALE_MERGED
    assert shard.push("c", 0, delta(2, n), base=0).result == pb.PUSH_RESULT_REFUSED_STALE


def test_a_fragment_that_had_durable_state_at_start_takes_no_restore():
    journal = KeepingJournal()
    shard = Shard(make_config(), journal=journal)
    restarted = ShardCore(shard.cfg, 0, clock=shard.clock, journal=journal)
    restarted.restore(journal.restored())
    restarted.join("a", 1, "r", MANIFEST)
    shard.core = restarted
    with refused("ALREADY_EXISTS", "not_restorable") as info:
        restore(shard, "a", 0, delta(7, shard.numel()), 3)
    assert "fragment 0 is at version 0 on this shard: pull it" in info.value.message
    assert shard.version() == 0 and torch.equal(shard.value(), shard.seeds[0])


def test_no_restore_once_a_contribution_was_admitted_or_a_round_closed():
    shard = Shard(make_config(quorum=1), seed=False, joined=("a", "b"))
    n = shard.numel()
    restore(shard, "a", 0, delta(7, n), 2)
    restore(shard, "a", 1, delta(8, shard.numel(1)), 2)
    shard.push("a", 0, delta(1, n), base=2)  # admitted: the open round holds it
    with refused("ALREADY_EXISTS", "not_restorable"):
        restore(shard, "b", 0, delta(9, n), 9)
    shard.push("a", 1, delta(2, shard.numel(1)), base=2)
    shard.push("b", 1, delta(3, shard.numel(1)), base=2)  # round closed: version 3
    with refused("ALREADY_EXISTS", "not_restorable") as info:
        restore(shard, "b", 1, delta(9, shard.numel(1)), 9)
    assert "at version 3" in info.value.message and shard.version(1) == 3


def test_a_restore_whose_hash_does_not_match_its_value_is_refused():
    shard = Shard(make_config(), seed=False)
    with refused("INVALID_ARGUMENT", "bad_state_hash") as info:
        restore(shard, "a", 0, delta(7, shard.numel()), 4, hash_of=delta(8, shard.numel()))
    assert "state_hash" in info.value.message
    with refused("INVALID_ARGUMENT", "bad_restore"):
        restore(shard, "a", 0, delta(7, shard.numel()), 0)
    assert shard.core.fragments[0].committed is None and shard.core.fragments[0].restorable


def test_a_higher_restore_replaces_a_lower_one_or_a_reseed_while_nothing_was_merged():
    shard = Shard(make_config(), seed=True)  # re-seeded with a learner's local weights: version 0
    n = shard.numel()
    low, high = delta(7, n, scale=1.0), delta(8, n, scale=1.0)
    assert restore(shard, "a", 0, low, 3).result == pb.PUSH_RESULT_RESTORED
    assert restore(shard, "b", 0, high, 6).result == pb.PUSH_RESULT_RESTORED
    assert shard.version() == 6 and torch.equal(shard.value(), high)
    with refused("ALREADY_EXISTS", "not_restorable"):  # not higher: nothing to gain
        restore(shard, "c", 0, low, 6)
    with refused("ALREADY_EXISTS", "already_seeded"):
        shard.push("c", 0, low, kind=pb.PUSH_KIND_SEED)


def test_a_push_ahead_of_the_shard_says_the_shard_lost_its_state():
    shard = Shard(make_config())
    with refused("FAILED_PRECONDITION", "future_base_version") as info:
        shard.push("a", 1, delta(1, shard.numel(1)), base=3)
    assert info.value.message.startswith(
        "base_version 3 is ahead of fragment 1's version 0: the shard lost its state or the learner holds another run's")


# ---- a full disk ----------------------------------------------------------------------------

class FillingJournal(KeepingJournal):
    """A disk that fills up: the listed calls raise ENOSPC while `full`."""

    def __init__(self):
        super().__init__()
        self.full, self.failing = False, {"append", "sync", "close_round", "commit"}

    def _write(self, call):
        if self.full and call in self.failing:
            raise OSError(errno.ENOSPC, "No space left on device")

    def append(self, fragment_id, contribution, spool):
        self._write("append")
        super().append(fragment_id, contribution, spool)

    def sync(self, fragment_id):
        self._write("sync")

    def close_round(self, fragment_id, close):
        self._write("close_round")
        super().close_round(fragment_id, close)

    def commit(self, snapshot):
        self._write("commit")
        super().commit(snapshot)


def test_a_full_disk_refuses_pushes_logs_once_and_loses_no_contribution(caplog):
    sgd = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    journal = FillingJournal()
    shard = Shard(make_config(quorum=1, merge="mean", outer_optimizer=sgd), journal=journal)
    shard.core = ShardCore(shard.cfg, 0, clock=shard.clock, journal=journal, state_location="/state/shard-0")
    shard.core.restore(journal.restored())
    for learner in LEARNERS:
        shard.core.join(learner, 1, "r", MANIFEST)
    n = shard.numel()
    x, y = delta(1, n), delta(2, n)
    shard.push("a", 0, x)
    journal.full = True
    with refused("RESOURCE_EXHAUSTED", "disk_full") as info:
        shard.push("b", 0, y)
    assert "/state/shard-0" in info.value.message and "No space left" in info.value.message
    assert shard.core.fragments[0].round.count == 1
    shard.clock.advance(5.0)  # a's round is due (quorum 1, grace passed), but cannot be committed
    for _ in range(100):
        assert shard.core.tick() == []
    assert shard.core.counters.snapshot()["refusals.disk_full"] == 1
    failures = [r for r in caplog.records if "cannot write the shard's state" in r.getMessage()]
    assert len(failures) == 1 and not any(r.exc_info for r in caplog.records)
    journal.full = False
    assert shard.core.tick() == [0]  # a's contribution survived the full disk
    assert torch.allclose(shard.value() - shard.seeds[0], -x, atol=1e-6)
    assert sum("writing the shard's state in /state/shard-0 again" in r.getMessage() for r in caplog.records) == 1


def test_a_push_whose_round_cannot_be_committed_is_accepted_and_merged_once_the_disk_has_room():
    journal = FillingJournal()
    sgd = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    shard = Shard(make_config(merge="mean", outer_optimizer=sgd), journal=journal, joined=("a",))
    n = shard.numel()
    journal.full, journal.failing = True, {"close_round"}  # room for the push's record, not for the close's
    reply = shard.push("a", 0, delta(1, n))
    assert reply.result == pb.PUSH_RESULT_ACCEPTED and not reply.committed and shard.version() == 0
    journal.full = False
    assert shard.core.tick() == [0] and shard.version() == 1
    assert torch.allclose(shard.value() - shard.seeds[0], -delta(1, n), atol=1e-6)


def test_a_learner_stays_live_while_its_push_arrives_however_long_its_link_takes():
    # On a slow link a heartbeat waits behind a push's bytes: the bytes themselves are proof of life.
    shard = Shard(make_config(lease_seconds=1.5), joined=("a", "b"))
    header, chunks = shard.push_parts("a", 0, delta(0, shard.numel()), chunk_bytes=64)

    def slow(chunks):
        for chunk in chunks:
            shard.clock.advance(1.0)  # each chunk a lease's worth of time after the last
            assert alive(shard, "a")
            yield chunk

    assert shard.core.push(header, slow(chunks)).result == pb.PUSH_RESULT_ACCEPTED
    shard.clock.advance(1.4)  # its lease runs from the push's end
    assert alive(shard, "a")
    shard.clock.advance(0.2)
    assert not alive(shard, "a")


def alive(shard, learner_id: str) -> bool:
    return next(l for l in shard.core.status().learners if l.id == learner_id).alive
