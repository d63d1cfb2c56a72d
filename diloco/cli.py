"""The `diloco` command. Each subcommand lives beside the role that owns it and provides
`add_arguments(parser)` and `run(args) -> int`; only the chosen one is imported, so
`diloco shard` does not load the learner and `diloco --help` does not load torch."""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from types import ModuleType

from diloco.services.process import die_with_parent

# name -> one-line help
SUBCOMMANDS = {
    "syncer": "run one syncer shard",
    "learner": "run one learner island",
    "sim": "run a whole multi-region cluster as local processes",
    "plan": "simulate a whole run at datacenter scale in virtual time: goodput by mode",
    "export": "write the run's global model from its shards as safetensors",
    "evaluate": "the validation loss of a model file (the run's global model)",
    "status": "show a cluster's learners and fragments from its shards",
    "config": "validate a config file and print what it describes",
    "certs": "make a CA and a certificate for every shard, learner and operator of a config",
}


def subcommand(name: str) -> ModuleType:
    """The module of a subcommand, imported now."""
    if name == "syncer":
        from diloco.syncer import main as module
    elif name == "learner":
        from diloco.learner.trainer import main as module
    elif name == "sim":
        from diloco.localcluster import sim as module
    elif name == "plan":
        from diloco.planner import main as module
    elif name == "export":
        from diloco.services.cli import export as module
    elif name == "evaluate":
        from diloco.learner.trainer import evaluate as module
    elif name == "status":
        from diloco.services.cli import status as module
    elif name == "config":
        from diloco.services.cli import config as module
    elif name == "certs":
        from diloco.services.cli import certs as module
    else:
        raise KeyError(name)
    return module


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one its help does not already say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as `diloco` reads it (argparse exits on a bad one, naming it)."""
    parser = argparse.ArgumentParser(
        prog="diloco", description="Decoupled DiLoCo: syncer shards, learner islands and local clusters.")
    parser.add_argument("--version", action="version",
                        version=f"diloco {importlib.metadata.version('decoupled-diloco')}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, help_text in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpWithDefaults)
        # After the command too (`diloco sim --log-level DEBUG`); given before it, it stays.
        sub_parser.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                                help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
        if name == chosen:
            module = subcommand(name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
