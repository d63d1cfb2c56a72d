"""Decoupled DiLoCo in virtual time, its decisions made by the real cores.

Real: one syncer ShardCore (NullJournal, the virtual clock) owns every fragment and decides
what it does with each push (merged, stale, refused), when each round closes (every live
learner, or quorum then grace; leases expiring) and the versions; each learner's
LearnerSchedule decides when each fragment syncs, when its result is due, how long the
learner may wait for it, when the schedule holds, and when the run's token budget is spent.
Pushes are a real push header and payload chunks of one-element fragments with the learner's
real metadata (base version, c_steps, c_tokens, step time); heartbeats are real calls.

Modelled: time and bytes. A step takes the learner's step time; a push or pull takes its bytes
(the codec's size of a fragment of the real model) over the learner's region link, one
transfer at a time in each direction, plus the link's latency; a round close takes the
fragment's parameters at the syncer's round-close throughput. A learner's process takes its
start-up time before it joins, and each step its loop's other work (step_overhead_seconds). Its
heartbeats keep their own time, every heartbeat_seconds from a moment of the first interval
drawn from the seed, not from a step's start (the real learner's thread is not timed to its
steps). A learner that fails ends its Attend call (the shard stops waiting for it at once)
and loses the steps its fragments have not delivered, or those since its last checkpoint, and
the step in progress; after its repair and start-up it rejoins with a new incarnation and
pulls the whole model (fp32) before it trains again. A shard that is down fails its
fragments' pushes and pulls at once (those syncs are skipped, as a learner skips a sync to a
shard it cannot reach), and a learner (re)joining waits until every shard is back. A learner
of several slices trains on without a failed one, on fewer tokens per step; where that is its
leader slice, another takes the lead: the learner loses what a failed one loses and restores
as a restarted one does, without a repair or a start-up (planner/island.py).
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from diloco.learner.schedule import LearnerSchedule
from diloco.planner.events import EventQueue, VirtualClock
from diloco.planner.failures import FailureModel, FleetChange
from diloco.planner.inputs import PlanInputs
from diloco.planner.island import STATE_BYTES_PER_PARAMETER, Island, SliceFailed
from diloco.planner.outcome import Bandwidth, Ledger, PlanResult, SyncerFacts, Uptime, staleness_counts
from diloco.planner.syncer_model import FP32, FRAGMENT_NUMEL, Answer, SyncerModel
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import Config, parse_config
from diloco.services.contract.fragments import FragmentPlan, plan_for_config
from diloco.services.contract.goodput import fragment_compute_seconds
from diloco.services.contract.wire import pb

PEAK_WINDOW_SECONDS = 60.0


def core_config(inputs: PlanInputs) -> Config:
    """The cluster config the cores run under: the plan's algorithm settings, fp32 one-element
    fragments (their bytes are modelled), no step budget (the run's length is the plan's)."""
    m = inputs.num_learners
    return parse_config({
        "shards": [{"address": "127.0.0.1:1", "metrics_port": 0}],
        "learners": [{"id": f"learner-{i}", "region": inputs.region(i), "metrics_port": 0}
                     for i in range(m)],
        "sync": {"fragments": inputs.fragments, "interval_steps": inputs.interval_steps,
                 "overlap_steps": inputs.overlap_steps, "codec": "fp32",
                 "max_block_seconds": inputs.max_block_seconds, "wait_for_own_link": inputs.wait_for_own_link},
        "syncer": {"quorum": inputs.quorum, "max_staleness": inputs.max_staleness,
                   "grace": {"mode": inputs.grace_mode, "seconds": inputs.grace_seconds},
                   "lease_seconds": inputs.lease_seconds, "history_versions": inputs.history_versions,
                   "max_tokens_per_step": inputs.learner_tokens_per_step()},
        "trainer": {"max_steps": 1 << 40, "heartbeat_seconds": inputs.heartbeat_seconds,
                    "max_run_tokens": inputs.target_tokens},
    }, source="planner core config")


class Link:
    """One learner's link to the syncer in one direction: transfers one at a time."""

    def __init__(self, mbps: float, latency_seconds: float):
        self.bytes_per_second = mbps * 1e6 / 8
        self.latency_seconds = latency_seconds
        self.free_at = 0.0
        self.bytes_total = 0
        self.bytes_by_window: Counter[int] = Counter()  # bytes moved in each minute

    def send(self, now: float, nbytes: int) -> float:
        """Queues a transfer; returns when its last byte has arrived."""
        start = max(now, self.free_at)
        end = self.free_at = start + nbytes / self.bytes_per_second
        self.bytes_total += nbytes
        window = int(start // PEAK_WINDOW_SECONDS)
        while end > start and window * PEAK_WINDOW_SECONDS < end:  # spread over the windows it spans
            overlap = min(end, (window + 1) * PEAK_WINDOW_SECONDS) - max(start, window * PEAK_WINDOW_SECONDS)
            self.bytes_by_window[window] += nbytes * overlap / (end - start)
            window += 1
        return end + self.latency_seconds


@dataclass(frozen=True)
class Result:
    """A sync's answer as it reaches the learner."""
    version: int
    applied: bool  # a new global value (False: the push was refused for another reason than staleness)


class Learner:
    """One learner unit: its schedule (the real one) and what the simulation tracks around it."""

    def __init__(self, index: int, inputs: PlanInputs, clock: VirtualClock, ledger: Ledger):
        self.index = index
        self.id = f"learner-{index}"
        self.step_seconds = inputs.learner_step_seconds(index)
        self.overhead_seconds = inputs.learner_step_overhead_seconds(index)  # per step, not kept
        self.push_overhead_seconds = inputs.learner_push_overhead_seconds(index)
        self.startup_seconds = inputs.learner_startup_seconds(index)
        self.tokens_per_step = inputs.learner_tokens_per_step()  # every slice training
        transfer = inputs.model_parameters * STATE_BYTES_PER_PARAMETER * 8 / (inputs.island_gbps * 1e9)
        self.island = Island(inputs.slices_per_learner, clock, ledger, inputs.island_reconfigure_seconds,
                             self.startup_seconds, transfer, inputs.island_leader_loss == "failover")
        self.region = inputs.region(index)
        link = inputs.link(index)
        self.up = Link(link.up_mbps, link.latency_ms / 1000)
        self.down = Link(link.down_mbps, link.latency_ms / 1000)
        # A learner's heartbeat thread keeps its own time, not its steps' (learner/session.py):
        # each start of its heartbeats is at a moment drawn from this, the same for a seed.
        self.heartbeat_phases = random.Random(f"{inputs.seed}/heartbeats/{index}")
        self.incarnation = 0
        self.attendance = 0  # its Attend call on the shard, which ends when it fails
        self.life = 0  # bumped by every failure and rejoin: events of an earlier life are void
        # startup (its process), restore (pulling the model), training, failover (its island's new
        # leader restores: the island books it), down, finished
        self.phase = "startup"
        self.phase_since = 0.0
        self.steps = self.tokens = 0
        self.checkpointed_steps = self.checkpointed_tokens = 0  # as of its last checkpoint (checkpoint_steps)
        self.checkpointed_held: dict[int, int] | None = None  # the versions that checkpoint holds
        self.lost_seconds = 0.0
        self.schedule: LearnerSchedule | None = None
        self.held: dict[int, int] = {}  # fragment -> version of the global value it holds
        self.delivered_tokens: dict[int, int] = {}  # fragment -> c_tokens merged, not yet applied
        self.results: dict[int, Result] = {}  # arrived, waiting for their apply step
        self.to_apply: list[int] = []  # fragments due at the last step, in order
        self.blocked_since: float | None = None
        self.blocks = 0  # waits begun: a wait's time limit ends only its own wait
        self.aborts = 0  # steps aborted by a reconfiguration of its island: their end is void
        self.last_step_end = 0.0  # or the end of the evaluation or checkpoint after it
        self.after_step = 0.0  # the loop's work after the last step: bookkeeping, an evaluation, a checkpoint

    @property
    def training(self) -> bool:
        return self.phase == "training"

    def step_tokens(self) -> int:
        """The tokens of one step: the training slices' share of its batch."""
        return self.tokens_per_step * len(self.island.training) // self.island.slices

    def full_steps(self, tokens: int) -> float:
        """How many steps of all its slices these tokens are: the compute they cost, in steps."""
        return tokens / self.tokens_per_step


class DilocoRun:
    def __init__(self, inputs: PlanInputs, failures: FailureModel):
        self.inputs = inputs
        self.failures = failures
        self.clock = VirtualClock()
        self.queue = EventQueue(self.clock)
        self.cfg = core_config(inputs)
        self.manifest = [(f"fragment.{i}", (FRAGMENT_NUMEL,)) for i in range(inputs.fragments)]
        self.plan: FragmentPlan = plan_for_config(self.cfg, self.manifest)
        self.ledger, self.uptime = Ledger(), Uptime()
        self.learners = [Learner(i, inputs, self.clock, self.ledger) for i in range(inputs.num_learners)]
        codec = get_codec(inputs.codec)
        numel = math.ceil(inputs.model_parameters / inputs.fragments)  # balanced fragments
        self.update_bytes = codec.encoded_size(numel, inputs.codec_block_size)
        self.snapshot_bytes = FP32.encoded_size(numel, inputs.codec_block_size)
        self.syncer = SyncerModel(inputs, self.cfg, self.clock, self.queue, self.learners, self.answer_pull,
                                  close_seconds=numel / inputs.syncer_params_per_second)
        self.core = self.syncer.core
        self.failure_count = 0  # the moments a slice failed, as the data-parallel modes count them
        self.failed_at = -1.0
        self._changes: Iterator[FleetChange] = failures.changes()

    # ---- the run -------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None]) -> PlanResult:
        self._join(self.learners[0])  # the first learner seeds the fragments
        self.syncer.seed(self.learners[0], [f.id for f in self.plan.fragments])
        for learner in self.learners:
            self.queue.at(learner.startup_seconds, lambda learner=learner: self._started(learner, 0, first=True))
        self._next_change()
        for outage in self.inputs.shard_outages:
            self.queue.at(outage.at_seconds, lambda shard=outage.shard: self.syncer.shard_failed(shard))
        self.queue.run(self.inputs.duration_seconds, self._over, progress)
        return self._result()

    def _over(self) -> bool:
        """A budget run is over once no learner is training and none has yet to finish."""
        return (self.inputs.target_tokens is not None and any(l.phase == "finished" for l in self.learners)
                and not any(l.phase in ("training", "restore", "failover") for l in self.learners))

    def _start_training(self, learner: Learner, at: float) -> None:
        learner.schedule = LearnerSchedule(self.cfg, self.plan, self.clock)
        learner.held = {f.id: self.core.fragments[f.id].version for f in self.plan.fragments}
        learner.delivered_tokens = dict.fromkeys(learner.held, 0)
        learner.results, learner.to_apply, learner.blocked_since = {}, [], None
        learner.island.started()
        self._next_step(learner, at)
        life = learner.life
        # Its first heartbeat comes at any moment of the first interval, so they do not land on
        # the step ends (they would, at the same instant, for a step time that divides it).
        first = at + learner.heartbeat_phases.random() * self.cfg.trainer.heartbeat_seconds
        self.queue.at(first, lambda: self._heartbeat(learner, life))

    def _next_step(self, learner: Learner, ready: float) -> None:
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
        actions = learner.schedule.step_done(learner.steps - 1, tokens)
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
            elif (limit := learner.schedule.wait_limit(fid)) == 0:
                learner.schedule.fragments[fid].missed()  # trains on; applied at the first step after it arrives
            else:
                learner.blocked_since = now
                learner.blocks += 1
                if limit is not None:
                    life, block = learner.life, learner.blocks
                    self.queue.at(now + limit, lambda: self._wait_over(learner, life, block))
                return
            learner.to_apply.pop(0)
        self._next_step(learner, now + learner.after_step)  # the loop's work after the step, then the next one

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

    def _wait_over(self, learner: Learner, life: int, block: int) -> None:
        if learner.life != life or learner.blocks != block or learner.blocked_since is None:
            return  # the result came in time, or this life is over
        fid = learner.to_apply.pop(0)
        self._stop_blocking(learner, fid)
        learner.schedule.fragments[fid].missed()
        self._apply_due(learner)

    def _finish(self, learner: Learner) -> None:
        """Budget spent: the learner leaves; its provisioned time ends here."""
        self._phase(learner, "finished")
        learner.island.stopped()
        learner.life += 1
        self.core.leave(learner.id, learner.incarnation)
        self.syncer.tick()  # rounds no longer wait for it
        self._training_changed()

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
            self._lose(learner, fragment_compute_seconds(learner.full_steps(header.c_tokens), header.step_seconds, 1,
                                                         self.inputs.fragments))
            self.answer_pull(learner, fid, Answer(outcome.current_version, True, self.clock.now,
                                                  outcome.current_version - header.base_version))

    def answer_pull(self, learner: Learner, fid: int, answer: Answer) -> None:
        """A pull's answer `answer.versions` versions past the learner's: one delta from the
        anchor the syncer served it, one update's bytes however many rounds closed
        (docs/protocol.md, "The downlink"), down the learner's link."""
        nbytes = self._pull_bytes(answer.versions)
        ready = answer.ready
        arrives = learner.down.send(ready, nbytes) if nbytes else ready + learner.down.latency_seconds
        life, result = learner.life, Result(answer.version, answer.applied)
        self.queue.at(arrives, lambda: self._result_arrives(learner, life, fid, result))

    def _pull_bytes(self, versions: int) -> int:
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
        rate = learner.step_tokens() / learner.step_seconds
        self.core.heartbeat(learner.id, learner.incarnation, step=learner.steps, step_seconds=learner.step_seconds,
                            tokens_per_second=rate, sync_step=learner.steps + learner.schedule.sync_offset,
                            tokens=learner.tokens,
                            waiting_for=learner.to_apply[0] if learner.blocked_since is not None else None,
                            standing_still=learner.island.standing_still)
        if self.inputs.target_tokens is not None:  # only a token budget reads the run's count
            run_tokens, run_rate = self.core.run_tokens()
            learner.schedule.heard_run_tokens(run_tokens, run_rate, learner.tokens, rate)
        self.queue.at(self.clock.now + self.cfg.trainer.heartbeat_seconds, lambda: self._heartbeat(learner, life))

    # ---- failures ------------------------------------------------------------------------

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
                self.failure_count += change.at != self.failed_at
                self.failed_at = change.at
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
        self._next_step(learner, max(now, learner.island.ready))

    def _failed(self, learner: Learner) -> None:
        """Down until it (with an island: a slice that can lead it) is repaired."""
        self._lose_progress(learner)
        learner.island.stopped()
        self._phase(learner, "down")
        learner.life += 1
        self._training_changed()

    def _failed_over(self, learner: Learner) -> None:
        """Its island's leader slice failed and another took the lead in its running process:
        the learner loses what a failed one loses, and after the island's pause the new leader
        restores as a restarted learner does (below), with no repair and no start-up."""
        self._lose_progress(learner)
        self._phase(learner, "failover")
        learner.life += 1
        life = learner.life
        self.queue.at(learner.island.resume_at, lambda: self._pull(learner, life))
        self._training_changed()

    def _lose_progress(self, learner: Learner) -> None:
        """A failure's loss: the steps since its last checkpoint (or those its fragments had not
        delivered) and the step in progress; its Attend call ends with its process."""
        now = self.clock.now
        if learner.training:
            if self.inputs.checkpoint_steps:  # the next life trains them again: its counts go back
                lost = learner.tokens - learner.checkpointed_tokens
                learner.steps, learner.tokens = learner.checkpointed_steps, learner.checkpointed_tokens
                self._lose(learner, learner.full_steps(lost) * learner.step_seconds, rolled_back=True)
            else:  # each fragment's steps not delivered to the syncer
                undelivered = sum(f.tokens_since_sync - learner.delivered_tokens[fid]
                                  for fid, f in learner.schedule.fragments.items())
                self._lose(learner, learner.full_steps(undelivered) * learner.step_seconds / self.inputs.fragments)
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
        self._phase(learner, "startup")
        life = learner.life
        self.queue.at(self.clock.now + learner.startup_seconds, lambda: self._started(learner, life))

    def _started(self, learner: Learner, life: int, first: bool = False) -> None:
        """The process is up: it pulls the global model (the first learner seeded it), only the
        updates since its checkpoint where it has one, then joins and trains."""
        if learner.life != life:
            return
        if first and (learner.index == 0 or not self.inputs.pull_at_start):
            self._join(learner)
            self._phase(learner, "training")
            self._start_training(learner, self.clock.now)
            self._training_changed()
            return
        self._phase(learner, "restore")
        self._pull(learner, life)

    def _pull(self, learner: Learner, life: int) -> None:
        """The pull of a restarted learner, or of an island's new leader after a failover."""
        if learner.life != life:
            return
        held = learner.checkpointed_held
        nbytes = (sum(self._pull_bytes(self.core.fragments[fid].version - version) for fid, version in held.items())
                  if held else self.snapshot_bytes * self.inputs.fragments)
        self.queue.at(learner.down.send(self.syncer.every_shard_up(self.clock.now), nbytes),
                      lambda: self._restored(learner, life))

    def _restored(self, learner: Learner, life: int) -> None:
        if learner.life != life:
            return
        # Joined once it holds the model: the rounds do not wait for a learner still pulling.
        self._join(learner)
        self._phase(learner, "training")
        self._start_training(learner, self.clock.now)
        learner.schedule.join_in_phase(self.syncer.learner_statuses(), learner.id, learner.steps)
        self._training_changed()

    def _join(self, learner: Learner) -> None:
        """A new process: a new incarnation, which holds an Attend call open."""
        learner.incarnation += 1
        self.core.join(learner.id, learner.incarnation, learner.region, self.manifest)
        learner.attendance = self.core.attend(learner.id, learner.incarnation)

    # ---- accounting ----------------------------------------------------------------------

    def _lose(self, learner: Learner, seconds: float, rolled_back: bool = False) -> None:
        """Steps already counted as kept that the run will not keep (`rolled_back`: already
        taken off the learner's own step and token counts)."""
        self.ledger.kept -= seconds
        self.ledger.add("lost", seconds)
        if not rolled_back:
            learner.lost_seconds += seconds

    def _phase(self, learner: Learner, phase: str) -> None:
        """Ends the learner's current phase: time starting, restoring or down is badput of that name."""
        if learner.phase in ("startup", "restore", "down"):
            self.ledger.add(learner.phase, self.clock.now - learner.phase_since)
        learner.phase, learner.phase_since = phase, self.clock.now

    def _training_changed(self) -> None:
        self.uptime.training(self.clock.now, any(l.training for l in self.learners))

    def _result(self) -> PlanResult:
        end = self.clock.now
        for learner in self.learners:
            if learner.phase == "finished":
                self.ledger.provisioned += learner.phase_since
                continue
            if learner.training and learner.blocked_since is not None:
                self.ledger.add("blocked", learner.island.share_seconds(learner.blocked_since, end))
            learner.island.stopped()
            self._phase(learner, "finished")
            self.ledger.provisioned += end
        counters = self.core.counters_snapshot()
        syncer = SyncerFacts(int(counters["state.merged_contributions"]), int(counters.get("rounds.all", 0)),
                             int(counters.get("rounds.quorum_grace", 0)),
                             sum(s.version for s in self.core.fragments.values()),
                             int(counters.get("contributions.refused_stale", 0)))
        kept_tokens = sum(l.tokens - l.lost_seconds / l.step_seconds * l.tokens_per_step for l in self.learners)
        failure_free = sum(l.tokens_per_step / l.step_seconds for l in self.learners)
        return PlanResult("diloco", self.inputs.chips, len(self.learners), end, self.ledger.goodput(),
                          self.uptime.share(end), round(kept_tokens), failure_free, self.failure_count,
                          self._bandwidth(end), staleness_counts(self.syncer.staleness, self.syncer.refused_stale), syncer,
                          slices=self.inputs.slices_per_learner)

    def _bandwidth(self, end: float) -> Bandwidth:
        links = [(l.up, l.down) for l in self.learners]
        total = sum(up.bytes_total + down.bytes_total for up, down in links)
        peak = max((up.bytes_by_window[w] + down.bytes_by_window[w] for up, down in links
                    for w in set(up.bytes_by_window) | set(down.bytes_by_window)), default=0)
        return Bandwidth(total * 8 / 1e9 / end / len(links) if end else 0.0,
                         peak * 8 / 1e9 / PEAK_WINDOW_SECONDS, total, sum(up.bytes_total for up, _ in links),
                         sum(down.bytes_total for _, down in links))


def simulate_diloco(inputs: PlanInputs, failures: FailureModel, progress: Callable[[float], None]) -> PlanResult:
    return DilocoRun(inputs, failures).run(progress)
