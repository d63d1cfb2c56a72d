"""Who is training: learners, their incarnations and leases, as one shard sees them.

Each shard keeps its own table (docs/protocol.md, Leases), so no shard depends on another for
liveness. A learner joins with a fresh incarnation per process start, renews its lease with
every heartbeat or push, and is dead once the lease expires, or at once when the Attend call it
holds open ends without a Leave (its process died): it stops counting towards "every live
learner has contributed". It must then join again, which is also where it learns what it
missed.

The table is deliberately not persisted. After a shard restart every learner's next heartbeat
or push gets FAILED_PRECONDITION ("not joined") and it rejoins, so the table rebuilds itself
within one heartbeat interval, and a learner that died while the shard was down is never
mistaken for a live one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from diloco.syncer.counters import Counters
from diloco.syncer.refusal import Refusal


@dataclass(frozen=True)
class HeartbeatReport:
    """What a heartbeat says about the learner's training (see HeartbeatRequest)."""
    step: int = 0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    held_versions: dict[int, int] = field(default_factory=dict)  # fragment id -> version held
    sync_step: int = 0
    tokens: int = 0
    waiting_for: int | None = None  # the fragment whose result its training waits for
    standing_still: bool = False  # its training stands still (an island regrouping)
    skipped: frozenset[int] = frozenset()  # fragments whose open round it will not contribute to


@dataclass
class Learner:
    id: str
    region: str
    incarnation: int
    last_seen: float  # last join, heartbeat or push, on the core's clock
    lease_expires: float
    # When this shard learnt where the learner is on the sync schedule: at its join when no
    # other live learner had trained yet (it starts on its own step), else at its first
    # heartbeat since (it took the others' phase, which a push around its join says nothing of).
    placed_at: float | None = None
    left: bool = False
    expired: bool = False  # set (and counted) the first time the lease is seen expired
    step: int = 0
    sync_step: int = 0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    tokens: int = 0  # trained, as last reported
    heartbeat_at: float = 0.0  # when step, sync_step and tokens were reported (a push renews last_seen, not this)
    held_versions: dict[int, int] = field(default_factory=dict)  # fragment id -> version held
    waiting_for: int | None = None  # as last reported
    standing_still: bool = False  # as last reported
    skipped: frozenset[int] = frozenset()  # as last reported
    attendance: int = 0  # its Attend call now open (0: none since it joined)
    # Its pushes whose payload is arriving: each is proof of life while it lasts, since on a
    # slow link a heartbeat waits behind a push's bytes longer than a lease.
    receiving: int = 0

    @property
    def alive(self) -> bool:
        return not (self.left or self.expired)


class Membership:
    def __init__(self, learner_ids: Iterable[str], lease_seconds: float, counters: Counters):
        self._allowed = tuple(learner_ids)
        self._lease_seconds = lease_seconds
        self._counters = counters
        self._learners: dict[str, Learner] = {}
        self._attendances = 0  # Attend calls numbered
        self._lock = threading.Lock()
        # Every round close and heartbeat asks who is live or in the run: the answers are kept
        # until a join, a leave or the earliest lease end (renewals only move leases later).
        self._live: frozenset[str] | None = None
        self._live_until = -math.inf
        self._roster: tuple[frozenset[str], frozenset[str]] | None = None  # (members, departed)

    def check_allowed(self, learner_id: str) -> None:
        if learner_id not in self._allowed:
            raise Refusal("unknown_learner_id", "PERMISSION_DENIED",
                          f"learner id {learner_id!r} is not in the cluster config "
                          f"(learners: {', '.join(self._allowed)})")

    def join(self, learner_id: str, incarnation: int, region: str, now: float) -> None:
        """A new process (higher incarnation) replaces the old one; the same incarnation may
        rejoin (after its lease expired, or a shard restart); an older one is a zombie."""
        self.check_allowed(learner_id)
        with self._lock:
            current = self._learners.get(learner_id)
            if current is not None and incarnation < current.incarnation:
                raise Refusal("old_incarnation", "FAILED_PRECONDITION",
                              f"learner {learner_id!r} incarnation {incarnation} is older than its "
                              f"joined incarnation {current.incarnation}")
            others_training = any(l.alive and l.step > 0 for i, l in self._learners.items() if i != learner_id)
            self._learners[learner_id] = Learner(learner_id, region, incarnation, now, now + self._lease_seconds,
                                                 placed_at=None if others_training else now)
            self._live = self._roster = None
        self._counters.add("learners.rejoined" if current is not None else "learners.joined")

    def authenticate(self, learner_id: str, incarnation: int, now: float) -> None:
        """Checks that this is the joined, live incarnation and renews its lease: any call a
        learner makes is proof of life."""
        with self._lock:
            learner = self._identify(learner_id, incarnation, now)
            if not learner.alive:
                raise Refusal("not_live", "FAILED_PRECONDITION",
                              f"learner {learner_id!r} {'has left' if learner.left else 'let its lease expire'}"
                              f" (last seen {now - learner.last_seen:.1f}s ago): join again")
            learner.last_seen = now
            learner.lease_expires = now + self._lease_seconds

    @contextlib.contextmanager
    def receiving(self, learner_id: str, incarnation: int, clock: Callable[[], float]) -> Iterator[None]:
        """A push of this live incarnation (authenticated) whose payload is arriving: its lease
        does not run out meanwhile, and runs from the push's end."""
        with self._lock:
            learner = self._identify(learner_id, incarnation, clock())
            learner.receiving += 1
        try:
            yield
        finally:
            with self._lock:
                learner.receiving -= 1
                learner.lease_expires = max(learner.lease_expires, clock() + self._lease_seconds)

    def heartbeat(self, learner_id: str, incarnation: int, now: float, report: HeartbeatReport) -> None:
        self.authenticate(learner_id, incarnation, now)
        with self._lock:
            learner = self._learners[learner_id]
            learner.step, learner.step_seconds, learner.sync_step = report.step, report.step_seconds, report.sync_step
            learner.tokens_per_second, learner.tokens, learner.heartbeat_at = report.tokens_per_second, report.tokens, now
            learner.held_versions = dict(report.held_versions)
            learner.waiting_for, learner.standing_still = report.waiting_for, report.standing_still
            learner.skipped = report.skipped
            if learner.placed_at is None:
                learner.placed_at = now

    def attend(self, learner_id: str, incarnation: int, now: float) -> int:
        """This live incarnation holds an Attend call open: the call's number, which replaces
        any earlier one's."""
        self.authenticate(learner_id, incarnation, now)
        with self._lock:
            self._attendances += 1
            self._learners[learner_id].attendance = self._attendances
            return self._attendances

    def absent(self, learner_id: str, incarnation: int, attendance: int, now: float) -> None:
        """Attend call `attendance` ended without a Leave: the learner's process died, or its
        connection did. Its lease ends now, as if it had expired; a learner still alive joins
        again. A call replaced by a later one, or from before a join, changes nothing."""
        with self._lock:
            learner = self._learners.get(learner_id)
            if (learner is None or learner.incarnation != incarnation or learner.attendance != attendance
                    or not learner.alive):
                return
            learner.expired = True
            learner.lease_expires = now
            self._live = None
        self._counters.add("learners.disconnected")

    def record(self, learner_id: str, incarnation: int) -> Learner | None:
        """A copy of this incarnation's record as last reported, None if it has not joined;
        renews nothing."""
        with self._lock:
            learner = self._learners.get(learner_id)
            if learner is None or learner.incarnation != incarnation:
                return None
            return dataclasses.replace(learner, held_versions=dict(learner.held_versions))

    def leave(self, learner_id: str, incarnation: int, now: float) -> None:
        with self._lock:
            learner = self._identify(learner_id, incarnation, now)
            if learner.left:
                return
            learner.left = True
            self._live = self._roster = None
        self._counters.add("learners.left")

    def awaited_ids(self, now: float, round_opened_at: float | None) -> frozenset[str]:
        """Whom a round that opened at `round_opened_at` waits for: the live learners this
        shard had placed on the sync schedule by then (Learner.placed_at). One that (re)joined a
        run in progress takes the others' phase, and a round they opened around its join is
        most likely one whose turn it passed while it pulled and restored: its next push of the
        fragment comes a whole period later, and waiting for it would hold the round, and
        every learner waiting for its result, that long. A push of it into the round still
        counts. Every live learner when none was placed by then (the shard restarted, and
        replayed the round before anyone rejoined)."""
        with self._lock:
            live = self._refresh_all(now)
            if round_opened_at is None:  # no round open: every live learner
                return live
            placed = frozenset(i for i in live if (at := self._learners[i].placed_at) is not None
                               and at <= round_opened_at)
            return placed or live

    def expire_leases(self, now: float) -> None:
        """Marks every learner whose lease has ended by `now` (counted as learners.expired)."""
        with self._lock:
            self._refresh_all(now)

    def waiting_elsewhere(self, fragment_id: int) -> frozenset[str]:
        """Live learners whose last heartbeat said their training waits for another fragment's
        result, or stands still (an island regrouping), or that they skip this fragment's open
        round (their push for it was refused or never sent): none of them pushes this fragment
        before that ends."""
        with self._lock:
            return frozenset(l.id for l in self._learners.values() if l.alive and (
                l.standing_still or fragment_id in l.skipped
                or (l.waiting_for is not None and l.waiting_for != fragment_id)))

    def member_ids(self) -> frozenset[str]:
        """Learners that joined and have not left, live or not: whom a synchronous round
        (wait_for_all) waits for."""
        with self._lock:
            return self._members_and_departed()[0]

    def departed_ids(self) -> frozenset[str]:
        """Learners that said goodbye (their budget spent, or a clean shutdown)."""
        with self._lock:
            return self._members_and_departed()[1]

    def _members_and_departed(self) -> tuple[frozenset[str], frozenset[str]]:
        if self._roster is None:
            learners = self._learners.values()
            self._roster = (frozenset(l.id for l in learners if not l.left),
                            frozenset(l.id for l in learners if l.left))
        return self._roster

    def _refresh_all(self, now: float) -> frozenset[str]:
        """Marks every learner whose lease has ended by `now`; the live ones' ids. No lease ends
        before the earliest one seen at the last count, so until then that count stands."""
        if self._live is None or now >= self._live_until:
            live = [learner for learner in self._learners.values() if self._refresh(learner, now).alive]
            self._live = frozenset(learner.id for learner in live)
            self._live_until = min((learner.lease_expires for learner in live), default=math.inf)
        return self._live

    def reported_tokens(self, now: float, budget: int) -> tuple[float, float]:
        """(every learner's tokens as reported, a live one's grown at its rate since, each at
        most `budget`; the live learners' tokens per second). Every heartbeat asks for this: it
        reads the records in place, where copies would cost more than the rest of a heartbeat."""
        with self._lock:
            self._refresh_all(now)
            learners = self._learners.values()
            heard = sum(min(budget, l.tokens + (l.tokens_per_second * (now - l.heartbeat_at)
                                                if l.alive and l.heartbeat_at else 0.0))
                        for l in learners)
            return heard, sum(l.tokens_per_second for l in learners if l.alive)

    def learners(self, now: float) -> list[Learner]:
        """Copies, in join order, for reporting."""
        with self._lock:
            return [dataclasses.replace(self._refresh(learner, now), held_versions=dict(learner.held_versions))
                    for learner in self._learners.values()]

    def _identify(self, learner_id: str, incarnation: int, now: float) -> Learner:
        self.check_allowed(learner_id)
        learner = self._learners.get(learner_id)
        if learner is None or incarnation > learner.incarnation:
            raise Refusal("not_joined", "FAILED_PRECONDITION",
                          f"learner {learner_id!r} incarnation {incarnation} has not joined this shard "
                          "(or the shard restarted): join again")
        if incarnation < learner.incarnation:
            raise Refusal("old_incarnation", "FAILED_PRECONDITION",
                          f"learner {learner_id!r} incarnation {incarnation} was replaced by "
                          f"incarnation {learner.incarnation}")
        return self._refresh(learner, now)

    def _refresh(self, learner: Learner, now: float) -> Learner:
        if not learner.alive or now < learner.lease_expires or learner.receiving:
            return learner
        learner.expired = True
        self._live = None
        self._counters.add("learners.expired")
        return learner
