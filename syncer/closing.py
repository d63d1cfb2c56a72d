"""Closing rounds and writing snapshots: when a fragment's open round is due to close (every
learner it waits for has contributed, or quorum and grace), the close made durable before it
is applied, and the fragment's whole state written once its log has grown enough.
"""
from __future__ import annotations

import threading
from typing import Callable

from diloco.services.contract.config import Config
from diloco.syncer.counters import Counters
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.journal import Journal, LoggedClose
from diloco.syncer.membership import Membership
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import ClosedRound

RoundListener = Callable[[int, ClosedRound], None]


class RoundCloser:
    def __init__(self, cfg: Config, membership: Membership, journal: Journal, counters: Counters,
                 listeners: list[RoundListener], clock: Callable[[], float], wall_clock: Callable[[], float]):
        self.wait_for_all = cfg.syncer.wait_for_all
        self.membership, self.journal, self.counters = membership, journal, counters
        self.listeners = listeners  # told of every round closed, under the fragment's lock
        self.clock, self.wall_clock = clock, wall_clock
        # One round close's arithmetic at a time: each already uses every core (torch's
        # threads), and the temporaries of closes on several threads at once would add up.
        # Hashing the new value needs none, so the next close starts during it.
        self._arithmetic = threading.Lock()

    def tick(self, states: list[FragmentState]) -> list[int]:
        """Closes every round that is due by time alone (grace passed, leases expired), and
        writes the fragments' full state where it is due. Returns the ids of the fragments
        that got a new version."""
        self.membership.expire_leases(self.clock())  # counted at every tick, open rounds or not
        closed = []
        for state in states:
            with state.lock:
                if self.close_if_due(state):
                    closed.append(state.id)
                if state.snapshot_due():
                    self._write_snapshot(state)
        return closed

    def close_if_due(self, state: FragmentState) -> bool:
        """Called with state.lock held."""
        if state.failure is not None:
            return False
        if state.round.count == 0:  # most fragments at a tick
            return False
        started = self.clock()
        # Whom a round waits for: the live learners that had joined when it opened, or with
        # wait_for_all (synchronous data parallel) every learner still in the run, also while
        # it is down.
        live_ids = (self.membership.member_ids() if self.wait_for_all
                    else self.membership.awaited_ids(started, state.round.first_at))
        if self.wait_for_all:
            reason = state.round.synchronous_close_reason(live_ids, self.membership.departed_ids())
        else:
            reason = state.round.close_reason(live_ids, started, state.grace.seconds(),
                                              self.membership.member_ids(), self.membership.departed_ids(),
                                              self.membership.waiting_elsewhere(state.id))
        if reason is None:
            return False
        round_ = state.round
        run_ids = self.membership.member_ids() | self.membership.departed_ids()
        closed = round_.closing(reason, live_ids, run_ids, started, self.wall_clock())
        try:
            self.journal.close_round(state.id, LoggedClose(closed, state.committed.state_hash))
        except Refusal:  # a disk that cannot take it (logged once): the round stays open, the next push or tick retries
            return False
        state.close(closed, arithmetic=self._arithmetic)
        state.observe_close(round_, self.clock() - started)
        self.counters.add(f"rounds.{reason}")
        for listener in self.listeners:
            listener(state.id, closed)
        return True

    def _write_snapshot(self, state: FragmentState) -> None:
        """Called with state.lock held."""
        try:
            self.journal.commit(state.committed)
        except Refusal:  # a disk that cannot take it (logged once): the log still holds every round, the next tick retries
            return
        state.snapshot_written()
        self.counters.add("snapshots")
