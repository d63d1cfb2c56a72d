"""Who may call a shard, and how much one caller may ask of it: the checks the gRPC servicer
makes before a call reaches the core.

- Identity (tls.mode mtls): the TLS handshake already proved the caller holds a certificate
  of the run's CA. Join, Heartbeat, Leave and PushFragment act for a learner id, so the
  certificate must name that learner (services/tls.py): a certificate naming no learner is
  UNAUTHENTICATED, one naming another learner PERMISSION_DENIED. PullFragment and Status
  only read, so any certificate of the CA will do (the operator's, for `diloco status`).
  In plaintext mode there is no identity to check: the config said the network is trusted.
- Limits (config `limits`): streams in flight per peer, a push's declared size and chunk
  count, and its pace: a push that stalls for limits.push_idle_seconds, or outlasts the
  deadline a client would give it (services.rpc.stream_deadline), is cut off. Everything a
  refused push sent is dropped, since the core changes nothing before a payload is complete.

Refusals are syncer.refusal.Refusal, answered and counted like the core's own.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from typing import Iterator

import grpc

from services.config import Config
from services.rpc import stream_deadline
from services.tls import LEARNER_PREFIX, learner_of, peer_spiffe_id
from services.wire import pb
from syncer.counters import Counters
from syncer.refusal import Refusal


class CallGuard:
    def __init__(self, cfg: Config, counters: Counters):
        self.authenticating = cfg.tls.mode == "mtls"
        self.limits, self.rpc = cfg.limits, cfg.rpc
        self.counters = counters
        self._streams: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check_learner(self, context: grpc.ServicerContext, learner_id: str) -> None:
        """A unary call made for `learner_id` (Join, Heartbeat, Leave)."""
        self._counted(self._learner_refusal(context, learner_id))

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

    def push_requests(self, requests: Iterator[pb.PushRequest],
                      context: grpc.ServicerContext) -> Iterator[pb.PushRequest]:
        """The push stream as the core reads it: the header checked against the caller's
        identity and the limits, then chunks for as long as they keep coming. Raises
        Refusal from the iteration (the core counts it)."""
        reader, idle = _StreamReader(requests), self.limits.push_idle_seconds
        try:
            first = reader.next(idle)
            if first is _TIMED_OUT:
                raise _stalled("before its header", idle)
            if first is None:
                return
            size = 0
            if first.WhichOneof("item") == "header":
                self._check_push_header(context, first.header)
                size = first.header.payload.payload_bytes
            yield first
            allowed = stream_deadline(self.rpc, size)
            ends = time.monotonic() + allowed
            while (item := reader.next(min(idle, max(0.0, ends - time.monotonic())))) is not None:
                if item is _TIMED_OUT:
                    if time.monotonic() < ends:
                        raise _stalled("between two chunks", idle)
                    raise Refusal("push_deadline", "DEADLINE_EXCEEDED",
                                  f"push of {size} bytes took longer than {allowed:.0f}s "
                                  f"(rpc.deadline_seconds={self.rpc.deadline_seconds:g} per MiB): cut off")
                yield item
        finally:
            reader.close()

    def _check_push_header(self, context: grpc.ServicerContext, header: pb.PushHeader) -> None:
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


_TIMED_OUT = object()
_END = object()


def _stalled(where: str, seconds: float) -> Refusal:
    return Refusal("push_stalled", "DEADLINE_EXCEEDED",
                   f"push stalled: no message {where} for {seconds:g}s (limits.push_idle_seconds): cut off")


class _StreamReader:
    """Reads a request stream on a thread of its own, so that the handler can give up on a
    peer that stops sending (the gRPC request iterator blocks with no timeout). A small queue
    keeps gRPC's flow control: the reader runs at most a few messages ahead."""

    def __init__(self, requests: Iterator[pb.PushRequest]):
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(requests,), name="push-reader", daemon=True)
        self._thread.start()

    def _run(self, requests: Iterator[pb.PushRequest]) -> None:
        try:
            for item in requests:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as error:  # the client cancelled: the handler raises it
            self._put(error)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def next(self, timeout: float) -> object:
        """The next message, None at the end of the stream, _TIMED_OUT after `timeout` seconds
        without one."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return _TIMED_OUT
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """The reader stops at its next message; once the call has ended, gRPC ends the stream."""
        self._closed.set()
