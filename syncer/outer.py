"""The outer optimizer: SGD with (Nesterov) momentum on the merged outer gradient.

    buf  = momentum * buf + delta
    step = delta + momentum * buf   (nesterov)   or   buf
    u    = -lr * step

The outer gradient delta = anchor - theta points back towards where the learners started, so
the update subtracts it: with lr = 1 and no momentum, the global value moves exactly to where
the learners went.

With delayed Nesterov (fragment_state.FragmentState.close) one sync period's outer gradient
delta = g_1 + ... + g_n arrives over n rounds: rounds 1..n-1 each apply a plain -lr * g_i, and
round n applies what is left of u:

    rest = u + lr * (delta - g_n)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.services.contract.config import Config


@dataclass(frozen=True)
class OuterOptimizer:
    lr: float
    momentum: float
    nesterov: bool

    def end_period(self, buffer: torch.Tensor, delta: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """`rest` for the period's summed outer gradient `delta` whose last round is `last`,
        written over `last`; advances `buffer` in place. With the whole period in one round,
        pass delta as last too: rest is then u exactly."""
        torch.add(delta, buffer, alpha=self.momentum, out=buffer)
        if self.nesterov:  # rest = -lr * (delta + momentum * buf - (delta - last))
            return last.add_(buffer, alpha=self.momentum).mul_(-self.lr)
        return last.sub_(delta).add_(buffer).mul_(-self.lr)

    @classmethod
    def of_run(cls, cfg: Config) -> OuterOptimizer:
        """syncer.outer_optimizer of `cfg`, its momentum resolved (Config.outer_momentum)."""
        settings = cfg.syncer.outer_optimizer
        return cls(settings.lr, cfg.outer_momentum(), settings.nesterov)
