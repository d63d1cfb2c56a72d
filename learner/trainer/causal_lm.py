"""A Hugging Face transformers causal LM in the built-in learner (`diloco learner`, `diloco sim`),
with no adapter of the user's: `model: {transformers: LlamaForCausalLM, config: {...}, seq_len: N}`
in the cluster config, or a factory (`model: "pkg.module:factory"`) that returns one.

The learner trains a `CausalLM` around it (the inner loop's `forward(idx, targets) -> (logits,
loss)` and `seq_len`), but syncs, exports and evaluates the transformers model itself
(`synced_module`): the run's parameters carry the model's own names, and an export opens with
`AutoModelForCausalLM.from_pretrained`. Nothing here imports transformers: a config names the
class, a factory has imported it already.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from diloco.services.contract.config import TransformersModelConfig, transformers_class, transformers_config


class CausalLM(nn.Module):
    """A transformers causal LM with the built-in learner's model interface: `forward(idx,
    targets)` returns `(logits, loss)` for targets already shifted by one token (HF's own
    `labels` would shift them again), and `seq_len` is the context the data is cut to."""

    def __init__(self, lm: nn.Module, seq_len: int):
        super().__init__()
        self.lm = lm
        self.seq_len = seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.lm(input_ids=idx, use_cache=False).logits
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def build_transformers_model(spec: TransformersModelConfig) -> CausalLM:
    """The configured class with random weights from its config (the caller seeds torch)."""
    return CausalLM(transformers_class(spec)(transformers_config(spec)), spec.seq_len)


def wrap_factory_model(model: nn.Module, spec: str) -> CausalLM:
    """A factory's transformers model for the inner loop: its context is an int `seq_len` the
    factory set on it, else its config's max_position_embeddings."""
    seq_len = getattr(model, "seq_len", None)
    if not isinstance(seq_len, int):
        seq_len = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(seq_len, int):
        raise ValueError(f"model: {spec!r}: returned a transformers model whose config has no "
                         "max_position_embeddings: set an int `seq_len` on it (the context the data is cut to)")
    if getattr(model.config, "vocab_size", 0) < 256:
        raise ValueError(f"model: {spec!r}: returned a transformers model with vocab_size "
                         f"{model.config.vocab_size}; the learner's tokens are bytes, so it must be at least 256")
    return CausalLM(model, seq_len)


def synced_module(model: nn.Module) -> nn.Module:
    """The module whose parameters a run syncs and exports: the transformers model inside a
    CausalLM (its own parameter names), else the model itself."""
    return model.lm if isinstance(model, CausalLM) else model
