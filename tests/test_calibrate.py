"""`diloco plan --calibrate-from`: the planner configured from a `diloco sim` report predicts what
the run measured. One short real run (two learners killed and restarted, one shard killed, a link
per region), then the planner beside it; and the refusals of reports it cannot plan."""
import json

import pytest

from diloco.planner.calibrate import CalibrationError, calibrate, inputs_from_report
from diloco.cli import main
from diloco.services.contract.config import dump_config
from tests.cluster_config import tiny_cluster
from tests.sim_command import run_sim

# What a loaded 2-core machine still holds (the planner's model: BENCHMARKS.md §10 is within a few
# points); a model that forgets kills, restarts, start-up or the links misses these by far more.
GOODPUT_POINTS = 0.12
BYTES_RATIO = (0.6, 1.6)


@pytest.mark.slow
def test_the_planner_predicts_a_short_chaos_run_of_the_local_cluster(tmp_path, capsys):
    report = run_sim(tmp_path, "--learners", "2", "--regions", "us-east,us-west", "--shards", "2", "--steps", "100000",
                     # seed 17: the learners killed 11 s and 25 s in, a shard 10 s in (both trained first)
                     "--duration", "25", "--chaos-mtbf", "15", "--chaos-shards", "30", "--restart-delay", "3",
                     "--seed", "17",
                     "--wan-mbps", "us-east=20,us-west=2/5", "--wan-latency-ms", "us-west=30")
    path = tmp_path / "report.json"
    inputs, result, rows = calibrate(path)
    kills = [e for e in report["chaos_events"] if e["event"] == "kill"]
    assert len(inputs.failures) == sum(e["kind"] == "learner" for e in kills) > 0
    assert len(inputs.shard_outages) == sum(e["kind"] == "shard" for e in kills)
    assert inputs.links["us-west"].up_mbps == 2 and inputs.links["us-west"].down_mbps == 5
    by_figure = {row.figure: row for row in rows}
    goodput = by_figure["goodput"]
    assert abs(goodput.difference) < GOODPUT_POINTS, rows
    assert by_figure["down"].difference == pytest.approx(0.0, abs=0.01)  # the same kills, the same restarts
    # Bytes per step kept: how much was trained is the goodput's to predict (checked above); in
    # a run this short its error alone moves the bytes by half, as much as a wrong link model.
    steps = by_figure["inner steps kept"]
    for figure in ("MB up", "MB down"):
        per_step = (by_figure[figure].predicted / steps.predicted) / (by_figure[figure].measured / steps.measured)
        assert BYTES_RATIO[0] < per_step < BYTES_RATIO[1], rows
    # The command prints the same comparison.
    assert main(["plan", "--calibrate-from", str(path), "--json", str(tmp_path / "calibration.json")]) == 0
    out = capsys.readouterr().out
    assert "planned" in out and "measured" in out and "goodput" in out
    written = json.loads((tmp_path / "calibration.json").read_text())
    assert written["rows"][0]["figure"] == "goodput"
    assert written["rows"][0]["predicted"] == pytest.approx(goodput.predicted)


@pytest.mark.slow
def test_the_planner_predicts_a_data_parallel_job_whose_all_reduce_crosses_capped_links(tmp_path):
    report = run_sim(tmp_path, "--mode", "dp", "--learners", "2", "--regions", "us-east,us-west", "--steps", "8",
                     "--wan-mbps", "us-east=20,us-west=2/4", "--wan-latency-ms", "us-west=30")
    (job,) = report["per_learner"].values()
    assert job["wan_seconds"] > 0 and report["badput_seconds"]["blocked"] == pytest.approx(2 * job["wan_seconds"])
    inputs, result, rows = calibrate(tmp_path / "report.json")
    assert inputs.links["us-west"].up_mbps == 2 and inputs.gradient_dtype == "fp32" and not inputs.failures
    by_figure = {row.figure: row for row in rows}
    # The slow link paces the ring: without it the steps would be mostly compute, not mostly blocked.
    assert by_figure["blocked"].measured > 0.5
    assert abs(by_figure["blocked"].difference) < GOODPUT_POINTS, rows
    assert BYTES_RATIO[0] < by_figure["step seconds"].difference < BYTES_RATIO[1], rows


def test_a_dp_report_with_kills_is_refused():
    with pytest.raises(CalibrationError, match="a dp run with kills"):
        inputs_from_report({"mode": "dp", "cluster_config": tiny_cluster_dict(), "started_at": 0.0,
                            "per_learner": {}, "links": {}, "chaos_events": [{"event": "kill"}]})


def test_a_report_without_what_the_planner_needs_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(CalibrationError, match="no cluster_config, started_at"):
        inputs_from_report({"mode": "diloco", "per_learner": {}, "links": {}, "chaos_events": []})
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"mode": "diloco"}))
    assert main(["plan", "--calibrate-from", str(old)]) == 2
    assert "rerun diloco sim with this version" in capsys.readouterr().err
    assert main(["plan", "--calibrate-from", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def tiny_cluster_dict() -> dict:
    import yaml
    return yaml.safe_load(dump_config(tiny_cluster("/tmp/unused", shards=1, learners=2)))
