"""A Decoupled DiLoCo learner of S slices (replica groups, `slices_per_learner`) that trains on
without a failed one: an elastic island, as torchft's replica groups make one in a data centre.

- A training slice that fails leaves the island: the slices left pause to reconfigure
  (`island_reconfigure_seconds`) and lose the step in progress, then
  train on at the same step time on their share of the learner's batch; the learner's pushes
  carry the tokens trained, so the syncer's merge weighs them by what was trained. After a
  pause the learner syncs on at its own step count, a pause behind the others' schedule
  (with `island_rephase`, it takes its phase from them again as a rejoining learner does:
  planner/training.py).
- A repaired slice starts (`startup_seconds`), receives the learner's state from a peer slice in
  the data centre (STATE_BYTES_PER_PARAMETER per parameter at `island_gbps`) while the others
  train, and joins at the next step boundary, with another pause.
- The leader slice (the one that syncs with the shards and holds the sync's state, as the island
  is built: docs/reliability.md "Losing a replica group") fails: what that costs is
  `island_leader_loss`. `failover` (the learner as built): the lowest slice still training takes
  the lead in its running process; the learner loses what a failed learner loses (the steps
  since its checkpoint, the step in progress) and its Attend call, and its slices wait for the
  pause and for the new leader's restore (the pull of the updates since the checkpoint, a new
  incarnation's join, in phase: planner/restarts.py), with no repair and no start-up; the failed
  slice rejoins later as any repaired slice does. `learner_failure`: a learner failure, down
  until slice 0 is repaired.
- A failure that leaves no slice training is a learner failure, as for a learner of one slice:
  down until one of its slices (with `learner_failure`, slice 0) is repaired, then it starts,
  pulls the model from the syncer and rejoins, with every slice repaired by then.

This keeps one learner's slices, the share of the learner that trains over time, and the time
its other slices spend out of it and all of them paused; planner/restarts.py drives it from the
fleet's changes, and planner/training.py asks it when the learner's next step may start.
"""
from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass

from diloco.planner.events import VirtualClock
from diloco.planner.outcome import Ledger

# What a repaired slice receives from a peer: fp32 parameters, the inner optimizer's two
# moments (AdamW) and the fragments' global values the learner's outer steps start from.
STATE_BYTES_PER_PARAMETER = 16


class SliceFailed(enum.Enum):
    QUIET = "the learner goes on as it was (the slice was not training, or the learner is failing over)"
    RECONFIGURE = "a training slice left: the step in progress is lost, the next waits for the pause"
    LEADER_FAILED_OVER = "the leader slice left: another leads, the learner rolls back and restores"
    LEARNER_FAILED = "no slice of the learner is left to train, or its leader slice failed (no failover)"


@dataclass
class Outside:
    """A slice out of the island while its learner trains: down since `since`, then (once
    `repaired`) starting, receiving the state, waiting for a step boundary to join."""
    since: float
    repaired: float | None = None


class Island:
    def __init__(self, slices: int, clock: VirtualClock, ledger: Ledger, pause_seconds: float,
                 startup_seconds: float, transfer_seconds: float, fails_over: bool):
        self.slices = slices
        self.fails_over = fails_over  # losing the leader slice fails over (else: fails the learner)
        self.leader = 0  # the slice that syncs: without a failover, the slice the learner cannot lose
        self.clock, self.ledger = clock, ledger
        self.pause_seconds = pause_seconds
        self.startup_seconds = startup_seconds
        self.join_after = startup_seconds + transfer_seconds  # from its repair
        self.broken: set[int] = set()  # failed, not yet repaired
        self.training: set[int] = set()
        self.outside: dict[int, Outside] = {}  # only while the learner trains
        self.active = False  # the learner trains (its phases are booked whole otherwise)
        self.failing_over = False  # the slices left wait for the new leader's restore, a pause
        self.times, self.shares = [0.0], [0.0]  # the share of the learner training from each time on
        self.resume_at = 0.0  # no step starts before: a reconfiguration
        self.ready = 0.0  # when the learner was last ready for its next step
        self.pause = (0.0, 0.0)  # the pause before the next step, booked as it elapses

    @property
    def share(self) -> float:
        return len(self.training) / self.slices

    @property
    def healthy(self) -> bool:
        """Whether the learner can start: any slice is up (without a failover: slice 0)."""
        return len(self.broken) < self.slices if self.fails_over else self.leader not in self.broken

    @property
    def standing_still(self) -> bool:
        """Whether the learner's training stands still now, in a reconfiguration's pause (its
        heartbeats say so)."""
        return self.active and self.clock.now < self.resume_at

    def share_seconds(self, start: float, end: float) -> float:
        """The learner's seconds from start to end, times the share of it that was training
        (exactly end - start for a learner of one slice)."""
        total = 0.0
        i = bisect.bisect_right(self.times, start) - 1
        while i < len(self.times) and self.times[i] < end:
            upto = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            total += (min(end, upto) - max(start, self.times[i])) * self.shares[i]
            i += 1
        return total

    # ---- the learner -----------------------------------------------------------------

    def started(self) -> None:
        """The learner trains (after its start and restore): every slice repaired by now trains;
        after a failover its slices are those that were left, and their wait ends."""
        now = self.clock.now
        if self.failing_over:
            self._settle_pause()
        else:
            self.active = True
            self.training = set(range(self.slices)) - self.broken
            self.outside = {k: Outside(now) for k in self.broken}
            self.resume_at = now
            self._share_changed()
        if self.leader not in self.training:  # a failover's learner restarted on other slices
            self.leader = min(self.training)
        self.failing_over = False
        self.ready = now
        self.pause = (now, now)

    def stopped(self) -> None:
        """The learner stops training (failed, finished, the run's end): from now its phase
        counts for all its slices."""
        if not self.active:
            return
        self._settle_pause()
        for k in self.outside:
            self._book_outside(k)
        self.active, self.failing_over, self.training, self.outside = False, False, set(), {}
        self._share_changed()

    def next_step_start(self, ready: float) -> float:
        """When the learner's next step starts, given when it is ready for it: slices whose
        state has arrived join now, and a pause (theirs, or a failure's) delays it."""
        now = self.clock.now
        self._settle_pause()
        joining = [k for k, out in self.outside.items()
                   if out.repaired is not None and out.repaired + self.join_after <= now]
        for k in joining:
            self._book_outside(k)
            del self.outside[k]
        if joining:
            self.training.update(joining)
            self._share_changed()
            self.resume_at = max(self.resume_at, ready + self.pause_seconds)
        start = max(ready, self.resume_at)
        self.ready, self.pause = ready, (ready, start)
        return start

    # ---- its slices ------------------------------------------------------------------

    def failed(self, k: int) -> SliceFailed:
        now = self.clock.now
        self.broken.add(k)
        if not self.active:
            return SliceFailed.QUIET if self.healthy else SliceFailed.LEARNER_FAILED
        if k in self.outside:  # failed again before it joined: its repair starts over
            self._book_outside(k)
            self.outside[k] = Outside(now)
            return SliceFailed.QUIET
        self._settle_pause()
        if not self.failing_over:
            self.pause = (self.pause[0], self.pause[0])  # the step after it is void: the learner reschedules
        self.training.discard(k)
        self.outside[k] = Outside(now)
        self._share_changed()
        if not self.training or (k == self.leader and not self.fails_over):
            return SliceFailed.LEARNER_FAILED
        self.resume_at = now + self.pause_seconds  # a failing-over learner's first step waits for it too
        if k == self.leader:
            self.leader = min(self.training)
            self.failing_over = True
            self.pause = (now, math.inf)  # booked as it elapses, until the learner trains again
            return SliceFailed.LEADER_FAILED_OVER
        return SliceFailed.QUIET if self.failing_over else SliceFailed.RECONFIGURE

    def repaired(self, k: int) -> None:
        self.broken.discard(k)
        if k in self.outside:
            self.outside[k].repaired = self.clock.now

    # ---- accounting --------------------------------------------------------------------

    def _share_changed(self) -> None:
        self.times.append(self.clock.now)
        self.shares.append(self.share)

    def _settle_pause(self) -> None:
        """Books the part of the pause that has elapsed (every training slice pauses)."""
        start, end = self.pause
        upto = min(self.clock.now, end)
        if upto > start:
            self.ledger.add("restore", (upto - start) * self.share)
            self.pause = (upto, end)

    def _book_outside(self, k: int) -> None:
        """Books slice k's time out of the island since it was last booked: down until its
        repair, then starting, then receiving the state and waiting to join (restore)."""
        now, out = self.clock.now, self.outside[k]
        repaired = math.inf if out.repaired is None else out.repaired
        started = repaired + self.startup_seconds
        for category, begin, end in (("down", out.since, repaired), ("startup", repaired, started),
                                     ("restore", started, math.inf)):
            seconds = min(now, end) - max(out.since, begin)
            if seconds > 0:
                self.ledger.add(category, seconds / self.slices)
        out.since = now
