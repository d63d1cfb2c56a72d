"""Who may call a shard, and how much one caller may ask of it: the checks the gRPC servicer
makes before a call reaches the core.

- Identity (tls.mode mtls): the TLS handshake already proved the caller holds a certificate
  of the run's CA. Join, Heartbeat, Leave and PushFragment act for a learner id, so the
  certificate must name that learner (services/contract/tls.py): a certificate naming no learner is
  UNAUTHENTICATED, one naming another learner PERMISSION_DENIED. A PullFragment that names a
  learner moves the anchor the shard serves that learner deltas from (docs/protocol.md, "The
  downlink"), so it is checked the same way; one naming none, and Status, only read, so any
  certificate of the CA will do (the operator's, for `diloco status` and `diloco export`).
  A certificate the CA revoked is refused PERMISSION_DENIED on every call
  (syncer/certificates.py). In plaintext mode there is no identity to check: the config said
  the network is trusted.
- Limits (config `limits`): streams in flight per peer, a push's declared size and chunk
  count, and its pace: a push that stalls for limits.push_idle_seconds, or outlasts the
  deadline a client would give it (services.rpc.stream_deadline), is cut off. Everything a
  refused push sent is dropped, since the core changes nothing before a payload is complete.

Refusals are syncer.refusal.Refusal, answered and counted like the core's own.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Callable, Iterator, TypeVar

import grpc

from diloco.services.contract.config import Config
from diloco.services.contract.rpc import stream_deadline
from diloco.services.contract.tls import LEARNER_PREFIX, learner_of, peer_spiffe_id
from diloco.services.contract.wire import pb
from diloco.syncer.certificates import ShardCertificates
from diloco.syncer.counters import Counters
from diloco.syncer.refusal import Refusal

T = TypeVar("T")


class CallGuard:
    def __init__(self, cfg: Config, counters: Counters, certificates: ShardCertificates | None):
        """`certificates`: the shard's, under tls.mode mtls (None in plaintext)."""
        self.authenticating = cfg.tls.mode == "mtls"
        self.certificates = certificates
        self.limits, self.rpc = cfg.limits, cfg.rpc
        self.counters = counters
        self._streams: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check_learner(self, context: grpc.ServicerContext, learner_id: str) -> None:
        """A unary call made for `learner_id` (Join, Heartbeat, Leave)."""
        self._counted(self._learner_refusal(context, learner_id))

    def check_puller(self, context: grpc.ServicerContext, learner_id: str) -> None:
        """A pull: for `learner_id` where it names one, else a read anyone of the run may make."""
        if learner_id:
            self.check_learner(context, learner_id)
        else:
            self.check_reader(context)

    def check_reader(self, context: grpc.ServicerContext) -> None:
        """A call that only reads (Status, a pull naming no learner): any certificate of the
        run's CA that it did not revoke."""
        if self.certificates is not None:
            self._counted(self.certificates.refusal(context))

    def open_stream(self, context: grpc.ServicerContext) -> None:
        """Takes one of the peer's stream slots until the call ends."""
        peer = self._peer(context)
        with self._lock:
            if self._streams[peer] >= self.limits.max_streams_per_peer:
                refusal = Refusal("too_many_streams", "RESOURCE_EXHAUSTED",
                                  f"{peer} already has {self._streams[peer]} pushes and pulls in flight "
                                  f"(limits.max_streams_per_peer={self.limits.max_streams_per_peer})")
            else:
                self._streams[peer] += 1
                refusal = None
        self._counted(refusal)
        if not context.add_callback(lambda: self._close_stream(peer)):
            self._close_stream(peer)  # the call already ended

    def run_push(self, push: Callable[[Iterator[pb.PushRequest]], T], requests: Iterator[pb.PushRequest],
                 context: grpc.ServicerContext) -> T:
        """push(requests) with the header checked against the caller's identity and the limits,
        and the stream's pace watched: a push that stalls or outlasts its deadline is refused
        with DEADLINE_EXCEEDED. The gRPC request iterator blocks with no timeout, so the push
        runs on a thread of its own while this (the handler's) thread keeps time; a refusal
        ends the call, which ends that thread's iteration with an error before the core has
        changed anything. Only the start and the end cross threads, not every chunk."""
        pace = _PushPace(self, requests, context)
        outcome: Future = Future()

        def run() -> None:
            try:
                outcome.set_result(push(pace.requests()))
            except BaseException as error:  # the handler raises it
                outcome.set_exception(error)

        threading.Thread(target=run, name="push", daemon=True).start()
        while True:
            try:
                return outcome.result(pace.seconds_to_next_check())
            except TimeoutError:
                if outcome.done():
                    raise  # the push's own error
            self._counted(pace.cut_off_if_late())

    def check_push_header(self, context: grpc.ServicerContext, header: pb.PushHeader) -> None:
        """A push's header against the caller's identity and the limits on a push's size."""
        refusal = self._learner_refusal(context, header.learner_id)
        if refusal:
            raise refusal
        payload, limits = header.payload, self.limits
        if payload.payload_bytes > limits.max_push_bytes:
            raise Refusal("push_too_large", "RESOURCE_EXHAUSTED",
                          f"push declares {payload.payload_bytes} payload bytes, more than "
                          f"limits.max_push_bytes={limits.max_push_bytes}")
        if payload.chunk_count > limits.max_chunks_per_push:
            raise Refusal("too_many_chunks", "RESOURCE_EXHAUSTED",
                          f"push declares {payload.chunk_count} chunks, more than "
                          f"limits.max_chunks_per_push={limits.max_chunks_per_push}")

    def _learner_refusal(self, context: grpc.ServicerContext, learner_id: str) -> Refusal | None:
        if not self.authenticating:
            return None
        revoked = self.certificates.refusal(context) if self.certificates is not None else None
        if revoked is not None:
            return revoked
        peer = peer_spiffe_id(context)
        certified = learner_of(peer)
        if certified is None:
            return Refusal("unauthenticated", "UNAUTHENTICATED",
                           f"acting as learner {learner_id!r} needs that learner's client certificate "
                           f"({LEARNER_PREFIX}{learner_id}); this one is {peer or 'without a SPIFFE ID'}")
        if certified != learner_id:
            return Refusal("wrong_learner", "PERMISSION_DENIED",
                           f"the client certificate is learner {certified!r}'s: it may not act as "
                           f"learner {learner_id!r}")
        return None

    def _peer(self, context: grpc.ServicerContext) -> str:
        """Whose streams are counted together: the certificate, or the connection in plaintext."""
        return (peer_spiffe_id(context) if self.authenticating else None) or context.peer()

    def _close_stream(self, peer: str) -> None:
        with self._lock:
            self._streams[peer] -= 1
            if not self._streams[peer]:
                del self._streams[peer]

    def _counted(self, refusal: Refusal | None) -> None:
        if refusal is not None:
            self.counters.add(f"refusals.{refusal.reason}")
            raise refusal


class _CutOff(Exception):
    """Ends the iteration of a push the guard refused for its pace (the guard counts it)."""


class _PushPace:
    """When a push's last message came, against its limits. The iteration (on the push's
    thread) and the watch (on the handler's) take turns under one lock, so that once a push
    is cut off no later message reaches the core, and a push whose stream has ended is never
    cut off."""

    def __init__(self, guard: CallGuard, requests: Iterator[pb.PushRequest], context: grpc.ServicerContext):
        self._guard, self._requests, self._context = guard, requests, context
        self._idle = guard.limits.push_idle_seconds
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._ends: float | None = None  # the deadline, once the header told the size
        self._size, self._allowed = 0, 0.0
        self._streaming = True
        self._cut_off = False

    def requests(self) -> Iterator[pb.PushRequest]:
        first = self._next()
        if first is None:
            return
        if first.WhichOneof("item") == "header":
            self._guard.check_push_header(self._context, first.header)
            self._size = first.header.payload.payload_bytes
        self._allowed = stream_deadline(self._guard.rpc, self._size)
        with self._lock:
            self._ends = time.monotonic() + self._allowed
        yield first
        while (item := self._next()) is not None:
            yield item

    def _next(self) -> pb.PushRequest | None:
        item = next(self._requests, None)
        with self._lock:
            if self._cut_off:
                raise _CutOff()
            if item is None:
                self._streaming = False
            self._last = time.monotonic()
        return item

    def seconds_to_next_check(self) -> float:
        with self._lock:
            due = self._last + self._idle
            if self._ends is not None:
                due = min(due, self._ends)
        return max(0.01, due - time.monotonic())

    def cut_off_if_late(self) -> Refusal | None:
        now = time.monotonic()
        with self._lock:
            if not self._streaming:
                return None  # every message is in: the core decides now
            if self._ends is not None and now >= self._ends:
                refusal = Refusal("push_deadline", "DEADLINE_EXCEEDED",
                                  f"push of {self._size} bytes took longer than {self._allowed:.0f}s "
                                  f"(rpc.deadline_seconds={self._guard.rpc.deadline_seconds:g} per MiB): cut off")
            elif now - self._last >= self._idle:
                where = "before its header" if self._ends is None else "between two chunks"
                refusal = Refusal("push_stalled", "DEADLINE_EXCEEDED",
                                  f"push stalled: no message {where} for {self._idle:g}s "
                                  "(limits.push_idle_seconds): cut off")
            else:
                return None
            self._cut_off = True
        return refusal
