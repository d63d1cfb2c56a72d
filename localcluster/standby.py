"""A warm standby for a learner's next life: `python -m diloco.localcluster.standby ARGV...`
imports torch and the learner's code, then waits for one line on stdin (`go_line`); the cluster
writes it when the learner is due back, and the standby runs ARGV (`-m MODULE ARGS...` or
`SCRIPT ARGS...`) in this same interpreter, as `python ARGV...` would.

The cluster prepares a learner's standby while the learner is down (a replacement host booting
during the repair), so its next life does not pay the interpreter's and torch's import again.
The life's start-up is counted from when the cluster wrote the line (LIFE_STARTED_ENV, which
learner/sync/report.py reads), imports not yet finished then included, not from the standby's own start.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import runpy
import sys

from diloco.services.process import LIFE_STARTED_ENV, die_with_parent


def go_line(started: float) -> bytes:
    """What starts a standby's life: the time.monotonic (one clock for every process) at which
    the cluster started it, the start of that life's start-up."""
    return f"go {started!r}\n".encode()


# What every learner life imports first; a user's own script may import more.
PRELOAD = ("torch", "diloco.learner.trainer.main")


def run_life(argv: list[str]) -> None:
    """`python ARGV...` in this interpreter: `-m MODULE ARGS...` or `SCRIPT ARGS...`."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(pathlib.Path(argv[0]).resolve().parent)  # as `python SCRIPT` sets it
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    die_with_parent()  # the prctl holds for the life this process becomes, too
    argv = sys.argv[1:]
    if not argv or argv[:1] == ["-m"] and len(argv) < 2:
        print("usage: python -m diloco.localcluster.standby (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        return 2
    for module in PRELOAD:
        importlib.import_module(module)
    line = sys.stdin.buffer.readline().split()
    if not line or line[0] != b"go":  # the cluster ended, or discarded this standby
        return 0
    os.environ[LIFE_STARTED_ENV] = line[1].decode()
    sys.stdin.close()
    run_life(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
