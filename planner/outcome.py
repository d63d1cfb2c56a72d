"""What a simulated run produced, and the ledger every mode keeps it in.

Seconds are unit-seconds (one learner unit, or data-parallel slice, for one second): every unit
has the same chips, so shares of unit-seconds are shares of chip-seconds. Goodput and badput
follow services/contract/goodput.py, the definition `diloco sim` and Prometheus use.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from diloco.services.contract.goodput import Goodput, account, no_badput


class Ledger:
    """Provisioned, kept and badput seconds of a whole fleet, as a mode walks through its run."""

    def __init__(self):
        self.provisioned = 0.0
        self.kept = 0.0
        self.badput = no_badput()

    def add(self, category: str, seconds: float) -> None:
        self.badput[category] += seconds

    def goodput(self) -> Goodput:
        return account(self.provisioned, self.kept, self.badput)


class Uptime:
    """How long at least one unit was training, from the moments that changes."""

    def __init__(self):
        self.training_seconds = 0.0
        self._since: float | None = None

    def training(self, now: float, training: bool) -> None:
        if training and self._since is None:
            self._since = now
        elif not training and self._since is not None:
            self.training_seconds += now - self._since
            self._since = None

    def share(self, end: float) -> float:
        self.training(end, False)
        return self.training_seconds / end if end else 0.0


@dataclass(frozen=True)
class Bandwidth:
    """WAN traffic of the learners' links to the syncer, both directions."""
    mean_gbps: float  # per learner, over the run
    peak_gbps: float  # the busiest minute of any learner's link
    bytes_total: int
    bytes_up: int  # learners to the syncer
    bytes_down: int


@dataclass(frozen=True)
class SyncerFacts:
    """What the syncer's core reports at the end of a Decoupled DiLoCo run."""
    merged_contributions: int
    rounds_all: int  # closed because every live learner contributed
    rounds_quorum_grace: int  # closed on quorum after the grace window
    versions: int  # outer steps, summed over fragments
    refused_stale: int


@dataclass(frozen=True)
class PlanResult:
    mode: str
    chips: int
    learners: int
    seconds: float  # the run's wall time
    goodput: Goodput
    uptime: float  # share of the run with at least one unit training
    tokens: int  # kept: trained and not lost
    failure_free_tokens_per_second: float  # the same mode and fleet, never failing
    failures: int
    bandwidth: Bandwidth | None = None
    staleness: dict[str, int] = field(default_factory=dict)  # merged contributions by staleness, and "refused"
    syncer: SyncerFacts | None = None
    step_seconds: float | None = None  # data parallel: one global step
    slices: int = 1  # per learner unit (slices_per_learner)

    @property
    def label(self) -> str:
        return f"{self.mode} M={self.learners}" + (f" S={self.slices}" if self.slices > 1 else "")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def effective_share(self) -> float:
        """Tokens per second against the failure-free run of the same mode."""
        return self.tokens_per_second / self.failure_free_tokens_per_second

    def as_json(self) -> dict:
        body = dataclasses.asdict(self)
        body["goodput"] = {"share": self.goodput.share, "provisioned_seconds": self.goodput.provisioned_seconds,
                           "kept_seconds": self.goodput.kept_seconds,
                           "badput_seconds": dict(self.goodput.badput_seconds)}
        body.update(tokens_per_second=self.tokens_per_second, effective_share=self.effective_share)
        return body


def staleness_counts(merged: Counter[int], refused: int) -> dict[str, int]:
    counts = {str(staleness): merged[staleness] for staleness in sorted(merged)}
    counts["refused"] = refused
    return counts
