"""`diloco sim` as a test runs it: on a tiny cluster config of its own, quiet, its run folder
and JSON report under the test's folder."""
from __future__ import annotations

import json
import subprocess
import sys

from diloco.services.contract.config import dump_config
from tests.cluster_config import tiny_cluster


def sim_command(tmp_path, *flags: str) -> list[str]:
    base = tmp_path / "base.yaml"
    base.write_text(dump_config(tiny_cluster(tmp_path / "unused", shards=2, learners=3)))
    return [sys.executable, "-m", "diloco", "sim", "--config", str(base), "--quiet",
            "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "report.json"), *flags]


def run_sim(tmp_path, *flags: str) -> dict:
    try:
        result = subprocess.run(sim_command(tmp_path, *flags), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as timeout:  # what each process of the run was doing last
        raise AssertionError(f"diloco sim ran past {timeout.timeout:g} s:\n{_tail(timeout.stderr)}\n"
                             + "\n".join(f"--- {log.name}:\n{_tail(log.read_bytes())}"
                                          for log in sorted((tmp_path / "run" / "logs").glob("*.log")))) from None
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "state hashes agree" in result.stdout  # the summary table
    return json.loads((tmp_path / "report.json").read_text())


def _tail(output: str | bytes | None, lines: int = 12) -> str:
    text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    return "\n".join(text.splitlines()[-lines:])
