"""`diloco export --config C --out DIR`: the run's global model from its shards into DIR
(model.safetensors and export.json, and config.json for `model: {transformers: ...}`;
services/export.py says what they hold)."""
from __future__ import annotations

import argparse
import pathlib
import sys

from diloco.services.contract.config import ConfigError, load_config
from diloco.services.contract.tls import OPERATOR, load_identity
from diloco.services.export import MODEL_FILE, ExportError, fetch_global_model, write_export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster YAML file: pull from every shard it lists")
    parser.add_argument("--out", required=True, help="folder to write model.safetensors and export.json to")
    parser.add_argument("--tls-dir", help="folder with the ca.crt, tls.crt and tls.key to present "
                        "(default: <tls.dir>/operator)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        identity = load_identity(cfg, OPERATOR, args.tls_dir)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    try:
        model = fetch_global_model(cfg, identity)
    except ExportError as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 1
    except ConfigError as error:  # the config's transformers model, for config.json
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    write_export(model, out)
    versions = [f.version for f in model.fragments]
    print(f"exported {model.info()['parameters']} parameters of run {model.run!r} to {out / MODEL_FILE} "
          f"(fragment versions {min(versions)}..{max(versions)})")
    return 0
