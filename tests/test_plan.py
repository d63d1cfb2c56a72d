"""`diloco plan`: the three modes in virtual time, Decoupled DiLoCo decided by the real ShardCore
and LearnerSchedule. Small fleets and short runs, no sockets: the file runs in seconds."""
import itertools
import json
import pathlib
import re
from collections import defaultdict

import pytest

from diloco.planner.diloco import DilocoRun
from diloco.planner.failures import FailureModel
from diloco.planner.inputs import PlanError, load_file, load_inputs
from diloco.planner.simulate import simulate
from diloco.cli import main

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "plan" / "datacenter.yaml"

# Four learner units of 16 chips, a small model on fast links, one push every other step.
SMALL = {"chips": 64, "learners": 4, "model_parameters": 10_000_000, "interval_steps": 8, "fragments": 4,
         "overlap_steps": 2, "wan_gbps": (10.0,), "chip_mtbf_hours": None}


def plan(**inputs):
    return load_inputs({**SMALL, **inputs})


def plan_with_links(links: dict, **inputs):
    """SMALL with each region's link named instead of wan_gbps."""
    return load_inputs({**{k: v for k, v in SMALL.items() if k != "wan_gbps"}, "links": links, **inputs})


def test_without_failures_every_mode_keeps_almost_all_its_time():
    inputs = plan(hours=0.05)
    for mode in ("dp", "elastic", "diloco"):
        result = simulate(inputs, mode)
        assert result.goodput.share > 0.99, (mode, result.goodput)
        assert result.uptime == pytest.approx(1.0) and result.failures == 0
        assert result.effective_share > 0.99


def test_data_parallel_steps_at_the_slowest_learners_pace_and_the_others_wait():
    result = simulate(plan(hours=0.05, step_seconds=(1.0, 1.0, 1.0, 2.0)), "dp")
    assert result.step_seconds == 2.0
    # Three slices wait a second of every two-second step: 3 of 8 slice-seconds.
    assert result.goodput.badput_shares()["blocked"] == pytest.approx(3 / 8)
    diloco = simulate(plan(hours=0.05, step_seconds=(1.0, 1.0, 1.0, 2.0)), "diloco")
    assert diloco.goodput.share > 0.95  # each learner trains at its own pace


def test_data_parallel_across_regions_waits_for_its_all_reduce_beyond_the_backward_pass():
    # 12B parameters in bf16 across two regions, ring over the slower 2 Gbit/s link: each link
    # carries 2 (R - 1) / R of the 24 GB gradient each way, 96 s, of which 2/3 s overlaps the
    # backward pass; each hop takes two links' latency (30 ms each way).
    inputs = plan(hours=0.5, model_parameters=12_000_000_000, wan_gbps=(2.0, 5.0), wan_latency_ms=(30.0,))
    allreduce = 24e9 * 8 / 2e9 + 2 * 0.06
    dp = simulate(inputs, "dp")
    assert dp.step_seconds == pytest.approx(1.0 + allreduce - 2 / 3)
    assert dp.tokens_per_second == pytest.approx(inputs.batch_tokens / dp.step_seconds, rel=0.05)
    assert dp.goodput.badput_shares()["blocked"] > 0.98  # every slice waits for the WAN
    assert dp.bandwidth.peak_gbps == pytest.approx(2 * 24e9 * 8 / 1e9 / allreduce)  # both ways at 2 Gbit/s
    elastic = simulate(inputs, "elastic")
    assert elastic.failure_free_tokens_per_second == pytest.approx(inputs.batch_tokens / dp.step_seconds)
    diloco = simulate(inputs, "diloco")
    assert diloco.tokens_per_second > 50 * dp.tokens_per_second
    fp32 = simulate(plan(hours=0.5, model_parameters=12_000_000_000, wan_gbps=(2.0, 5.0), gradient_dtype="fp32"),
                    "dp")
    assert fp32.step_seconds > 1.9 * dp.step_seconds


def test_data_parallel_in_one_region_or_hiding_its_all_reduce_pays_nothing_for_the_wan():
    assert simulate(plan(hours=0.05, wan_gbps=(2.0,)), "dp").step_seconds == 1.0
    assert simulate(plan(hours=0.05, wan_gbps=(2.0,)), "dp").bandwidth is None
    # 10M parameters across regions on 10 Gbit/s: a 16 ms all-reduce, inside the backward pass.
    assert simulate(plan(hours=0.05, wan_gbps=(10.0, 10.0), wan_latency_ms=(0.0,)), "dp").step_seconds == 1.0


def test_the_plan_prints_each_modes_time_to_train_the_same_tokens_and_its_speed_up_over_dp(capsys):
    assert main(["plan", "--modes", "dp,diloco", "--chips", "64", "--learners", "4", "--chip-mtbf-hours", "null",
                 "--hours", "0.05", "--wan-gbps", "2,5", "--model-parameters", "1000000000"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.split("speed-up over dp")[1].splitlines()[1:3]}
    assert rows["dp"][-1] == "1.0x" and float(rows["diloco"][-1].rstrip("x")) > 3
    assert float(rows["dp"][-2]) > 3 * float(rows["diloco"][-2])  # hours to train the same tokens


def test_links_by_region_are_the_numbered_regions_links_when_they_say_the_same():
    numbered = simulate(plan(hours=0.05, wan_gbps=(10.0, 0.004), wan_latency_ms=(30.0, 80.0)), "diloco")
    named = simulate(plan_with_links({"us-east": {"up_mbps": 10_000, "down_mbps": 10_000, "latency_ms": 30},
                                      "us-west": {"up_mbps": 4, "down_mbps": 4, "latency_ms": 80}}, hours=0.05),
                     "diloco")
    assert numbered.goodput.badput_seconds["blocked"] > 0  # the 4 Mbit/s region does cost something
    assert named.goodput == numbered.goodput and named.bandwidth == numbered.bandwidth


def test_a_slow_downlink_alone_blocks_learners_that_a_fast_uplink_does_not_save():
    fast = {"up_mbps": 10_000, "down_mbps": 10_000}
    slow_down = {"up_mbps": 10_000, "down_mbps": 4}  # a fragment's int4 pull takes ~2.5 s, every 2 s
    even = simulate(plan_with_links({"a": fast, "b": fast}, hours=0.05), "diloco")
    uneven = simulate(plan_with_links({"a": fast, "b": slow_down}, hours=0.05), "diloco")
    assert even.goodput.share > 0.99
    assert uneven.goodput.badput_shares()["blocked"] > 0.05


def test_mixed_links_cost_no_more_than_every_link_at_the_slowest():
    """The paper's operating point (12B, H = P = 24, tau = 2, int4): rounds close in time for the
    5 Gbit/s learners; a 2 Gbit/s link cannot bring a sync back within tau steps, so those
    learners wait for their results, or (wait_for_own_link false) merge them late."""
    def goodput(gbps, **inputs):
        data = {k: v for k, v in load_file(EXAMPLE).items() if k not in ("wan_gbps", "wan_latency_ms")}
        data.update(chips=16384, learners=4, chip_mtbf_hours=None, hours=0.05,
                    links={f"r{i}": {"up_mbps": g * 1000, "down_mbps": g * 1000, "latency_ms": 30}
                           for i, g in enumerate(gbps)}, **inputs)
        return simulate(load_inputs(data), "diloco").goodput.share
    slowest, mixed = goodput((2, 2, 2, 2)), goodput((2, 5, 2, 5))
    assert mixed > slowest + 0.02 and slowest < 0.9, (mixed, slowest)
    assert goodput((2, 5, 2, 5), wait_for_own_link=False) > 0.99


def test_the_command_takes_links_that_replace_the_files_numbered_regions(capsys):
    links = "{us-east: {up_mbps: 2000, down_mbps: 5000, latency_ms: 30}, us-west: {up_mbps: 5000, down_mbps: 5000}}"
    assert main(["plan", "--config", str(EXAMPLE), "--chips", "1024", "--learners", "4", "--hours", "0.01",
                 "--modes", "diloco", "--links", links, "--quiet"]) == 0
    assert main(["plan", "--chips", "1024", "--learners", "4", "--links", links, "--wan-gbps", "5",
                 "--quiet"]) == 2
    assert "links: give each region's link in links or in wan_gbps, not both" in capsys.readouterr().err


def test_one_failure_costs_dp_its_work_since_the_checkpoint_and_the_restart_but_diloco_only_that_learners_down_time():
    inputs = plan(hours=1.0, failures=({"learner": 0, "at_seconds": 600.0},), repair_minutes=5.0,
                  checkpoint_minutes=8.0, restore_minutes=2.0, step_seconds=(10.0,), lease_seconds=40.0,
                  heartbeat_seconds=5.0)
    dp = simulate(inputs, "dp")
    badput = dp.goodput.badput_seconds
    assert badput["lost"] == pytest.approx(4 * 120.0)  # 600 s is 120 s past the checkpoint at 480 s
    assert badput["down"] == pytest.approx(4 * 300.0)  # every slice waits for the repair
    assert badput["restore"] == pytest.approx(4 * 120.0)  # and for the checkpoint to load
    assert dp.goodput.share == pytest.approx(1 - (120 + 300 + 120) / 3600)

    diloco = simulate(inputs, "diloco")
    badput = diloco.goodput.badput_seconds
    assert badput["down"] == pytest.approx(300.0)  # only the failed learner
    assert badput["restore"] < 1.0  # pulling a 10M-parameter model at 10 Gbit/s
    assert badput["lost"] <= 10.0 * (8 + 1)  # at most a sync period of steps and the step in progress
    assert diloco.goodput.share > 1 - (300 + 90 + 10) / (4 * 3600)
    assert diloco.uptime == 1.0 and dp.uptime < 1.0
    # Its Attend call ended with it: every round closed on the live learners, none waited for
    # its lease (40 s) to run out.
    assert diloco.syncer.rounds_all == diloco.syncer.versions and badput["blocked"] < 1.0


def test_uptime_is_total_with_four_learners_at_a_modest_failure_rate_while_dp_stops():
    # Each unit fails about every 4 hours and is down 20 minutes.
    inputs = plan(hours=12.0, chip_mtbf_hours=64.0, repair_minutes=20.0, repair_distribution="fixed",
                  step_seconds=(120.0,), lease_seconds=480.0, heartbeat_seconds=60.0)
    diloco, dp = simulate(inputs, "diloco"), simulate(inputs, "dp")
    assert diloco.failures >= 8 and diloco.failures == dp.failures  # the same outages in every mode
    assert diloco.uptime == 1.0
    assert dp.uptime < 0.9 and dp.goodput.share < diloco.goodput.share
    for result in (diloco, dp, simulate(inputs, "elastic")):  # no second is counted twice
        goodput = result.goodput
        measured = sum(seconds for category, seconds in goodput.badput_seconds.items() if category != "other")
        assert goodput.kept_seconds + measured <= goodput.provisioned_seconds * (1 + 1e-9)


def test_a_units_failures_come_at_the_rate_of_its_chips_and_last_the_repair_time():
    # 16 chips of 1600 hours each: a unit fails every 100 hours of uptime on average.
    failures = FailureModel.from_inputs(plan(chip_mtbf_hours=1600.0, repair_minutes=30.0, repair_distribution="fixed"))
    outages = list(itertools.islice(failures.outages(2), 2000))
    assert all(o.end - o.start == 1800.0 for o in outages)
    uptimes = [b.start - a.end for a, b in zip(outages, outages[1:])]
    assert sum(uptimes) / len(uptimes) == pytest.approx(100 * 3600, rel=0.05)
    # A unit's outages are its own: the same in a fleet of another size.
    bigger = FailureModel.from_inputs(plan(chips=128, learners=8, chip_mtbf_hours=1600.0, repair_minutes=30.0,
                                           repair_distribution="fixed"))
    assert list(itertools.islice(bigger.outages(2), 10)) == outages[:10]


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    inputs = plan(hours=1.0, chip_mtbf_hours=32.0, repair_minutes=10.0, step_seconds=(20.0,), lease_seconds=80.0,
                  heartbeat_seconds=10.0)
    first, again = simulate(inputs, "diloco"), simulate(inputs, "diloco")
    assert first.failures > 0 and first.as_json() == again.as_json()
    other = simulate(plan(hours=1.0, chip_mtbf_hours=32.0, repair_minutes=10.0, step_seconds=(20.0,),
                          lease_seconds=80.0, heartbeat_seconds=10.0, seed=1), "diloco")
    assert other.as_json() != first.as_json()


def test_a_learners_heartbeats_keep_their_own_time_not_its_steps():
    # A real learner's heartbeat thread ticks on its own timer (learner/sync/session.py). Started
    # with the first step, a 0.5 s interval would put every other heartbeat on a 1 s step's end,
    # where one counted half a step into its step (learner/sync/schedule.py) reads half a step ahead.
    inputs = plan(hours=0.02, step_seconds=(1.0,), heartbeat_seconds=0.5)
    run = DilocoRun(inputs, FailureModel.from_inputs(inputs))
    into_step = defaultdict(set)  # learner -> how far into its step each heartbeat came
    heartbeat = run.core.heartbeat

    def heard(learner_id, *args, **kwargs):
        learner = next(l for l in run.learners if l.id == learner_id)
        into_step[learner_id].add(round(run.clock.now - learner.last_step_end, 6))
        return heartbeat(learner_id, *args, **kwargs)

    run.core.heartbeat = heard
    run.run(lambda _: None)
    assert len(into_step) == 4 and all(0 < seconds < 1 for s in into_step.values() for seconds in s)
    assert len({min(s) for s in into_step.values()}) == 4  # each learner's at its own moment


def test_a_learner_reports_a_wait_to_the_shards_only_once_it_has_lasted_a_heartbeat_interval():
    # As the real learner does (LearnerSchedule.waiting_elsewhere): a shorter wait is the
    # schedule's own, and reported it would close the other fragments' rounds without the learner.
    inputs = plan(hours=0.01, step_seconds=(0.1,), heartbeat_seconds=0.25, wan_gbps=(0.01,))
    run = DilocoRun(inputs, FailureModel.from_inputs(inputs))
    waited_when_reported = []
    heartbeat = run.core.heartbeat

    def heard(learner_id, *args, waiting_for=None, **kwargs):
        learner = next(l for l in run.learners if l.id == learner_id)
        if waiting_for is not None:
            waited_when_reported.append(run.clock.now - learner.blocked_since)
        return heartbeat(learner_id, *args, waiting_for=waiting_for, **kwargs)

    run.core.heartbeat = heard
    run.run(lambda _: None)
    assert waited_when_reported and min(waited_when_reported) >= 0.25


def test_diloco_rounds_are_closed_by_the_shard_core():
    result = simulate(plan(hours=0.05), "diloco")
    syncer = result.syncer
    assert syncer.versions == syncer.rounds_all + syncer.rounds_quorum_grace > 0
    # Learners in step: every round closes when all four have contributed, none stale.
    assert syncer.rounds_quorum_grace == 0
    assert syncer.merged_contributions == 4 * syncer.versions
    assert result.staleness == {"0": syncer.merged_contributions, "refused": 0}
    assert result.bandwidth.mean_gbps > 0 and result.bandwidth.peak_gbps >= result.bandwidth.mean_gbps


def test_a_learner_far_behind_makes_stale_contributions_the_core_judges():
    result = simulate(plan(hours=0.1, step_seconds=(1.0, 1.0, 1.0, 3.0), max_staleness=1), "diloco")
    assert result.syncer.refused_stale == result.staleness["refused"] > 0
    assert result.goodput.badput_seconds["lost"] > 0  # refused contributions are lost work


def test_a_token_budget_ends_the_run_when_the_learners_schedules_say_it_is_spent():
    inputs = plan(steps=300)  # 300 global steps at the full batch
    for mode in ("dp", "elastic", "diloco"):
        result = simulate(inputs, mode)
        assert result.tokens == pytest.approx(300 * inputs.batch_tokens, rel=0.05), mode


@pytest.mark.parametrize("inputs, message", [
    ({"chips": 100, "learners": 8}, "learners: M=8 does not divide chips=100"),
    ({"chips": "many"}, "chips: Input should be a valid integer"),
    ({"chip_mtbf_hour": 5}, "chip_mtbf_hour: unknown key"),
    ({"overlap_steps": 24}, "overlap_steps: tau=24 must be smaller than interval_steps"),
    ({"quorum": 9}, "quorum: K=9 exceeds the number of learners (M=8)"),
    ({"lease_seconds": 0.5}, "lease_seconds: 0.5 must be at least twice heartbeat_seconds"),
    ({"codec": "int3"}, "codec: unknown codec 'int3'"),
    ({"step_seconds": [1.0, 2.0]}, "step_seconds: 2 values for M=8 learners"),
    ({"hours": 1.0, "steps": 5}, "steps: give one run length"),
    ({"failures": [{"learner": 8, "at_seconds": 1.0}]}, "failures[0].learner: 8 is not a learner unit"),
    ({"repair_minutes": -1.0}, "repair_minutes: Input should be greater than or equal to 0"),
    ({"links": {"us-east": {"up_mbps": 5000.0}}}, "links.us-east.down_mbps: required in a plan"),
    ({"links": {"us-east": {"up": 5000.0}}}, "links.us-east.up: unknown key"),
    ({"links": {}}, "links: Dictionary should have at least 1 item"),
    ({"links": {"us-east": {"up_mbps": 1.0, "down_mbps": 1.0}}, "wan_latency_ms": [5.0]},
     "links: give each region's link in links or in wan_latency_ms, not both"),
])
def test_bad_inputs_are_refused_naming_the_key(inputs, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_inputs(inputs)


def test_the_command_sweeps_chips_and_writes_a_table_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "goodput.png"
    code = main(["plan", "--chips", "64,128", "--learners", "4", "--hours", "0.02", "--model-parameters", "1e7",
                 "--interval-steps", "8", "--fragments", "4", "--fail", "1@30", "--json", str(out),
                 "--plot", str(png), "--quiet"])
    assert code == 0
    results = json.loads(out.read_text())
    assert [(r["mode"], r["chips"]) for r in results] == [
        (mode, chips) for chips in (64, 128) for mode in ("dp", "elastic", "diloco")]
    assert all(r["failures"] == 1 for r in results)
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "goodput" in table and "diloco" in table


def test_the_command_names_a_bad_flag(capsys):
    assert main(["plan", "--learners", "3", "--chips", "64", "--quiet"]) == 2
    assert "learners: M=3 does not divide chips=64" in capsys.readouterr().err


def test_the_example_config_describes_the_documented_sweep(capsys):
    assert main(["plan", "--config", str(EXAMPLE), "--hours", "0.01", "--modes", "dp",
                 "--quiet"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    assert "1,179,648" in table and len(table.splitlines()) == 1 + 6  # 3 fleet sizes x M = 8, 16



def test_without_arguments_the_command_plans_two_hours_of_the_documented_example(tmp_path, capsys):
    defaults = load_inputs({})
    # The example's failure model and settings at one of its fleet sizes: seconds of wall time.
    assert defaults == load_inputs({**load_file(str(EXAMPLE)), "chips": 1179648, "learners": None, "hours": None})
    assert defaults.num_learners == 8 and defaults.duration_seconds == 2 * 3600
    out = tmp_path / "plan.json"
    assert main(["plan", "--hours", "0.1", "--fail", "2@60", "--quiet", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    goodput = {r["mode"]: r["goodput"]["share"] for r in results}
    # One of 8 units down for 5 of the 6 minutes: data parallel stops, the others lose about an eighth.
    assert goodput["dp"] < 0.3 and goodput["elastic"] > 0.8 and goodput["diloco"] > 0.8
    assert all(r["speed"]["events"] > 0 and r["speed"]["wall_seconds"] > 0 for r in results)
    assert "events/s" in capsys.readouterr().out


def test_a_killed_learner_starts_again_and_resumes_at_its_last_checkpoint():
    # 1 s steps after a 5 s start-up; killed at 103.5 s, after step 98: the steps since the
    # checkpoint at 90 and half a step are lost, and its process starts again after the repair.
    inputs = plan(hours=0.1, step_seconds=(1.0,), startup_seconds=(5.0,), checkpoint_steps=10,
                  failures=({"learner": 0, "at_seconds": 103.5, "repair_minutes": 0.5},))
    badput = simulate(inputs, "diloco").goodput.badput_seconds
    assert badput["lost"] == pytest.approx(8.5)
    assert badput["startup"] == pytest.approx(4 * 5.0 + 5.0)  # every learner's first start, and the restart
    assert badput["down"] == pytest.approx(30.0) and 0 < badput["restore"] < 1.0


def test_a_shard_down_skips_its_fragments_syncs_and_holds_a_restarting_learner_until_it_is_back():
    inputs = plan(hours=0.05, shards=2, shard_outages=({"shard": 1, "at_seconds": 30.0, "seconds": 60.0},),
                  failures=({"learner": 0, "at_seconds": 40.0, "repair_minutes": 0.1},))
    result = simulate(inputs, "diloco")
    badput = result.goodput.badput_seconds
    # Repaired at 46 s, it joins every shard: shard 1 is back at 90 s, tried again by 92.5 s.
    assert badput["restore"] == pytest.approx(92.5 - 46.0, abs=0.1)
    assert badput["blocked"] < 1.0  # a push to the shard that is down fails at once: nobody waits
    with pytest.raises(PlanError, match=r"shard_outages\[0\].shard: 2 is not a shard"):
        plan(shards=2, shard_outages=({"shard": 2, "at_seconds": 1.0, "seconds": 1.0},))


def test_evaluations_and_checkpoints_pause_the_learner_at_their_steps():
    # 1 s steps; every 10th step a 0.5 s checkpoint copy, every 50th a 2 s evaluation: a learner
    # trains 50 steps in 54.5 s, so 165 steps in 180 s, with 3 evaluations and 16 checkpoints.
    result = simulate(plan(hours=0.05, step_seconds=(1.0,), evaluation_every_steps=50, evaluation_seconds=2.0,
                           checkpoint_steps=10, checkpoint_seconds=0.5), "diloco")
    badput = result.goodput.badput_seconds
    assert badput["evaluation"] == pytest.approx(4 * 3 * 2.0) and badput["checkpoint"] == pytest.approx(4 * 16 * 0.5)
    assert result.goodput.kept_seconds == pytest.approx(4 * 165 * 1.0)


def test_a_cluster_config_given_as_plan_inputs_is_recognised_and_the_right_commands_named(capsys):
    assert main(["plan", "--config", "examples/local-4-regions.yaml"]) == 2
    assert ("examples/local-4-regions.yaml: a cluster config (shards, learners, trainer, run), not plan "
            "inputs: `diloco config check` checks it; `diloco plan --calibrate-from REPORT`") in capsys.readouterr().err


def test_the_plans_sync_and_syncer_are_the_cluster_configs_own_sections_whichever_way_they_are_written():
    from diloco.services.contract.config import SyncConfig, SyncerConfig, load_config
    nested_form = load_inputs({"sync": {"interval_steps": 48, "overlap_steps": 4}, "syncer": {"grace": {"mode": "fixed"}}})
    flat_form = load_inputs({"interval_steps": 48, "overlap_steps": 4, "grace_mode": "fixed"})
    assert nested_form == flat_form
    assert isinstance(nested_form.sync, SyncConfig) and isinstance(nested_form.syncer, SyncerConfig)
    assert (nested_form.sync.fragments, nested_form.syncer.lease_seconds) == (24, 10.0)  # the plan's defaults
    cfg = load_config("examples/local-4-regions.yaml")  # a config's sections are taken whole
    taken = load_inputs({"chips": 4, "learners": 4, "sync": cfg.sync, "syncer": cfg.syncer})
    assert (taken.sync, taken.syncer) == (cfg.sync, cfg.syncer)
    with pytest.raises(PlanError, match=r"sync\.interval_steps: Input should be greater than 0"):
        load_inputs({"interval_steps": 0})
    with pytest.raises(PlanError, match=r"syncer\.qorum: unknown key \(did you mean syncer\.quorum\?\)"):
        load_inputs({"syncer": {"qorum": 2}})


def test_suggested_settings_fit_every_learners_round_trip_and_the_best_is_first(capsys, tmp_path):
    from diloco.planner.suggest import MARGIN, candidates, round_trip_seconds, suggest
    inputs = load_inputs({"chips": 4, "learners": 4, "model_parameters": 20_000_000, "step_seconds": [0.5],
                          "wan_gbps": [0.05, 0.2], "wan_latency_ms": [20.0], "hours": 0.02, "chip_mtbf_hours": None})
    found = suggest(inputs)
    assert found
    for s in found:
        assert s.overlap_steps < s.interval_steps
        assert s.overlap_steps * 0.5 >= MARGIN * round_trip_seconds(inputs, s.fragments, s.codec)
        assert s.round_trip_seconds == pytest.approx(round_trip_seconds(inputs, s.fragments, s.codec))
    best = found[0]
    assert best.result.goodput.share >= max(s.result.goodput.share for s in found) - 0.005
    assert best.result.goodput.share > 0.9
    assert main(["plan", "--chips", "4", "--learners", "4", "--model-parameters", "20000000", "--step-seconds", "0.5",
                 "--wan-gbps", "0.05,0.2", "--wan-latency-ms", "20", "--hours", "0.02", "--chip-mtbf-hours", "null",
                 "--suggest", "--json", str(tmp_path / "suggested.json")]) == 0
    out = capsys.readouterr().out
    (written,) = json.loads((tmp_path / "suggested.json").read_text())
    assert written["suggestions"][0] == best.as_json()
    assert written["suggestions"][0]["sync"]["overlap_steps"] == best.overlap_steps
    assert written["links"]["region-0"]["up_mbps"] == 50
    assert (f"suggested: sync: {{interval_steps: {best.interval_steps}, fragments: {best.fragments}, "
            f"overlap_steps: {best.overlap_steps}, codec: {best.codec}, max_block_steps: 1}}") in out
    assert all(c.sync.max_block_steps == 1 for c in candidates(inputs))


def test_links_too_slow_for_any_setting_are_said_so(capsys):
    assert main(["plan", "--chips", "4", "--learners", "4", "--model-parameters", "12000000000", "--step-seconds",
                 "0.1", "--wan-gbps", "0.01", "--hours", "0.01", "--chip-mtbf-hours", "null", "--suggest"]) == 0
    assert "no H, P, tau and codec fit these links" in capsys.readouterr().out


@pytest.mark.slow
def test_the_suggestion_docs_planning_shows_for_the_seeds_point_is_what_the_planner_suggests(capsys):
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "planning.md").read_text()
    documented = re.search(r"^suggested: sync: .*$", text, re.M)[0]
    assert main(["plan", "--config", "examples/plan/datacenter.yaml", "--chips", "16384", "--learners", "4",
                 "--chip-mtbf-hours", "null", "--hours", "0.1", "--wan-gbps", "2,5,2,5", "--suggest", "--quiet"]) == 0
    assert documented in capsys.readouterr().out
