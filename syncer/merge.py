"""Merging one round's outer gradients into one.

Each contribution is weighted by "quantity x quality", w = c_tokens * (c_tokens / c_steps):
learners that processed more tokens, and processed them faster per step, count more; a stale
contribution is down-weighted by stale_weight_decay ** staleness. Both numbers are the
learner's own claims: w is capped (syncer/claims.py), computed in float64, and the round's
weights are normalised to sum to 1 before they touch a float32 tensor, so no claim can
overflow the merge or drown the other contributions in rounding.

Two merges (config syncer.merge):
- "rda", radial-directional averaging (the default): the norm is the weighted mean of the
  norms, the direction the normalised weighted mean of the unit vectors. Nearly orthogonal
  outer gradients keep their size; a plain mean of M of them shrinks by about sqrt(M).
- "mean": the weighted mean.

Both are running sums over the round's contributions, folded in when the round closes
(open_round.OpenRound keeps them encoded until then).
"""
from __future__ import annotations

import math

import torch

METHODS = ("rda", "mean")


def contribution_weight(c_tokens: int, c_steps: int, staleness: int, stale_weight_decay: float,
                        max_weight: float = math.inf) -> float:
    return min(c_tokens * (c_tokens / c_steps), max_weight) * stale_weight_decay ** staleness


class RoundAccumulator:
    def __init__(self, numel: int, method: str):
        if method not in METHODS:
            raise ValueError(f"unknown merge {method!r}; valid: {', '.join(METHODS)}")
        self.numel, self.method = numel, method
        self._sum: torch.Tensor | None = None  # rda: sum of w * unit vector; mean: sum of w * delta
        self._weight = 0.0  # sum of w
        self._norm = 0.0  # rda: sum of w * |delta|
        self._scratch: torch.Tensor | None = None

    def scratch(self) -> torch.Tensor:
        """A buffer to decode the next outer gradient into before add(): one allocation for
        the round, which the first contribution's add() keeps as the running sum."""
        if self._scratch is None:
            self._scratch = torch.empty(self.numel)
        return self._scratch

    def add(self, delta: torch.Tensor, weight: float, norm: float) -> None:
        """Folds in one outer gradient with its weight (normalised: at most 1) and L2 norm.
        Takes `delta`: it may be overwritten or kept, so pass scratch() or a buffer of your own."""
        if self.method == "rda":
            # A zero outer gradient has no direction: it adds only its (zero) norm, which
            # pulls the merged norm down, as a learner that made no progress should.
            if norm > 0:  # divided first: weight / norm overflows float32 for a tiny norm
                self._fold(delta.div_(norm), weight)
            self._norm += weight * norm
        else:
            self._fold(delta, weight)
        self._weight += weight

    def _fold(self, term: torch.Tensor, weight: float) -> None:
        if self._sum is not None:
            self._sum.add_(term, alpha=weight)
            return
        # The first term becomes the sum in place: the values of adding it to zeros (only a
        # -0.0 keeps its sign), two passes over the fragment fewer (one-learner rounds are common).
        self._sum = term if weight == 1 else term.mul_(weight)
        if term is self._scratch:
            self._scratch = None

    def merged(self) -> torch.Tensor:
        """The running sum's own memory, scaled (call it once); zeros when nothing with a
        weight or a direction was added."""
        if self._sum is None or self._weight == 0:
            return torch.zeros(self.numel)
        if self.method == "mean":
            return self._sum.div_(self._weight)
        length = float(torch.linalg.vector_norm(self._sum))
        if length == 0:  # no contribution had a direction, or they cancelled exactly
            return torch.zeros(self.numel)
        return self._sum.mul_((self._norm / self._weight) / length)
