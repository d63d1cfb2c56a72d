"""One learner's membership of one shard: join (checking the shard runs this learner's model
and sync settings), seed or restore the fragments the shard lacks, heartbeat, rejoin when the
shard forgot this learner, leave. Also the pulls every part of the sync makes through the
shard: with retries, and with the state hash checked.

A shard that cannot be reached never stops training: the heartbeat thread rejoins it when
it is back. A join the shard refuses for good (another model, other settings, not in the
run) is a JoinRefused, which the training thread raises at its next step.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, TypeVar

import grpc
import torch

from diloco.learner.sync.host_copy import copy_to_host
from diloco.learner.sync.known_hashes import KnownHashes
from diloco.learner.sync.pulled import value_after
from diloco.learner.sync.shard_errors import Remedy, reason, refusal_reason, remedy, with_retries
from diloco.learner.sync.stats import SyncStats
from diloco.services.client import PullResult, ShardClient
from diloco.services.contract.config import Config
from diloco.services.contract.fragments import Fragment, FragmentPlan
from diloco.services.contract.settings import settings_differences
from diloco.services.contract.state import StateHashMismatch
from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)

T = TypeVar("T")


class JoinRefused(RuntimeError):
    """A shard this learner cannot train with: other sync settings, another model, or a
    refusal of the learner itself. Retrying cannot help: the learner stops."""


@dataclass(frozen=True)
class Progress:
    """Where this learner is, as its heartbeats report it."""
    step: int
    step_seconds: float
    tokens: int  # trained by this learner (every rank of its island)
    tokens_per_second: float
    sync_step: int  # the step its sync schedule is at
    waiting_for: int | None = None  # the fragment whose result training waits for now
    standing_still: bool = False  # training stands still (an island regrouping)
    # Fragments whose last push was not delivered, or whose turn this period the phase taken on
    # joining had passed: their rounds need not wait for this learner.
    skipped: tuple[int, ...] = ()


class SessionHost(Protocol):
    """What a session asks of the learner's sync."""

    def held(self, fragment_id: int) -> tuple[int, torch.Tensor] | None:
        """(version, global value) held of a fragment; None when none is."""

    def held_versions(self) -> dict[int, int]:
        """Version of each fragment this learner syncs (none while it starts)."""

    def progress(self) -> Progress: ...

    def heard_run_tokens(self, reply: pb.HeartbeatResponse, progress: Progress) -> None: ...


class ReanchorDue:
    """Fragments a shard serves below the version this learner holds (it lost its state and
    did not take ours back): their next pull takes the shard's value instead of pushing."""

    def __init__(self):
        self._due: set[int] = set()
        self._lock = threading.Lock()

    def add(self, fragment_id: int) -> None:
        with self._lock:
            self._due.add(fragment_id)

    def take(self, fragment_id: int) -> bool:
        with self._lock:
            due = fragment_id in self._due
            self._due.discard(fragment_id)
        return due


class ShardSession:
    """This learner and one shard. `joined`: the shard accepted its Join (the fragments it
    lacked may still be being seeded or restored)."""

    def __init__(self, index: int, client: ShardClient, region: str, cfg: Config, plan: FragmentPlan,
                 params: Mapping[str, torch.Tensor], host: SessionHost, stats: SyncStats,
                 reanchor_due: ReanchorDue, stop: threading.Event):
        self.index = index
        self.client = client
        self.region = region
        self.cfg = cfg
        self.plan = plan
        self.params = params
        self.manifest = [(name, tuple(p.shape)) for name, p in params.items()]
        self.host = host
        self.stats = stats
        self.reanchor_due = reanchor_due
        self.failure: JoinRefused | None = None  # a rejoin refused for good: the learner must stop
        self._joined = False
        self._attendance: grpc.Call | None = None  # the open Attend call (services/client.py)
        self._lock = threading.Lock()
        # The hashes of the values pulls left (checked): the next pull names its base by them.
        self.hashes = KnownHashes()
        self._stop = stop
        self._may_rejoin = threading.Event()  # start-up is over: the heartbeat thread rejoins from now on
        self._left = threading.Event()  # said goodbye: no heartbeats, no rejoining
        self._beat_now = threading.Event()  # a heartbeat is due before the interval is up
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True, name=f"heartbeat-{index}")

    @property
    def joined(self) -> bool:
        return self._joined

    def forgotten(self) -> None:
        """The shard forgot this learner (or lost the version it holds): the heartbeat thread
        rejoins, which restores our value to it or re-anchors."""
        with self._lock:
            self._joined = False

    def retry(self, call: Callable[[], T], give_up: Callable[[], bool]) -> T:
        return with_retries(call, f"shard {self.index} ({self.client.address})", give_up, self._stop)

    # ---- start-up ---------------------------------------------------------------------

    def start_heartbeats(self) -> None:
        """Before the joins: seeding and pulling a large model can take longer than a lease.
        One thread per shard: a shard that does not answer must not keep the others from
        hearing this learner before its lease on them runs out."""
        self._heartbeats.start()

    def join(self, should_stop: Callable[[], bool]) -> None:
        self.retry(self._join, should_stop)

    def started(self) -> None:
        self._may_rejoin.set()

    def _join(self) -> None:
        """Joins, checking the shard runs this learner's model with its sync settings (else
        JoinRefused), and seeds or restores the fragments it lacks."""
        try:
            reply = self.client.join(self.region, self.manifest)
        except grpc.RpcError as error:
            if remedy(error) is Remedy.RETRY_LATER:
                raise
            raise JoinRefused(f"shard {self.index} refused this learner: {reason(error)}") from None
        differences = settings_differences(self.index, reply.settings, self.cfg)
        if differences:
            raise JoinRefused(f"shard {self.index} runs other sync settings than this learner's config: "
                              + "; ".join(differences))
        if reply.plan_digest != self.plan.digest:
            raise JoinRefused(f"shard {self.index} uses plan {reply.plan_digest[:12]}, this learner "
                              f"{self.plan.digest[:12]}: model or sync settings differ")
        with self._lock:
            self._joined = True  # heartbeats keep the lease while seeding
            self._attend()
        try:
            for info in reply.fragments:
                fragment = self.plan.fragments[info.fragment_id]
                held = self.host.held(fragment.id)
                if held is not None and held[0] >= 1 and (not info.initialized or info.version < held[0]):
                    self._restore(fragment, info, *held)
                elif not info.initialized:
                    self._seed(fragment, copy_to_host(fragment, self.params).wait())
        except BaseException:
            self.forgotten()  # joining again seeds what is still missing
            raise

    def _restore(self, fragment: Fragment, info: pb.FragmentInfo, version: int, anchor: torch.Tensor) -> None:
        """The shard serves the fragment below the version we hold (or not at all): it lost its
        state. Offer it our global value back (RESTORE); if it does not take it, take the
        shard's value instead at our next sync of the fragment (re-anchor)."""
        served = f"at version {info.version}" if info.initialized else "unseeded"
        try:
            reply = self.client.push(fragment.id, anchor, codec="fp32", block_size=self.cfg.sync.codec_block_size,
                                     kind=pb.PUSH_KIND_RESTORE, base_version=version,
                                     state_hash=self.hashes.of(fragment.id, anchor))
            if reply.result == pb.PUSH_RESULT_RESTORED:
                log.warning("shard %d held fragment %d %s: restored it at version %d",
                            self.index, fragment.id, served, version)
                return
            answer = pb.PushResult.Name(reply.result)
        except grpc.RpcError as error:
            if remedy(error) is Remedy.RETRY_LATER:
                raise
            answer = reason(error)
        log.warning("shard %d holds fragment %d %s, below our version %d, and did not restore it (%s): "
                    "re-anchoring to its value", self.index, fragment.id, served, version, answer)
        if not info.initialized:  # the run's value at `version` is a better start than local weights
            self._seed(fragment, anchor)
        self.reanchor_due.add(fragment.id)

    def _seed(self, fragment: Fragment, value: torch.Tensor) -> None:
        try:
            self.client.push(fragment.id, value, codec="fp32", block_size=self.cfg.sync.codec_block_size,
                             kind=pb.PUSH_KIND_SEED)
            log.info("seeded fragment %d on shard %d", fragment.id, self.index)
        except grpc.RpcError as error:
            if remedy(error) is not Remedy.ALREADY_DELIVERED:  # another learner was first: fine
                raise

    # ---- pulls ------------------------------------------------------------------------

    def pull_checked(self, fragment_id: int, base_version: int | None, base: torch.Tensor | None,
                     **wait) -> tuple[PullResult, torch.Tensor | None]:
        """(the pull, the value after its items on `base`, which is left as it was). The pull
        names `base` by its hash, so the shard can answer with one delta from it (docs/protocol.md,
        "The downlink"). A value that does not have the hash the shard sent (an update of the
        shard's that did not make its version, a wrong base) is pulled again as a snapshot,
        counted. `wait`: min_version, max_wait_seconds and exact of ShardClient.pull."""
        base_hash = "" if base is None else self.hashes.of(fragment_id, base)
        result = self.client.pull(fragment_id, base_version, anchor_hash=base_hash, **wait)
        try:
            value = value_after(result, base)
            if value is not None:
                self.hashes.remember(fragment_id, value, result.state_hash if result.items else base_hash)
            return result, value
        except StateHashMismatch as mismatch:
            self.stats.count("hash_mismatches")
            log.warning("%s: pulling a snapshot from shard %d", mismatch, self.index)
        snapshot = self.client.pull(fragment_id)
        snapshot.payload_bytes += result.payload_bytes
        value = value_after(snapshot, None)
        if value is not None:
            self.hashes.remember(fragment_id, value, snapshot.state_hash)
        return snapshot, value

    def pull_at_start(self, fragment_id: int, saved: Mapping[str, torch.Tensor | int] | None
                      ) -> tuple[PullResult, torch.Tensor, bool]:
        """(the pull, the fragment's value after it, whether that re-anchored a checkpoint's
        value): what takes the checkpoint's value to the shard's, or without one, the
        learner's own initial value taken as version 0 (nothing to pull where it is the seed
        and the fragment is still at version 0; else a snapshot); a snapshot where the shard
        serves the fragment below the checkpoint's version."""
        if saved is not None and not self.reanchor_due.take(fragment_id):
            try:
                return *self.pull_checked(fragment_id, saved["version"], saved["anchor"]), False
            except grpc.RpcError as error:
                if remedy(error) is not Remedy.REJOIN:  # REJOIN: our version is ahead of the shard's
                    raise
                log.warning("fragment %d: shard %d: %s", fragment_id, self.index, error.details())
        if saved is None:
            own = copy_to_host(self.plan.fragments[fragment_id], self.params).wait()
            result, value = self.pull_checked(fragment_id, 0, own)
        else:
            result, value = self.pull_checked(fragment_id, None, None)
        if value is None:
            raise RuntimeError(f"fragment {fragment_id}: shard {self.index} sent no value")
        if saved is not None:
            self.stats.reanchored_fragment(fragment_id, saved["version"], result.version)
        return result, value, saved is not None

    # ---- heartbeats, leave --------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Heartbeats the shard, rejoining it when it forgot this learner. The interval runs
        from a heartbeat's start: one whose answer waits behind a pull's bytes on a slow link
        (its deadline is half a lease) must not hold the next one back past the lease."""
        interval = self.cfg.trainer.heartbeat_seconds
        started = time.monotonic()
        while True:
            self._beat_now.wait(max(0.0, started + interval - time.monotonic()))
            self._beat_now.clear()
            started = time.monotonic()
            if self._stop.is_set() or self._left.is_set():
                return
            try:
                if not self._joined:
                    if not self._may_rejoin.is_set():
                        continue  # start-up joins it
                    self._join()
                    log.info("rejoined shard %d", self.index)
                self._heartbeat()
            except grpc.RpcError as error:
                if refusal_reason(error) == "revoked":  # the run shut this learner out
                    self.failure = JoinRefused(f"shard {self.index}: {reason(error)}")
                    return
                if remedy(error) is Remedy.REJOIN:
                    log.info("shard %d forgot this learner (%s): rejoining", self.index, reason(error))
                    self.forgotten()
                elif remedy(error) is not Remedy.RETRY_LATER:
                    log.warning("heartbeat to shard %d: %s", self.index, reason(error))
            except JoinRefused as refused:  # the training thread raises it at its next step
                self.failure = refused
                return

    def _heartbeat(self) -> None:
        """Each call's deadline is half a lease: a shard that hangs is given up on in time to
        try again."""
        deadline = min(self.cfg.rpc.deadline_seconds, self.cfg.syncer.lease_seconds / 2)
        progress = self.host.progress()
        held = {fid: version for fid, version in self.host.held_versions().items()
                if self.plan.fragments[fid].shard == self.index}
        reply = self.client.heartbeat(progress.step, progress.step_seconds, progress.tokens_per_second, held,
                                      sync_step=progress.sync_step, tokens=progress.tokens,
                                      waiting_for=progress.waiting_for, standing_still=progress.standing_still,
                                      skipped=tuple(f for f in progress.skipped
                                                    if self.plan.fragments[f].shard == self.index),
                                      timeout=deadline)
        self.host.heard_run_tokens(reply, progress)

    def _attend(self) -> None:
        """Called with self._lock held, once joined: holds an Attend call open, replacing the
        previous join's, so that the shard stops counting this learner the moment its process
        dies rather than a lease later."""
        if self._attendance is not None:
            self._attendance.cancel()
        self._attendance = self.client.attend()

    def leave(self) -> None:
        """Stop counting towards any round; no more heartbeats, no rejoining."""
        self._left.set()
        if self._heartbeats.is_alive():  # it must not rejoin behind our back
            self._heartbeats.join()
        if self._joined:
            try:
                self._heartbeat()  # its last steps and tokens: the run's count includes them
                self.client.leave()
            except grpc.RpcError as error:
                log.warning("leave shard %d: %s", self.index, error.code().name)
        with self._lock:
            if self._attendance is not None:  # after the Leave: its end then changes nothing
                self._attendance.cancel()
                self._attendance = None
        self.forgotten()

    def heartbeat_now(self) -> None:
        """What the heartbeats say changed (a push of one of this shard's fragments failed, and
        its round need not wait for this learner): the next one goes now."""
        self._beat_now.set()

    def stop_heartbeats(self) -> None:
        """After the sync's stop event is set."""
        self._beat_now.set()  # ends the wait at once
        if self._heartbeats.is_alive():
            self._heartbeats.join(timeout=5)
