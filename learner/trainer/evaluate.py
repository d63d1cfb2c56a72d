"""`diloco evaluate --config C --weights model.safetensors`: the validation loss of a model file,
on the fixed validation set every learner evaluates on.

Used on what `diloco export` writes, this is the loss of the model a run produced (the global
model), not of any learner's local copy of it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.learner.trainer.train import Trainer
from diloco.learner.sync.synced_parameters import named_parameters
from diloco.services.contract.config import Config, ConfigError, load_config


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


class WeightsError(Exception):
    """A model file that cannot be read, or that does not fit the config's model."""


def evaluate_weights(cfg: Config, weights: str | os.PathLike) -> float:
    """The validation loss of the model file `weights` in the config's model. Raises ConfigError
    (data.files that match nothing on this machine) or WeightsError."""
    trainer = Trainer.from_config(cfg, cfg.learners[0].id)  # every learner has the same validation set
    try:
        load_weights(trainer.synced_module, load_file(weights))
    except (OSError, ValueError, SafetensorError) as error:
        raise WeightsError(f"{weights}: {error}") from None
    return trainer.evaluate()


def run(args: argparse.Namespace) -> int:
    try:
        loss = evaluate_weights(load_config(args.config), args.weights)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    except WeightsError as error:
        print(error, file=sys.stderr)
        return 1
    if args.json in (None, "-"):
        print(json.dumps({"eval_loss": loss}) if args.json else f"validation loss {loss:.4f}")
    else:
        pathlib.Path(args.json).write_text(json.dumps({"eval_loss": loss}))
        print(f"validation loss {loss:.4f}: {args.json}")
    return 0
