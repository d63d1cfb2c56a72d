"""When each unit of the fleet is down, the same for every mode compared.

The units are the fleet's slices: M learners of S slices each (slices_per_learner; S = 1: a
learner is one unit), the same slices in every mode, so unit u is slice u mod S of learner
u // S. A unit of n chips fails when any of its chips does: with
chip failures exponential of mean MTBF, the unit's are exponential of mean MTBF / n, counted
while it is up. A failed unit is down for its repair time (fixed, or lognormal around the given
median), which covers replacing the hardware and restarting its processes; then its clock runs
again. Each unit draws from its own seeded stream, so a unit's outages do not depend on the
mode or on the other units, and the same seed gives the same outages.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Iterator

from diloco.planner.inputs import PlanInputs


@dataclass(frozen=True)
class Outage:
    unit: int
    start: float  # seconds into the run
    end: float


@dataclass(frozen=True)
class FleetChange:
    """A unit going down or coming back: the events every mode reacts to."""
    at: float
    up: bool  # False: it failed; True: it is repaired
    unit: int


@dataclass(frozen=True)
class FailureModel:
    units: int
    unit_mtbf_seconds: float  # inf: no random failures
    repair_seconds: float  # fixed, or the lognormal's median
    repair_sigma: float | None  # None: fixed repair time
    injected: tuple[Outage, ...]  # chosen failures, each with its repair
    seed: int

    @classmethod
    def from_inputs(cls, inputs: PlanInputs) -> FailureModel:
        repair = inputs.repair_minutes * 60
        mtbf = inputs.chip_mtbf_hours * 3600 / inputs.slice_chips if inputs.chip_mtbf_hours else math.inf
        s = inputs.slices_per_learner
        injected = tuple(sorted(
            (Outage(f.learner * s + k, f.at_seconds,
                    f.at_seconds + (repair if f.repair_minutes is None else f.repair_minutes * 60))
             for f in inputs.failures for k in (range(s) if f.slice is None else (f.slice,))),
            key=lambda o: o.start))
        sigma = inputs.repair_sigma if inputs.repair_distribution == "lognormal" else None
        return cls(inputs.num_slices, mtbf, repair, sigma, injected, inputs.seed)

    def outages(self, unit: int) -> Iterator[Outage]:
        """The unit's outages in time order, endless unless no random failures are drawn: the
        random ones merged with the injected ones (an outage that begins while the unit is
        already down is dropped)."""
        chosen = (o for o in self.injected if o.unit == unit)
        merged = heapq.merge(self._random(unit), chosen, key=lambda o: o.start)
        down_until = -math.inf
        for outage in merged:
            if outage.start >= down_until:
                down_until = outage.end
                yield outage

    def changes(self) -> Iterator[FleetChange]:
        """Every unit's failures and repairs, in time order."""
        return heapq.merge(*(self._changes(unit) for unit in range(self.units)),
                           key=lambda c: (c.at, c.up, c.unit))

    def _changes(self, unit: int) -> Iterator[FleetChange]:
        for outage in self.outages(unit):
            yield FleetChange(outage.start, False, unit)
            yield FleetChange(outage.end, True, unit)

    def _random(self, unit: int) -> Iterator[Outage]:
        if math.isinf(self.unit_mtbf_seconds):
            return
        rng = random.Random(f"{self.seed}/{unit}")
        now = 0.0
        while True:
            start = now + rng.expovariate(1.0 / self.unit_mtbf_seconds)
            now = start + self._repair(rng)
            yield Outage(unit, start, now)

    def _repair(self, rng: random.Random) -> float:
        if self.repair_sigma is None or self.repair_seconds == 0:
            return self.repair_seconds
        return rng.lognormvariate(math.log(self.repair_seconds), self.repair_sigma)
