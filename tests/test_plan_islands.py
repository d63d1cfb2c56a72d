"""`diloco plan` with learners of several slices (elastic islands, planner/island.py): a slice's
failure costs its learner a pause and the slice's share until it rejoins, the leader slice's
fails over to another slice (a rollback to the checkpoint and a restore, no repair), every slice
down is a learner failure, and the slices are the fleet's failure units in every mode. Virtual
time, no sockets: seconds."""
import itertools

import pytest

from diloco.planner.diloco import DilocoRun
from diloco.planner.failures import FailureModel
from diloco.planner.inputs import PlanError, load_inputs
from diloco.planner.simulate import simulate
from diloco.cli import main

# Four learners of 16 chips, each 4 slices of 4 chips; a small model on fast links; no random failures.
SMALL = {"chips": 64, "learners": 4, "slices_per_learner": 4, "model_parameters": 10_000_000, "interval_steps": 8,
         "fragments": 4, "overlap_steps": 2, "wan_gbps": (10.0,), "chip_mtbf_hours": None, "hours": 0.3,
         "island_reconfigure_seconds": 10.0}


def plan(**inputs):
    return load_inputs({**SMALL, **inputs})


def run_diloco(inputs):
    """The result, and the learners as the run left them."""
    run = DilocoRun(inputs, FailureModel.from_inputs(inputs))
    return run.run(lambda seconds: None), run.learners


def test_a_slice_failure_costs_its_learner_a_pause_and_the_slices_share_until_it_rejoins():
    healthy = simulate(plan(), "diloco")
    # Slice 1 of learner 0 fails halfway through a step at 100.5 s and is repaired 300 s later.
    result = simulate(plan(island_rephase=False, failures=({"learner": 0, "slice": 1, "at_seconds": 100.5},)),
                      "diloco")
    badput = result.goodput.badput_seconds
    assert badput["down"] == pytest.approx(300.0 / 4)  # the slice's share of its repair, not the learner's
    # The three slices left pause 10 s; it joins after its state transfer (0.013 s) at a step
    # boundary (under a second), and all four pause 10 s more.
    assert 7.5 + 10.0 < badput["restore"] < 7.5 + 10.0 + 0.3
    assert badput["lost"] == pytest.approx(0.5) and result.uptime == 1.0  # the step in progress
    # The learner trained on at a quarter fewer tokens per step while the slice was out, and not
    # at all while it paused: the kept tokens fall by that much, not by a whole learner's.
    per_second = load_inputs(SMALL).learner_tokens_per_step() / 1.0
    missing = (healthy.tokens - result.tokens) / per_second
    assert 300.0 / 4 + 7.5 + 10.0 < missing < 300.0 / 4 + 7.5 + 10.0 + 2.5
    # Not re-phased after its pauses it syncs at its own step count, 20.5 steps behind the
    # others' schedule: their rounds close without it, and its pushes count in the next ones.
    assert result.staleness["0"] < 0.9 * result.syncer.merged_contributions
    # Taking its phase from the others again (the default, as a rejoining learner does), the
    # rounds hold every learner.
    rephased = simulate(plan(failures=({"learner": 0, "slice": 1, "at_seconds": 100.5},)), "diloco")
    assert rephased.staleness["0"] > 0.99 * rephased.syncer.merged_contributions
    assert rephased.goodput.badput_seconds["down"] == badput["down"] and rephased.tokens == result.tokens


def test_the_learners_pushes_carry_the_tokens_its_slices_trained():
    outage = plan(failures=({"learner": 0, "slice": 1, "at_seconds": 100.0, "repair_minutes": 30.0},))
    result = simulate(outage, "diloco")
    # A learner short of a slice for the rest of the run: three quarters of its tokens per step.
    steps = 1080 - 100 - 10  # the run after the failure and the pause, at 1 s steps
    per_step = outage.learner_tokens_per_step()
    assert simulate(plan(), "diloco").tokens - result.tokens == pytest.approx(per_step / 4 * steps + per_step * 10,
                                                                             rel=0.01)


def test_every_slice_down_at_once_is_a_learner_failure_as_with_one_slice():
    failure = ({"learner": 2, "at_seconds": 100.0},)  # no slice given: every slice of learner 2
    island = simulate(plan(failures=failure), "diloco")
    whole = simulate(plan(failures=failure, slices_per_learner=1), "diloco")
    assert island.goodput == whole.goodput and island.tokens == whole.tokens and island.syncer == whole.syncer
    assert island.goodput.badput_seconds["down"] == pytest.approx(300.0) and island.failures == 1


def test_the_last_slice_failing_fails_the_learner_which_restarts_when_a_slice_is_repaired():
    # Two slices: slice 0 down from 100 s for 10 minutes (slice 1 takes the lead: a 10 s pause
    # and a pull, then trains on), slice 1 from 200 s for 5: the learner is down from 200 s to
    # 500 s, restarts on slice 1 (a pull from the syncer), and slice 0 rejoins at 700 s
    # (another 10 s pause, both slices).
    result = simulate(plan(slices_per_learner=2, failures=(
        {"learner": 0, "slice": 0, "at_seconds": 100.0, "repair_minutes": 10.0},
        {"learner": 0, "slice": 1, "at_seconds": 200.0, "repair_minutes": 5.0})), "diloco")
    badput = result.goodput.badput_seconds
    restore_pull = badput["restore"] - 10.0 / 2 - 10.0  # less the pauses
    assert 0 < restore_pull < 1.0
    assert badput["down"] == pytest.approx(100.0 / 2 + 300.0 + (700.0 - 500.0 - restore_pull) / 2, abs=0.5)
    assert result.failures == 2 and result.uptime == 1.0  # three other learners train on


def test_without_a_failover_the_leader_slices_failure_fails_the_learner_until_the_leader_is_repaired():
    # island_leader_loss: learner_failure: slice 1 fails at 100 s for 2 minutes, slice 0 at
    # 150 s for 5: the learner is down from 150 s to 450 s, although slice 1 is back at 220 s,
    # and restarts with both.
    failures = ({"learner": 0, "slice": 1, "at_seconds": 100.0, "repair_minutes": 2.0},
                {"learner": 0, "slice": 0, "at_seconds": 150.0, "repair_minutes": 5.0})
    badput = simulate(plan(failures=failures, island_leader_loss="learner_failure"), "diloco").goodput.badput_seconds
    assert badput["down"] == pytest.approx(50.0 / 4 + 300.0)
    # Failing over (the default), slice 0's failure is one more slice out.
    failover = simulate(plan(failures=failures), "diloco").goodput.badput_seconds
    assert failover["down"] == pytest.approx(120.0 / 4 + 300.0 / 4)


# Checkpoints every 50 steps; 30 s start-ups, so the learners' step n ends at 30 + n seconds.
CHECKPOINTED = dict(checkpoint_steps=50, startup_seconds=(30.0,))


def test_the_leader_slice_fails_over_losing_the_steps_since_the_checkpoint_and_a_pause_not_a_repair():
    healthy, healthy_learners = run_diloco(plan(**CHECKPOINTED))
    # Slice 0, the leader, fails halfway through step 121 (150.5 s), 20 steps after the checkpoint.
    failure = ({"learner": 0, "slice": 0, "at_seconds": 150.5},)
    result, learners = run_diloco(plan(**CHECKPOINTED, failures=failure))
    badput, before = result.goodput.badput_seconds, healthy.goodput.badput_seconds
    assert badput["lost"] == pytest.approx(20.0 + 0.5)  # the steps since the checkpoint, the step in progress
    # No repair, no start-up: only the failed slice's share of its own 5-minute repair and 30 s start.
    assert badput["down"] == pytest.approx(300.0 / 4)
    assert badput["startup"] - before["startup"] == pytest.approx(30.0 / 4)
    # The three slices left pause 10 s, then the new leader pulls the updates since the
    # checkpoint (0.03 s); slice 0 rejoins later with a 10 s pause of all four.
    assert 7.5 + 10.0 < badput["restore"] < 7.5 + 10.0 + 0.3
    # The new leader joins as a new incarnation of the learner; the lowest slice left leads.
    assert learners[0].incarnation == healthy_learners[0].incarnation + 1
    assert learners[0].island.leader == 1 and result.uptime == healthy.uptime  # the others trained on
    # As a learner failure: the same loss, then down until slice 0 is repaired and a start-up.
    failed = simulate(plan(**CHECKPOINTED, failures=failure, island_leader_loss="learner_failure"), "diloco")
    assert failed.goodput.badput_seconds["lost"] == pytest.approx(20.0 + 0.5)
    assert failed.goodput.badput_seconds["down"] == pytest.approx(300.0)
    assert failed.goodput.badput_seconds["startup"] - before["startup"] == pytest.approx(30.0)
    assert healthy.goodput.share > result.goodput.share > failed.goodput.share


def test_the_new_leaders_failure_fails_over_again():
    # Slice 0 fails at 150.5 s (slice 1 leads), rejoins about 340 s later; slice 1 fails at 700.5 s.
    result, learners = run_diloco(plan(**CHECKPOINTED, failures=(
        {"learner": 0, "slice": 0, "at_seconds": 150.5}, {"learner": 0, "slice": 1, "at_seconds": 700.5})))
    assert learners[0].island.leader == 0 and learners[0].incarnation == 2 + 2  # seeded, joined, two failovers
    assert result.goodput.badput_seconds["down"] == pytest.approx(2 * 300.0 / 4)

def test_the_slices_are_the_same_failure_units_whatever_the_learners_they_make_up():
    islands = dict(chips=64, learners=2, slices_per_learner=4, chip_mtbf_hours=200.0, hours=6.0)
    slices = dict(islands, learners=8, slices_per_learner=1)
    by_slice = FailureModel.from_inputs(plan(**islands))
    assert [list(itertools.islice(by_slice.outages(u), 5)) for u in range(8)] == [
        list(itertools.islice(FailureModel.from_inputs(plan(**slices)).outages(u), 5)) for u in range(8)]
    # Data parallel runs in the same 8 slices either way.
    for mode in ("dp", "elastic"):
        assert simulate(plan(**islands), mode).goodput == simulate(plan(**slices), mode).goodput


def test_islands_keep_decoupled_diloco_training_where_a_slice_failure_took_its_learner_down():
    # Each 16-chip learner fails about every half hour of uptime, for 20 minutes: as one unit, or
    # one of its four slices does. 10 s steps keep the run short.
    inputs = dict(chip_mtbf_hours=8.0, repair_minutes=20.0, repair_distribution="fixed", hours=3.0,
                  step_seconds=(10.0,), lease_seconds=40.0, heartbeat_seconds=5.0)
    islands = simulate(plan(**inputs), "diloco")
    learners = simulate(plan(**inputs, slices_per_learner=1), "diloco")
    assert islands.failures > 10
    assert islands.goodput.share > learners.goodput.share
    assert islands.goodput.badput_shares()["down"] < learners.goodput.badput_shares()["down"] / 2
    goodput = islands.goodput  # no second counted twice
    measured = sum(seconds for category, seconds in goodput.badput_seconds.items() if category != "other")
    assert goodput.kept_seconds + measured <= goodput.provisioned_seconds * (1 + 1e-9)


@pytest.mark.parametrize("inputs, message", [
    ({"chips": 64, "learners": 4, "slices_per_learner": 3}, "slices_per_learner: S=3 does not divide a learner's 16 chips"),
    ({"chips": 64, "learners": 4, "slices_per_learner": 4, "failures": [{"learner": 1, "slice": 4, "at_seconds": 1.0}]},
     r"failures\[0\].slice: 4 is not a slice of the learner \(slices_per_learner=4\)"),
    ({"slices_per_learner": 0}, "slices_per_learner: Input should be greater than 0"),
    ({"island_gbps": 0}, "island_gbps: Input should be greater than 0"),
    ({"island_leader_loss": "free"}, "island_leader_loss: Input should be 'failover' or 'learner_failure'"),
])
def test_bad_island_inputs_are_refused_naming_the_key(inputs, message):
    with pytest.raises(PlanError, match=message):
        load_inputs(inputs)


def test_the_command_fails_one_slice_and_shows_the_slices(capsys):
    assert main(["plan", "--chips", "64", "--learners", "4", "--slices-per-learner", "4", "--hours", "0.05",
                 "--model-parameters", "1e7", "--interval-steps", "8", "--fragments", "4", "--chip-mtbf-hours", "null",
                 "--fail", "1/3@30", "--quiet"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    assert table.splitlines()[0].split()[:3] == ["mode", "M", "S"]
    assert all(line.split()[2] == "4" for line in table.splitlines()[1:])
    assert main(["plan", "--fail", "1/x@30", "--quiet"]) == 2
    assert "expected LEARNER@SECONDS or LEARNER/SLICE@SECONDS" in capsys.readouterr().err
    assert main(["plan", "--island-leader-loss", "none", "--quiet"]) == 2
    assert "island_leader_loss: Input should be 'failover' or 'learner_failure' (got 'none')" in capsys.readouterr().err
