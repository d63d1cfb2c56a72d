"""The second built-in model family: a byte-level Llama-style decoder.

It differs from GPT (learner/model.py) where real models of the Llama family do: RMSNorm
instead of LayerNorm, rotary position embeddings instead of a learned position table, a SwiGLU
MLP, no biases, and an output head of its own (not tied to the embedding). Same interface:

    logits, loss = Llama(cfg)(idx, targets)

Blocks are `blocks.<i>.` like GPT's, for the strided fragment plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.learner.model import VOCAB_SIZE
from diloco.services.contract.config import GPTConfig

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


class Attention(nn.Module):
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


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd)
        self.attn = Attention(cfg)
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
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
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
