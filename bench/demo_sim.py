"""One `diloco sim` run of a bench script, quiet, in a run folder of its own: the command as a
user would type it, and the run's report."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def sim(config: str, run_dir: pathlib.Path, flags: list[str]) -> tuple[list[str], dict]:
    command = ["diloco", "sim", "--config", config, *flags]
    subprocess.run([sys.executable, "-m", "diloco", *command[1:], "--quiet", "--run-dir", str(run_dir)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return command, json.loads((run_dir / "report.json").read_text())
