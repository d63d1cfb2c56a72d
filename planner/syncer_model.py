"""The syncer side of a Decoupled DiLoCo plan: one real ShardCore in virtual time, the pulls
waiting for its rounds, and the shards' outages.

The core decides what it does with each push, when each round closes and the versions (see
planner/diloco.py); this keeps which learner's pull each closed round answers, when (the
round's close takes the fragment's parameters at the syncer's round-close throughput), and
fails the pushes and pulls of a shard that is down.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from diloco.learner.sync.shard_errors import RETRY_MAX_SECONDS
from diloco.planner.events import EventQueue, VirtualClock
from diloco.planner.inputs import PlanInputs
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import Config
from diloco.services.contract.payload import describe, iter_chunks
from diloco.services.contract.wire import pb
from diloco.syncer.core import PushOutcome, ShardCore
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import ClosedRound

FP32 = get_codec("fp32")
FRAGMENT_NUMEL = 1  # decisions do not depend on the tensors' size: the cores see one element


class Pulling(Protocol):
    """What the syncer needs of a learner to answer its pulls."""
    index: int
    id: str
    life: int


@dataclass(frozen=True)
class Waiter:
    """A learner's pull for the round its contribution counts in."""
    learner: int
    life: int
    base_version: int
    version: int  # the version that answers it
    asked_at: float  # when the pull reached the syncer


@dataclass(frozen=True)
class Answer:
    """A pull's answer leaving the syncer: the round's version, or (applied False) a failed sync."""
    version: int
    applied: bool
    ready: float  # when it leaves the syncer
    versions: int  # past the learner's base version


# answer(learner, fragment id, answer): the learner side sends it down the learner's link.
Answerer = Callable[[Pulling, int, Answer], None]


class SyncerModel:
    def __init__(self, inputs: PlanInputs, cfg: Config, clock: VirtualClock, queue: EventQueue,
                 learners: list, answer: Answerer, close_seconds: float):
        self.inputs, self.clock, self.queue = inputs, clock, queue
        self.learners = learners
        self.answer = answer
        self.close_seconds = close_seconds
        self.core = ShardCore(cfg, 0, clock=clock, wall_clock=clock)
        self.waiters: dict[int, list[Waiter]] = defaultdict(list)
        self.closed: list[tuple[int, ClosedRound]] = []
        self.core.round_listeners.append(lambda fid, closed: self.closed.append((fid, closed)))
        self.contributions: Counter[tuple[int, int]] = Counter()  # (fragment, round): pushes merged
        self.staleness: Counter[int] = Counter()
        self.refused_stale = 0
        zeros = FP32.encode(torch.zeros(FRAGMENT_NUMEL), inputs.sync.codec_block_size)
        self.payload = describe(FP32, FRAGMENT_NUMEL, zeros, inputs.sync.codec_block_size)
        self.chunks = list(iter_chunks(zeros))

    def seed(self, learner: Pulling, fragment_ids: list[int]) -> None:
        for fid in fragment_ids:
            header = pb.PushHeader(learner_id=learner.id, incarnation=1, fragment_id=fid,
                                   kind=pb.PUSH_KIND_SEED, base_version=0, payload=self.payload)
            self.core.push(header, self.chunks)

    def push(self, learner: Pulling, header: pb.PushHeader, uplink_latency: float,
             transfer_seconds: float) -> PushOutcome | None:
        """A push reaching the syncer: the core's outcome, or None when the sync failed (its
        shard is down, or back but not yet rejoined: the learner's next heartbeat does it; or
        the core refused it). A merged push's pull waits for its round; a stale one is
        answered by the caller with the current value."""
        fid = header.fragment_id
        if self.shard_down(fid % self.inputs.shards, self.clock.now - self.inputs.heartbeat_seconds):
            return None
        try:
            outcome = self.core.push(header, self.chunks, transfer_seconds)
        except Refusal:
            return None
        if outcome.result == pb.PUSH_RESULT_REFUSED_STALE:
            self.refused_stale += 1
            return outcome
        self.staleness[outcome.staleness] += 1
        # The push's answer goes back and the pull comes out: a round trip before the syncer has
        # the pull (one latency each way, as the local cluster's links wait on every call).
        asked_at = self.clock.now + 2 * uplink_latency
        self.waiters[fid].append(Waiter(learner.index, learner.life, header.base_version, outcome.round, asked_at))
        self.answer_closed_rounds()
        self.contributions[fid, outcome.round] += 1
        if self.contributions[fid, outcome.round] == self.inputs.syncer.quorum:
            self._tick_after_grace(fid, outcome.round)
        close_by = self.core.fragments[fid].round.close_by
        if close_by > self.clock.now and math.isfinite(close_by):  # a contributor's deadline (syncer/grace.py)
            self.queue.at(close_by + 1e-9, self.tick)
        return outcome

    def _tick_after_grace(self, fid: int, round_number: int) -> None:
        """Ticks when quorum and grace may close the round, again while it stays open (an
        adaptive grace window may have grown)."""
        def tick() -> None:
            self.tick()
            if self.core.fragments[fid].version < round_number:
                self._tick_after_grace(fid, round_number)
        self.queue.at(self.clock.now + self.core.fragments[fid].grace.seconds() + 1e-9, tick)

    def tick(self) -> None:
        self.core.tick()
        self.answer_closed_rounds()

    def answer_closed_rounds(self) -> None:
        """Each round the core closed answers the pulls waiting for it, once the syncer has
        computed it (round-close throughput)."""
        closed, self.closed = self.closed, []
        for fid, round_ in closed:
            ready = self.clock.now + self.close_seconds
            waiting = self.waiters[fid]
            self.waiters[fid] = [w for w in waiting if w.version > round_.round]
            self.contributions.pop((fid, round_.round), None)
            for waiter in waiting:
                learner = self.learners[waiter.learner]
                if waiter.version <= round_.round and learner.life == waiter.life:
                    self.answer(learner, fid, Answer(round_.round, True, max(ready, waiter.asked_at),
                                                     round_.round - waiter.base_version))

    def shard_down(self, shard: int, at: float) -> float | None:
        """When `shard` serves again, if it is down at `at` (or after `at`, until now)."""
        return next((o.at_seconds + o.seconds for o in self.inputs.shard_outages if o.shard == shard
                     and o.at_seconds <= self.clock.now and at < o.at_seconds + o.seconds), None)

    def every_shard_up(self, at: float) -> float:
        """When a learner starting at `at` has joined every shard: one that is down (now, or by
        the time another is back) is retried until it is, a try every RETRY_MAX_SECONDS by then."""
        while (back := max((o.at_seconds + o.seconds for o in self.inputs.shard_outages
                            if o.at_seconds <= at < o.at_seconds + o.seconds), default=None)) is not None:
            at = back + RETRY_MAX_SECONDS / 2
        return at

    def shard_failed(self, shard: int) -> None:
        """The pulls waiting on the shard's fragments fail: those syncs are skipped (their
        contributions are merged all the same, and the next pull brings them)."""
        for fid in [fid for fid in self.waiters if fid % self.inputs.shards == shard]:
            for waiter in self.waiters.pop(fid):
                learner = self.learners[waiter.learner]
                if learner.life == waiter.life:
                    self.answer(learner, fid, Answer(waiter.base_version, False, self.clock.now, 0))

    def learner_statuses(self) -> list[pb.LearnerStatus]:
        """The Status reply's learners, as a rejoining learner reads them to take its phase."""
        return [pb.LearnerStatus(learner_id=l.id, alive=l.alive, last_step=l.step, sync_step=l.sync_step,
                                 seconds_since_heartbeat=l.seconds_since_heartbeat, step_seconds=l.step_seconds)
                for l in self.core.status().learners]
