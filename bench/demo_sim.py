"""One `diloco sim` run of a bench script, quiet, in a run folder of its own: the command as a
user would type it, and the run's report."""
from __future__ import annotations

import argparse
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


def seeded_args(doc: str, steps: int) -> argparse.Namespace:
    """The command line of a bench script that runs its cases once per seed: --steps (per
    learner, default `steps`), --seeds (default 1 2 3) and --json (where the figures go)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args()


def seeded_command(script: str, args: argparse.Namespace) -> str:
    """How the figures of a seeded_args script were made, as BENCHMARKS.md quotes it."""
    return f"python {script} --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
