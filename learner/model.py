"""The learner's model: a small byte-level GPT in the style of nanoGPT (or, with
`model.family: llama`, the Llama-style decoder of learner/llama.py), or the user's own.

    model = build_model(cfg.model, seed=cfg.run.seed)
    logits, loss = model(idx, targets)   # idx, targets: (batch, time) int64 bytes

Every learner and every rank of an island calls build_model with the same seed and gets the
same initial bits, so the fragments they sync start from one common point.

A user's model comes from `model: "pkg.module:factory"` in the config: `factory(seed=seed)`
returns an nn.Module whose `forward(idx, targets=None)` returns `(logits, loss)` like GPT's,
and which has an int attribute `seq_len`, the context length it trains on (the data is cut
to it); or a transformers causal LM as it is (learner/causal_lm.py), which
`model: {transformers: Class, config: {...}, seq_len: N}` also builds.

Parameter names matter beyond this file: the fragment planner sees them through
`named_parameters()`, and its strided split reads the first integer path component as the
layer index, hence `blocks.<i>.` for the transformer blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.learner.causal_lm import build_transformers_model, is_transformers_model, wrap_factory_model
from diloco.services.contract.config import GPTConfig, TransformersModelConfig, resolve_factory

VOCAB_SIZE = 256  # bytes are the tokens


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # query, key, value in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.token_embedding = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.position_embedding = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        # Weight tying: one Parameter under two names. named_parameters() reports it once, as
        # token_embedding.weight, so it is synced once.
        self.lm_head.weight = self.token_embedding.weight

        self.apply(_init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 n_layer),
        # two per block, so the stream's variance does not grow with depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(T, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, VOCAB_SIZE), targets.reshape(B * T))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_model(model_cfg: GPTConfig | TransformersModelConfig | str, seed: int) -> nn.Module:
    """The built-in model of a GPTConfig's family (GPT, or Llama-style: learner/llama.py), a
    transformers causal LM (learner/causal_lm.py), or the module a "pkg.module:factory" string
    names. Same seed, same initial weights."""
    # Seeding here, not only inside the factory, also makes a user factory that ignores its
    # seed argument build the same weights in every process.
    torch.manual_seed(seed)
    if isinstance(model_cfg, TransformersModelConfig):
        return build_transformers_model(model_cfg)
    if not isinstance(model_cfg, str):
        if model_cfg.family == "llama":
            from diloco.learner.llama import Llama  # here: learner.llama imports this module
            return Llama(model_cfg)
        return GPT(model_cfg)
    model = resolve_factory(model_cfg, "model")(seed=seed)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: {model_cfg!r}: returned {type(model).__name__}, not a torch.nn.Module")
    if is_transformers_model(model):
        return wrap_factory_model(model, model_cfg)
    if not isinstance(getattr(model, "seq_len", None), int):
        raise ValueError(f"model: {model_cfg!r}: returned a module without an int `seq_len` "
                         f"attribute (the context length the data is cut to)")
    return model
