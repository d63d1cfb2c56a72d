"""`diloco evaluate --config C --weights model.safetensors`: the validation loss of a model file,
on the fixed validation set every learner evaluates on.

Used on what `diloco export` writes, this is the loss of the model a run produced (the global
model), not of any learner's local copy of it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.learner.trainer.train import Trainer
from diloco.learner.sync.synced_parameters import named_parameters
from diloco.services.contract.config import ConfigError, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the run's cluster YAML file (model and data)")
    parser.add_argument("--weights", required=True, help="a model.safetensors from `diloco export`")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write {\"eval_loss\": ...} here instead of a sentence (no PATH, or '-': stdout)")


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copies `tensors` into the model's parameters by name; every parameter, nothing else."""
    params = named_parameters(model)
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"the weights do not fit the config's model: missing {missing[:5]}, "
                         f"unknown {extra[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                raise ValueError(f"{name}: the weights have shape {list(tensors[name].shape)}, "
                                 f"the model {list(param.shape)}")
            param.copy_(tensors[name])


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    try:
        trainer = Trainer.from_config(cfg, cfg.learners[0].id)  # every learner has the same validation set
    except ConfigError as error:  # data.files that match nothing on this machine
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    try:
        load_weights(trainer.synced_module, load_file(args.weights))
    except (OSError, ValueError, SafetensorError) as error:
        print(f"{args.weights}: {error}", file=sys.stderr)
        return 1
    loss = trainer.evaluate()
    if args.json in (None, "-"):
        print(json.dumps({"eval_loss": loss}) if args.json else f"validation loss {loss:.4f}")
    else:
        pathlib.Path(args.json).write_text(json.dumps({"eval_loss": loss}))
        print(f"validation loss {loss:.4f}: {args.json}")
    return 0
