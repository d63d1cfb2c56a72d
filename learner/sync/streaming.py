"""Streaming fragment sync: the learner's side of the outer loop, the thin per-step shell
around the decisions of learner/sync/schedule.py (when each fragment syncs, when and how its
result is applied, when the schedule holds, when the run is over).

After every inner step the training loop calls `after_step(step, tokens, seconds)`. A sync
due now snapshots its fragment and runs on a background thread while training goes on
(learner/sync/pipeline.py: push the compressed outer gradient, pull the round's result). When
its result is due the loop waits for it as long as the schedule allows (that wait is
badput), then merges it, or trains on and merges it after the first step that finds it in:
a round waits for its contributors, and learners that each wait for a round the other has
yet to contribute to would otherwise wait for ever.

Each shard is a session (learner/sync/session.py: join, seed, restore, heartbeats, rejoin,
leave); what to do about a shard's error is one rule (learner/sync/shard_errors.py). A shard
that cannot be reached never stops training: the sync is skipped (the next outer gradient
still carries all local progress, since it is taken against the same anchor), and the
session rejoins the shard when it is back.

Memory: per fragment fp32 in host memory whatever the training dtype, the anchor (4 B/param)
and the error-feedback residual (4 B/param); a sync in flight adds its fragment's snapshot
(4 B/param; learner/sync/host_copy.py copies it off the device without stalling training), and
for moments up to three more fp32 buffers of the fragment. docs/gpus.md has the whole table.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import torch

from diloco.learner.sync.healing import Healing
from diloco.learner.sync.joined_run import others_tokens, started_beside, tell_what_it_joined
from diloco.learner.sync.pipeline import FragmentPipeline, SyncContext
from diloco.learner.sync.run_end import RunEnd
from diloco.learner.sync.run_phase import RunPhase
from diloco.learner.sync.schedule import LearnerSchedule
from diloco.learner.sync.session import JoinRefused, Progress, ReanchorDue, ShardSession
from diloco.learner.sync.stats import SyncStats
from diloco.services.client import ShardClient, TransferObserver, emulated_link
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.config import Config
from diloco.services.contract.fragments import Fragment, FragmentPlan, assemble, device_of, scatter
from diloco.services.contract.tls import Identity
from diloco.services.contract.wire import pb

__all__ = ["JoinRefused", "StreamingSync"]

log = logging.getLogger(__name__)

# Weight of the newest step in the learner's step-time average. One step's time varies a lot
# (data, the other processes on its cores): the others reading a fast one as the rate placed
# this learner up to several steps ahead of where it was.
STEP_TIME_SMOOTHING = 0.2
# trainer.heal_window_steps when the config leaves it out: this many sync periods.
HEAL_WINDOW_PERIODS = 4


class StreamingSync:
    """One learner's sync with every shard; every decision of when and how is its
    `schedule`'s (LearnerSchedule)."""

    def __init__(self, cfg: Config, learner_id: str, region: str,
                 params: Mapping[str, torch.Tensor], plan: FragmentPlan,
                 incarnation: int | None = None, observer: TransferObserver | None = None, *,
                 identity: Identity | None, standing_still: Callable[[], bool] = lambda: False):
        self.cfg = cfg
        self.learner_id = learner_id
        self.params = params
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.manifest = [(name, tuple(p.shape)) for name, p in params.items()]
        self.plan = plan
        self.schedule = LearnerSchedule(cfg, plan)
        self.stats = SyncStats()
        self.fragments: dict[int, FragmentPipeline] = {}
        self.step = 0
        # A moving average of the steps' time: what heartbeats and pushes report, and what the
        # others extrapolate this learner's schedule with over the seconds since its heartbeat.
        self.step_seconds = 0.0
        self.tokens_per_second = 0.0
        self.standing_still = standing_still  # whether training stands still (its island regrouping)
        self.tokens = 0  # trained by this learner (every rank of its island)
        self._lock = threading.Lock()  # guards `fragments` while heartbeat threads read them
        self._stop = threading.Event()
        self._should_stop: Callable[[], bool] = lambda: False  # set by start()
        self._restored: Mapping[int, Mapping[str, torch.Tensor | int]] = {}  # a checkpoint's, while starting
        reanchor_due = ReanchorDue()
        trainer = cfg.trainer
        self.healing = Healing(trainer.heal_after_refusals,
                               trainer.heal_window_steps or HEAL_WINDOW_PERIODS * cfg.sync.interval_steps)
        wan = emulated_link(cfg, learner_id, region)  # None unless a harness emulates the WAN
        self.sessions = [
            ShardSession(i, ShardClient(s.address, cfg.rpc, learner_id, self.incarnation, wan, observer,
                                        identity=identity),
                         region, cfg, plan, params, self, self.stats, reanchor_due, self._stop)
            for i, s in enumerate(cfg.shards)]
        self._context = SyncContext(cfg, params, ThreadPoolExecutor(len(plan.fragments), thread_name_prefix="sync"),
                                    self.stats, reanchor_due, self.healing,
                                    stopping=lambda: self._stop.is_set() or self._should_stop())
        self._phase = RunPhase(cfg, learner_id, self.sessions, self.schedule)
        self._end = RunEnd(cfg, learner_id, self.fragments, self.sessions, self.schedule, self.stats, self._stop,
                           should_stop=lambda: self._should_stop())

    @property
    def failure(self) -> JoinRefused | None:
        """A rejoin refused for good: the learner must stop."""
        return next((s.failure for s in self.sessions if s.failure is not None), None)

    # ---- start-up: join, seed, pull every fragment --------------------------------

    def start(self, restored: Mapping[str, object] | None = None,
              should_stop: Callable[[], bool] = lambda: False, step: int = 0, tokens: int = 0,
              process_started: float | None = None) -> int:
        """Joins every shard (retrying until each answers), seeds fragments nobody has
        seeded, pulls every fragment and moves the model onto the global values.

        `restored` is the sync state of a checkpoint (see state_dict); with it the
        learner pulls only the updates it missed. `should_stop` (the process was asked to
        stop) also ends waits for a round's result. `step` and `tokens` are where training
        resumes. `process_started` (time.monotonic's clock; default now) tells a start beside
        the learners already training from a join of a run with older progress. Returns how
        many versions it was behind, summed over fragments.
        """
        self._should_stop = should_stop
        self.step, self.tokens = step, tokens
        self._restored = (restored or {}).get("fragments", {})
        for session in self.sessions:
            session.start_heartbeats()
        for session in self.sessions:
            session.join(should_stop)
        status = self._phase.join(self.step, self.tokens)
        if self.schedule.turns_passed:  # rounds of those need not wait for the pulls below
            for session in self.sessions:
                session.heartbeat_now()
        behind = sum(self._pull_at_start(fragment, should_stop) for fragment in self.plan.fragments)
        age = 0.0 if process_started is None else time.monotonic() - process_started
        tell_what_it_joined(self.learner_id, self.cfg.run.name, self.cfg.trainer.max_run_tokens,
                            self.schedule.run_over(self.tokens), self.held_versions(), self.tokens,
                            others_tokens(status, self.learner_id), started_beside(status, self.learner_id, age),
                            resumed=bool(self._restored))
        self._restored = {}
        self.stats.versions_behind_at_join = behind
        log.info("learner %s (incarnation %d) joined %d shards; %d versions behind; syncing at step + %d",
                 self.learner_id, self.incarnation, len(self.sessions), behind, self.schedule.sync_offset)
        for session in self.sessions:
            session.started()
        return behind

    def rephase(self) -> None:
        """The training stood still while the others trained on: their phase again, from Status."""
        self._phase.join(self.step, self.tokens)
        self.stats.rephased += 1
        log.info("%s: sync schedule back in phase with the others (offset %d)", self.learner_id,
                 self.schedule.sync_offset)

    def _pull_at_start(self, fragment: Fragment, should_stop: Callable[[], bool]) -> int:
        """Pulls the fragment (only the updates since a checkpoint's version where there is
        one) and takes it; returns how many versions this learner was behind on it."""
        session = self.sessions[fragment.shard]
        saved = self._restored.get(fragment.id)
        result, anchor, reanchored = self.stats.counted_pull(
            lambda: session.retry(lambda: session.pull_at_start(fragment.id, saved), should_stop))
        version = result.version if result.version is not None else (saved["version"] if saved else 0)
        device = device_of(fragment, self.params)  # on a GPU the residual lives there (learner/sync/outer_gradient.py)
        feedback = ErrorFeedback(get_codec(self.cfg.sync.codec), fragment.numel, self.cfg.sync.codec_block_size,
                                 device if device.type == "cuda" else "cpu")
        if saved and not reanchored:  # a residual built on another value means nothing
            feedback.residual = saved["residual"].clone()
        pipeline = FragmentPipeline(fragment, anchor, version, feedback, session, self._context)
        with self._lock:
            self.fragments[fragment.id] = pipeline
        if saved:
            pipeline.adopt(anchor, version)  # keeps local progress since the checkpoint's anchor
        else:
            scatter(fragment, anchor, self.params)
        return max(0, version - (saved["version"] if saved else version))

    # ---- what the sessions ask (SessionHost) -----------------------------------------

    def held(self, fragment_id: int) -> tuple[int, torch.Tensor] | None:
        """(version, global value) this learner holds of a fragment: while starting, its
        checkpoint's; None when it holds none."""
        with self._lock:
            pipeline = self.fragments.get(fragment_id)
        if pipeline is not None:
            return pipeline.held()
        saved = self._restored.get(fragment_id)
        return (saved["version"], saved["anchor"]) if saved else None

    def held_versions(self) -> dict[int, int]:
        with self._lock:
            pipelines = list(self.fragments.values())
        return {p.fragment.id: p.held()[0] for p in pipelines}

    def progress(self) -> Progress:
        with self._lock:
            undelivered = {fid for fid, p in self.fragments.items() if p.undelivered is not None}
        skipped = tuple(sorted(undelivered | self.schedule.turns_passed | self.schedule.done_syncing))
        return Progress(self.step, self.step_seconds, self.tokens, self.tokens_per_second,
                        self.step + self.schedule.sync_offset, self.schedule.waiting_elsewhere(), self.standing_still(),
                        skipped)

    def heard_run_tokens(self, reply: pb.HeartbeatResponse, progress: Progress) -> None:
        self.schedule.heard_run_tokens(reply.run_tokens, reply.run_tokens_per_second, progress.tokens,
                                       progress.tokens_per_second)

    # ---- the per-step shell -----------------------------------------------------------

    def after_step(self, step: int, tokens: int, step_seconds: float) -> list[int]:
        """Call after inner step `step` (0-based) has updated the model. Starts the syncs due
        at this step (their outer gradient includes it) and applies those started tau steps
        ago (tau = 0: at once, waiting for the result). Returns the fragment ids applied."""
        if self.failure is not None:
            raise self.failure
        self.step = step + 1
        self.tokens += tokens
        mean = self.step_seconds
        self.step_seconds = step_seconds if mean <= 0 else mean + STEP_TIME_SMOOTHING * (step_seconds - mean)
        self.tokens_per_second = tokens / self.step_seconds if self.step_seconds > 0 else 0.0
        for pipeline in self.fragments.values():
            if (seconds := pipeline.take_push_seconds()) is not None:
                self.schedule.pushed(seconds, step_seconds)
        if self.schedule.first_step_pending and (status := self._phase.first_status()) is not None:
            self.schedule.heard_again_before_first_step(status.learners, self.learner_id)
        healed = []
        if self.healing.sick():  # every fragment takes back the global value this learner holds
            why = self.healing.heal(self.fragments.values(), step)  # raises LearnerDiverged if it did not help
            self.stats.heals += 1
            log.error("learner %s healed at step %d: %s. It took back the global model it holds (versions %s) "
                      "and dropped its local progress since", self.learner_id, step, why, self.held_versions())
            healed = list(self.fragments)
        done_syncing = self.schedule.done_syncing
        actions = self.schedule.step_done(step, tokens, self.step_seconds)
        if self.schedule.done_syncing != done_syncing:  # rounds of those need not wait for this learner
            for session in self.sessions:
                session.heartbeat_now()
        if actions.held:
            self.stats.held_steps += 1
        for sync in actions.start:
            self.fragments[sync.fragment_id].start(sync.c_steps, sync.c_tokens, self.step_seconds)
            self.stats.syncs_started += 1
        applied = [due.fragment_id for due in actions.apply if self._finish(self.fragments[due.fragment_id],
                                                                              due.wait_limit)]
        return healed or applied

    def _finish(self, pipeline: FragmentPipeline, wait_limit: float | None) -> bool:
        """Applies the in-flight result, waiting up to `wait_limit` seconds for it (None: as
        long as it takes). Returns whether a new global value was applied; False also while
        the result is still out (it stays in flight)."""
        fragment_id = pipeline.fragment.id
        self.schedule.waiting_began(fragment_id)
        try:
            waited = pipeline.wait(wait_limit)
        finally:
            reported = self.schedule.waiting_ended()
        if reported:  # the shards count this learner as waiting elsewhere: tell them it trains again
            for session in self.sessions:
                session.heartbeat_now()
        result_in = pipeline.result_in()
        self.stats.waited(fragment_id, waited, result_in)
        if not result_in:
            if self.schedule.result_still_out(fragment_id, waited):
                log.debug("fragment %d: result still out after %.2fs; training on", fragment_id, waited)
                pipeline.keep_local_at_apply()
            return False
        outcome, local_at_apply = pipeline.take()
        self.stats.took(outcome)
        applied = outcome.anchor is not None
        if self.schedule.result_arrived(fragment_id, self.step - 1, self.step_seconds, applied, waited,
                                        outcome.early_seconds):
            self.stats.syncs_late += 1
        if not applied:
            self.stats.syncs_skipped += 1
            return False
        if outcome.push_result == pb.PUSH_RESULT_REFUSED_STALE:
            self.stats.refused_stale += 1
        if outcome.reanchored:
            self.stats.reanchored_fragment(fragment_id, pipeline.version, outcome.version)
        pipeline.adopt(outcome.anchor, outcome.version, local_at_apply, outcome.staged)
        self.stats.syncs_applied += 1
        return True

    def flush(self) -> None:
        """Applies every in-flight sync (training stopped before its end), waiting as long as it
        takes: the checkpoint must hold the results, or a restart would push the same progress
        again under its new incarnation."""
        for pipeline in self.fragments.values():
            if pipeline.in_flight is not None:
                self._finish(pipeline, wait_limit=None)

    def deliver(self) -> dict[int, str]:
        """Budget spent: the learner's last contributions delivered (learner/sync/run_end.py)."""
        return self._end.deliver(self.step_seconds)

    # ---- leave, the final pulls, the state held ----------------------------------------

    def leave(self) -> None:
        """Budget spent: stop counting towards any round (a synchronous round would wait for
        this learner forever) but keep pulling the global values."""
        for session in self.sessions:
            session.leave()

    def catch_up(self, quiet_seconds: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """After training: pull until the run is quiet and end holding the shards' exact final
        values (learner/sync/run_end.py)."""
        self._end.catch_up(quiet_seconds, should_stop)

    def take_global_model(self) -> None:
        """Writes every fragment's global value into the model: a learner that left the run
        ends holding the global model (each parameter in its own dtype), not its local one."""
        for pipeline in self.fragments.values():
            scatter(pipeline.fragment, pipeline.anchor, self.params)

    def fragment_hashes(self) -> dict[int, tuple[int, str]]:
        """(version, state hash) of the global value this learner holds, per fragment."""
        return {fid: pipeline.hash() for fid, pipeline in self.fragments.items()}

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The run's global model as this learner holds it (the anchors: after catch_up, the
        shards' final values), fp32, by parameter name; the local model stays as it is."""
        return assemble(self.manifest, ((p.fragment, p.anchor) for p in self.fragments.values()))

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume syncing without a full pull (the tensors
        themselves, not copies; checkpoint_state copies them)."""
        return {"incarnation": self.incarnation, "fragments": {
            fid: {"version": p.version, "anchor": p.anchor, "residual": p.feedback.residual}
            for fid, p in self.fragments.items()}}

    def close(self, leave: bool = True) -> None:
        self._stop.set()
        for session in self.sessions:
            session.stop_heartbeats()
        self._context.pool.shutdown(wait=True, cancel_futures=True)
        if leave:
            self.leave()
        for session in self.sessions:
            session.client.close()
