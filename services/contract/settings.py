"""The run's sync settings a shard sends every learner that joins (JoinResponse.settings), and
the comparison a learner makes with its own config: a learner trains only with shards that run
the settings it runs (docs/protocol.md, Plan and seeding).

One table maps each config key to its pb.ClusterSettings field and its value in a Config, so
what a shard sends and what a learner checks are the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from diloco.services.contract.codecs import codec_name, get_codec
from diloco.services.contract.config import Config
from diloco.services.contract.wire import pb


@dataclass(frozen=True)
class _Setting:
    key: str  # the config key a difference names
    field: str  # of pb.ClusterSettings
    of_config: Callable[[Config], object]
    shown: Callable[[object], str] = str  # how a difference writes a value


_SETTINGS = (
    _Setting("sync.fragments", "fragments", lambda cfg: cfg.sync.fragments),
    _Setting("sync.interval_steps", "sync_interval_steps", lambda cfg: cfg.sync.interval_steps),
    _Setting("sync.overlap_steps", "overlap_steps", lambda cfg: cfg.sync.overlap_steps),
    _Setting("sync.mix_alpha", "mix_alpha", lambda cfg: cfg.sync.mix_alpha),
    _Setting("sync.codec", "codec", lambda cfg: get_codec(cfg.sync.codec).wire, shown=codec_name),
    _Setting("sync.codec_block_size", "codec_block_size", lambda cfg: cfg.sync.codec_block_size),
    _Setting("sync.fragmentation", "fragmentation", lambda cfg: cfg.sync.fragmentation),
    _Setting("syncer.max_staleness", "max_staleness", lambda cfg: cfg.syncer.max_staleness),
    _Setting("syncer.lease_seconds", "lease_seconds", lambda cfg: cfg.syncer.lease_seconds),
    _Setting("trainer.heartbeat_seconds", "heartbeat_interval_seconds", lambda cfg: cfg.trainer.heartbeat_seconds),
    _Setting("shards (count)", "shards", lambda cfg: len(cfg.shards)),
)


def cluster_settings(cfg: Config) -> pb.ClusterSettings:
    """The settings a shard of this config sends."""
    return pb.ClusterSettings(**{setting.field: setting.of_config(cfg) for setting in _SETTINGS})


def settings_differences(shard_index: int, settings: pb.ClusterSettings, cfg: Config) -> list[str]:
    """'key: shard i uses X, this learner Y' for each setting of a shard's JoinResponse that
    differs from this learner's config."""
    differences = []
    for setting in _SETTINGS:
        theirs, ours = getattr(settings, setting.field), setting.of_config(cfg)
        if theirs != ours:
            differences.append(f"{setting.key}: shard {shard_index} uses {setting.shown(theirs)}, "
                               f"this learner {setting.shown(ours)}")
    return differences
