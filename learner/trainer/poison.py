"""Fault injection for tests and `diloco sim --chaos-poison`: a learner whose model goes bad at
one step, as a learning rate that blew up, an fp16 overflow or flipped memory bits make it.

    scale    every parameter times 1000 (finite, enormous: the shards refuse its pushes as outliers)
    nan      one value NaN (it spreads through the next steps; the learner never pushes it)
    bitflip  the top exponent bit flipped in 16 random fp32 values (silent data corruption:
             each grows by a factor of 2^128 or shrinks to nearly 0), which its next pushes carry

What the run does about it: docs/reliability.md, "A diverged learner".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

KINDS = ("scale", "nan", "bitflip")
SCALE = 1000.0
FLIPPED_VALUES = 16
TOP_EXPONENT_BIT = 1 << 30  # of an IEEE fp32 value


@dataclass(frozen=True)
class Poison:
    step: int  # applied after this inner step (1-based: the learner's step count)
    kind: str

    @classmethod
    def parse(cls, text: str) -> Poison:
        """STEP:KIND, e.g. 100:scale; ValueError naming what is wrong."""
        step, sep, kind = text.partition(":")
        if not sep or not step.isdigit() or int(step) < 1 or kind not in KINDS:
            raise ValueError(f"{text!r}: expected STEP:KIND with STEP >= 1 and KIND one of {', '.join(KINDS)}")
        return cls(int(step), kind)

    @torch.no_grad()
    def apply(self, params: Iterable[torch.Tensor], seed: int = 0) -> None:
        params = list(params)
        if self.kind == "scale":
            for p in params:
                p.mul_(SCALE)
        elif self.kind == "nan":
            params[0].view(-1)[0] = float("nan")
        else:
            floats = [p for p in params if p.dtype == torch.float32]
            if not floats:
                raise ValueError("bitflip poisons fp32 parameters; the model has none")
            generator = torch.Generator().manual_seed(seed)
            for _ in range(FLIPPED_VALUES):
                p = floats[int(torch.randint(len(floats), (1,), generator=generator))].view(-1)
                i = int(torch.randint(p.numel(), (1,), generator=generator))
                p[i:i + 1].view(torch.int32).bitwise_xor_(TOP_EXPONENT_BIT)
