"""The Syncer gRPC service of one shard: translates between the wire and ShardCore.

Rounds close on pushes and on time: a ticker thread calls `core.tick()` every TICK_SECONDS, so
a round that reached quorum closes when its grace window ends (or when the last missing
learner's lease expires) without waiting for another push. Pulls wait on a condition that
every new version notifies. Under mTLS a RevocationWatch reads the shard's certificate folder
every REVOCATION_POLL_SECONDS and ends the calls of a learner whose certificate it finds revoked.

    handle = start_shard(cfg, shard_index=0, listen="127.0.0.1:0", state_dir=tmp)
    ... ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, ...) ...
    handle.stop()
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Iterator

import grpc

from diloco.services.contract.config import Config, check_state_folder
from diloco.services.contract.payload import iter_chunks
from diloco.services.contract.rpc import Server
from diloco.services.contract.settings import cluster_settings
from diloco.services.contract.tls import load_identity, shard_name
from diloco.services.contract.wire import REFUSAL_REASON_KEY, pb, pb_grpc
from diloco.syncer.admission import PushOutcome
from diloco.syncer.certificates import ShardCertificates
from diloco.syncer.core import ShardCore
from diloco.syncer.counters import Counters
from diloco.syncer.guard import CallGuard
from diloco.services.memory import release_freed_memory
from diloco.syncer.memory import IdleRelease
from diloco.syncer.refusal import Refusal
from diloco.syncer.store import ShardStore
from diloco.syncer.store_format import shard_state_dir
from diloco.syncer.views import FragmentView

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Syncer"].full_name
TICK_SECONDS = 0.05
REVOCATION_POLL_SECONDS = 1.0


def _answer_refusals(method):
    """A Refusal becomes the RPC's status and message, its reason the trailing metadata's
    REFUSAL_REASON_KEY."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def streaming(self, request, context):
            try:
                yield from method(self, request, context)
            except Refusal as refusal:
                _abort(context, refusal)
        return streaming

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Refusal as refusal:
            _abort(context, refusal)
    return unary


def _abort(context: grpc.ServicerContext, refusal: Refusal) -> None:
    context.set_trailing_metadata(((REFUSAL_REASON_KEY, refusal.reason),))
    context.abort(grpc.StatusCode[refusal.status], refusal.message)


class SyncerServicer(pb_grpc.SyncerServicer):
    def __init__(self, core: ShardCore, certificates: ShardCertificates | None = None):
        """`certificates`: the shard's under tls.mode mtls; None in plaintext."""
        self.core = core
        self.certificates = certificates
        self.guard = CallGuard(core.cfg, core.counters, certificates)
        self.settings = cluster_settings(core.cfg)
        self._new_version = threading.Condition()
        # Each learner's open Attend call and the serial of the certificate it presented (None
        # in plaintext), ended by a newer one, by a revocation or by the shard stopping.
        self._attending: dict[str, tuple[threading.Event, int | None]] = {}
        self._attending_lock = threading.Lock()
        self._stopping = False
        # Pulls wake as each fragment's round closes, not once the ticker has closed them all:
        # learners then receive one fragment's update while the shard closes and commits the next.
        core.round_listeners.append(lambda fragment_id, closed_round: self.versions_changed())

    def versions_changed(self) -> None:
        with self._new_version:
            self._new_version.notify_all()

    @_answer_refusals
    def Join(self, request, context):
        self.guard.check_learner(context, request.learner_id)
        digest, fragments = self.core.join(request.learner_id, request.incarnation, request.region,
                                           [(t.name, tuple(t.shape)) for t in request.manifest.tensors])
        return pb.JoinResponse(shard_index=self.core.shard_index, plan_digest=digest,
                               fragments=[_fragment_info(f) for f in fragments], settings=self.settings)

    @_answer_refusals
    def Heartbeat(self, request, context):
        self.guard.check_learner(context, request.learner_id)
        versions = self.core.heartbeat(request.learner_id, request.incarnation, request.step,
                                       request.step_seconds, request.tokens_per_second,
                                       dict(request.held_versions), request.sync_step, request.tokens,
                                       request.waiting_for_fragment if request.HasField("waiting_for_fragment") else None,
                                       request.standing_still, frozenset(request.skipped_fragments))
        run_tokens, run_tokens_per_second = self.core.run_tokens()
        return pb.HeartbeatResponse(lease_seconds=self.core.cfg.syncer.lease_seconds, versions=versions,
                                    run_tokens=run_tokens, run_tokens_per_second=run_tokens_per_second)

    @_answer_refusals
    def Leave(self, request, context):
        self.guard.check_learner(context, request.learner_id)
        self.core.leave(request.learner_id, request.incarnation)
        return pb.LeaveResponse()

    @_answer_refusals
    def Attend(self, request, context):
        """Holds the call (and a worker thread: one per learner, worker_threads counts it) until
        the learner's connection or a newer Attend of the same learner ends it."""
        self.guard.check_learner(context, request.learner_id)
        attendance = self.core.attend(request.learner_id, request.incarnation)
        presented = self.certificates.presented(context) if self.certificates else None
        ended = threading.Event()
        with self._attending_lock:
            replaced = self._attending.get(request.learner_id)
            self._attending[request.learner_id] = (ended, presented.serial if presented else None)
        if replaced is not None:
            replaced[0].set()
        if context.add_callback(ended.set) and not self._stopping:
            ended.wait()
        with self._attending_lock:
            if self._attending.get(request.learner_id, (None,))[0] is ended:
                del self._attending[request.learner_id]
        if not self._stopping:
            self.core.absent(request.learner_id, request.incarnation, attendance)
        if presented is not None:  # ended by a revocation: the learner is told why
            refusal = self.certificates.refusal_of(presented)
            if refusal is not None:
                raise refusal
        yield from ()

    def revocations_changed(self) -> None:
        """Ends the Attend call of every learner whose certificate is now revoked (its lease
        ends with it: no round waits for it), and wakes waiting pulls to check theirs."""
        with self._attending_lock:
            revoked = [ended for ended, serial in self._attending.values()
                       if serial is not None and self.certificates.revocations.revoked_on(serial)]
        for ended in revoked:
            ended.set()
        self.versions_changed()

    def stop_attending(self) -> None:
        """The shard is stopping: every Attend call ends without counting its learner absent."""
        self._stopping = True
        with self._attending_lock:
            for ended, _ in self._attending.values():
                ended.set()

    @_answer_refusals
    def PushFragment(self, request_iterator, context):
        self.guard.open_stream(context)
        outcome = self.guard.run_push(self.push_stream, request_iterator, context)
        if outcome.committed:
            self.versions_changed()
        return pb.PushResponse(result=outcome.result, current_version=outcome.current_version,
                               staleness=outcome.staleness, round=outcome.round)

    def push_stream(self, requests: Iterator[pb.PushRequest]) -> PushOutcome:
        """The core's push of the stream's header and the chunks after it."""
        with self.core.counters.counting_refusals():
            header = _push_header(requests)
        return self.core.push(header, _push_chunks(requests))

    @_answer_refusals
    def PullFragment(self, request, context):
        self.guard.check_puller(context, request.learner_id)
        self.guard.open_stream(context)
        fragment_id = request.fragment_id
        self.core.version(fragment_id)  # an unknown fragment is refused before any wait
        context.add_callback(self.versions_changed)  # a cancelled call stops waiting at once

        def reached() -> bool:
            version = self.core.version(fragment_id)
            return ((version is not None and version >= request.min_version) or not context.is_active()
                    or self._revoked(context))

        wait = _wait_budget(request.max_wait_seconds, context.time_remaining())
        if wait > 0:
            with self._new_version:
                self._new_version.wait_for(reached, timeout=wait)
            self.guard.check_puller(context, request.learner_id)  # revoked meanwhile
        plan = self.core.pull(fragment_id, request.base_version if request.HasField("base_version") else None,
                              request.learner_id, request.anchor_hash, exact=request.exact)
        kind = pb.PAYLOAD_KIND_SNAPSHOT if plan.snapshot else pb.PAYLOAD_KIND_UPDATE
        for index, item in enumerate(plan.items):
            last = index == len(plan.items) - 1
            yield pb.PullResponse(header=pb.PullItemHeader(
                kind=kind, version=item.version, payload=item.header, state_hash=plan.state_hash if last else ""))
            for chunk in iter_chunks(item.payload):
                yield pb.PullResponse(chunk=chunk)

    def _revoked(self, context: grpc.ServicerContext) -> bool:
        presented = self.certificates.presented(context) if self.certificates else None
        return presented is not None and self.certificates.revocations.revoked_on(presented.serial) is not None

    @_answer_refusals
    def Status(self, request, context):
        self.guard.check_reader(context)
        status = self.core.status()
        return pb.StatusResponse(
            shard_index=status.shard_index, plan_digest=status.plan_digest,
            fragments=[pb.FragmentStatus(
                fragment_id=f.id, numel=f.numel, initialized=f.initialized, version=f.version,
                state_hash=f.state_hash, pending_contributions=f.pending_contributions,
                merged_tokens=f.merged_tokens,
                served=[pb.ServedAnchor(learner_id=learner_id, version=a.version, state_hash=a.state_hash,
                                        offset=a.offset) for learner_id, a in sorted(f.served.items())],
                last_round=pb.RoundInfo(
                    round=f.last_round.round, close_reason=f.last_round.close_reason,
                    contributors=f.last_round.contributors,
                    closed_unix_seconds=f.last_round.closed_unix_seconds,
                    duration_seconds=f.last_round.duration_seconds) if f.last_round else None)
                for f in status.fragments],
            learners=[pb.LearnerStatus(
                learner_id=l.id, region=l.region, incarnation=l.incarnation, alive=l.alive,
                last_step=l.step, staleness=l.staleness, seconds_since_heartbeat=l.seconds_since_heartbeat,
                tokens_per_second=l.tokens_per_second, sync_step=l.sync_step, step_seconds=l.step_seconds,
                tokens=l.tokens)
                for l in status.learners],
            counters=wire_counters(status.counters),
            manifest=pb.ParameterManifest(tensors=[pb.TensorSpec(name=name, shape=list(shape))
                                                   for name, shape in self.core.manifest or ()]),
            certificates=[pb.CertificateStatus(name=c.name, serial=f"{c.serial:x}",
                                               expires_unix_seconds=c.expires.timestamp(), revoked=c.revoked)
                          for c in (self.certificates.views() if self.certificates else ())],
            revoked_certificates=len(self.certificates.revocations) if self.certificates else 0)


def _push_header(requests: Iterator[pb.PushRequest]) -> pb.PushHeader:
    first = next(requests, None)
    if first is None or first.WhichOneof("item") != "header":
        raise Refusal("bad_stream", "INVALID_ARGUMENT", "a push starts with a PushHeader")
    return first.header


def _push_chunks(requests: Iterator[pb.PushRequest]) -> Iterator[pb.Chunk]:
    """The chunks after a push's header, read as the core asks for them."""
    for request in requests:
        if request.WhichOneof("item") != "chunk":
            raise Refusal("bad_stream", "INVALID_ARGUMENT", "a push has one PushHeader, then only chunks")
        yield request.chunk


def wire_counters(counters: dict[str, float]) -> dict[str, int]:
    """Status.counters holds integers: seconds travel as milliseconds."""
    wire = {}
    for name, value in counters.items():
        if name.endswith("_seconds"):
            wire[name.removesuffix("_seconds") + "_milliseconds"] = round(value * 1000)
        else:
            wire[name] = int(value)
    return wire


def _wait_budget(max_wait_seconds: float, time_remaining: float | None) -> float:
    """How long a pull may wait: what it asked for, leaving a tenth of the call's remaining
    deadline (at most a second) to send the result."""
    remaining = math.inf if time_remaining is None else time_remaining
    return max(0.0, min(max_wait_seconds, remaining - min(1.0, remaining / 10)))


def _fragment_info(f: FragmentView) -> pb.FragmentInfo:
    return pb.FragmentInfo(fragment_id=f.id, numel=f.numel, offset_step=f.offset_step,
                           tensor_names=f.tensor_names, initialized=f.initialized, version=f.version,
                           state_hash=f.state_hash)


class Ticker:
    """A thread that closes the rounds due by time alone (the core tells its round listeners),
    writes the snapshots due, and gives the memory of the last rounds back to the system once
    pushes and pulls have paused for longer than between rounds (syncer/memory.py)."""

    def __init__(self, core: ShardCore, interval: float = TICK_SECONDS):
        self.core, self.interval = core, interval
        self.idle_release = IdleRelease()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shard-{core.shard_index}-ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.core.tick()
            except Exception:  # a bug: a full disk is the core's to report (syncer/disk.py), once
                log.exception("closing a round failed")
            if self.idle_release.due(self.core.clock(), self.core.last_busy_at):
                release_freed_memory()
                self.core.counters.add("memory_releases")

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


class RevocationWatch:
    """A thread that reads the shard's certificate folder again every REVOCATION_POLL_SECONDS:
    a renewed certificate is taken for new connections, a new revocation ends the revoked
    learners' calls within a poll."""

    def __init__(self, servicer: SyncerServicer, interval: float = REVOCATION_POLL_SECONDS):
        self.servicer, self.interval = servicer, interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="revocation-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                if self.servicer.certificates.refresh():
                    self.servicer.revocations_changed()
            except Exception:  # a bug; the files' own faults are logged where they are read
                log.exception("reading the certificate folder failed")

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


def worker_threads(cfg: Config) -> int:
    """Enough RPC threads that pulls waiting for rounds never starve the pushes that close
    them: per learner, a push and a waiting pull for each fragment a shard may own, plus a
    heartbeat and its Attend call, plus a few for Status and health."""
    fragments_per_shard = -(-cfg.sync.fragments // len(cfg.shards)) + 1
    return len(cfg.learners) * (2 * fragments_per_shard + 2) + 8


@dataclass
class ShardHandle:
    core: ShardCore
    servicer: SyncerServicer
    server: Server
    store: ShardStore
    ticker: Ticker
    port: int
    revocation_watch: RevocationWatch | None = None

    def stop(self, drain_seconds: float = 0.0) -> None:
        """Health NOT_SERVING, in-flight calls drain, then the ticker and the files close.
        Everything acknowledged is already durable: stopping needs no flush."""
        self.servicer.stop_attending()
        self.server.stop(drain_seconds)
        self.ticker.stop()
        if self.revocation_watch is not None:
            self.revocation_watch.stop()
        self.store.close()


def start_shard(cfg: Config, shard_index: int, listen: str = "127.0.0.1:0",
                state_dir: str | os.PathLike | None = None, *, tls_dir: str | os.PathLike | None = None,
                health_listen: str | None = None) -> ShardHandle:
    """Restores the shard's state from disk and serves it on `listen` (port 0: any free one),
    with mutual TLS unless the config says plaintext: the shard's certificate comes from
    `tls_dir`, else <tls.dir>/shard-<i>. `health_listen`: also a plaintext health-only port."""
    identity = load_identity(cfg, shard_name(shard_index), tls_dir)
    counters = Counters()
    store = ShardStore(shard_state_dir(cfg.run.state_dir if state_dir is None else state_dir, shard_index), counters)
    try:
        check_state_folder(store.directory)  # fails at start, naming it, not on the first Join
        core = ShardCore(cfg, shard_index, journal=store, state_location=str(store.directory), counters=counters,
                         anchor_folder=store.directory / "anchors" if cfg.syncer.spill_anchors else None)
        core.restore(store.load())
        certificates = ShardCertificates(identity, shard_name(shard_index), counters) if identity else None
        servicer = SyncerServicer(core, certificates)
        server = Server(cfg.rpc, [SERVICE_NAME], max_workers=worker_threads(cfg), identity=identity)
        pb_grpc.add_SyncerServicer_to_server(servicer, server.grpc_server)
        port = server.start(listen, health_listen)
    except BaseException:
        store.close()
        raise
    ticker = Ticker(core)
    return ShardHandle(core, servicer, server, store, ticker, port,
                       RevocationWatch(servicer) if certificates else None)
