"""A fragment's open round: the contributions admitted since the last version, kept encoded
until the round closes, and the bookkeeping that decides when it closes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diloco.services.contract.config import SyncerConfig
from diloco.services.contract.payload import decode_payload
from diloco.services.contract.wire import pb
from diloco.syncer.merge import RoundAccumulator
from diloco.syncer.snapshot import ClosedRound, ContributionKey


@dataclass(frozen=True)
class PendingContribution:
    """An admitted outer gradient as it arrived: decoded only when its round closes."""
    header: pb.PayloadHeader
    chunks: tuple[bytes, ...]  # the payload as received
    weight: float
    tokens: int  # c_tokens
    final: bool = False  # the learner's last contribution of the fragment


class OpenRound:
    """What arrived since the last version. Contributions are kept encoded (an eighth of their
    fp32 size in int4) and merged when the round closes, so a push is acknowledged without
    decoding it."""

    def __init__(self, number: int, numel: int, rules: SyncerConfig):
        self.number = number  # closing it produces version `number`
        self.numel, self.merge, self.quorum = numel, rules.merge, rules.quorum
        self.contributions: dict[ContributionKey, PendingContribution] = {}
        self.contributors: set[str] = set()
        # Who counts towards the quorum: learners with a fresh push (based on the last version),
        # and those with a stale one until its deadline (syncer/grace.py). A push that missed
        # the round before by a moment opens this one a sync period before the others push
        # the fragment again; counted then, it would close this round before one of them is
        # in, who would miss it in turn (bench/history.md). Within its deadline it counts, so
        # that with K = 1, where pushes are stale because others' rounds closed meanwhile,
        # each still closes a round of its own.
        self.fresh_contributors: set[str] = set()
        self.stale_until: dict[str, float] = {}
        self.first_at: float | None = None
        self.fresh_first_at: float | None = None  # the round's own timing starts at its first fresh push
        self.quorum_at: float | None = None  # when K learners counted
        self.transfer_seconds = 0.0  # summed over contributions
        self._fresh_close_by = math.inf  # the earliest of its fresh contributors' deadlines (syncer/grace.py)

    @property
    def count(self) -> int:
        return len(self.contributions)

    @property
    def quorum_seconds(self) -> float:
        """From the first fresh push (the first push, if the quorum came before one) to the quorum."""
        if self.quorum_at is None:
            return 0.0
        fresh = self.fresh_first_at
        return self.quorum_at - (fresh if fresh is not None and fresh <= self.quorum_at else self.first_at)

    @property
    def mean_transfer_seconds(self) -> float:
        return self.transfer_seconds / self.count if self.count else 0.0

    def admit(self, key: ContributionKey, contribution: PendingContribution, now: float,
              transfer_seconds: float, close_by: float = math.inf) -> None:
        self.contributions[key] = contribution
        self.contributors.add(key.learner_id)
        self.transfer_seconds += transfer_seconds
        if self.first_at is None:
            self.first_at = now
        if key.base_version == self.number - 1:
            self.fresh_contributors.add(key.learner_id)
            self._fresh_close_by = min(self._fresh_close_by, close_by)
            if self.fresh_first_at is None:
                self.fresh_first_at = now
        else:
            self.stale_until[key.learner_id] = close_by
        if self.quorum_at is None and len(self.counted(now)) >= self.quorum:
            self.quorum_at = now

    @property
    def close_by(self) -> float:
        """When the round closes at the latest once it has its quorum: the earliest deadline of
        its fresh contributors and of the stale ones that counted when the quorum came."""
        if self.quorum_at is None:
            return self._fresh_close_by
        return min([self._fresh_close_by, *(until for until in self.stale_until.values() if until >= self.quorum_at)])

    def counted(self, now: float) -> set[str]:
        """The learners that count towards the quorum at `now`."""
        return self.fresh_contributors | {i for i, until in self.stale_until.items() if until >= now}

    def close_reason(self, live_ids: frozenset[str], now: float, grace_seconds: float,
                     member_ids: frozenset[str] = frozenset(), departed_ids: frozenset[str] = frozenset(),
                     waiting_ids: frozenset[str] = frozenset()) -> str | None:
        """"all" once every live learner has contributed; "others_waiting" once every live
        learner has contributed or waits elsewhere (`waiting_ids`: for another fragment's
        result, which may be for a round that waits for this one's contributors, or for its
        island to regroup; its next push of this fragment comes after that wait); "quorum_grace" once at least K
        have and the grace window has passed since the K-th, or a contributor's deadline has
        come (syncer/grace.py); "all_left" once every learner
        that joined has left the run and the contributors with them (nobody is left to add to
        the round: its contributions would never be merged). With nobody live (say, just
        after a shard restart, before learners rejoin) only these two can close."""
        if self.count == 0:
            return None
        if live_ids and live_ids <= self.contributors:
            return "all"
        if live_ids and live_ids <= self.contributors | waiting_ids:
            return "others_waiting"
        if self.quorum_at is not None and (now - self.quorum_at >= grace_seconds or now >= self.close_by):
            return "quorum_grace"
        if not member_ids and departed_ids and self.contributors <= departed_ids:
            return "all_left"
        return None

    def synchronous_close_reason(self, member_ids: frozenset[str], departed_ids: frozenset[str]) -> str | None:
        """wait_for_all (synchronous data parallel): "all" once every learner still in the run,
        down or not, has contributed and, counting those that already left, at least K have
        (so the first round waits for learners that have not joined yet)."""
        contributors = self.contributors
        if member_ids <= contributors and len(contributors | departed_ids) >= self.quorum and self.count > 0:
            return "all"
        return None

    def closing(self, reason: str, live_ids: frozenset[str], run_ids: frozenset[str], now: float,
                unix_now: float) -> ClosedRound:
        """The decision to close this round for `reason`: with the round's logged
        contributions, all FragmentState.close needs. Changes nothing. An ordinary
        contribution's share is of the live learners; a last one's of every learner of the
        run (`run_ids`, with those that left), so that the last contributions add up to the
        average of the learners' final models however their learners' ends are spread."""
        finishing = {key.learner_id for key, c in self.contributions.items() if c.final}
        ordinary = self.contributors - finishing
        return ClosedRound(self.number, reason, len(self.contributors), unix_now, now - self.first_at,
                           share=len(ordinary) / len(live_ids | ordinary) if ordinary else 0.0,
                           final_share=len(finishing) / len(run_ids | self.contributors))

    def merged(self, final: bool = False) -> torch.Tensor:
        """The merged outer gradient of the round's ordinary contributions (syncer.merge), or
        (`final`) the weighted mean of its learners' last ones. Contributions are folded in key
        order, not arrival order, so a round rebuilt from the journal after a restart merges
        to the same bits."""
        accumulator = RoundAccumulator(self.numel, "mean" if final else self.merge)
        chosen = {key: c for key, c in self.contributions.items() if c.final == final}
        total = math.fsum(c.weight for c in chosen.values())
        if total == 0:  # every weight decayed to nothing
            return torch.zeros(self.numel)
        for key in sorted(chosen):
            contribution = chosen[key]
            delta = decode_payload(contribution.header, b"".join(contribution.chunks), out=accumulator.scratch())
            accumulator.add(delta, contribution.weight / total, float(torch.linalg.vector_norm(delta)))
        return accumulator.merged()
