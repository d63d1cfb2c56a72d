"""The settings a shard sends every learner that joins, and the learner's comparison of them
with its own config (services/contract/settings.py)."""
from diloco.services.contract.config import parse_config
from diloco.services.contract.settings import cluster_settings, settings_differences


def config(shards: int = 1, **sync):
    return parse_config({
        "shards": [{"address": f"127.0.0.1:{port}"} for port in range(1, shards + 1)],
        "learners": [{"id": "a", "region": "r"}],
        "sync": {"fragments": 2, "interval_steps": 4, "overlap_steps": 1, "codec": "int4", **sync},
    })


def test_a_shard_of_the_same_config_runs_the_learners_settings():
    settings = cluster_settings(config())
    assert settings.codec_block_size == config().sync.codec_block_size and settings.shards == 1
    assert settings_differences(0, settings, config()) == []


def test_each_differing_setting_is_named_with_both_values():
    shard = cluster_settings(config(shards=2, codec="int8", mix_alpha=0.5))
    assert settings_differences(1, shard, config()) == [
        "sync.mix_alpha: shard 1 uses 0.5, this learner 0.0",
        "sync.codec: shard 1 uses int8, this learner int4",
        "shards (count): shard 1 uses 2, this learner 1",
    ]


def test_a_codec_this_version_does_not_know_is_named_by_its_number():
    shard = cluster_settings(config())
    shard.codec = 99
    assert settings_differences(0, shard, config()) == ["sync.codec: shard 0 uses unknown codec 99, this learner int4"]
