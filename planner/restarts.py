"""What the fleet's changes do to Decoupled DiLoCo learners in virtual time, and their (re)starts.

A slice failure pauses its learner's island, fails it over to another leader, or fails the
learner (planner/island.py says which); a failed learner is down until repaired, then its
process starts, pulls the model and rejoins in phase with the others; an island's new leader
pulls and rejoins the same way without a repair or a start-up. Each rejoin is a new
incarnation, and a learner's events of an earlier life are void (`life`). planner/training.py
trains a learner between these.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from diloco.planner.accounting import RunAccounts
from diloco.planner.events import EventQueue, VirtualClock
from diloco.planner.failures import FleetChange
from diloco.planner.inputs import PlanInputs
from diloco.planner.island import SliceFailed
from diloco.planner.learner_model import Learner
from diloco.planner.syncer_model import SyncerModel
from diloco.planner.training import Training


class Restarts:
    def __init__(self, inputs: PlanInputs, clock: VirtualClock, queue: EventQueue, learners: list[Learner],
                 syncer: SyncerModel, training: Training, accounts: RunAccounts,
                 changes: Iterator[FleetChange], manifest: Sequence[tuple[str, tuple[int, ...]]], snapshot_bytes: int):
        self.inputs, self.clock, self.queue, self.learners = inputs, clock, queue, learners
        self.syncer, self.core, self.training = syncer, syncer.core, training
        self.accounts, self.ledger = accounts, accounts.ledger
        self._changes = changes
        self.manifest = manifest
        self.snapshot_bytes = snapshot_bytes  # one fragment's whole value (fp32): a pull without a checkpoint

    def begin(self, fragment_ids: list[int]) -> None:
        """The run's start: the first learner joins and seeds the fragments, every learner's
        process starts, and the fleet's changes begin."""
        first = self.learners[0]
        self._join(first)
        self.syncer.seed(first, fragment_ids)
        for learner in self.learners:
            self.queue.at(learner.startup_seconds, lambda learner=learner: self._started(learner, 0, first=True))
        self._next_change()

    def _next_change(self) -> None:
        change = next(self._changes, None)
        if change is not None:
            self.queue.at(change.at, lambda: self._fleet_changed(change))

    def _fleet_changed(self, change: FleetChange) -> None:
        """A slice of a learner failed or is repaired (a learner of one slice: the learner)."""
        learner = self.learners[change.unit // self.inputs.slices_per_learner]
        island, k = learner.island, change.unit % self.inputs.slices_per_learner
        if learner.phase != "finished":
            if change.up:
                island.repaired(k)
            else:
                self.accounts.slice_failed(change.at)
                outcome = island.failed(k)
                if outcome is SliceFailed.LEARNER_FAILED:
                    self._failed(learner)
                elif outcome is SliceFailed.LEADER_FAILED_OVER:
                    self._failed_over(learner)
                elif outcome is SliceFailed.RECONFIGURE:
                    self._reconfigure(learner)
            if learner.phase == "down" and island.healthy:
                self._repaired(learner)
        self._next_change()

    def _reconfigure(self, learner: Learner) -> None:
        """A slice left the island: the step in progress is lost, and the next one waits for the
        pause (a learner waiting for a result pauses meanwhile)."""
        if learner.blocked_since is not None:
            return
        now = self.clock.now
        if now > learner.last_step_end:
            self.ledger.add("lost", learner.island.share_seconds(learner.last_step_end, now))
        learner.aborts += 1
        self.training.next_step(learner, max(now, learner.island.ready))

    def _failed(self, learner: Learner) -> None:
        """Down until it (with an island: a slice that can lead it) is repaired."""
        self._lose_progress(learner)
        learner.island.stopped()
        self.accounts.enter_phase(learner, "down")
        learner.life += 1
        self.accounts.training_changed()

    def _failed_over(self, learner: Learner) -> None:
        """Its island's leader slice failed and another took the lead in its running process:
        the learner loses what a failed one loses, and after the island's pause the new leader
        restores as a restarted learner does (below), with no repair and no start-up."""
        self._lose_progress(learner)
        self.accounts.enter_phase(learner, "failover")
        learner.life += 1
        life = learner.life
        self.queue.at(learner.island.resume_at, lambda: self._pull(learner, life))
        self.accounts.training_changed()

    def _lose_progress(self, learner: Learner) -> None:
        """A failure's loss: the steps since its last checkpoint (or those its fragments had not
        delivered) and the step in progress; its Attend call ends with its process."""
        now = self.clock.now
        if learner.training:
            if self.inputs.checkpoint_steps:  # the next life trains them again: its counts go back
                lost = learner.tokens - learner.checkpointed_tokens
                learner.steps, learner.tokens = learner.checkpointed_steps, learner.checkpointed_tokens
                self.accounts.lose(learner, learner.full_steps(lost) * learner.step_seconds, rolled_back=True)
            else:  # each fragment's steps not delivered to the syncer
                undelivered = sum(f.tokens_since_sync - learner.delivered_tokens[fid]
                                  for fid, f in learner.schedule.fragments.items())
                self.accounts.lose(learner,
                                   learner.full_steps(undelivered) * learner.step_seconds / self.inputs.sync.fragments)
            if learner.blocked_since is not None:
                self.ledger.add("blocked", learner.island.share_seconds(learner.blocked_since, now))
            elif now > learner.last_step_end:  # the step in progress
                self.ledger.add("lost", learner.island.share_seconds(learner.last_step_end, now))
        if learner.attendance:
            # Its Attend call ends with its process: the rounds stop waiting for it now.
            self.core.absent(learner.id, learner.incarnation, learner.attendance)
            learner.attendance = 0
            self.syncer.tick()

    def _repaired(self, learner: Learner) -> None:
        """Its process starts again (start-up), pulls the whole model, then rejoins (below)."""
        learner.life += 1
        self.accounts.enter_phase(learner, "startup")
        life = learner.life
        self.queue.at(self.clock.now + learner.startup_seconds, lambda: self._started(learner, life))

    def _started(self, learner: Learner, life: int, first: bool = False) -> None:
        """The process is up: it pulls the global model (the first learner seeded it), only the
        updates since its checkpoint where it has one, then joins and trains."""
        if learner.life != life:
            return
        if first and (learner.index == 0 or not self.inputs.pull_at_start):
            self._join(learner)
            self.accounts.enter_phase(learner, "training")
            self.training.start(learner, self.clock.now)
            self.accounts.training_changed()
            return
        self.accounts.enter_phase(learner, "restore")
        self._pull(learner, life)

    def _pull(self, learner: Learner, life: int) -> None:
        """The pull of a restarted learner, or of an island's new leader after a failover."""
        if learner.life != life:
            return
        held = learner.checkpointed_held
        nbytes = (sum(self.training.pull_bytes(self.core.fragments[fid].version - version)
                      for fid, version in held.items())
                  if held else self.snapshot_bytes * self.inputs.sync.fragments)
        self.queue.at(learner.down.send(self.syncer.every_shard_up(self.clock.now), nbytes),
                      lambda: self._restored(learner, life))

    def _restored(self, learner: Learner, life: int) -> None:
        if learner.life != life:
            return
        # Joined once it holds the model: the rounds do not wait for a learner still pulling.
        self._join(learner)
        self.accounts.enter_phase(learner, "training")
        self.training.start(learner, self.clock.now)
        learner.schedule.join_in_phase(self.syncer.learner_statuses(), learner.id, learner.steps)
        self.accounts.training_changed()

    def _join(self, learner: Learner) -> None:
        """A new process: a new incarnation, which holds an Attend call open."""
        learner.incarnation += 1
        self.core.join(learner.id, learner.incarnation, learner.region, self.manifest)
        learner.attendance = self.core.attend(learner.id, learner.incarnation)
