"""The benchmark runner: a quick run of one section end to end, and the shape of the committed
bench/results.json (every section, numbers not strings, the dp baseline beside diloco)."""
from __future__ import annotations

import json
import numbers
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("quality", "bandwidth", "goodput", "overlap", "transport", "recovery")


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
    assert all(is_number(run["push_vs_raw"]) for run in results["transport"]["runs"])
    assert all(is_number(size["learner_back_to_training_seconds"]) for size in results["recovery"]["sizes"])
    assert is_number(results["runner"]["wall_seconds"])
