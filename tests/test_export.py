"""`diloco export` against real shards over gRPC: the run's global model as safetensors, bit for
bit the shards' values; a shard that does not answer or a value that does not match its hash
is refused by name, and nothing is written. `diloco evaluate` gives a weights file's loss."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco.learner.trainer.train import Trainer
from diloco.learner.sync.synced_parameters import named_parameters
from diloco.cli import main
from diloco.services.client import ShardClient
from diloco.services.contract.config import dump_config
from diloco.services.contract.fragments import plan_for_config, scatter
from diloco.services.contract.state import state_hash
from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.tls import certs_dir, learner_name, load_identity
from diloco.services.contract.wire import pb
from diloco.services.export import transformers_config_of
from diloco.syncer.service import start_shard
from tests.cluster_config import export_both_ways, tiny_cluster

MANIFEST = [("embed", (64, 8)), ("block.w", (32, 8)), ("block.b", (32,)), ("head", (8,))]


@pytest.fixture
def run(tmp_path):
    """Two shards of one run: a learner seeded every fragment with its own values and pushed one
    outer gradient to fragment 0, so its round closed (version 1)."""
    cfg = tiny_cluster(tmp_path / "state", shards=2, learners=1)
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(dump_config(cfg))
    issue_cluster_certs(cfg, certs_dir(cfg))
    handles = [start_shard(cfg, i, listen=shard.address, state_dir=tmp_path / "state")
               for i, shard in enumerate(cfg.shards)]
    learner = cfg.learners[0]
    identity = load_identity(cfg, learner_name(learner.id))
    try:
        clients = [ShardClient(shard.address, cfg.rpc, learner.id, 1, identity=identity) for shard in cfg.shards]
        for client in clients:
            for info in client.join(learner.region, MANIFEST).fragments:
                client.push(info.fragment_id, torch.randn(info.numel), codec="fp32", block_size=128,
                            kind=pb.PUSH_KIND_SEED)
        plan = plan_for_config(cfg, MANIFEST)
        first = plan.fragments[0]
        owner = clients[first.shard]
        owner.push(first.id, torch.full((first.numel,), 0.01), codec="int4", block_size=128, base_version=0,
                   c_steps=5, c_tokens=5 * 8 * 32, step_seconds=0.02)
        owner.pull(first.id, 0, min_version=1, max_wait_seconds=5)
        for client in clients:
            client.close()
        yield cfg, config_path, handles, plan
    finally:
        for handle in handles:
            handle.stop()


def _shard_values(handles, plan) -> dict[str, torch.Tensor]:
    tensors = {name: torch.empty(shape) for name, shape in MANIFEST}
    for fragment in plan.fragments:
        scatter(fragment, handles[fragment.shard].core.fragments[fragment.id].committed.value, tensors)
    return tensors


def test_export_writes_the_shards_global_values_bit_for_bit(run, tmp_path, capsys):
    cfg, config_path, handles, plan = run
    out = tmp_path / "export"
    assert main(["export", "--config", str(config_path), "--out", str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    expected = _shard_values(handles, plan)
    assert sorted(exported) == sorted(name for name, _ in MANIFEST)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    info = json.loads((out / "export.json").read_text())
    assert info["run"] == cfg.run.name and info["plan_digest"] == plan.digest
    assert info["parameters"] == sum(t.numel() for t in expected.values())
    by_id = {f["fragment_id"]: f for f in info["fragments"]}
    for fragment in plan.fragments:
        committed = handles[fragment.shard].core.fragments[fragment.id].committed
        assert by_id[fragment.id]["version"] == committed.version
        assert by_id[fragment.id]["state_hash"] == committed.state_hash == state_hash(committed.value)
    assert by_id[plan.fragments[0].id]["version"] == 1
    assert "exported 808 parameters" in capsys.readouterr().out


def test_export_refuses_a_shard_that_does_not_answer_and_writes_nothing(run, tmp_path, capsys):
    cfg, config_path, handles, _ = run
    handles[1].stop()
    out = tmp_path / "export"
    assert main(["export", "--config", str(config_path), "--out", str(out)]) == 1
    assert f"shard 1 ({cfg.shards[1].address}) did not answer: UNAVAILABLE" in capsys.readouterr().err
    assert not out.exists()


def test_export_refuses_a_value_that_does_not_match_its_state_hash(run, tmp_path, capsys):
    _, config_path, handles, plan = run
    damaged = plan.fragments[2]
    handles[damaged.shard].core.fragments[damaged.id].committed.value[3] += 1.0  # memory the hash no longer covers
    out = tmp_path / "export"
    out.mkdir()
    assert main(["export", "--config", str(config_path), "--out", str(out)]) == 1
    assert f"shard {damaged.shard}: fragment {damaged.id}: the value at v0 after this pull has xxh3-128" \
        in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_evaluate_gives_the_loss_of_the_model_in_a_weights_file(tmp_path, capsys):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1)
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(dump_config(cfg))
    trainer = Trainer.from_config(cfg, cfg.learners[0].id)
    for _ in range(5):
        trainer.train_step()
    weights = tmp_path / "model.safetensors"
    save_file({name: p.detach().clone() for name, p in named_parameters(trainer.model).items()}, str(weights))
    assert main(["evaluate", "--config", str(config_path), "--weights", str(weights), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"eval_loss": trainer.evaluate()}

    save_file({"head": torch.zeros(3)}, str(weights))
    assert main(["evaluate", "--config", str(config_path), "--weights", str(weights)]) == 1
    assert "the weights do not fit the config's model: missing ['blocks.0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_learner_exports_the_global_model_it_ends_with_as_the_shards_hold_it(tmp_path):
    learner_folder, shards_folder = export_both_ways(tiny_cluster(tmp_path / "state", shards=2, learners=1, steps=30),
                                                     tmp_path)
    by_learner = load_file(learner_folder / "model.safetensors")
    by_shards = load_file(shards_folder / "model.safetensors")
    assert by_learner.keys() == by_shards.keys()
    assert all(torch.equal(by_learner[name], by_shards[name]) for name in by_shards)
    info = json.loads((learner_folder / "export.json").read_text())
    shards = json.loads((shards_folder / "export.json").read_text())
    assert [(f["version"], f["state_hash"]) for f in info["fragments"]] == \
        [(f["version"], f["state_hash"]) for f in shards["fragments"]]
    assert max(f["version"] for f in info["fragments"]) >= 1  # the run synced


def test_an_export_of_a_factory_that_cannot_build_on_the_meta_device_has_no_config_json_and_says_why(caplog):
    assert transformers_config_of("tests.user_plugins:make_model") is None  # not a transformers model
    assert transformers_config_of("tests.user_plugins:model_from_real_memory") is None
    assert "no config.json in the export: the factory did not build on the meta device" in caplog.text
