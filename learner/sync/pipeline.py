"""One fragment's sync, from the snapshot of its values to the new global value merged into
the model: compress the outer gradient `anchor - theta` (with error feedback), push it, pull
the round's result, all on a background thread while training goes on; then, when the
training thread takes the result, merge it (learner/sync/schedule.py: merged_fragment).

What it keeps is fp32 whatever the training dtype: the anchor (the global value at
`version`) in host memory, where pulls are decoded and checked against the shard's state hash;
on a GPU also the anchor's copy and the error-feedback residual on the device, where the outer
gradient is compressed (learner/sync/outer_gradient.py), on the CPU the residual in host memory.
Results are merged on the model's device one tensor at a time and cast to each parameter's
dtype between steps.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Mapping

import grpc
import torch

from diloco.learner.sync.healing import Healing
from diloco.learner.sync.host_copy import HostCopy, copy_to_host
from diloco.learner.sync.outer_gradient import OuterGradient
from diloco.learner.sync.schedule import SyncStart, merged_fragment
from diloco.learner.sync.session import ReanchorDue, ShardSession
from diloco.learner.sync.shard_errors import Remedy, reason, refusal_reason, remedy
from diloco.learner.sync.stats import SyncOutcome, SyncStats
from diloco.services.client import PullResult
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.config import Config
from diloco.services.contract.fragments import Fragment, pieces, scatter, to_device
from diloco.services.contract.state import StateHashMismatch
from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushMeta:
    """What an outer gradient's push says besides its payload."""
    base_version: int
    c_steps: int
    c_tokens: int
    step_seconds: float
    final: bool = False  # the learner's last contribution of the fragment (RunEnd.deliver)


@dataclass(frozen=True)
class SyncContext:
    """What every fragment's pipeline of one learner shares."""
    cfg: Config
    params: Mapping[str, torch.Tensor]
    pool: ThreadPoolExecutor  # a thread per fragment: a sync waiting for its round never holds up another's push
    stats: SyncStats
    reanchor_due: ReanchorDue
    healing: Healing  # what the pushes met: NaN, outlier refusals (learner/sync/healing.py)
    stopping: Callable[[], bool]  # shutting down, or asked to stop: waits for a shard end


class FragmentPipeline:
    """One fragment: its anchor, version and residual, and its sync in flight."""

    def __init__(self, fragment: Fragment, anchor: torch.Tensor, version: int, feedback: ErrorFeedback,
                 session: ShardSession, context: SyncContext):
        self.fragment = fragment
        self.anchor = anchor  # the global value at `version`, fp32 flat, in host memory
        self.version = version
        self.feedback = feedback
        self.session = session
        self.context = context
        self.in_flight: Future | None = None
        self.pushed = threading.Event()  # the in-flight push was answered (or never went out)
        # The fragment after the apply step of a result that was not in by then (fp32, on the
        # host): the steps trained since are kept on top of the result (merged_fragment).
        self.local_at_apply: HostCopy | None = None
        # Why the last push did not get through, and what the shard asked: None once one did.
        self.undelivered: tuple[Remedy, str] | None = None
        # The last push's time from its start until the shard held it, until the training
        # thread takes it for the schedule (LearnerSchedule.pushed): as soon as it is known.
        self.push_seconds: float | None = None
        self._on_gpu = any(p.is_cuda for p in context.params.values())
        # On a GPU: the anchor's copy on the fragment's device, what outer gradients are taken against.
        self.device_anchor = anchor.to(feedback.device, copy=True) if feedback.device.type == "cuda" else None
        self._lock = threading.Lock()  # anchor and version are read as a pair by a rejoin

    def held(self) -> tuple[int, torch.Tensor]:
        with self._lock:
            return self.version, self.anchor

    # ---- the training thread ------------------------------------------------------------

    def start(self, c_steps: int, c_tokens: int, step_seconds: float) -> None:
        """Snapshots the fragment now (the training thread's only work, and on a GPU launching
        its compression: learner/sync/outer_gradient.py); the rest runs on the fragment's sync
        thread. The counters are the push's (LearnerSchedule)."""
        meta = PushMeta(self.version, c_steps, c_tokens, step_seconds)
        self.pushed.clear()
        if self.context.reanchor_due.take(self.fragment.id):
            self.in_flight = self.context.pool.submit(self._reanchor)
        else:
            self.in_flight = self.context.pool.submit(self.exchange, self.anchor, self._outer_gradient(), meta)

    def _outer_gradient(self) -> OuterGradient:
        anchor = self.anchor if self.device_anchor is None else self.device_anchor
        return OuterGradient(self.fragment, self.context.params, anchor, self.feedback)

    def wait(self, limit: float | None) -> float:
        """Waits up to `limit` seconds (None: as long as it takes) for the sync in flight;
        returns the seconds waited."""
        if self.in_flight.done() or limit == 0:
            return 0.0
        started = time.perf_counter()
        wait([self.in_flight], timeout=limit)
        return time.perf_counter() - started

    def take_push_seconds(self) -> float | None:
        """The last push's time, once (None: no push got through since the last call)."""
        seconds, self.push_seconds = self.push_seconds, None
        return seconds

    def result_in(self) -> bool:
        return self.in_flight.done()

    def heal(self) -> None:
        """The model's fragment takes back the global value it holds, once the push in flight is
        answered (the sync thread then leaves the residual alone); what sick values built is dropped."""
        if self.in_flight is not None:
            self.pushed.wait()
        scatter(self.fragment, self.anchor if self.device_anchor is None else self.device_anchor,
                self.context.params)
        self.feedback.residual.zero_()
        self.local_at_apply = None

    def keep_local_at_apply(self) -> None:
        """The result missed its apply step: the values now are what it is merged with."""
        self.local_at_apply = copy_to_host(self.fragment, self.context.params)
        self.context.stats.copied_to_host(self.local_at_apply.device_to_host_bytes)

    def take(self) -> tuple[SyncOutcome, HostCopy | None]:
        """The finished sync's outcome (the sync is no longer in flight) and, for a late
        result, the fragment's values kept at its apply step."""
        outcome: SyncOutcome = self.in_flight.result()
        self.in_flight = None
        local_at_apply, self.local_at_apply = self.local_at_apply, None
        if outcome.anchor is not None and (outcome.reanchored or
                                           outcome.push_result == pb.PUSH_RESULT_REFUSED_STALE):
            self.feedback.residual.zero_()  # what it held was built on a value the run no longer has
        return outcome, local_at_apply

    def adopt(self, global_value: torch.Tensor, version: int, local_at_apply: HostCopy | None = None,
              staged: torch.Tensor | None = None) -> None:
        """The one way a new global value is taken: it becomes the anchor, and the model's
        fragment is merged with it (merged_fragment; `local_at_apply` for a late result) one
        tensor at a time, in fp32 on the model's device: no fragment-sized buffer there. From
        pinned memory (`staged`, the same values) the copies to the GPU queue without waiting."""
        with self._lock:
            self.anchor, self.version = global_value, version
        params, alpha = self.context.params, self.context.cfg.sync.mix_alpha
        source = global_value if staged is None else staged
        if self.device_anchor is not None:  # the one copy across: the model's fragment is merged from it
            self.device_anchor.copy_(source, non_blocking=source.is_pinned())
            self.context.stats.host_to_device_bytes += source.nbytes
            source = self.device_anchor
        if alpha == 0 and local_at_apply is None:  # overwritten: straight from the host (or the device anchor)
            scatter(self.fragment, source, params)
            return
        at_apply = repeat(None) if local_at_apply is None else \
            (piece for _, piece in pieces(self.fragment, local_at_apply.wait(), params))
        with torch.no_grad():
            for (param, global_piece), at_apply_piece in zip(pieces(self.fragment, source, params), at_apply):
                param.copy_(merged_fragment(alpha, to_device(global_piece, param.device), param.float(),
                                            None if at_apply_piece is None
                                            else to_device(at_apply_piece, param.device)))

    def hash(self) -> tuple[int, str]:
        """(version, state hash of the anchor): the hash the pull that left it checked."""
        with self._lock:
            version, anchor = self.version, self.anchor
        return version, self.session.hashes.of(self.fragment.id, anchor)

    # ---- the sync thread ----------------------------------------------------------------

    def exchange(self, anchor: torch.Tensor, outer: OuterGradient, meta: PushMeta) -> SyncOutcome:
        """Push the outer gradient, pull the result. While it runs the training thread leaves
        `feedback` and `anchor` alone."""
        try:
            return self._push_then_pull(anchor, outer, meta)
        finally:
            self.pushed.set()  # also when the push never went out

    def _push_then_pull(self, anchor: torch.Tensor, outer: OuterGradient, meta: PushMeta) -> SyncOutcome:
        started = time.perf_counter()
        fragment_id, version, session = self.fragment.id, meta.base_version, self.session
        delivered = self._push(outer, meta)
        if delivered is None:
            return SyncOutcome(None, version)
        push_result, round_version, payload_bytes = delivered
        # Delivered: the shard holds this contribution, so the residual stays as compressed
        # and the round's result is what comes next, however long the shard takes to give it.
        self.pushed.set()
        outcome = SyncOutcome(None, version, push_result, bytes_up=payload_bytes,
                              push_seconds=time.perf_counter() - started)
        self.push_seconds = outcome.push_seconds
        try:
            if push_result == pb.PUSH_RESULT_REFUSED_STALE:  # too stale to merge: re-anchor to the current value
                result, value = session.retry(lambda: session.pull_checked(fragment_id, version, anchor),
                                              self.context.stopping)
            else:
                result, value = self._pull_round_result(anchor, version, round_version)
            if result is None:
                return outcome
            outcome.anchor = value
            if value is not None and self._on_gpu:
                outcome.staged = value.pin_memory()  # here, not on the training thread
        except StateHashMismatch as mismatch:  # a snapshot too: nothing to trust from this shard now
            log.error("%s; skipping this sync", mismatch)
            return outcome
        except grpc.RpcError as error:
            log.warning("fragment %d: pull from shard %d failed: %s", fragment_id, session.index, reason(error))
            if remedy(error) is Remedy.REJOIN:
                # The shard serves the fragment below our version (it lost its state, and our
                # contribution with it): rejoining offers it our value back, or re-anchors.
                session.forgotten()
            return outcome
        outcome.version = result.version if result.version is not None else version
        outcome.bytes_down = result.payload_bytes
        outcome.seconds = time.perf_counter() - started
        if push_result != pb.PUSH_RESULT_REFUSED_STALE:  # the pull waited for the push's round to close
            outcome.early_seconds = max(0.0, outcome.seconds - 2 * outcome.push_seconds)
        return outcome

    def push_last(self, counters: SyncStart, step_seconds: float) -> Future:
        """After training, with no sync of the fragment in flight (or the last one's push not
        through): pushes its progress since its last applied sync, the learner's last
        contribution to it, on the fragment's sync thread; the snapshot is taken here. The
        future says whether it got through (`undelivered` says why not)."""
        outer = self._outer_gradient()
        meta = PushMeta(self.version, counters.c_steps, counters.c_tokens, step_seconds, final=True)
        return self.context.pool.submit(lambda: self._push(outer, meta) is not None)

    def _push(self, outer: OuterGradient, meta: PushMeta) -> tuple[int, int, int] | None:
        """Pushes the outer gradient: (the shard's answer, the version of the round that holds
        it, payload bytes), or None when it did not get through (`undelivered` says why; the
        residual is rolled back, so the next push carries this progress)."""
        session = self.session
        if not session.joined:
            outer.rollback()
            self.undelivered = (Remedy.REJOIN, f"shard {session.index} is being rejoined")
            return None
        try:
            payload = outer.payload()
        except ValueError as exc:  # non-finite values: never send them; the learner heals
            outer.rollback()
            self.context.healing.non_finite(self.fragment.id, str(exc))
            self.undelivered = (Remedy.STOP, str(exc))
            session.heartbeat_now()  # its round need not wait for this learner's push (skipped_fragments)
            return None
        finally:
            self.context.stats.copied_to_host(outer.device_to_host_bytes)
        try:
            push_result, round_version = self._deliver(payload, meta)
        except grpc.RpcError as error:
            # Lost push: undo the residual update so nothing is counted twice; the next
            # outer gradient still holds this progress.
            outer.rollback()
            if remedy(error) is Remedy.REJOIN:
                session.forgotten()
            elif remedy(error) is Remedy.STOP:
                self.context.stats.count("syncs_refused")
                if refusal_reason(error) == "norm_outlier":  # the model that made it is sick
                    self.context.healing.refused_as_outlier(self.fragment.id, reason(error))
            log.warning("fragment %d: push to shard %d failed: %s", self.fragment.id, session.index, reason(error))
            self.undelivered = (remedy(error), f"shard {session.index}: {reason(error)}")
            session.heartbeat_now()
            return None
        self.undelivered = None
        self.context.healing.delivered()
        return push_result, round_version, len(payload)

    def _deliver(self, payload: bytes, meta: PushMeta) -> tuple[int, int]:
        """Pushes an outer gradient: (the shard's answer, the version of the round that holds
        it). Already delivered is an answer too: an earlier attempt of this push (its reply
        lost to a shard restart) is held by the shard, in the round after its base version at
        the earliest."""
        cfg = self.context.cfg
        try:
            reply = self.session.client.push(
                self.fragment.id, payload, codec=self.feedback.codec, block_size=cfg.sync.codec_block_size,
                base_version=meta.base_version, c_steps=meta.c_steps, c_tokens=meta.c_tokens,
                step_seconds=meta.step_seconds, numel=self.fragment.numel, final=meta.final)
        except grpc.RpcError as error:
            if remedy(error) is not Remedy.ALREADY_DELIVERED:
                raise
            log.info("fragment %d: shard %d already holds this contribution: %s", self.fragment.id,
                     self.session.index, error.details())
            return pb.PUSH_RESULT_ACCEPTED, meta.base_version + 1
        return reply.result, reply.current_version + 1

    def _pull_round_result(self, anchor: torch.Tensor, version: int,
                           round_version: int) -> tuple[PullResult | None, torch.Tensor | None]:
        """Pulls until the round holding our delivered contribution has closed, across shard
        restarts (the round is durable on the shard). The contribution is already merged (or
        durable in the open round), so taking an older value now would push the same progress
        twice next time: wait for it instead (the training thread only blocks if this outlasts
        the overlap window). (None, None) once stopping."""
        session, stopping = self.session, self.context.stopping
        pulled_bytes = 0
        while True:
            try:
                result, value = session.retry(lambda: session.pull_checked(
                    self.fragment.id, version, anchor, min_version=round_version,
                    max_wait_seconds=self.context.cfg.syncer.lease_seconds), stopping)
            except grpc.RpcError as error:
                if remedy(error) is Remedy.RETRY_LATER:  # stopping while the shard is down
                    return None, None
                raise
            pulled_bytes += result.payload_bytes
            if result.version is not None and result.version >= round_version:
                result.payload_bytes = pulled_bytes
                return result, value
            if result.items:  # a version before the round's: the shard now serves deltas from this value
                version, anchor = result.version, value
            # Shutting down; or asked to stop while a round cannot close (synchronous rounds
            # wait for a learner that is down): the training thread must not block on it.
            if stopping():
                return None, None

    def _reanchor(self) -> SyncOutcome:
        """Instead of a push: takes the shard's value of a fragment it serves below our version
        (the residual was built on our value: it is dropped when the outcome is taken)."""
        session = self.session
        try:
            started = time.perf_counter()
            result, value = session.retry(lambda: session.pull_checked(self.fragment.id, None, None),
                                          self.context.stopping)
            return SyncOutcome(value, result.version, bytes_down=result.payload_bytes,
                               seconds=time.perf_counter() - started, reanchored=True)
        except (grpc.RpcError, StateHashMismatch) as error:
            log.warning("fragment %d: re-anchoring on shard %d failed: %s", self.fragment.id, session.index, error)
            self.context.reanchor_due.add(self.fragment.id)  # at the next sync, then
            return SyncOutcome(None, self.version)
        finally:
            self.pushed.set()
