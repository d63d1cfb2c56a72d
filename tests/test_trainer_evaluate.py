"""The built-in learner evaluates its own model, or the global model it holds in a copy of it
(`diloco learner --eval-global`), leaving its own untouched."""
import torch

from diloco.learner.trainer.train import Trainer
from tests.cluster_config import tiny_cluster


def test_a_copy_holding_other_values_is_evaluated_and_the_model_keeps_its_own(tmp_path):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1)
    trainer = Trainer.from_config(cfg, cfg.learners[0].id, cache_dir=tmp_path / "cache")
    own = {name: p.detach().clone() for name, p in trainer.synced_module.named_parameters()}
    loss = trainer.evaluate()
    assert trainer.evaluate(own) == loss
    other = {name: p + 0.05 * torch.randn_like(p) for name, p in own.items()}
    assert trainer.evaluate(other) != loss
    assert all(torch.equal(p, own[name]) for name, p in trainer.synced_module.named_parameters())
    assert trainer.model.training  # back to training mode
