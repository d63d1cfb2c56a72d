"""Streaming fragment sync: the learner's side of the outer loop, the I/O around the
decisions of learner/schedule.py (when each fragment syncs, when and how its result is
applied, when the schedule holds, when the run is over).

After every inner step the training loop calls `after_step(step, tokens, seconds)`. A sync
due now snapshots its fragment; its outer gradient `anchor_p - theta_p` is compressed (with
error feedback) and pushed, and the new global value is pulled, all on a background thread
while training goes on. When its result is due the loop waits for it as long as the
schedule allows (that wait is badput), then merges it, or trains on and merges it after the
first step that finds it in: a round waits for its contributors, and learners that each
wait for a round the other has yet to contribute to would otherwise wait for ever.

The model may live on any device and in any dtype. What this keeps per fragment is fp32 in
host memory whatever the training dtype: the anchor (4 B/param) and the error-feedback
residual (4 B/param), 8 B/param of host memory for the whole model. A sync in flight adds
its fragment's snapshot (4 B/param; learner/host_copy.py copies it off the device without
stalling training), and for moments up to three more fp32 buffers of the fragment (encoding:
outer gradient, new residual, decoded values; pulling: the replaced residual, the new global
value). docs/gpus.md has the whole table. The outer
gradient anchor - theta is computed in fp32 from the snapshot; results are merged on the
model's device and cast to each parameter's dtype between steps.

A shard that cannot be reached never stops training: the sync is skipped (the
next outer gradient still carries all local progress, since it is taken against
the same anchor), and the heartbeat thread rejoins the shard when it is back.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable, Mapping

import grpc
import torch

from diloco.learner.host_copy import HostCopy, copy_to_host
from diloco.learner.schedule import LearnerSchedule, merged_fragment
from diloco.localcluster.wan import WanLink
from diloco.services.client import PullResult, ShardClient, StateHashMismatch, TransferObserver
from diloco.services.contract.codecs import ErrorFeedback, get_codec
from diloco.services.contract.config import Config
from diloco.services.contract.fragments import Fragment, FragmentPlan, assemble, pieces, scatter, to_device
from diloco.services.contract.state import state_hash
from diloco.services.contract.tls import Identity
from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)

# A shard that does not answer is retried after this long, doubling up to the cap.
RETRY_INITIAL_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0
# How long the last pull after training keeps retrying a shard that is down.
FINAL_PULL_SECONDS = 60.0
# Errors that mean "the shard is down or restarting", not "we sent something wrong".
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED}


class JoinRefused(RuntimeError):
    """A shard this learner cannot train with: other sync settings, another model, or a
    refusal of the learner itself. Retrying cannot help: the learner stops."""


def settings_differences(shard_index: int, settings: pb.ClusterSettings, cfg: Config) -> list[str]:
    """'key: shard i uses X, this learner Y' for each setting of a shard's JoinResponse that
    differs from this learner's config."""
    def codec_name(key: str | int) -> str:
        try:
            return get_codec(key).name
        except ValueError:
            return f"codec {key}"

    pairs = {
        "sync.fragments": (settings.fragments, cfg.sync.fragments),
        "sync.interval_steps": (settings.sync_interval_steps, cfg.sync.interval_steps),
        "sync.overlap_steps": (settings.overlap_steps, cfg.sync.overlap_steps),
        "sync.mix_alpha": (settings.mix_alpha, cfg.sync.mix_alpha),
        "sync.codec": (codec_name(settings.codec), codec_name(cfg.sync.codec)),
        "sync.codec_block_size": (settings.codec_block_size, cfg.sync.codec_block_size),
        "sync.fragmentation": (settings.fragmentation, cfg.sync.fragmentation),
        "syncer.max_staleness": (settings.max_staleness, cfg.syncer.max_staleness),
        "syncer.lease_seconds": (settings.lease_seconds, cfg.syncer.lease_seconds),
        "trainer.heartbeat_seconds": (settings.heartbeat_interval_seconds, cfg.trainer.heartbeat_seconds),
        "shards (count)": (settings.shards, len(cfg.shards)),
    }
    return [f"{key}: shard {shard_index} uses {theirs}, this learner {ours}"
            for key, (theirs, ours) in pairs.items() if theirs != ours]


@dataclass
class FragmentSync:
    """What a learner keeps per fragment between syncs, besides its schedule
    (LearnerSchedule.fragments)."""
    fragment: Fragment
    anchor: torch.Tensor  # the global value g_p at `version`, fp32 flat
    version: int
    feedback: ErrorFeedback
    in_flight: Future | None = None
    pushed: threading.Event = field(default_factory=threading.Event)  # the in-flight push was answered
    # The fragment after the apply step of a result that was not in by then (fp32, copied to the
    # host): the steps trained since are kept on top of the result (merged_fragment).
    local_at_apply: HostCopy | None = None


@dataclass(frozen=True)
class PushMeta:
    """What an outer gradient's push says besides its payload."""
    fragment_id: int
    base_version: int
    c_steps: int
    c_tokens: int
    step_seconds: float


@dataclass
class SyncOutcome:
    """The result of one background push + pull."""
    anchor: torch.Tensor | None  # new global value, None when the shard was unreachable
    version: int
    push_result: int = pb.PUSH_RESULT_UNSPECIFIED
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    reanchored: bool = False  # the anchor is the shard's value after it lost the one we held
    staged: torch.Tensor | None = None  # the anchor in pinned memory (a model on a GPU): copied there without a wait


@dataclass
class SyncStats:
    """Counters the learner reports (metrics, final report)."""
    syncs_started: int = 0
    syncs_applied: int = 0
    syncs_skipped: int = 0  # shard unreachable: progress kept for the next sync
    syncs_late: int = 0  # applied after the loop stopped waiting for them
    held_steps: int = 0  # steps the sync schedule stood still to fall back into phase
    refused_stale: int = 0
    syncs_refused: int = 0  # pushes the shard refused with an error (not "unreachable", not "rejoin")
    blocked_seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    transfer_seconds: float = 0.0  # time pushes and pulls spent on the wire
    versions_behind_at_join: int = 0
    reanchored: int = 0  # fragments taken from a shard that served them below our version
    hash_mismatches: int = 0  # pulls whose result did not have the shard's hash: pulled again whole
    push_results: dict[str, int] = field(default_factory=dict)


class ShardLink:
    """One shard: its client and whether this learner is a member of it (its Join was accepted;
    the fragments it lacked may still be being seeded or restored)."""

    def __init__(self, index: int, client: ShardClient):
        self.index = index
        self.client = client
        self.joined = False


class StreamingSync:
    """One learner's sync with every shard: joins, seeds or restores, pushes and pulls on
    background threads with retries, heartbeats and rejoins; every decision of when and how
    is its `schedule`'s (LearnerSchedule)."""

    def __init__(self, cfg: Config, learner_id: str, region: str,
                 params: Mapping[str, torch.Tensor], plan: FragmentPlan,
                 incarnation: int | None = None, observer: TransferObserver | None = None, *,
                 identity: Identity | None):
        self.cfg = cfg
        self.learner_id = learner_id
        self.region = region
        self.params = params
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.manifest = [(name, tuple(p.shape)) for name, p in params.items()]
        self.plan = plan
        self._on_gpu = any(p.is_cuda for p in params.values())
        self.codec = get_codec(cfg.sync.codec)
        wan = WanLink(cfg.rpc.wan_mbps) if cfg.rpc.wan_mbps else None
        self.links = [ShardLink(i, ShardClient(s.address, cfg.rpc, learner_id, self.incarnation, wan, observer,
                                                 identity=identity))
                      for i, s in enumerate(cfg.shards)]
        self.fragments: dict[int, FragmentSync] = {}
        self.schedule = LearnerSchedule(cfg, plan)
        self.stats = SyncStats()
        self.step = 0
        self.step_seconds = 0.0
        self.tokens_per_second = 0.0
        self.tokens = 0  # trained by this learner (every rank of its island)
        self._lock = threading.Lock()  # guards link.joined and heartbeat-visible fields
        self._stop = threading.Event()
        self._should_stop: Callable[[], bool] = lambda: False  # set by start()
        self._left = threading.Event()  # the learner said goodbye: no heartbeats, no rejoining
        self._started = threading.Event()  # start() is done: heartbeat threads rejoin from now on
        # One thread per fragment: a sync waiting for its round must never keep another
        # fragment's push from going out (that push may be what closes the round).
        self._pool = ThreadPoolExecutor(max_workers=len(plan.fragments), thread_name_prefix="sync")
        self._heartbeats: list[threading.Thread] = []
        # Fragments a shard serves below the version this learner holds (it lost its state and
        # did not take ours back): their next sync re-anchors instead of pushing.
        self._reanchor_due: set[int] = set()
        self._restored: Mapping[int, Mapping[str, torch.Tensor | int]] = {}  # a checkpoint's, while starting
        self.failure: JoinRefused | None = None  # a rejoin refused for good: the learner must stop

    # ---- start-up: join, seed, pull every fragment --------------------------------

    def start(self, restored: Mapping[str, object] | None = None,
              should_stop: Callable[[], bool] = lambda: False, step: int = 0, tokens: int = 0) -> int:
        """Joins every shard (retrying until each answers), seeds fragments nobody has
        seeded, pulls every fragment and moves the model onto the global values.

        `restored` is the sync state of a checkpoint (see state_dict); with it the
        learner pulls only the updates it missed. `should_stop` (the process was asked to
        stop) also ends waits for a round's result. `step` and `tokens` are where training
        resumes.
        Returns how many versions it was behind, summed over fragments.
        """
        self._should_stop = should_stop
        self.step, self.tokens = step, tokens
        self._restored = (restored or {}).get("fragments", {})
        # One heartbeat thread per shard: a shard that does not answer must not keep the
        # others from hearing this learner before its lease on them runs out. They start
        # before the joins: seeding and pulling a large model can take longer than a lease.
        self._heartbeats = [threading.Thread(target=self._heartbeat_loop, args=(link,), daemon=True,
                                             name=f"heartbeat-{link.index}") for link in self.links]
        for thread in self._heartbeats:
            thread.start()
        for link in self.links:
            self._join_with_retry(link, should_stop)
        self._join_in_phase()
        behind = 0
        for fragment in self.plan.fragments:
            link = self.links[fragment.shard]
            saved = self._restored.get(fragment.id)
            pull_started = time.perf_counter()
            result, anchor, reanchored = self._retry(link, should_stop,
                                                     lambda: self._pull_at_start(link, fragment.id, saved))
            self.stats.transfer_seconds += time.perf_counter() - pull_started
            if anchor is None:
                raise RuntimeError(f"fragment {fragment.id}: shard {link.index} sent no value")
            version = result.version if result.version is not None else saved["version"]
            behind += max(0, version - (saved["version"] if saved else version))
            self.stats.bytes_down += result.payload_bytes
            feedback = ErrorFeedback(self.codec, fragment.numel, self.cfg.sync.codec_block_size)
            if saved and not reanchored:  # a residual built on another value means nothing
                feedback.residual = saved["residual"].clone()
            state = FragmentSync(fragment, anchor, version, feedback)
            with self._lock:  # heartbeat threads read held_versions meanwhile
                self.fragments[fragment.id] = state
            if saved:
                # Keep local progress since the checkpoint's anchor, like any merge.
                self._adopt(state, anchor, version)
            else:
                scatter(fragment, anchor, self.params)
        self._restored = {}
        self.stats.versions_behind_at_join = behind
        log.info("learner %s (incarnation %d) joined %d shards; %d versions behind; syncing at step + %d",
                 self.learner_id, self.incarnation, len(self.links), behind, self.schedule.sync_offset)
        self._started.set()
        return behind

    def _join_in_phase(self) -> None:
        """Starts the sync schedule in phase with the learners already training, as the first
        shard that answers Status sees them (none answers: at this learner's own step)."""
        for link in self.links:
            try:
                learners = link.client.status(timeout=self.cfg.rpc.deadline_seconds).learners
            except grpc.RpcError:
                continue
            self.schedule.join_in_phase(learners, self.learner_id, self.step)
            return

    def _join(self, link: ShardLink) -> None:
        """Joins one shard, checking it runs this learner's model with its sync settings (else
        JoinRefused), and seeds or restores the fragments it lacks."""
        try:
            reply = link.client.join(self.region, self.manifest)
        except grpc.RpcError as exc:
            # Not in the run (PERMISSION_DENIED), another model (FAILED_PRECONDITION), ...
            if exc.code() in UNREACHABLE:
                raise
            raise JoinRefused(f"shard {link.index} refused this learner: {exc.code().name} {exc.details()}") from None
        differences = settings_differences(link.index, reply.settings, self.cfg)
        if differences:
            raise JoinRefused(f"shard {link.index} runs other sync settings than this learner's config: "
                              + "; ".join(differences))
        if reply.plan_digest != self.plan.digest:
            raise JoinRefused(f"shard {link.index} uses plan {reply.plan_digest[:12]}, this learner "
                              f"{self.plan.digest[:12]}: model or sync settings differ")
        with self._lock:
            link.joined = True  # heartbeats keep the lease while seeding
        try:
            for info in reply.fragments:
                fragment = self.plan.fragments[info.fragment_id]
                held = self._held(fragment.id)
                if held is not None and held[0] >= 1 and (not info.initialized or info.version < held[0]):
                    self._restore(link, fragment, info, *held)
                elif not info.initialized:
                    self._seed(link, fragment, copy_to_host(fragment, self.params).wait())
        except BaseException:
            with self._lock:  # joining again seeds what is still missing
                link.joined = False
            raise

    def _held(self, fragment_id: int) -> tuple[int, torch.Tensor] | None:
        """(version, global value) this learner holds of a fragment: while starting, its
        checkpoint's; None when it holds none."""
        with self._lock:
            state = self.fragments.get(fragment_id)
            if state is not None:
                return state.version, state.anchor
        saved = self._restored.get(fragment_id)
        return (saved["version"], saved["anchor"]) if saved else None

    def _restore(self, link: ShardLink, fragment: Fragment, info: pb.FragmentInfo, version: int,
                 anchor: torch.Tensor) -> None:
        """The shard serves the fragment below the version we hold (or not at all): it lost its
        state. Offer it our global value back (RESTORE); if it does not take it, take the
        shard's value instead at our next sync of the fragment (re-anchor)."""
        served = f"at version {info.version}" if info.initialized else "unseeded"
        try:
            reply = link.client.push(fragment.id, anchor, codec="fp32", block_size=self.cfg.sync.codec_block_size,
                                     kind=pb.PUSH_KIND_RESTORE, base_version=version, state_hash=state_hash(anchor))
            if reply.result == pb.PUSH_RESULT_RESTORED:
                log.warning("shard %d held fragment %d %s: restored it at version %d",
                            link.index, fragment.id, served, version)
                return
            answer = pb.PushResult.Name(reply.result)
        except grpc.RpcError as exc:
            if exc.code() in UNREACHABLE:
                raise
            answer = f"{exc.code().name} {exc.details()}"
        log.warning("shard %d holds fragment %d %s, below our version %d, and did not restore it (%s): "
                    "re-anchoring to its value", link.index, fragment.id, served, version, answer)
        if not info.initialized:  # the run's value at `version` is a better start than local weights
            self._seed(link, fragment, anchor)
        with self._lock:
            self._reanchor_due.add(fragment.id)

    def _seed(self, link: ShardLink, fragment: Fragment, value: torch.Tensor) -> None:
        try:
            link.client.push(fragment.id, value, codec="fp32",
                             block_size=self.cfg.sync.codec_block_size, kind=pb.PUSH_KIND_SEED)
            log.info("seeded fragment %d on shard %d", fragment.id, link.index)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:  # another learner was first: fine
                raise

    def _take_reanchor_due(self, fragment_id: int) -> bool:
        with self._lock:
            due = fragment_id in self._reanchor_due
            self._reanchor_due.discard(fragment_id)
        return due

    def _pull_at_start(self, link: ShardLink, fragment_id: int,
                       saved: Mapping[str, torch.Tensor | int] | None) -> tuple[PullResult, torch.Tensor | None, bool]:
        """(the pull, the fragment's value after it, whether that re-anchored a checkpoint's
        value): the updates since the checkpoint's version, or a snapshot without one or when
        the shard serves the fragment below it."""
        if saved is not None and not self._take_reanchor_due(fragment_id):
            try:
                return *self._apply_checked(link, link.client.pull(fragment_id, saved["version"]),
                                            saved["anchor"]), False
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # our version is ahead of it
                    raise
                log.warning("fragment %d: shard %d: %s", fragment_id, link.index, exc.details())
        result, value = self._apply_checked(link, link.client.pull(fragment_id), None)
        reanchored = saved is not None
        if reanchored:
            self._count_reanchor(fragment_id, saved["version"], result.version)
        return result, value, reanchored

    def _apply_checked(self, link: ShardLink, result: PullResult,
                       base: torch.Tensor | None) -> tuple[PullResult, torch.Tensor | None]:
        """(the pull, the value after its items on `base`, which is left as it was). A value that
        does not have the hash the shard sent (an update of the shard's that did not make its
        version, a wrong base) is pulled again as a snapshot, counted."""
        try:
            return result, result.apply(None if base is None else base.clone())
        except StateHashMismatch as mismatch:
            with self._lock:
                self.stats.hash_mismatches += 1
            log.warning("%s: pulling a snapshot from shard %d", mismatch, link.index)
        snapshot = link.client.pull(result.fragment_id)
        snapshot.payload_bytes += result.payload_bytes
        return snapshot, snapshot.apply(None)

    def _count_reanchor(self, fragment_id: int, ours: int, theirs: int) -> None:
        with self._lock:
            self.stats.reanchored += 1
        log.warning("fragment %d: re-anchored from version %d to the shard's version %d", fragment_id, ours, theirs)

    def _join_with_retry(self, link: ShardLink, should_stop: Callable[[], bool]) -> None:
        self._retry(link, should_stop, lambda: self._join(link))

    def _retry(self, link: ShardLink, should_stop: Callable[[], bool], call):
        delay = RETRY_INITIAL_SECONDS
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in UNREACHABLE or should_stop():
                    raise
                log.warning("shard %d unreachable (%s); retrying in %.1fs",
                            link.index, exc.code().name, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    # ---- the per-step hooks ---------------------------------------------------------

    def after_step(self, step: int, tokens: int, step_seconds: float) -> list[int]:
        """Call after inner step `step` (0-based) has updated the model. Starts the syncs due
        at this step (their outer gradient includes it) and applies those started tau steps
        ago (tau = 0: at once, waiting for the result). Returns the fragment ids applied."""
        if self.failure is not None:
            raise self.failure
        self.step = step + 1
        self.tokens += tokens
        self.step_seconds = step_seconds
        self.tokens_per_second = tokens / step_seconds if step_seconds > 0 else 0.0
        actions = self.schedule.step_done(step, tokens)
        if actions.held:
            self.stats.held_steps += 1
        for fragment_id in actions.start:
            self._start_sync(self.fragments[fragment_id])
        applied = []
        for fragment_id in actions.apply:
            wait_limit = self.schedule.fragments[fragment_id].wait_limit()
            if self._finish_sync(self.fragments[fragment_id], wait_limit):
                applied.append(fragment_id)
        return applied

    def flush(self) -> None:
        """Applies every in-flight sync (training stopped before its end), waiting as long as it
        takes: the checkpoint must hold the results, or a restart would push the same progress
        again under its new incarnation."""
        for state in self.fragments.values():
            if state.in_flight is not None:
                self._finish_sync(state, wait_limit=None)

    def deliver(self) -> None:
        """Budget spent: waits until every in-flight push has been answered, but not for the
        rounds to close. The shards hold this learner's last contributions durably, the rounds
        close without it once it has left, and catch_up pulls what they made."""
        for state in self.fragments.values():
            if state.in_flight is not None:
                state.pushed.wait()

    def _start_sync(self, state: FragmentSync) -> None:
        """Snapshots the fragment now; everything else runs on the background thread."""
        fragment = state.fragment
        local = copy_to_host(fragment, self.params)  # the only work on the training thread
        counters = self.schedule.fragments[fragment.id]
        meta = PushMeta(fragment.id, state.version, counters.steps_since_sync, counters.tokens_since_sync,
                        self.step_seconds)
        state.pushed.clear()
        if self._take_reanchor_due(fragment.id):
            state.in_flight = self._pool.submit(self._reanchor, self.links[fragment.shard], state)
        else:
            state.in_flight = self._pool.submit(self._push_and_pull, self.links[fragment.shard], state,
                                                state.anchor, local, meta)
        self.stats.syncs_started += 1

    def _push_and_pull(self, link: ShardLink, state: FragmentSync, anchor: torch.Tensor,
                       local: HostCopy, meta: PushMeta) -> SyncOutcome:
        """Runs on the sync thread: compress the outer gradient, push it, pull the result.
        While it runs the training thread leaves `state.feedback` and `anchor` alone."""
        try:
            return self._push_then_pull(link, state, anchor, local.wait(), meta)
        finally:
            state.pushed.set()  # also when the push never went out

    def _push_then_pull(self, link: ShardLink, state: FragmentSync, anchor: torch.Tensor,
                        local: torch.Tensor, meta: PushMeta) -> SyncOutcome:
        started = time.perf_counter()
        fragment_id, version = meta.fragment_id, meta.base_version
        if not link.joined:
            return SyncOutcome(None, version)
        residual_before = state.feedback.residual
        try:
            payload, _ = state.feedback.compress(anchor - local)
        except ValueError as exc:  # non-finite values: never send them
            log.error("fragment %d: not pushing: %s", fragment_id, exc)
            return SyncOutcome(None, version)
        try:
            push_result, round_version = self._deliver(link, payload, meta)
        except grpc.RpcError as exc:
            # Lost push: undo the residual update so nothing is counted twice; the next
            # outer gradient still holds this progress.
            state.feedback.residual = residual_before
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                with self._lock:
                    link.joined = False  # the shard forgot us (restart): heartbeat rejoins
            elif exc.code() not in UNREACHABLE:
                with self._lock:
                    self.stats.syncs_refused += 1
            log.warning("fragment %d: push to shard %d failed: %s %s", fragment_id, link.index,
                        exc.code().name, exc.details())
            return SyncOutcome(None, version)
        # Delivered: the shard holds this contribution, so the residual stays as compressed
        # and the round's result is what comes next, however long the shard takes to give it.
        state.pushed.set()
        outcome = SyncOutcome(None, version, push_result, bytes_up=len(payload))
        try:
            if push_result == pb.PUSH_RESULT_REFUSED_STALE:
                # Too stale to merge: re-anchor to the current global value.
                result = self._retry(link, self._stopping, lambda: link.client.pull(fragment_id, version))
            else:
                result = self._pull_round_result(link, fragment_id, version, round_version)
            if result is None:
                return outcome
            result, outcome.anchor = self._apply_checked(link, result, anchor)
            if outcome.anchor is not None and self._on_gpu:
                outcome.staged = outcome.anchor.pin_memory()  # here, not on the training thread
        except StateHashMismatch as mismatch:  # a snapshot too: nothing to trust from this shard now
            log.error("%s; skipping this sync", mismatch)
            return outcome
        except grpc.RpcError as exc:
            log.warning("fragment %d: pull from shard %d failed: %s %s", fragment_id, link.index,
                        exc.code().name, exc.details())
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The shard serves the fragment below our version (it lost its state, and our
                # contribution with it): rejoining offers it our value back, or re-anchors.
                with self._lock:
                    link.joined = False
            return outcome
        outcome.version = result.version if result.version is not None else version
        outcome.bytes_down = result.payload_bytes
        outcome.seconds = time.perf_counter() - started
        return outcome

    def _reanchor(self, link: ShardLink, state: FragmentSync) -> SyncOutcome:
        """Runs on the sync thread instead of a push: takes the shard's value of a fragment it
        serves below our version (the residual was built on our value: it is dropped)."""
        try:
            started = time.perf_counter()
            result, value = self._retry(link, self._stopping, lambda: self._apply_checked(
                link, link.client.pull(state.fragment.id), None))
            outcome = SyncOutcome(value, result.version, bytes_down=result.payload_bytes,
                                  seconds=time.perf_counter() - started, reanchored=True)
        except (grpc.RpcError, StateHashMismatch) as exc:
            log.warning("fragment %d: re-anchoring on shard %d failed: %s", state.fragment.id, link.index, exc)
            with self._lock:
                self._reanchor_due.add(state.fragment.id)  # at the next sync, then
            return SyncOutcome(None, state.version)
        finally:
            state.pushed.set()
        return outcome

    def _deliver(self, link: ShardLink, payload: bytes, meta: PushMeta) -> tuple[int, int]:
        """Pushes an outer gradient: (the shard's answer, the version of the round that holds
        it). ALREADY_EXISTS is an answer too: an earlier attempt of this push (its reply lost
        to a shard restart) is held by the shard, so it is delivered, in the round after its
        base version at the earliest."""
        try:
            reply = link.client.push(meta.fragment_id, payload, codec=self.codec,
                                     block_size=self.cfg.sync.codec_block_size, base_version=meta.base_version,
                                     c_steps=meta.c_steps, c_tokens=meta.c_tokens, step_seconds=meta.step_seconds,
                                     numel=self.plan.fragments[meta.fragment_id].numel)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            log.info("fragment %d: shard %d already holds this contribution: %s", meta.fragment_id,
                     link.index, exc.details())
            return pb.PUSH_RESULT_ACCEPTED, meta.base_version + 1
        return reply.result, reply.current_version + 1

    def _stopping(self) -> bool:
        """Shutting down, or asked to stop: waits for a shard must end."""
        return self._stop.is_set() or self._should_stop()

    def _pull_round_result(self, link: ShardLink, fragment_id: int, version: int,
                           round_version: int) -> PullResult | None:
        """Pulls until the round holding our delivered contribution has closed, across shard
        restarts (the round is durable on the shard). The contribution is already merged (or
        durable in the open round), so taking an older value now would push the same progress
        twice next time: wait for it instead (the training thread only blocks if this outlasts
        the overlap window). None once stopping."""
        while True:
            try:
                result = self._retry(link, self._stopping, lambda: link.client.pull(
                    fragment_id, version, min_version=round_version,
                    max_wait_seconds=self.cfg.syncer.lease_seconds))
            except grpc.RpcError as exc:
                if exc.code() in UNREACHABLE:  # stopping while the shard is down
                    return None
                raise
            if result.version is not None and result.version >= round_version:
                return result
            # Shutting down; or asked to stop while a round cannot close (synchronous rounds
            # wait for a learner that is down): the training thread must not block on it.
            if self._stopping():
                return None

    def _finish_sync(self, state: FragmentSync, wait_limit: float | None) -> bool:
        """Applies the in-flight result, waiting up to `wait_limit` seconds for it (None: as
        long as it takes). Returns whether a new global value was applied; False also while
        the result is still out (it stays in flight)."""
        fragment_schedule = self.schedule.fragments[state.fragment.id]
        future = state.in_flight
        if not future.done() and wait_limit != 0:
            started = time.perf_counter()
            wait([future], timeout=wait_limit)
            waited = time.perf_counter() - started
            fragment_schedule.waited(waited)
            self.stats.blocked_seconds += waited
        if not future.done():
            if fragment_schedule.missed():
                log.debug("fragment %d: result still out after %.2fs; training on", state.fragment.id,
                          fragment_schedule.blocked_seconds)
                state.local_at_apply = copy_to_host(state.fragment, self.params)
            return False
        outcome: SyncOutcome = future.result()
        state.in_flight = None
        self.stats.bytes_up += outcome.bytes_up
        self.stats.bytes_down += outcome.bytes_down
        self.stats.transfer_seconds += outcome.seconds
        if not outcome.reanchored:
            name = pb.PushResult.Name(outcome.push_result)
            self.stats.push_results[name] = self.stats.push_results.get(name, 0) + 1
        local_at_apply, state.local_at_apply = state.local_at_apply, None
        applied = outcome.anchor is not None
        if self.schedule.result_arrived(state.fragment.id, self.step - 1, self.step_seconds, applied):
            self.stats.syncs_late += 1
        if not applied:
            self.stats.syncs_skipped += 1
            return False
        if outcome.push_result == pb.PUSH_RESULT_REFUSED_STALE:
            self.stats.refused_stale += 1
            state.feedback.residual.zero_()  # what it held was built on a stale anchor
        if outcome.reanchored:
            self._count_reanchor(state.fragment.id, state.version, outcome.version)
            state.feedback.residual.zero_()  # what it held was built on a value the run lost
        self._adopt(state, outcome.anchor, outcome.version, local_at_apply, outcome.staged)
        self.stats.syncs_applied += 1
        return True

    def _adopt(self, state: FragmentSync, global_value: torch.Tensor, version: int,
               local_at_apply: HostCopy | None = None, staged: torch.Tensor | None = None) -> None:
        """The one way a new global value is taken: it becomes the anchor, and the model's
        fragment is merged with it (merged_fragment; `local_at_apply` for a late result) one
        tensor at a time, in fp32 on the model's device: no fragment-sized buffer there. From
        pinned memory (`staged`, the same values) the copies to the GPU queue without waiting."""
        with self._lock:  # read as a pair by a rejoin's _held
            state.anchor, state.version = global_value, version
        source = global_value if staged is None else staged
        if self.cfg.sync.mix_alpha == 0 and local_at_apply is None:  # overwritten: straight from the host
            scatter(state.fragment, source, self.params)
            return
        at_apply = repeat(None) if local_at_apply is None else \
            (piece for _, piece in pieces(state.fragment, local_at_apply.wait(), self.params))
        with torch.no_grad():
            for (param, global_piece), at_apply_piece in zip(pieces(state.fragment, source, self.params), at_apply):
                param.copy_(merged_fragment(self.cfg.sync.mix_alpha, to_device(global_piece, param.device),
                                            param.float(), None if at_apply_piece is None
                                            else to_device(at_apply_piece, param.device)))

    # ---- heartbeats, leave, final state ---------------------------------------------

    def held_versions(self) -> dict[int, int]:
        with self._lock:
            return {fid: s.version for fid, s in self.fragments.items()}

    def leave(self) -> None:
        """Budget spent: stop counting towards any round (a synchronous round would wait for
        this learner forever) but keep pulling the global values."""
        self._left.set()
        for thread in self._heartbeats:  # they must not rejoin behind our back
            thread.join()
        for link in self.links:
            if link.joined:
                try:
                    link.client.leave()
                except grpc.RpcError as exc:
                    log.warning("leave shard %d: %s", link.index, exc.code().name)
            link.joined = False

    def _heartbeat_loop(self, link: ShardLink) -> None:
        """Heartbeats one shard, rejoining it when it forgot this learner. Each call's deadline
        is half a lease: a shard that hangs is given up on in time to try again."""
        interval = self.cfg.trainer.heartbeat_seconds
        deadline = min(self.cfg.rpc.deadline_seconds, self.cfg.syncer.lease_seconds / 2)
        while not self._stop.wait(interval) and not self._left.is_set():
            try:
                if not link.joined:
                    if not self._started.is_set():
                        continue  # start() joins it
                    self._join(link)
                    log.info("rejoined shard %d", link.index)
                held = {fid: v for fid, v in self.held_versions().items()
                        if self.plan.fragments[fid].shard == link.index}
                tokens, tokens_per_second = self.tokens, self.tokens_per_second
                reply = link.client.heartbeat(self.step, self.step_seconds, tokens_per_second, held,
                                              sync_step=self.step + self.schedule.sync_offset, tokens=tokens,
                                              timeout=deadline)
                self.schedule.heard_run_tokens(reply.run_tokens, reply.run_tokens_per_second, tokens, tokens_per_second)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    with self._lock:
                        link.joined = False
                elif exc.code() not in UNREACHABLE:
                    log.warning("heartbeat to shard %d: %s %s", link.index, exc.code().name, exc.details())
            except JoinRefused as refused:  # the training thread raises it at its next step
                self.failure = refused
                return

    def catch_up(self, quiet_seconds: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """After training: keep pulling until no fragment changed for `quiet_seconds` or
        until stopped, then pull once more, so this learner ends holding the run's final
        global values."""
        quiet_since = time.monotonic()
        while not should_stop() and time.monotonic() - quiet_since < quiet_seconds:
            changed, reached_all = self._pull_new_versions(wait_seconds=0.2)
            if changed or not reached_all:  # a shard that is down is not quiet
                quiet_since = time.monotonic()
        # The last pull must reach every shard: one that is restarting is retried.
        deadline = time.monotonic() + FINAL_PULL_SECONDS
        delay = RETRY_INITIAL_SECONDS
        while not self._pull_new_versions(wait_seconds=0.0)[1] and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    def _pull_new_versions(self, wait_seconds: float) -> tuple[bool, bool]:
        """(whether any fragment changed, whether every shard answered)."""
        changed, reached_all = False, True
        for state in self.fragments.values():
            link = self.links[state.fragment.shard]
            try:
                result, value = self._pull_or_reanchor(link, state, wait_seconds)
            except grpc.RpcError as exc:
                if exc.code() not in UNREACHABLE:
                    raise
                reached_all = False
                continue
            except StateHashMismatch as mismatch:  # a snapshot too: ask again
                log.error("%s", mismatch)
                reached_all = False
                continue
            if result.items:
                self._adopt(state, value, result.version)
                self.stats.bytes_down += result.payload_bytes
                changed = True
        return changed, reached_all

    def _pull_or_reanchor(self, link: ShardLink, state: FragmentSync,
                          wait_seconds: float) -> tuple[PullResult, torch.Tensor | None]:
        """The fragment's versions after ours, or the shard's value where it serves the fragment
        below our version (re-anchored; an unseeded one: we keep ours)."""
        try:
            return self._apply_checked(link, link.client.pull(state.fragment.id, state.version,
                                                              min_version=state.version + 1,
                                                              max_wait_seconds=wait_seconds), state.anchor)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("fragment %d: shard %d: %s", state.fragment.id, link.index, exc.details())
        try:
            result = link.client.pull(state.fragment.id)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("fragment %d: shard %d serves no value: keeping ours at version %d",
                        state.fragment.id, link.index, state.version)
            return PullResult(state.fragment.id, [], "", 0), None
        self._count_reanchor(state.fragment.id, state.version, result.version)
        state.feedback.residual.zero_()
        return self._apply_checked(link, result, None)

    def fragment_hashes(self) -> dict[int, tuple[int, str]]:
        """(version, sha256) of the global value this learner holds, per fragment."""
        return {fid: (s.version, state_hash(s.anchor)) for fid, s in self.fragments.items()}

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The run's global model as this learner holds it (the anchors: after catch_up, the
        shards' final values), fp32, by parameter name; the local model stays as it is."""
        return assemble(self.manifest, ((state.fragment, state.anchor) for state in self.fragments.values()))

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume syncing without a full pull (the tensors
        themselves, not copies; checkpoint_state copies them)."""
        return {"incarnation": self.incarnation, "fragments": {
            fid: {"version": s.version, "anchor": s.anchor, "residual": s.feedback.residual}
            for fid, s in self.fragments.items()}}

    def close(self, leave: bool = True) -> None:
        self._stop.set()
        for thread in self._heartbeats:
            thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if leave:
            self.leave()
        for link in self.links:
            link.client.close()
