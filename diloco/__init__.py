"""Decoupled DiLoCo as a cluster of gRPC services: the one import name of this project.

    from diloco import DecoupledDiLoCo     # around your own training loop (learner/sync/api.py)

    diloco.services   what the shard and the learner share (wire contract, codecs, config, CLI)
    diloco.learner    one learner: the public API, its sync, the built-in model and inner loop
    diloco.syncer     one syncer shard (decisions, durability, gRPC servicer)
    diloco.localcluster  the local-cluster harness: LocalCluster (real processes) and `diloco sim`
    diloco.integrations  adapters to other libraries (hf: transformers, with the `hf` extra)

In the repository these live in services/, learner/, syncer/, localcluster/ and integrations/ at
the top level, mapped under `diloco` by pyproject.toml's package-dir; nothing else is installed
at top level.
"""
from __future__ import annotations

__all__ = ["DecoupledDiLoCo", "JoinRefused", "ConfigError"]


def __getattr__(name: str):
    # Imported on first use: `diloco shard` and `diloco --help` need not load the learner.
    if name == "DecoupledDiLoCo":
        from diloco.learner.sync.api import DecoupledDiLoCo
        return DecoupledDiLoCo
    if name == "JoinRefused":
        from diloco.learner.sync.streaming import JoinRefused
        return JoinRefused
    if name == "ConfigError":
        from diloco.services.contract.config import ConfigError
        return ConfigError
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
