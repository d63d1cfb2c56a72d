"""A Decoupled DiLoCo learner training in virtual time: its steps, the syncs its schedule starts,
its waits for their results, its heartbeats, and its leaving once the run's token budget is
spent. The real LearnerSchedule decides and this times it (planner/diloco.py says what is
modelled); planner/restarts.py starts it after each (re)join.
"""
from __future__ import annotations

from diloco.learner.sync.schedule import LearnerSchedule
from diloco.planner.accounting import RunAccounts
from diloco.planner.events import EventQueue, VirtualClock
from diloco.planner.inputs import PlanInputs
from diloco.planner.learner_model import Learner, Result
from diloco.planner.syncer_model import Answer, SyncerModel
from diloco.services.contract.config import Config
from diloco.services.contract.fragments import FragmentPlan
from diloco.services.contract.goodput import fragment_compute_seconds
from diloco.services.contract.wire import pb


class Training:
    def __init__(self, inputs: PlanInputs, cfg: Config, plan: FragmentPlan, clock: VirtualClock, queue: EventQueue,
                 syncer: SyncerModel, accounts: RunAccounts, update_bytes: int):
        self.inputs, self.cfg, self.plan = inputs, cfg, plan
        self.clock, self.queue = clock, queue
        self.syncer, self.core = syncer, syncer.core
        self.accounts, self.ledger = accounts, accounts.ledger
        self.update_bytes = update_bytes  # one fragment's update, as the codec encodes it

    def start(self, learner: Learner, at: float) -> None:
        """The learner trains from `at`, joined and holding the model: a new schedule, its first
        step and its heartbeats."""
        learner.schedule = LearnerSchedule(self.cfg, self.plan, self.clock)
        learner.held = {f.id: self.core.fragments[f.id].version for f in self.plan.fragments}
        learner.delivered_tokens = dict.fromkeys(learner.held, 0)
        learner.results, learner.to_apply, learner.blocked_since = {}, [], None
        learner.island.started()
        self.next_step(learner, at)
        life = learner.life
        # Its first heartbeat comes at any moment of the first interval, so they do not land on
        # the step ends (they would, at the same instant, for a step time that divides it).
        first = at + learner.heartbeat_phases.random() * self.cfg.trainer.heartbeat_seconds
        self.queue.at(first, lambda: self._heartbeat(learner, life))

    def next_step(self, learner: Learner, ready: float) -> None:
        """The next step starts once the learner is ready and its island is not reconfiguring."""
        learner.last_step_end = learner.island.next_step_start(ready)
        if self.inputs.island_rephase and learner.last_step_end > ready:  # its island pauses
            learner.schedule.join_in_phase(self.syncer.learner_statuses(), learner.id, learner.steps)
        life, aborts = learner.life, learner.aborts
        self.queue.at(learner.last_step_end + learner.step_seconds, lambda: self._step_done(learner, life, aborts))

    # ---- a learner's steps ---------------------------------------------------------------

    def _step_done(self, learner: Learner, life: int, aborts: int) -> None:
        if learner.life != life or learner.aborts != aborts:
            return
        now = self.clock.now
        tokens = learner.step_tokens()
        learner.steps += 1
        learner.tokens += tokens
        self.ledger.kept += learner.full_steps(tokens) * learner.step_seconds
        learner.after_step = self._after_step(learner)
        learner.last_step_end = now
        actions = learner.schedule.step_done(learner.steps - 1, tokens, learner.step_seconds)
        for sync in actions.start:
            self._push(learner, sync.fragment_id)
        if learner.schedule.run_over(learner.tokens):
            self._finish(learner)
            return
        learner.to_apply = [due.fragment_id for due in actions.apply]
        self._apply_due(learner)

    def _apply_due(self, learner: Learner) -> None:
        """Applies the due results in order; waits (blocks) for one that is not in, as long as
        the schedule allows; then the next step starts."""
        now = self.clock.now
        while learner.to_apply:
            fid = learner.to_apply[0]
            if fid in learner.results:
                self._apply(learner, fid, learner.results.pop(fid))
            elif (limit := learner.schedule.wait_limit(fid, learner.step_seconds)) == 0:
                learner.schedule.fragments[fid].missed()  # trains on; applied at the first step after it arrives
            else:
                learner.blocked_since = now
                learner.blocks += 1
                learner.schedule.waiting_began(fid)
                if limit is not None:
                    life, block = learner.life, learner.blocks
                    self.queue.at(now + limit, lambda: self._wait_over(learner, life, block))
                return
            learner.to_apply.pop(0)
        self.next_step(learner, now + learner.after_step)  # the loop's work after the step, then the next one

    def _after_step(self, learner: Learner) -> float:
        """The loop's work after the step just done (its syncs, then this): bookkeeping, and the
        evaluation and checkpoint due at this step, each counted as its badput."""
        seconds, share = learner.overhead_seconds, learner.island.share
        every = self.inputs.evaluation_every_steps
        if every and learner.steps % every == 0:
            self.ledger.add("evaluation", self.inputs.evaluation_seconds * share)
            seconds += self.inputs.evaluation_seconds
        every = self.inputs.checkpoint_steps
        if every and learner.steps % every == 0:
            learner.checkpointed_steps, learner.checkpointed_tokens = learner.steps, learner.tokens
            learner.checkpointed_held = dict(learner.held)
            self.ledger.add("checkpoint", self.inputs.checkpoint_seconds * share)
            seconds += self.inputs.checkpoint_seconds
        return seconds

    def _apply(self, learner: Learner, fid: int, result: Result) -> None:
        learner.schedule.result_arrived(fid, learner.steps - 1, learner.step_seconds, result.applied)
        if result.applied:
            learner.held[fid] = result.version
            learner.delivered_tokens[fid] = 0

    def _stop_blocking(self, learner: Learner, fid: int) -> None:
        waited = self.clock.now - learner.blocked_since
        learner.schedule.fragments[fid].waited(waited)
        self.ledger.add("blocked", learner.island.share_seconds(learner.blocked_since, self.clock.now))
        learner.blocked_since = None
        if learner.schedule.waiting_ended():  # the shards count it as waiting elsewhere: it tells them at once
            self._beat(learner)

    def _wait_over(self, learner: Learner, life: int, block: int) -> None:
        if learner.life != life or learner.blocks != block or learner.blocked_since is None:
            return  # the result came in time, or this life is over
        fid = learner.to_apply.pop(0)
        self._stop_blocking(learner, fid)
        learner.schedule.fragments[fid].missed()
        self._apply_due(learner)

    def _finish(self, learner: Learner) -> None:
        """Budget spent: the learner leaves; its provisioned time ends here."""
        self.accounts.enter_phase(learner, "finished")
        learner.island.stopped()
        learner.life += 1
        self.core.leave(learner.id, learner.incarnation)
        self.syncer.tick()  # rounds no longer wait for it
        self.accounts.training_changed()

    # ---- syncs ---------------------------------------------------------------------------

    def _push(self, learner: Learner, fid: int) -> None:
        fragment = learner.schedule.fragments[fid]
        if self.syncer.shard_down(fid % self.inputs.shards, self.clock.now - self.inputs.heartbeat_seconds):
            # A shard that is down, or back but not yet rejoined (the next heartbeat does it),
            # fails the push at once: the sync is skipped and the next one carries its steps.
            self.answer_pull(learner, fid, Answer(learner.held[fid], False, self.clock.now, 0))
            return
        header = pb.PushHeader(learner_id=learner.id, incarnation=learner.incarnation, fragment_id=fid,
                               kind=pb.PUSH_KIND_OUTER_GRADIENT, base_version=learner.held[fid],
                               c_steps=fragment.steps_since_sync, c_tokens=fragment.tokens_since_sync,
                               step_seconds=learner.step_seconds, payload=self.syncer.payload)
        arrives = learner.up.send(self.clock.now + learner.push_overhead_seconds, self.update_bytes)
        life, upload_seconds = learner.life, arrives - self.clock.now
        self.queue.at(arrives, lambda: self._push_arrives(learner, life, header, upload_seconds))

    def _push_arrives(self, learner: Learner, life: int, header: pb.PushHeader, upload_seconds: float) -> None:
        if learner.life != life:
            return  # the learner died with the push on the wire
        learner.schedule.pushed(upload_seconds, learner.step_seconds)
        fid = header.fragment_id
        outcome = self.syncer.push(learner, header, learner.up.latency_seconds,
                                   self.update_bytes / learner.up.bytes_per_second)
        if outcome is None:  # the sync failed: skipped, the next push carries its steps
            self.answer_pull(learner, fid, Answer(header.base_version, False, self.clock.now, 0))
            return
        learner.delivered_tokens[fid] = header.c_tokens  # refused stale: counted lost here, not again if it fails
        if outcome.result == pb.PUSH_RESULT_REFUSED_STALE:
            # The learner re-anchors on the current value: the fragment's steps are lost.
            lost = fragment_compute_seconds(learner.full_steps(header.c_tokens), header.step_seconds, 1,
                                            self.inputs.sync.fragments)
            self.accounts.lose(learner, lost)
            self.answer_pull(learner, fid, Answer(outcome.current_version, True, self.clock.now,
                                                  outcome.current_version - header.base_version))

    def answer_pull(self, learner: Learner, fid: int, answer: Answer) -> None:
        """A pull's answer `answer.versions` versions past the learner's: one delta from the
        anchor the syncer served it, one update's bytes however many rounds closed
        (docs/protocol.md, "The downlink"), down the learner's link."""
        nbytes = self.pull_bytes(answer.versions)
        ready = answer.ready
        arrives = learner.down.send(ready, nbytes) if nbytes else ready + learner.down.latency_seconds
        life, result = learner.life, Result(answer.version, answer.applied)
        self.queue.at(arrives, lambda: self._result_arrives(learner, life, fid, result))

    def pull_bytes(self, versions: int) -> int:
        """One delta from the anchor the syncer served the learner, however far behind: a
        checkpoint's anchor is among the two it keeps, as a fragment syncs less often than a
        learner checkpoints."""
        return self.update_bytes if versions > 0 else 0

    def _result_arrives(self, learner: Learner, life: int, fid: int, result: Result) -> None:
        if learner.life != life:
            return
        learner.results[fid] = result
        if learner.blocked_since is not None and learner.to_apply and learner.to_apply[0] == fid:
            self._stop_blocking(learner, fid)
            self._apply_due(learner)

    def _heartbeat(self, learner: Learner, life: int) -> None:
        if learner.life != life:
            return
        self._beat(learner)
        self.queue.at(self.clock.now + self.cfg.trainer.heartbeat_seconds, lambda: self._heartbeat(learner, life))

    def _beat(self, learner: Learner) -> None:
        """One heartbeat call. Like the real learner's, it reports a wait only once it has lasted
        a heartbeat interval (LearnerSchedule.waiting_elsewhere): shorter ones are the schedule's."""
        rate = learner.step_tokens() / learner.step_seconds
        self.core.heartbeat(learner.id, learner.incarnation, step=learner.steps, step_seconds=learner.step_seconds,
                            tokens_per_second=rate, sync_step=learner.steps + learner.schedule.sync_offset,
                            tokens=learner.tokens,
                            waiting_for=learner.schedule.waiting_elsewhere(),
                            standing_still=learner.island.standing_still)
        if self.inputs.target_tokens is not None:  # only a token budget reads the run's count
            run_tokens, run_rate = self.core.run_tokens()
            learner.schedule.heard_run_tokens(run_tokens, run_rate, learner.tokens, rate)
