"""Decoupled DiLoCo as a cluster of gRPC services: the one import name of this project.

What a user's script needs, and only that, is public here (docs/api.md):

    from diloco import DecoupledDiLoCo          # around your own training loop
    from diloco import load_config, Config      # the cluster config: its learners, shards, settings
    from diloco import ConfigError, JoinRefused # a config that cannot run; a join the shards refused
    from diloco import LearnerDiverged          # sick again right after healing: the learner stops
    from diloco import atomic_write_with        # write your checkpoint so that a crash never halves it
    from diloco import DecoupledDiLoCoCallback  # transformers' Trainer (the `hf` extra)

Everything else is internal and may move. In the repository the packages live at the top level,
mapped under `diloco` by pyproject.toml's package-dir:

    services/      diloco.services      what the shard and the learner share (contract, client, config)
    learner/       diloco.learner       sync/ (the library), trainer/ (the built-in learner), island/
    syncer/        diloco.syncer        one syncer shard (decisions, durability, gRPC servicer)
    localcluster/  diloco.localcluster  the local-cluster harness and `diloco sim`
    planner/       diloco.planner       `diloco plan`: a whole run at datacenter scale in virtual time
    integrations/  diloco.integrations  adapters to other libraries (hf: transformers)
"""
from __future__ import annotations

__all__ = ["DecoupledDiLoCo", "DecoupledDiLoCoCallback", "JoinRefused", "LearnerDiverged", "Config", "ConfigError",
           "load_config", "atomic_write_with"]


def __getattr__(name: str):
    # Imported on first use: `diloco syncer` and `diloco --help` need not load the learner or torch.
    if name == "DecoupledDiLoCo":
        from diloco.learner.sync.api import DecoupledDiLoCo
        return DecoupledDiLoCo
    if name == "DecoupledDiLoCoCallback":
        from diloco.integrations.hf import DecoupledDiLoCoCallback
        return DecoupledDiLoCoCallback
    if name == "JoinRefused":
        from diloco.learner.sync.session import JoinRefused
        return JoinRefused
    if name == "LearnerDiverged":
        from diloco.learner.sync.healing import LearnerDiverged
        return LearnerDiverged
    if name in ("Config", "ConfigError", "load_config"):
        from diloco.services.contract import config
        return getattr(config, name)
    if name == "atomic_write_with":
        from diloco.services.files import atomic_write_with
        return atomic_write_with
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
