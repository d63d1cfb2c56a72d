"""The second built-in model family (learner/trainer/model.py): built from the config like GPT, the same
bits for the same seed, positions only through rotary embeddings, and it learns the corpus."""
from __future__ import annotations

import math

import pytest
import torch

from diloco.learner.trainer.model import Llama, rotary_tables, rotate
from diloco.learner.trainer.model import build_model
from diloco.learner.trainer.train import Trainer
from diloco.learner.sync.synced_parameters import manifest
from diloco.services.contract.config import GPTConfig, parse_config

TINY_LLAMA = {"family": "llama", "n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 64}


def test_the_config_family_picks_the_llama_model_and_the_same_seed_its_weights():
    first = build_model(GPTConfig(**TINY_LLAMA), seed=3)
    again = build_model(GPTConfig(**TINY_LLAMA), seed=3).state_dict()
    assert isinstance(first, Llama)
    assert all(torch.equal(tensor, again[name]) for name, tensor in first.state_dict().items())
    names = [name for name, _ in manifest(first)]
    assert "blocks.1.mlp.gate.weight" in names and "lm_head.weight" in names  # untied head
    assert not any("bias" in name or "position" in name for name in names)


def test_rotary_attention_scores_depend_only_on_the_distance_between_positions():
    cos, sin = rotary_tables(seq_len=16, head_size=8)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> float:
        return float(rotate(q, cos[m], sin[m]) @ rotate(k, cos[n], sin[n]))

    assert score(3, 1) == pytest.approx(score(12, 10), abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)


def test_the_llama_model_trains_on_the_builtin_corpus(tmp_path):
    cfg = parse_config({
        "run": {"seed": 7, "state_dir": str(tmp_path)},
        "shards": [{"address": "127.0.0.1:50061"}],
        "learners": [{"id": "learner-0", "region": "local"}],
        "trainer": {"batch_size": 8, "max_steps": 100, "eval_batches": 4,
                    "inner_optimizer": {"lr": 3.0e-3, "warmup_steps": 10}},
        "model": TINY_LLAMA,
        "data": {"corpus": "python-stdlib", "max_bytes": 1_000_000},
    })
    trainer = Trainer.from_config(cfg, "learner-0")
    initial = trainer.evaluate()
    for _ in range(100):
        trainer.train_step()
    final = trainer.evaluate()
    assert initial == pytest.approx(math.log(256), rel=0.05)
    assert final < 0.75 * initial
