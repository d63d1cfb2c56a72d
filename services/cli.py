"""The `diloco` command. Each subcommand lives in the module that owns it and is
imported only when run, so `services` never imports `learner` or `syncer` and
`diloco --help` does not load torch.

A subcommand module provides `add_arguments(parser)` and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "syncer": ("syncer.main", "run one syncer shard"),
    "learner": ("learner.main", "run one learner island"),
    "sim": ("services.sim", "run a whole multi-region cluster as local processes"),
    "export": ("services.export", "write the run's global model from its shards as safetensors"),
    "evaluate": ("learner.evaluate", "the validation loss of a model file (the run's global model)"),
    "status": ("services.status", "show a cluster's learners and fragments from its shards"),
    "config": ("services.config_cli", "validate a config file and print what it describes"),
    "certs": ("services.tls", "make a CA and a certificate for every shard, learner and operator of a config"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {name: entry for name, entry in SUBCOMMANDS.items()
            if importlib.util.find_spec(entry[0]) is not None}


def main(argv: list[str] | None = None) -> int:
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
