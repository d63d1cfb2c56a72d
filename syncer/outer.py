"""The outer optimizer: SGD with (Nesterov) momentum on the merged outer gradient.

    buf  = momentum * buf + delta
    step = delta + momentum * buf   (nesterov)   or   buf
    u    = -lr * step

The outer gradient delta = anchor - theta points back towards where the learners started, so
the update subtracts it: with lr = 1 and no momentum, the global value moves exactly to where
the learners went.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterOptimizer:
    lr: float
    momentum: float
    nesterov: bool

    def step(self, buffer: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(new momentum buffer, update u) as new tensors: the inputs stay as they are, so a
        round close can be computed in full before anything is committed."""
        buffer = torch.add(delta, buffer, alpha=self.momentum)
        step = torch.add(delta, buffer, alpha=self.momentum) if self.nesterov else buffer
        return buffer, step * -self.lr
