"""`diloco config check --config C` (or `config check C`): validate a config file and summarise the run it describes.
A model or data factory is resolved (its module imported, nothing called)."""
from __future__ import annotations

import argparse
import collections
import sys

from diloco.services.contract.config import (Config, ConfigError, TransformersModelConfig, check_factories,
                                             load_config)
from diloco.services.contract.tls import certs_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check"], help="check: validate and summarise")
    parser.add_argument("config", nargs="?", help="path to the cluster YAML file (or --config, as elsewhere)")
    parser.add_argument("--config", dest="config_flag", metavar="CONFIG", help="path to the cluster YAML file")


def run(args: argparse.Namespace) -> int:
    if bool(args.config) == bool(args.config_flag):
        print("invalid: config check: give the cluster YAML file once (--config C)", file=sys.stderr)
        return 2
    args.config = args.config or args.config_flag
    try:
        cfg = load_config(args.config)
        check_factories(cfg)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 2
    regions = collections.Counter(learner.region for learner in cfg.learners)
    sync, syncer = cfg.sync, cfg.syncer
    print(f"{args.config}: valid")
    print(f"  run        {cfg.run.name} (seed {cfg.run.seed}, state in {cfg.run.state_dir})")
    print(f"  shards     {len(cfg.shards)}: {', '.join(s.address for s in cfg.shards)}")
    print(f"  learners   {len(cfg.learners)} in {len(regions)} regions: "
          + ", ".join(f"{region} x{n}" for region, n in sorted(regions.items())))
    print(f"  sync       H={sync.interval_steps} P={sync.fragments} tau={sync.overlap_steps} "
          f"alpha={sync.mix_alpha} codec={sync.codec} ({sync.fragmentation})")
    print(f"  syncer     K={syncer.quorum} grace={syncer.grace.mode}<= {syncer.grace.seconds}s "
          f"merge={syncer.merge} max_staleness={syncer.max_staleness} "
          f"outer lr={syncer.outer_optimizer.lr} momentum={cfg.outer_momentum():.3g}"
          + (f" (auto: {cfg.syncs_per_fragment():.0f} syncs per fragment)"
             if syncer.outer_optimizer.momentum == "auto" else ""))
    print(f"  model      {model_summary(cfg)}")
    tls = cfg.tls.mode if cfg.tls.mode == "plaintext" else f"mtls, certificates in {certs_dir(cfg)} (diloco certs)"
    print(f"  transport  {tls}")
    if warning := cfg.momentum_warning():
        print(f"warning: {warning}")
    return 0


def model_summary(cfg: Config) -> str:
    """The model in a line, saying so when it is the default of a config without `model:`."""
    model = cfg.model
    if isinstance(model, str):
        return f"{model} (a factory)"
    if isinstance(model, TransformersModelConfig):
        return f"transformers {model.transformers}, context {model.seq_len}"
    summary = f"{model.family} {model.n_layer} layers x {model.n_embd}, context {model.seq_len}"
    return summary if "model" in cfg.model_fields_set else f"{summary} (the default: the config has no model:)"
