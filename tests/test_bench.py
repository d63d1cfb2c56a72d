"""The benchmark runner: a quick run of one section end to end, the shape of the committed
bench/results.json (every section, numbers not strings, the dp baseline beside diloco), and
BENCHMARKS.md rendered from it (every section numbered, the history linked, merged runs named)."""
from __future__ import annotations

import json
import numbers
import pathlib
import subprocess
import sys

import pytest

from bench.report import HISTORY, RENDERERS, TITLES, render
from bench.run_all import SECTIONS, merged

ROOT = pathlib.Path(__file__).resolve().parent.parent


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@pytest.mark.slow
def test_quick_runner_measures_recovery_and_writes_the_report(tmp_path):
    command = [sys.executable, "bench/run_all.py", "--quick", "--sections", "recovery",
               "--out", str(tmp_path), "--work", str(tmp_path / "work")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    (size,) = results["recovery"]["sizes"]
    assert 0 < size["learner_restore_seconds"] < size["learner_back_to_training_seconds"]
    assert size["shard_serving_again_seconds"] > 0 and size["shard_state_bytes"] > 0
    assert results["recovery"]["command"] == "python bench/recovery.py --sizes 2x64 --kills 1"
    markdown = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## 6. Recovery" in markdown and results["machine"]["cpu"] in markdown
    assert (tmp_path / "bench" / "plots" / "recovery.png").stat().st_size > 5_000


def test_committed_results_hold_every_section_with_dp_beside_diloco():
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    assert set(SECTIONS) <= results.keys()
    for row in results["quality"]["rows"]:
        assert is_number(row["diloco"]["final_eval_loss"]) and is_number(row["dp"]["final_eval_loss"])
        assert is_number(row["loss_vs_dp"])
    for row in results["bandwidth"]["rows"]:
        assert is_number(row["diloco"]["bytes_per_token"]) and is_number(row["dp"]["bytes_per_token"])
        assert is_number(row["dp"]["at_1s_step"]["12B"]["average_gbps"])
    for row in results["goodput"]["rows"]:
        assert is_number(row["diloco"]["goodput"]) and is_number(row["dp"]["goodput"])
    assert all(is_number(link["utilisation"]) for link in results["overlap"]["links"])
    transport = results["transport"]
    for run in transport["runs"] + [transport["memory_run"]]:
        assert is_number(run["push_vs_raw"]) and is_number(run["round_seconds"])
        # the push path over the lower of raw gRPC's and the disk's rates, never the inverse
        bound = min(run["raw_push_mbytes_per_second"], run["log_mbytes_per_second"])
        assert run["push_bound_mbytes_per_second"] == pytest.approx(bound)
        assert run["push_vs_bound"] == pytest.approx(run["push_mbytes_per_second"] / bound)
    biggest = max(transport["scale"]["runs"], key=lambda run: run["params"])
    assert biggest["params"] >= 500e6 and is_number(biggest["rss_bytes_per_param"])
    assert [row["params"] for row in transport["scale"]["capacity"]] == [1e9, 12e9, 70e9]
    assert all(is_number(size["learner_back_to_training_seconds"]) for size in results["recovery"]["sizes"])
    sizes = results["user_loop"]["sizes"]
    assert max(size["model_parameters"] for size in sizes) >= 25e6  # issue 17: the demo model and one of >= 25M
    for size in sizes:
        assert is_number(size["ratio"]) and is_number(size["idle_step_call_seconds"]["p50"])
        assert 0 < size["idle_step_call_share"] <= size["step_calls_share"]
        assert len(size["runs_off"]) == len(size["runs_on"]) == results["user_loop"]["pairs"]
    assert is_number(results["hf"]["ratio"])
    plan = results["plan"]  # issue 34: every mode and M at 150k to 2.4M chips, two failure models
    assert [model["name"] for model in plan["models"]] == ["example", "milder"]
    for model in plan["models"]:
        assert {(r["mode"], r["learners"], r["chips"]) for r in model["rows"]} == {
            (mode, m, chips) for mode in ("dp", "elastic", "diloco") for m in (2, 4, 8, 16)
            for chips in (153600, 307200, 614400, 1228800, 2457600)}
        assert all(is_number(r["goodput"]) for r in model["rows"])
    suggested = results["suggest"]["suggestions"]  # issue 53: best first, each with what the planner predicts
    assert suggested and all(is_number(s["goodput"]) and is_number(s["staleness_zero_share"]) for s in suggested)
    assert suggested[0]["goodput"] == max(s["goodput"] for s in suggested)
    speed = plan["speed"]["rows"]
    assert [(r["mode"], r["chips"], r["learners"], r["hours"]) for r in speed] == [
        (mode, 2457600, 16, 24.0) for mode in ("dp", "elastic", "diloco")]
    assert all(is_number(r["speed"]["events_per_second"]) for r in speed)
    runs = results["calibration"]["rows"]  # issue 34: three failure rates, shard kills, mixed links
    assert len({run["command"].split("--chaos-mtbf ")[1].split()[0] for run in runs}) >= 3
    assert any(run["shard_kills"] > 0 for run in runs) and any("us-west=5/20" in run["command"] for run in runs)
    for run in runs:
        assert run["learner_kills"] > 0 and run["rows"][0]["figure"] == "goodput"
        assert all(is_number(row["predicted"]) and is_number(row["measured"]) for row in run["rows"])
    dp_runs = results["calibration"]["dp_rows"]  # issue 58: data parallel's all-reduce over capped links
    assert {run["name"] for run in dp_runs} == {"dp-20", "dp-mixed-links"}
    for run in dp_runs:
        assert [row["figure"] for row in run["rows"]] == ["step seconds", "blocked", "steps"]
        assert all(is_number(row["predicted"]) and is_number(row["measured"]) for row in run["rows"])
    kernel = results["kernel_links"]  # issue 56: the same links paced and shaped by the kernel
    assert {(run["seed"], run["shaping"]) for run in kernel["runs"]} == {
        (seed, shaping) for seed in kernel["seeds"] for shaping in ("paced", "kernel")}
    assert all(is_number(run["goodput"]) and run["state_hashes_agree"] for run in kernel["runs"])
    island = results["island"]  # issue 35: groups killed, the leading ones too, against no kills
    assert island["groups_killed"]["kills"] > 0 and island["groups_killed"]["leader_kills"] > 0
    assert island["groups_killed"]["learner_restarts"] == 0 and island["without_failures"]["kills"] == 0
    assert is_number(island["groups_killed"]["trained_again_seconds_median"])
    assert is_number(results["runner"]["wall_seconds"])


def test_benchmarks_md_numbers_every_section_and_links_the_history(tmp_path):
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    render(results, tmp_path)
    markdown = (tmp_path / "BENCHMARKS.md").read_text()
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    # Every section the runner makes; and the GPU's, recorded by hand (bench/gpu_runs.py), where present.
    shown = [name for name in RENDERERS if name in results]
    assert set(SECTIONS) <= set(shown) and set(shown) - set(SECTIONS) <= {"gpu_user_loop"}
    assert headings == ["## Summary", *(f"## {TITLES[name]}" for name in shown), "## History and notes"]
    summary = markdown.split("## Summary")[1].split("\n## ")[0]
    numbered = [line.split(".")[0] for line in summary.splitlines() if line[:3].startswith("| ") and line[2].isdigit()]
    # A summary row each numbered section; a lettered one (1b) adds its row under its number's.
    numbers = sorted({int(TITLES[name].split(".")[0].rstrip("b")) for name in SECTIONS})
    assert numbered == [f"| {number}" for number in numbers] and numbers == list(range(1, len(numbers) + 1))
    assert "| ↳ 1. user loop" in summary
    assert "[bench/history.md](bench/history.md)" in markdown.split("## History and notes")[1]
    assert HISTORY.read_text().startswith("# Benchmark history and notes")
    assert "python bench/user_loop.py" in markdown and "python bench/hf_overlap.py" in markdown


def test_merging_replaces_only_the_sections_run_and_names_the_run_that_made_them():
    def run(commit: str, **sections) -> dict:
        return {"machine": {"commit": commit}, "profile": "full", "runner": {"command": f"run {commit}"}, **sections}

    full = run("a", quality={"q": 1}, hf={"h": 1})
    once = merged(full, run("b", hf={"h": 2}), ["hf"])
    assert once["quality"] == {"q": 1} and once["hf"] == {"h": 2} and once["machine"]["commit"] == "a"
    assert [(r["sections"], r["machine"]["commit"]) for r in once["later_runs"]] == [(["hf"], "b")]
    twice = merged(once, run("c", hf={"h": 3}, quality={"q": 3}), ["quality", "hf"])
    assert [(r["sections"], r["machine"]["commit"]) for r in twice["later_runs"]] == [(["quality", "hf"], "c")]


def test_a_gpu_run_is_recorded_from_a_gpu_check_file_and_rendered_with_its_command(tmp_path, monkeypatch):
    from bench import gpu_runs
    results = tmp_path / "results.json"
    committed = json.loads((ROOT / "bench" / "results.json").read_text())
    results.write_text(json.dumps({k: v for k, v in committed.items() if k != "gpu_user_loop"}))
    row = committed["gpu_user_loop"][-1]["sizes"][0]
    check = tmp_path / "gpu-check.json"
    check.write_text(json.dumps({"checks": [{"name": "tests", "figures": {}},
                                            {"name": "user loop", "figures": {"sizes": [row]}}]}))
    monkeypatch.setattr(gpu_runs, "RESULTS", results)
    monkeypatch.setattr(sys, "argv", ["gpu_runs.py", str(check), "--device", "NVIDIA H100", "--cpu-cores", "16",
                                      "--torch", "2.11.0+cu130", "--commit", "abc1234", "--command", "make gpu-check"])
    assert gpu_runs.main() == 0
    (run,) = json.loads(results.read_text())["gpu_user_loop"]
    assert run["sizes"] == [row] and run["commit"] == "abc1234"
    render(json.loads(results.read_text()), tmp_path)
    section = (tmp_path / "BENCHMARKS.md").read_text().split(f"## {TITLES['gpu_user_loop']}")[1].split("\n## ")[0]
    assert "| NVIDIA H100 (16), abc1234 |" in section and "`make gpu-check`" in section
