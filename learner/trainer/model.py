"""The learner's model: a small byte-level GPT in the style of nanoGPT (or, with
`model.family: llama`, a Llama-style decoder, below), or the user's own.

    model = build_model(cfg.model, seed=cfg.run.seed)
    logits, loss = model(idx, targets)   # idx, targets: (batch, time) int64 bytes

Every learner and every rank of an island calls build_model with the same seed and gets the
same initial bits, so the fragments they sync start from one common point.

A user's model comes from `model: "pkg.module:factory"` in the config: `factory(seed=seed)`
returns an nn.Module whose `forward(idx, targets=None)` returns `(logits, loss)` like GPT's,
and which has an int attribute `seq_len`, the context length it trains on (the data is cut
to it); or a transformers causal LM as it is (learner/trainer/causal_lm.py), which
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

from diloco.learner.trainer.causal_lm import build_transformers_model, wrap_factory_model
from diloco.services.export import is_transformers_model
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


# The second built-in model family: a byte-level Llama-style decoder.
#
# It differs from GPT (above) where real models of the Llama family do: RMSNorm
# instead of LayerNorm, rotary position embeddings instead of a learned position table, a SwiGLU
# MLP, no biases, and an output head of its own (not tied to the embedding). Same interface:
#
#     logits, loss = Llama(cfg)(idx, targets)
#
# Blocks are `blocks.<i>.` like GPT's, for the strided fragment plan.

ROPE_BASE = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, (seq_len, head_size / 2)."""
    frequencies = ROPE_BASE ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each pair (x[2i], x[2i+1]) of the last dimension by its position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # positions enter here, and only here
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) * up(x)), hidden size 8/3 of the width as in Llama (rounded to 8)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = 8 * math.ceil(8 * cfg.n_embd / 3 / 8)
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.token_embedding = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.blocks = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.n_embd // cfg.n_head)
        # Buffers, not parameters: computed, never trained or synced.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.blocks:  # residual-stream writers scaled by depth, as in GPT-2
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len {self.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.token_embedding(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
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
    """The built-in model of a GPTConfig's family (GPT, or Llama-style), a
    transformers causal LM (learner/trainer/causal_lm.py), or the module a "pkg.module:factory" string
    names. Same seed, same initial weights."""
    # Seeding here, not only inside the factory, also makes a user factory that ignores its
    # seed argument build the same weights in every process.
    torch.manual_seed(seed)
    if isinstance(model_cfg, TransformersModelConfig):
        return build_transformers_model(model_cfg)
    if not isinstance(model_cfg, str):
        if model_cfg.family == "llama":
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
