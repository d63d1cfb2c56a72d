"""The learner's decisions, driven directly with a fake clock: when fragments sync, when and how
results are applied, holding the schedule, c_steps and c_tokens, the run's token budget and
the phase of the others. No gRPC, no threads, no sleeping."""
import pytest
import torch

from diloco.learner.sync.schedule import LearnerSchedule, merged_fragment, position_of_the_others
from diloco.services.contract.config import parse_config
from diloco.services.contract.fragments import plan_for_config
from diloco.services.contract.wire import pb

MANIFEST = [("blocks.0.w", (64,)), ("blocks.1.w", (48,)), ("head.w", (40,)), ("embed.w", (32,))]
TOKENS = 10  # per inner step


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_schedule(fragments=2, interval_steps=4, overlap_steps=1, max_block_seconds=2.0, max_block_steps=None,
                  max_run_tokens=None, wait_for_own_link=True, max_steps=1000, learners=1, quorum=1, grace_seconds=1.0):
    cfg = parse_config({
        "shards": [{"address": "127.0.0.1:1"}],
        "learners": [{"id": f"l{i}", "region": "r"} for i in range(learners)],
        "syncer": {"quorum": quorum, "grace": {"seconds": grace_seconds}},
        "sync": {"fragments": fragments, "interval_steps": interval_steps, "overlap_steps": overlap_steps,
                 "max_block_seconds": max_block_seconds, "max_block_steps": max_block_steps,
                 "wait_for_own_link": wait_for_own_link},
        "trainer": {"max_run_tokens": max_run_tokens, "max_steps": max_steps},
    })
    clock = FakeClock()
    return LearnerSchedule(cfg, plan_for_config(cfg, MANIFEST), clock=clock), clock


def offsets(schedule):
    return {f.id: f.offset_step for f in schedule.plan.fragments}


def starts(schedule, steps):
    """{step: fragments started after it}, over `steps` inner steps, never applying a result."""
    started = {}
    for step in range(steps):
        actions = schedule.step_done(step, TOKENS)
        for fid in ids(actions.start):
            started.setdefault(step, []).append(fid)
            schedule.result_arrived(fid, step, 0.1, applied=True)  # so that the next one can start
    return started


def ids(entries):
    """The fragment ids of StepActions.start or .apply."""
    return tuple(entry.fragment_id for entry in entries)


def start_one(schedule, fragment_id=0):
    """Steps until `fragment_id` starts syncing; the step it started after."""
    step = 0
    while fragment_id not in ids(schedule.step_done(step, TOKENS).start):
        step += 1
    return step


# --- when a sync starts -------------------------------------------------------------------

def test_a_fragment_starts_syncing_after_each_step_its_offset_falls_on():
    schedule, _ = make_schedule()
    started = starts(schedule, 8)
    expected = {}
    for fid, offset in offsets(schedule).items():
        for step in (offset, offset + 4):
            expected.setdefault(step, []).append(fid)
    assert started == expected


def test_the_sync_offset_moves_the_steps_a_fragment_syncs_at():
    schedule, _ = make_schedule(fragments=1)
    schedule.sync_offset = 1
    offset = offsets(schedule)[0]
    assert sorted(starts(schedule, 8)) == [step for step in range(8) if (step + 1) % 4 == offset]


def test_a_fragment_whose_sync_is_in_flight_does_not_start_another():
    schedule, _ = make_schedule(fragments=1)
    first = start_one(schedule)
    later = [ids(schedule.step_done(step, TOKENS).start) for step in range(first + 1, first + 9)]
    assert later == [()] * 8  # its result never arrived


def test_no_sync_starts_whose_result_the_step_budget_would_end_before_or_at():
    # Those fragments' progress goes out as the learner's last contribution instead.
    for tau in (0, 1, 2):
        schedule, _ = make_schedule(fragments=1, overlap_steps=tau, max_steps=12)
        offset = offsets(schedule)[0]
        # Steps are 0-based: a sync started after step s is applied after step s + tau.
        assert sorted(starts(schedule, 12)) == [s for s in range(12) if s % 4 == offset and s + tau < 11]


# --- when a result is applied -------------------------------------------------------------

def test_a_result_is_due_tau_steps_after_its_sync_started_and_stays_due_until_it_arrives():
    schedule, _ = make_schedule(fragments=1, overlap_steps=2)
    started = start_one(schedule)
    due = [ids(schedule.step_done(step, TOKENS).apply) for step in range(started + 1, started + 4)]
    assert due == [(), (0,), (0,)]
    schedule.result_arrived(0, started + 3, 0.1, applied=True)
    assert ids(schedule.step_done(started + 4, TOKENS).apply) == ()


def test_tau_zero_applies_after_the_same_step_and_waits_without_limit():
    schedule, _ = make_schedule(fragments=1, overlap_steps=0)
    step = 0
    while not (actions := schedule.step_done(step, TOKENS)).start:
        step += 1
    assert ids(actions.apply) == (0,)
    schedule.fragments[0].waited(1000.0)
    assert schedule.fragments[0].wait_limit() is None


def test_the_wait_for_a_result_is_bounded_by_max_block_seconds_per_sync():
    schedule, _ = make_schedule(fragments=1, max_block_seconds=2.0)
    start_one(schedule)
    fragment = schedule.fragments[0]
    assert fragment.wait_limit() == 2.0
    fragment.waited(1.5)
    assert fragment.wait_limit() == 0.5
    fragment.waited(1.0)
    assert fragment.wait_limit() == 0.0
    schedule.result_arrived(0, fragment.apply_at, 0.0, applied=True)
    start_one(schedule)  # the next sync waits afresh
    assert fragment.wait_limit() == 2.0


def test_max_block_steps_caps_the_wait_at_that_many_of_the_learners_step_times_per_sync():
    schedule, _ = make_schedule(fragments=1, max_block_seconds=2.0, max_block_steps=1.5)
    start_one(schedule)
    assert schedule.wait_limit(0, step_seconds=0.1) == pytest.approx(0.15)
    assert schedule.wait_limit(0, step_seconds=10.0) == 2.0  # max_block_seconds still bounds it
    assert schedule.wait_limit(0, step_seconds=0.0) == 2.0  # no step time measured yet
    schedule.result_still_out(0, 0.1)
    assert schedule.wait_limit(0, step_seconds=0.1) == pytest.approx(0.05)
    step = schedule.fragments[0].apply_at + 1
    assert schedule.step_done(step, TOKENS, step_seconds=0.2).apply[0].wait_limit == pytest.approx(0.2)


def test_a_due_result_comes_with_how_long_to_wait_for_it_and_a_start_with_its_counters():
    schedule, _ = make_schedule(fragments=1, max_block_seconds=2.0)
    step = 0
    while not (actions := schedule.step_done(step, TOKENS)).start:
        step += 1
    assert actions.start[0].c_steps == step + 1 and actions.start[0].c_tokens == (step + 1) * TOKENS
    assert schedule.result_still_out(0, 1.5) is True  # the first time: keep the local values now
    assert schedule.result_still_out(0, 0.25) is False
    due = schedule.step_done(step + 1, TOKENS).apply
    assert ids(due) == (0,) and due[0].wait_limit == 0.25


def test_a_result_missing_after_the_wait_asks_for_one_snapshot_of_the_fragment():
    schedule, _ = make_schedule(fragments=1)
    start_one(schedule)
    assert schedule.fragments[0].missed() is True
    assert schedule.fragments[0].missed() is False  # the first snapshot is the apply step's


# --- merging a result ---------------------------------------------------------------------

def test_a_wait_for_a_result_is_reported_as_waiting_elsewhere_only_once_it_lasts_a_heartbeat_interval():
    # Reported at once, the schedule's ordinary waits of tens of ms let the other fragments'
    # rounds close without this learner, whose pushes then land a round late (stale).
    schedule, clock = make_schedule()  # heartbeats every 0.5 s
    assert schedule.waiting_elsewhere() is None
    schedule.waiting_began(1)
    clock.now += 0.49
    assert schedule.waiting_elsewhere() is None
    assert schedule.waiting_ended() is False  # nothing to take back
    schedule.waiting_began(1)
    clock.now += 0.5
    assert schedule.waiting_elsewhere() == 1
    assert schedule.waiting_ended() is True  # a heartbeat must say it trains again
    assert schedule.waiting_elsewhere() is None


def test_alpha_zero_takes_the_global_value():
    local, global_value = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    assert torch.equal(merged_fragment(0.0, global_value, local), global_value)


def test_alpha_mixes_the_fragment_with_the_global_value():
    local, global_value = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    assert torch.equal(merged_fragment(0.5, global_value, local), torch.tensor([5.5, 11.0]))


def test_a_late_result_is_merged_with_the_fragment_at_its_apply_step_plus_the_steps_trained_since():
    at_apply, now, global_value = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([10.0, 20.0])
    assert torch.equal(merged_fragment(0.0, global_value, now, at_apply), torch.tensor([12.0, 23.0]))
    assert torch.equal(merged_fragment(0.5, global_value, now, at_apply), torch.tensor([7.5, 14.0]))


# --- c_steps and c_tokens -----------------------------------------------------------------

def test_a_result_applied_on_time_resets_c_steps_and_c_tokens():
    schedule, _ = make_schedule(fragments=1)
    started = start_one(schedule)
    schedule.step_done(started + 1, TOKENS)
    fragment = schedule.fragments[0]
    assert (fragment.steps_since_sync, fragment.tokens_since_sync) == (started + 2, (started + 2) * TOKENS)
    assert schedule.result_arrived(0, started + 1, 0.1, applied=True) is False
    assert (fragment.steps_since_sync, fragment.tokens_since_sync) == (0, 0)


def test_a_late_result_keeps_the_steps_and_tokens_trained_since_its_apply_step():
    schedule, _ = make_schedule(fragments=1)
    started = start_one(schedule)
    schedule.step_done(started + 1, TOKENS)
    schedule.fragments[0].missed()
    for step in (started + 2, started + 3):
        schedule.step_done(step, TOKENS)
    assert schedule.result_arrived(0, started + 3, 0.1, applied=True) is True
    assert (schedule.fragments[0].steps_since_sync, schedule.fragments[0].tokens_since_sync) == (2, 2 * TOKENS)


def test_a_skipped_sync_keeps_every_step_for_the_next_outer_gradient_and_does_not_hold():
    schedule, _ = make_schedule(fragments=1)
    started = start_one(schedule)
    schedule.fragments[0].missed()
    for step in (started + 1, started + 2, started + 3):
        schedule.step_done(step, TOKENS)
    schedule.result_arrived(0, started + 3, 0.1, applied=False)
    assert schedule.fragments[0].steps_since_sync == started + 4
    assert not schedule.fragments[0].in_flight and schedule.hold == 0


def test_a_learner_whose_own_transfers_outlast_the_overlap_waits_unless_told_not_to():
    waits, _ = make_schedule(fragments=1, overlap_steps=2, max_block_seconds=2.0)
    schedule, _ = make_schedule(fragments=1, overlap_steps=2, max_block_seconds=2.0, wait_for_own_link=False)
    for s in (waits, schedule):
        start_one(s)
        assert s.wait_limit(0) == 2.0
        s.pushed(upload_seconds=0.3, step_seconds=0.1)  # 3 steps a push: with the pull, 6 against tau = 2
    assert schedule.own_link_steps == pytest.approx(6)
    assert waits.wait_limit(0) == 2.0 and schedule.wait_limit(0) == 0.0
    for _ in range(30):  # its link got faster: it waits for its results again
        schedule.pushed(upload_seconds=0.01, step_seconds=0.1)
    assert schedule.wait_limit(0) == 2.0


def test_with_tau_zero_a_slow_link_still_waits_for_every_result():
    schedule, _ = make_schedule(fragments=1, overlap_steps=0, wait_for_own_link=False)
    start_one(schedule)
    for _ in range(10):
        schedule.pushed(upload_seconds=1.0, step_seconds=0.1)
    assert schedule.wait_limit(0) is None


# --- holding the schedule to fall back into phase ------------------------------------------

def late_by(schedule, steps, waited_seconds=0.0, step_seconds=0.1):
    """Starts fragment 0's sync and lets its result come `steps` steps past its apply step,
    after the training thread waited `waited_seconds` for it."""
    started = start_one(schedule)
    apply_at = schedule.fragments[0].apply_at
    for step in range(started + 1, apply_at + steps + 1):
        schedule.step_done(step, TOKENS)
    schedule.fragments[0].waited(waited_seconds)
    schedule.result_arrived(0, apply_at + steps, step_seconds, applied=True)
    return apply_at + steps


def test_lateness_the_own_link_explains_is_no_lead_to_hold_for():
    schedule, _ = make_schedule(fragments=1, interval_steps=16, overlap_steps=1)
    for _ in range(20):  # its own transfers take 3 steps a sync: 2 past tau
        schedule.pushed(upload_seconds=0.15, step_seconds=0.1)
    late_by(schedule, 3)
    assert schedule.hold == 1  # 3 steps late, 2 of them its own link's


def test_a_late_result_holds_the_schedule_for_the_steps_it_was_late():
    schedule, _ = make_schedule(fragments=1, interval_steps=8)
    last = late_by(schedule, 2)
    assert schedule.hold == 2
    held = [schedule.step_done(step, TOKENS).held for step in (last + 1, last + 2, last + 3)]
    assert held == [True, True, False] and schedule.sync_offset == -2
    # The next sync starts H + 2 steps after the last one.
    step = last + 3
    while not schedule.step_done(step := step + 1, TOKENS).start:
        pass
    assert step == offsets(schedule)[0] + 8 + 2


def test_the_time_waited_for_a_result_counts_towards_the_lead_in_steps():
    schedule, _ = make_schedule(fragments=1, interval_steps=8)
    late_by(schedule, 0, waited_seconds=0.3, step_seconds=0.1)
    assert schedule.hold == 3


def test_the_hold_is_capped_at_h_over_2p_steps():
    schedule, _ = make_schedule(fragments=1, interval_steps=8)
    late_by(schedule, 7)
    assert schedule.hold == 8 // 2


def test_steps_held_since_a_sync_started_count_against_its_lead():
    schedule, _ = make_schedule(fragments=1, interval_steps=8)
    started = start_one(schedule)
    schedule.hold = 2  # another fragment's lead, say
    for step in (started + 1, started + 2, started + 3):
        schedule.step_done(step, TOKENS)
    # Late by two steps, both already held: this learner is back in phase.
    schedule.result_arrived(0, started + 3, 0.1, applied=True)
    assert schedule.hold == 0


def test_a_shorter_lead_does_not_shorten_the_hold():
    schedule, _ = make_schedule(fragments=1, interval_steps=8)
    started = start_one(schedule)
    schedule.step_done(started + 1, TOKENS)
    schedule.step_done(started + 2, TOKENS)
    schedule.hold = 3  # another fragment's lead, say
    schedule.result_arrived(0, started + 2, 0.1, applied=True)  # late by one step
    assert schedule.hold == 3


def on_time_after_waiting_in_its_round(schedule, early_seconds, step_seconds=0.1):
    """Starts fragment 0's sync; its result is in at its apply step, the push having waited
    `early_seconds` in its round for the others' pushes."""
    started = start_one(schedule)
    apply_at = schedule.fragments[0].apply_at
    for step in range(started + 1, apply_at + 1):
        schedule.step_done(step, TOKENS)
    late = schedule.result_arrived(0, apply_at, step_seconds, applied=True, early_seconds=early_seconds)
    assert not late


def test_a_push_that_waited_steps_in_its_round_holds_the_schedule_before_it_becomes_a_wait():
    # In time, but 3.5 steps ahead of the others: this learner steps faster and would soon wait.
    schedule, _ = make_schedule(fragments=1, interval_steps=16)
    on_time_after_waiting_in_its_round(schedule, early_seconds=0.35)
    assert schedule.hold == 3 - 1  # less a step of margin: the others' jitter is no lead


def test_below_a_quorum_of_every_learner_the_grace_window_a_push_waits_is_no_lead():
    # K = 2 of 3: the round waits up to syncer.grace.seconds after its quorum by design.
    schedule, _ = make_schedule(fragments=1, interval_steps=16, learners=3, quorum=2, grace_seconds=0.2)
    on_time_after_waiting_in_its_round(schedule, early_seconds=0.35)
    assert schedule.hold == 0  # 1.5 steps past the grace: within the margin
    schedule, _ = make_schedule(fragments=1, interval_steps=16, learners=3, quorum=2, grace_seconds=0.2)
    on_time_after_waiting_in_its_round(schedule, early_seconds=0.55)
    assert schedule.hold == 3 - 1


def test_a_push_ahead_of_the_others_by_under_two_steps_holds_nothing():
    schedule, _ = make_schedule(fragments=1, interval_steps=16)
    on_time_after_waiting_in_its_round(schedule, early_seconds=0.19)
    assert schedule.hold == 0


def test_how_early_a_push_was_counts_the_steps_held_since_it_started_against_its_lead():
    schedule, _ = make_schedule(fragments=1, interval_steps=16, overlap_steps=3)
    started = start_one(schedule)
    schedule.hold = 2  # another fragment's lead, say
    for step in range(started + 1, started + 4):
        schedule.step_done(step, TOKENS)
    schedule.result_arrived(0, started + 3, 0.1, applied=True, early_seconds=0.35)
    assert schedule.hold == 0  # 3 - 1 steps of lead, both already held


def test_a_skipped_sync_gives_no_lead_however_long_its_pull_took():
    schedule, _ = make_schedule(fragments=1, interval_steps=16)
    started = start_one(schedule)
    schedule.step_done(started + 1, TOKENS)
    schedule.result_arrived(0, started + 1, 0.1, applied=False, early_seconds=1.0)
    assert schedule.hold == 0


# --- the run's token budget ----------------------------------------------------------------

def test_before_a_heartbeat_is_answered_the_run_has_this_learners_tokens():
    schedule, _ = make_schedule(max_run_tokens=100)
    assert schedule.run_tokens(own_tokens=60) == 60 and not schedule.run_over(own_tokens=60)
    assert schedule.run_over(own_tokens=100)


def test_the_others_tokens_grow_at_their_rate_since_the_heartbeat():
    schedule, clock = make_schedule()
    # The reply counts this learner's 400 tokens at 40 per second: the others had 600 at 60.
    schedule.heard_run_tokens(1000, 100.0, own_tokens=400, own_per_second=40.0)
    clock.now += 2.5
    assert schedule.run_tokens(own_tokens=400) == 600 + 150 + 400


def test_this_learners_own_tokens_count_exactly_whatever_rate_it_last_reported():
    # Its last step was slow (a sync wait): its own count must not lag by the rate it reported.
    schedule, clock = make_schedule()
    schedule.heard_run_tokens(1000, 1.0, own_tokens=1000, own_per_second=1.0)
    clock.now += 10.0
    assert schedule.run_tokens(own_tokens=3000) == 3000


def test_the_run_is_over_once_its_tokens_reach_the_budget():
    schedule, clock = make_schedule(max_run_tokens=1200)
    schedule.heard_run_tokens(1000, 100.0, own_tokens=0, own_per_second=0.0)
    clock.now += 1.9
    assert not schedule.run_over(own_tokens=0)
    clock.now += 0.1
    assert schedule.run_over(own_tokens=0)


def test_a_run_without_a_token_budget_is_never_over():
    schedule, clock = make_schedule()
    schedule.heard_run_tokens(10**12, 10.0**9, own_tokens=0, own_per_second=0.0)
    assert not schedule.run_over(own_tokens=10**12)


# --- the phase of the others at (re)join ------------------------------------------------------

def learner(learner_id, sync_step, seconds_since_heartbeat=0.0, step_seconds=0.1, alive=True, last_step=5):
    return pb.LearnerStatus(learner_id=learner_id, sync_step=sync_step, seconds_since_heartbeat=seconds_since_heartbeat,
                            step_seconds=step_seconds, alive=alive, last_step=last_step)


def test_a_learner_alone_syncs_on_its_own_step():
    assert position_of_the_others([], "me", 24) is None
    schedule, _ = make_schedule(interval_steps=8)
    schedule.join_in_phase([], "me", 3)
    assert schedule.sync_offset == 0


def test_the_others_position_is_their_median_schedule_step_half_a_step_on_modulo_h():
    # 6.5, 17.5 and 2.5 around the circle of 24: the widest gap is from 6.5 to 17.5, so the
    # median is 2.5 (26.5 between 17.5 and 30.5).
    others = [learner("a", 30), learner("b", 50), learner("c", 41)]
    assert position_of_the_others(others, "me", 24) == pytest.approx(50.5 % 24)


def test_a_heartbeat_is_counted_half_a_step_into_the_step_it_reports_next():
    # Its heartbeats keep their own time: one comes at any moment of a step, on average half a
    # step after the step count it carries. Taken as just begun, every learner read from
    # Status would be half a step behind on average, and a rejoining one with them.
    others = [learner("a", 30, step_seconds=1.0)]
    assert position_of_the_others(others, "me", 24) == pytest.approx(30.5 % 24)


def test_the_others_schedules_are_advanced_by_the_steps_since_their_heartbeat():
    others = [learner("a", 30, seconds_since_heartbeat=0.5, step_seconds=0.1)]
    assert position_of_the_others(others, "me", 24) == pytest.approx(35.5 % 24)


def test_the_phase_ignores_this_learner_the_dead_and_those_yet_to_train():
    others = [learner("me", 3), learner("dead", 7, alive=False), learner("new", 9, last_step=0), learner("a", 12)]
    assert position_of_the_others(others, "me", 8) == pytest.approx(4.5)


def test_the_others_median_is_taken_around_the_schedules_circle_not_by_step_count():
    # Two at schedule step 23 and one at 1 of H = 24 (one period on, or one that trained fewer
    # steps): by step count the median is the odd one at 25 (1 + H), around the circle 23.
    others = [learner("a", 23), learner("b", 1 + 24), learner("c", 47)]
    assert position_of_the_others(others, "me", 24) == pytest.approx(23.5)


def test_joining_in_phase_sets_the_sync_offset():
    schedule, _ = make_schedule(interval_steps=8)
    schedule.join_in_phase([learner("a", 12)], "me", 3)
    assert schedule.sync_offset == (12 - 3) % 8


def test_a_learner_slow_to_train_its_first_step_after_joining_keeps_the_others_phase():
    # Joined when the others' schedule was at 12.5 (H=8: heartbeats just now, half a step into
    # their step 12); its pulls and checkpoint take 0.33 s (3.3 of their 0.1 s steps) before its
    # first step ends, nearest the end of their step 15 (0.35 s on): its first step is their 15,
    # and it syncs fragment 0 (offset 0) after its second, their 16.
    schedule, clock = make_schedule(interval_steps=8)
    schedule.join_in_phase([learner("a", 12), learner("b", 12, step_seconds=0.1)], "me", 3)
    clock.now += 0.33
    first = schedule.step_done(3, 100)
    assert schedule.sync_offset == (15 - 3) % 8
    assert [s.fragment_id for s in first.start] == [] and [s.fragment_id for s in schedule.step_done(4, 100).start] == [0]


def test_a_rejoined_learners_first_step_takes_the_others_step_that_ends_nearest_to_it():
    # Their step 12 ends about 0.05 s after the Status (a heartbeat just now, half a step into
    # it, 0.1 s steps): a first step ending 0.38 s after it ends nearer their step 15 (0.35 s)
    # than 16 (0.45 s), and one ending 0.42 s after it nearer their 16.
    for seconds, nearest in ((0.38, 15), (0.42, 16)):
        schedule, clock = make_schedule(interval_steps=8)
        schedule.join_in_phase([learner("a", 12)], "me", 3)
        clock.now += seconds
        schedule.step_done(3, 100)
        assert schedule.sync_offset == (nearest - 3) % 8


def test_heartbeats_heard_again_before_the_first_step_number_it_and_none_heard_keep_the_joins():
    # Joined at their 12.5 (0.1 s steps); 5 s of pulls and restore later, extrapolating would
    # say their 62. Heard again just before the first step they are at 20.5: it is their 20.
    schedule, clock = make_schedule(interval_steps=8)
    schedule.join_in_phase([learner("a", 12)], "me", 3)
    clock.now += 5.0
    schedule.heard_again_before_first_step([learner("a", 20, alive=False)], "me")  # nobody live: the join's stand
    assert schedule.first_step_pending
    schedule.heard_again_before_first_step([learner("a", 20)], "me")
    schedule.step_done(3, 100)
    assert schedule.sync_offset == (20 - 3) % 8 and not schedule.first_step_pending


def test_a_rejoining_learner_takes_the_phase_most_others_sync_at_not_that_of_the_median_step_count():
    # H = 24: three learners sync at schedule step 23 (mod H), the one with the median step
    # count among them and a fourth that regrouped a moment ago at 1. Taking the fourth's phase
    # would put this learner two steps behind the three (and hand on the fourth's lag).
    schedule, _ = make_schedule(fragments=4, interval_steps=24)
    others = [learner("a", 23), learner("b", 47), learner("c", 71), learner("d", 49)]
    schedule.join_in_phase(others, "me", 30)
    assert (30 + schedule.sync_offset) % 24 == 23


def test_a_learner_that_joins_past_some_fragments_turns_reports_them_until_their_next_sync():
    # H = 8, P = 4 (offsets 0, 2, 4, 6): joined at the others' 13.5, its next step is their
    # 13, schedule position 5: fragments 0, 1 and 2 synced this period without it, and their
    # rounds should not wait for it; fragment 3 (offset 6) it syncs in this period.
    schedule, _ = make_schedule(fragments=4, interval_steps=8)
    schedule.join_in_phase([learner("a", 13)], "me", 3)
    assert offsets(schedule) == {0: 0, 1: 2, 2: 4, 3: 6}
    assert schedule.turns_passed == {0, 1, 2}
    started = []
    for step in range(3, 3 + 8):
        started += ids(schedule.step_done(step, TOKENS).start)
        if started == [3, 0]:
            assert schedule.turns_passed == {1, 2}  # fragment 0's next sync has started
    assert started == [3, 0, 1, 2] and schedule.turns_passed == set()


def test_a_learner_alone_or_joining_at_the_start_of_a_period_passed_no_turn():
    schedule, _ = make_schedule(fragments=4, interval_steps=8)
    schedule.join_in_phase([], "me", 0)
    assert schedule.turns_passed == set()
    schedule.join_in_phase([learner("a", 8)], "me", 0)  # at their 8.5: its next step is their 8, position 0
    assert schedule.turns_passed == set()


def test_the_turns_passed_are_those_before_the_first_step_as_its_phase_finally_numbers_it():
    # Joined at their 12.5 (position 4 for its first step: fragments 0 and 1 passed); its
    # pulls take 0.13 s, so its first step is their 13 (position 5): fragment 2 passed too.
    schedule, clock = make_schedule(fragments=4, interval_steps=8)
    schedule.join_in_phase([learner("a", 12, step_seconds=0.1)], "me", 3)
    assert schedule.turns_passed == {0, 1}
    clock.now += 0.13
    schedule.step_done(3, TOKENS)
    assert schedule.turns_passed == {0, 1, 2}


def test_a_fragment_whose_next_sync_could_not_be_applied_within_the_budget_is_done_syncing():
    # H = 8, P = 4 (offsets 0, 2, 4, 6), tau = 1, 20 steps: a sync starting after step s is
    # applied after s + 1, so none starts after step 17. Fragment 1's last sync starts after
    # step 10 and is applied after 11; its next turn (18) is too late, so from the step after
    # that apply no round of fragment 1 waits for this learner: its last contribution comes at
    # the run's end. Fragment 0's turn at 16 is still in time.
    schedule, _ = make_schedule(fragments=4, interval_steps=8, max_steps=20)
    done_from, started = {}, []
    for step in range(20):
        actions = schedule.step_done(step, TOKENS)
        started += [(step, fid) for fid in ids(actions.start)]
        for fid in schedule.done_syncing:
            done_from.setdefault(fid, step)
        for fid in ids(actions.apply):
            schedule.result_arrived(fid, step, 0.1, applied=True)
    assert started[-4:] == [(10, 1), (12, 2), (14, 3), (16, 0)]
    assert done_from == {1: 12, 2: 14, 3: 16, 0: 18}


def test_a_fragment_in_flight_is_not_done_syncing_until_its_result_is_in():
    schedule, _ = make_schedule(fragments=2, interval_steps=8, max_steps=10)  # offsets 0 and 4
    schedule.step_done(0, TOKENS)  # fragment 0 starts; its next turn (8) is too late
    assert schedule.done_syncing == set()
    schedule.step_done(1, TOKENS)  # its result is due, not in: in flight still
    assert schedule.done_syncing == set()
    schedule.result_arrived(0, 1, 0.1, applied=True)
    schedule.step_done(2, TOKENS)  # fragment 1's turn (4) is still in time
    assert schedule.done_syncing == {0}


def test_the_catch_up_after_joining_happens_at_the_first_step_only():
    schedule, clock = make_schedule(interval_steps=8)
    schedule.join_in_phase([learner("a", 12)], "me", 3)
    schedule.step_done(3, 100)
    clock.now += 5.0
    schedule.step_done(4, 100)
    assert schedule.sync_offset == (12 - 3) % 8
