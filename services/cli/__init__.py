"""The `diloco` command. Each subcommand lives in the module that owns it and is
imported only when run, so `services` never imports `learner`, `syncer`, `localcluster` or `planner` and
`diloco --help` does not load torch.

A subcommand module provides `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import logging
import os
import signal
import sys

# Set by localcluster.cluster to the pid of the process starting this one (the sim, a test's or a
# benchmark's cluster): this process must not outlive it.
DIE_WITH_PARENT_ENV = "DILOCO_DIE_WITH_PARENT"
# Set by a warm standby (localcluster/standby.py) when it becomes a learner's life: the time.monotonic
# at which that life started, which is not when the standby's process did (learner/report.py).
LIFE_STARTED_ENV = "DILOCO_LIFE_STARTED"
_PR_SET_PDEATHSIG = 1

# name -> (module, one-line help)
SUBCOMMANDS = {
    "syncer": ("diloco.syncer.main", "run one syncer shard"),
    "learner": ("diloco.learner.main", "run one learner island"),
    "sim": ("diloco.localcluster.sim", "run a whole multi-region cluster as local processes"),
    "plan": ("diloco.planner.main", "simulate a whole run at datacenter scale in virtual time: goodput by mode"),
    "export": ("diloco.services.cli.export", "write the run's global model from its shards as safetensors"),
    "evaluate": ("diloco.learner.evaluate", "the validation loss of a model file (the run's global model)"),
    "status": ("diloco.services.cli.status", "show a cluster's learners and fragments from its shards"),
    "config": ("diloco.services.cli.config", "validate a config file and print what it describes"),
    "certs": ("diloco.services.cli.certs", "make a CA and a certificate for every shard, learner and operator of a config"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {name: entry for name, entry in SUBCOMMANDS.items()
            if importlib.util.find_spec(entry[0]) is not None}


def die_with_parent() -> None:
    """When started by a cluster harness, asks the kernel for SIGKILL when the harness
    ends, however it ends (SIGKILL included): Linux's PR_SET_PDEATHSIG. Elsewhere the
    harness's own cleanup is all there is."""
    parent = os.environ.pop(DIE_WITH_PARENT_ENV, None)  # not for processes this one starts
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # the harness ended before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    commands = _available()
    parser = argparse.ArgumentParser(
        prog="diloco", description="Decoupled DiLoCo: syncer shards, learner islands and local clusters.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen subcommand's module is imported (and asked for its arguments).
    chosen = next((a for a in argv if a in commands), None)
    for name, (module_name, help_text) in commands.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
