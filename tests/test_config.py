"""Config loading: the example is valid, and each kind of bad input is refused
with a message that names the key."""
import dataclasses
import pathlib
import re

import pytest
import yaml

from diloco.cli import main
from diloco.planner.inputs import PlanInputs
from diloco.services.contract.config.loading import PLAN_FILE_KEYS
from diloco.services.contract.config import (Config, ConfigError, GPTConfig, LinkConfig, dump_config, load_config,
                                             parse_config)

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "local-4-regions.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_config_is_valid_and_describes_four_regions():
    cfg = load_config(EXAMPLE)
    assert len(cfg.shards) == 2
    assert {l.region for l in cfg.learners} == {"us-east", "us-west", "us-central", "us-south"}
    assert isinstance(cfg.model, GPTConfig)
    assert cfg.trainer.inner_optimizer.lr == pytest.approx(1e-3)


def test_every_config_in_examples_is_valid():
    paths = sorted((ROOT / "examples").glob("*.yaml"))
    assert paths
    for path in paths:
        load_config(path)


def test_dump_round_trips():
    cfg = load_config(EXAMPLE)
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg


def test_scientific_notation_is_a_float(tmp_path):
    data = example()
    text = yaml.safe_dump(data).replace("lr: 0.001", "lr: 1e-4")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(path).trainer.inner_optimizer.lr == pytest.approx(1e-4)


def mutate(path: str, value):
    data = example()
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize("path, value, expected", [
    ("sync.fragmnets", 4, "sync.fragmnets: unknown key"),
    ("sync.fragments", "four", "sync.fragments: Input should be a valid integer"),
    ("sync.fragments", "4", "sync.fragments: Input should be a valid integer"),
    ("sync.fragments", 0, "sync.fragments: Input should be greater than 0"),
    ("sync.overlap_steps", 50, "sync.overlap_steps: tau=50 must be smaller than sync.interval_steps (H=50)"),
    ("sync.codec", "int3", "sync.codec: unknown codec 'int3'"),
    ("sync.mix_alpha", 1.5, "sync.mix_alpha: Input should be less than or equal to 1"),
    ("sync.fragmentation", "random", "sync.fragmentation: Input should be 'balanced' or 'strided'"),
    ("syncer.quorum", 5, "syncer.quorum: K=5 exceeds the number of learners (M=4)"),
    ("syncer.merge", "median", "syncer.merge: Input should be 'rda' or 'mean'"),
    ("syncer.grace.gamma", 1.0, "syncer.grace.gamma: Input should be less than 1"),
    ("syncer.lease_seconds", 0.5, "syncer.lease_seconds: 0.5 must be at least twice trainer.heartbeat_seconds"),
    ("shards.0.address", "localhost", "shards[0].address: String should match pattern"),
    ("shards.1.address", "127.0.0.1:50061", "shards[1].address: duplicate value"),
    ("learners.1.id", "us-east-0", "learners[1].id: duplicate value"),
    ("learners.0.id", "Bad Id!", "learners[0].id: String should match pattern"),
    ("model.n_head", 3, "model.n_embd: 128 is not divisible by model.n_head (3)"),
    ("model", "not a factory", "model: String should match pattern"),
    ("trainer.batch_size", 2.5, "trainer.batch_size: Input should be a valid integer"),
    ("learners", [], "learners: List should have at least 1 item"),
    ("syncer.outer_optimizer.momentum", "fast", "syncer.outer_optimizer.momentum"),
    ("syncer.outer_optimizer.momentum", 1.0, "syncer.outer_optimizer.momentum"),
    ("links", {"us-north": {"up_mbps": 5.0}}, "links.us-north: no learner is in region 'us-north'"),
    ("links", {"us-east": {"up_mbps": 0.0}}, "links.us-east.up_mbps: Input should be greater than 0"),
    ("links", {"us-east": {"latency_ms": -1.0}}, "links.us-east.latency_ms: Input should be greater than or equal"),
    ("links", {"us-east": {"up": 5.0}}, "links.us-east.up: unknown key"),
    ("links", {"US East": {"up_mbps": 5.0}}, "links.US East: String should match pattern"),
    ("learners.0.link", {"down_mbps": "fast"}, "learners[0].link.down_mbps: Input should be a valid number"),
    ("island", {"replica_groups": 0}, "island.replica_groups: Input should be greater than 0"),
    ("island", {"replica_group": 2}, "island.replica_group: unknown key"),
    ("island", {"heartbeat_timeout_seconds": 0}, "island.heartbeat_timeout_seconds: Input should be greater than 0"),
    ("limits", {"max_chunks_per_push": 8}, "limits.max_chunks_per_push: Input should be greater than or equal to 16"),
])
def test_bad_values_are_refused_naming_the_key(path, value, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(mutate(path, value))
    assert expected in str(info.value)


def test_a_learners_link_is_its_own_else_its_regions_with_the_one_cap_for_a_rate_neither_gives():
    data = example()
    data["links"] = {"us-east": {"up_mbps": 50.0, "down_mbps": 100.0, "latency_ms": 20.0},
                     "us-west": {"up_mbps": 20, "latency_ms": 40}}
    data["learners"][2]["link"] = {"up_mbps": 5.0}  # us-central-0
    cfg = parse_config(data)
    assert cfg.link("us-east-0", "us-east") == LinkConfig(up_mbps=50.0, down_mbps=100.0, latency_ms=20.0)
    assert cfg.link("us-west-0", "us-west") == LinkConfig(up_mbps=20.0, latency_ms=40.0)
    assert cfg.link("us-central-0", "us-central") == LinkConfig(up_mbps=5.0)
    assert cfg.link("us-south-0", "us-south") is None  # loopback as it is
    data["rpc"] = {"wan_mbps": 8.0}
    cfg = parse_config(data)
    assert cfg.link("us-west-0", "us-west") == LinkConfig(up_mbps=20.0, down_mbps=8.0, latency_ms=40.0)
    assert cfg.link("us-south-0", "us-south") == LinkConfig(up_mbps=8.0, down_mbps=8.0)
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg


def test_more_shards_than_fragments_is_refused():
    data = mutate("sync.fragments", 1)
    with pytest.raises(ConfigError, match=r"shards: 2 shards but only sync.fragments=1"):
        parse_config(data)


def test_missing_required_section_is_named():
    data = example()
    del data["shards"]
    with pytest.raises(ConfigError, match=r"shards: Field required"):
        parse_config(data)


def test_user_factories_are_accepted():
    data = mutate("model", "mypkg.models:tiny_transformer")
    data["data"] = "mypkg.data:my_shards"
    with pytest.raises(ConfigError, match="syncer.max_tokens_per_step: required with a model factory"):
        parse_config(data)
    data["syncer"]["max_tokens_per_step"] = 4096
    cfg = parse_config(data)
    assert cfg.model == "mypkg.models:tiny_transformer" and cfg.data == "mypkg.data:my_shards"


def test_unreadable_and_non_yaml_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("shards: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    text = yaml.safe_dump(example()).replace("sync:\n", "sync:\n  interval_steps: 7\n", 1)
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"duplicate key 'interval_steps'\n  in .*, line \d+"):
        load_config(path)


@pytest.mark.parametrize("written", ["intervalSteps", "interval-steps", "interval_step"])
def test_an_unknown_key_is_named_as_written_with_the_key_it_may_mean(written):
    data = example()
    data["sync"][written] = data["sync"].pop("interval_steps")
    with pytest.raises(ConfigError, match=rf"sync\.{written}: unknown key \(did you mean sync\.interval_steps\?\)"):
        parse_config(data)


@pytest.mark.parametrize("section, key, meant", [(None, "interval_steps", "sync.interval_steps"),
                                                 ("sync", "quorum", "syncer.quorum"),
                                                 ("syncer", "quorum_", "syncer.quorum")])
def test_a_key_in_the_wrong_section_is_pointed_to_where_it_belongs(section, key, meant):
    data = example()
    (data[section] if section else data)[key] = 2
    where = f"{section}.{key}" if section else key
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}: unknown key \(did you mean {re.escape(meant)}\?\)"):
        parse_config(data)


def test_a_plan_input_file_is_recognised_and_the_plan_command_named():
    with pytest.raises(ConfigError, match=r"a `diloco plan` input file \(chips, chip_mtbf_hours.*\), not a cluster config: run "
                                          r"`diloco plan --config examples/plan/datacenter.yaml`"):
        load_config(pathlib.Path("examples/plan/datacenter.yaml"))
    assert set(PLAN_FILE_KEYS) <= {field.name for field in dataclasses.fields(PlanInputs)}


def test_lookup_of_unknown_learner_and_shard():
    cfg = load_config(EXAMPLE)
    assert cfg.learner("us-west-0").region == "us-west"
    with pytest.raises(ConfigError, match="no learner with id 'eu-0'"):
        cfg.learner("eu-0")
    with pytest.raises(ConfigError, match="no shard with index 2"):
        cfg.shard(2)
    assert isinstance(cfg, Config)


@pytest.mark.parametrize("key, spec, expected", [
    ("model", "tests.user_plugins:make_modle",
     "model: 'tests.user_plugins:make_modle': module 'tests.user_plugins' has no attribute 'make_modle'"),
    ("model", "tests.no_such_plugins:make_model",
     "model: 'tests.no_such_plugins:make_model': cannot import module 'tests.no_such_plugins'"),
    ("data", "tests.user_plugins:NOT_CALLABLE", "data: 'tests.user_plugins:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not callable"),
])
def test_config_check_resolves_the_factories_and_names_the_key_of_one_that_does_not_resolve(
        tmp_path, capsys, key, spec, expected):
    data = mutate(key, spec)
    data["syncer"]["max_tokens_per_step"] = 2048  # a config with a model factory gives it
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert expected in err and "valid" not in out


def test_config_check_accepts_factories_that_resolve_without_calling_them(tmp_path, capsys):
    from tests import user_plugins

    data = mutate("model", "tests.user_plugins:make_model")
    data["data"] = "tests.user_plugins:make_data"
    data["syncer"]["max_tokens_per_step"] = 2048
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    calls = len(user_plugins.calls)
    assert main(["config", "check", str(path)]) == 0
    assert f"{path}: valid" in capsys.readouterr().out
    assert len(user_plugins.calls) == calls


@pytest.mark.parametrize("steps, interval, expected", [
    (400, 16, 0.6),     # 25 syncs per fragment: a memory of 2.5 periods
    (1500, 50, 1 - 1 / 3),  # 30 syncs: 3 periods
    (1500, 25, 0.7),    # 60 syncs: at most 0.7
    (3000, 10, 0.7),
    (600, 50, 0.5),     # 12 syncs: at least 0.5
])
def test_auto_outer_momentum_remembers_a_tenth_of_the_runs_syncs_within_half_and_seven_tenths(
        steps, interval, expected):
    data = mutate("syncer.outer_optimizer.momentum", "auto")
    data["trainer"]["max_steps"], data["sync"]["interval_steps"] = steps, interval
    cfg = parse_config(data)
    assert cfg.syncs_per_fragment() == steps / interval
    assert cfg.outer_momentum() == pytest.approx(expected)


def test_a_run_token_budget_that_ends_the_run_first_shortens_the_run_auto_momentum_sees():
    data = mutate("sync.interval_steps", 16)
    cfg = parse_config(data)
    tokens_per_step = cfg.tokens_per_step()
    data["trainer"].update(max_steps=10_000, max_run_tokens=len(cfg.learners) * 400 * tokens_per_step)
    assert parse_config(data).syncs_per_fragment() == 25 and parse_config(data).outer_momentum() == pytest.approx(0.6)


def test_an_outer_momentum_given_is_the_one_used():
    cfg = parse_config(mutate("syncer.outer_optimizer.momentum", 0.8))
    assert cfg.outer_momentum() == 0.8


@pytest.mark.parametrize("momentum, warned", [("auto", False), (0.6, False), (0.9, True)])
def test_an_outer_momentum_well_above_auto_for_the_runs_length_is_warned_about(momentum, warned):
    data = mutate("syncer.outer_optimizer.momentum", momentum)
    data["trainer"]["max_steps"], data["sync"]["interval_steps"] = 600, 25  # auto: 0.58
    warning = parse_config(data).momentum_warning()
    assert (warning is not None) == warned
    if warned:
        assert "syncer.outer_optimizer.momentum: 0.9" in warning and "would choose 0.58" in warning


def test_config_check_says_the_model_is_the_default_when_the_config_names_none(tmp_path, capsys):
    data = example()
    del data["model"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", str(path)]) == 0
    assert "model      gpt 2 layers x 128, context 128 (the default: the config has no model:)" in capsys.readouterr().out
    assert main(["config", "check", str(EXAMPLE)]) == 0
    assert "(the default" not in capsys.readouterr().out


def test_the_default_token_bound_covers_every_replica_group_of_an_island():
    data = example()
    one = parse_config(data)
    data["island"] = {"replica_groups": 3}
    assert parse_config(data).max_tokens_per_step() == 3 * one.max_tokens_per_step() == 3 * one.tokens_per_step()
