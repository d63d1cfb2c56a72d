"""The run's product, the global model, from its shards (`diloco export`: services/cli/export.py;
the learner's `sync.export()`).

Every fragment's global value is pulled as a snapshot from the shard that owns it (read-only
calls, Status and PullFragment, under the operator's certificate), checked against the state
hash the shard sent with it, and cut back into the parameters of the run's manifest by the
same fragment plan the learners use. DIR receives

    model.safetensors   every parameter by name, fp32 (safetensors: no pickle)
    export.json         run name, plan digest, per fragment its shard, version, state hash and
                        merged tokens
    config.json         a transformers model's config, where the model is one (by class and
                        config, or from a factory): the folder then opens with
                        AutoModelForCausalLM.from_pretrained(DIR)

Everything is fetched and checked before anything is written, and each file is written under
a temporary name and renamed, so a failed export leaves DIR as it was.
"""
from __future__ import annotations

import copy
import json
import logging
import pathlib
import sys
from dataclasses import asdict, dataclass
from typing import Any

import grpc
import torch
from safetensors.torch import save_file

from diloco.services.client import ShardClient
from diloco.services.contract.config import Config, TransformersModelConfig, resolve_factory, transformers_config
from diloco.services.contract.fragments import assemble, plan_for_config
from diloco.services.contract.state import StateHashMismatch, check_pulled
from diloco.services.contract.tls import Identity
from diloco.services.contract.wire import pb
from diloco.services.files import atomic_write, atomic_write_with

MODEL_FILE = "model.safetensors"
INFO_FILE = "export.json"
CONFIG_FILE = "config.json"

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """Why the global model could not be exported; the message names the shard or fragment."""


@dataclass(frozen=True)
class ExportedFragment:
    fragment_id: int
    shard: int
    version: int
    state_hash: str
    merged_tokens: int | None  # None where it was not asked of the shard (a learner's own export)


@dataclass(frozen=True)
class GlobalModel:
    run: str
    plan_digest: str
    fragments: tuple[ExportedFragment, ...]
    tensors: dict[str, torch.Tensor]  # by parameter name, in manifest order
    transformers_config: Any = None  # a transformers PretrainedConfig, for a transformers model

    def info(self) -> dict:
        return {"run": self.run, "plan_digest": self.plan_digest,
                "parameters": sum(t.numel() for t in self.tensors.values()),
                "merged_tokens": max((f.merged_tokens or 0 for f in self.fragments), default=0),
                "fragments": [asdict(f) for f in self.fragments]}


def fetch_global_model(cfg: Config, identity: Identity | None) -> GlobalModel:
    """Pulls every fragment's current global value and reassembles the model's parameters (and
    the config of a `model: {transformers: ...}`)."""
    clients = [ShardClient(shard.address, cfg.rpc, identity=identity) for shard in cfg.shards]
    try:
        statuses = [_status(cfg, index, client) for index, client in enumerate(clients)]
        runs = {(tuple((t.name, tuple(t.shape)) for t in s.manifest.tensors), s.plan_digest) for s in statuses}
        if len(runs) != 1:
            raise ExportError("the shards disagree on the model manifest or fragment plan: they are not one run")
        ((manifest, digest),) = runs
        plan = plan_for_config(cfg, manifest)
        if plan.digest != digest:
            raise ExportError(f"the shards use fragment plan {digest[:12]}, this config makes "
                              f"{plan.digest[:12]}: sync settings or shards differ from the run's")
        merged_tokens = {f.fragment_id: f.merged_tokens for s in statuses for f in s.fragments}
        values, fragments = [], []
        for fragment in plan.fragments:
            value, version, value_hash = _pull_fragment(clients[fragment.shard], fragment.id, fragment.shard)
            values.append((fragment, value))
            fragments.append(ExportedFragment(fragment.id, fragment.shard, version, value_hash,
                                              merged_tokens.get(fragment.id, 0)))
        return GlobalModel(cfg.run.name, digest, tuple(fragments), assemble(manifest, values),
                           transformers_config_of(cfg.model))
    finally:
        for client in clients:
            client.close()


def transformers_config_of(model: Any) -> Any:
    """The config.json of a transformers model, None for any other: from `model.config`, or
    from the model a factory builds, on the meta device (no memory for its weights)."""
    if isinstance(model, TransformersModelConfig):
        return transformers_config(model)
    if not isinstance(model, str):
        return None
    try:
        with torch.device("meta"):
            built = resolve_factory(model, "model")(seed=0)
    except Exception as error:  # the weights are exported all the same; only config.json is missing
        log.warning("model %s: no config.json in the export: the factory did not build on the meta device (%s)",
                    model, error)
        return None
    return pretrained_config(built) if hasattr(getattr(built, "config", None), "to_json_string") else None


def is_transformers_model(model: torch.nn.Module) -> bool:
    """A transformers PreTrainedModel (its package is imported wherever one exists)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def pretrained_config(model: torch.nn.Module) -> Any:
    """A copy of a transformers model's config as save_pretrained writes it, its class named."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    return config


def _status(cfg: Config, index: int, client: ShardClient) -> pb.StatusResponse:
    try:
        status = client.status()
    except grpc.RpcError as error:
        raise ExportError(f"shard {index} ({cfg.shards[index].address}) did not answer: "
                          f"{error.code().name} {error.details() or ''}".rstrip()) from None
    if not status.plan_digest:
        raise ExportError(f"shard {index} ({cfg.shards[index].address}) has no model yet: no learner has joined")
    return status


def _pull_fragment(client: ShardClient, fragment_id: int, shard: int) -> tuple[torch.Tensor, int, str]:
    """(value, version, state hash) of the fragment's global value, its hash checked."""
    try:
        result = client.pull(fragment_id, None)
    except grpc.RpcError as error:
        raise ExportError(f"fragment {fragment_id}: shard {shard} ({client.address}) did not answer: "
                          f"{error.code().name} {error.details() or ''}".rstrip()) from None
    if not result.items:
        raise ExportError(f"fragment {fragment_id}: shard {shard} sent no value (not seeded yet)")
    if not result.state_hash:
        raise ExportError(f"fragment {fragment_id}: shard {shard} sent no state hash to check the value against")
    value = result.items[-1].values
    if len(result.items) != 1 or result.items[0].kind != pb.PAYLOAD_KIND_SNAPSHOT:
        raise ExportError(f"fragment {fragment_id}: shard {shard} sent updates where a whole value was asked for")
    try:
        check_pulled(fragment_id, result.version, value, result.state_hash)
    except StateHashMismatch as mismatch:
        raise ExportError(f"shard {shard}: {mismatch}") from None
    return value, result.version, result.state_hash


def write_export(model: GlobalModel, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # format "pt": what transformers' from_pretrained requires of a safetensors file.
    atomic_write_with(out / MODEL_FILE, lambda path: save_file(model.tensors, str(path), metadata={
        "format": "pt", "run": model.run, "plan_digest": model.plan_digest}))
    if model.transformers_config is not None:
        atomic_write(out / CONFIG_FILE, model.transformers_config.to_json_string(use_diff=False).encode())
    atomic_write(out / INFO_FILE, (json.dumps(model.info(), indent=2) + "\n").encode())
