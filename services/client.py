"""A typed client for one syncer shard: the learner, `diloco status`, the tests
and the benchmarks all talk to shards through it.

It hides the streaming details of the contract (header first, then ~1 MiB
chunks; a pull is a sequence of items, each a header and its chunks) and puts a
deadline on every call. gRPC errors propagate as grpc.RpcError so callers can
decide on retries by status code.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import grpc
import torch

from diloco.services.contract.codecs import Codec, get_codec
from diloco.services.contract.config import Config, RpcConfig
from diloco.services.contract.payload import (CHUNK_BYTES, Reassembler, decode_payload, describe, push_requests,
                                              seed_chunk_bytes)
from diloco.services.contract.rpc import open_channel, stream_deadline
from diloco.services.contract.tls import Identity
from diloco.services.contract.wire import pb, pb_grpc


class LinkEmulation(Protocol):
    """Paces the bytes of one learner's transfers as a capped link would (localcluster/wan.py:
    WanLink): `up.consume(n)` and `down.consume(n)` return once n bytes went through, and
    `wait_latency()` once a message would have crossed the link that way; `book(n)` takes the
    link for n bytes without waiting and says when they are through."""
    up: "Pacer"
    down: "Pacer"


class Pacer(Protocol):
    latency_seconds: float

    def book(self, count: int) -> float: ...

    def consume(self, count: int) -> None: ...

    def wait_latency(self) -> None: ...


LinkFactory = Callable[[Config, str, str], "LinkEmulation | None"]  # (config, learner id, region)
_link_factory: LinkFactory = lambda cfg, learner_id, region: None


def emulate_links(factory: LinkFactory) -> None:
    """How a harness that emulates a WAN hands its links to a learner it starts, before the
    learner makes its clients (the local cluster's launcher, localcluster/wan.py). A learner
    never emulates a link on its own: without a harness its traffic takes the real network."""
    global _link_factory
    _link_factory = factory


def emulated_link(cfg: Config, learner_id: str, region: str) -> LinkEmulation | None:
    """The link a harness handed in for this learner's sync traffic, or None."""
    return _link_factory(cfg, learner_id, region)


@dataclass
class PulledItem:
    kind: int  # pb.PAYLOAD_KIND_UPDATE or pb.PAYLOAD_KIND_SNAPSHOT
    version: int
    values: torch.Tensor  # decoded fp32


@dataclass
class PullResult:
    """A pull's items as they came (learner/sync/pulled.py applies them to a held value)."""
    fragment_id: int
    items: list[PulledItem]
    state_hash: str  # of the global value after the last item ("" if nothing was sent)
    payload_bytes: int  # bytes that crossed the wire, for bandwidth accounting

    @property
    def version(self) -> int | None:
        return self.items[-1].version if self.items else None


class TransferObserver(Protocol):
    """Told about every completed transfer and heartbeat (learner/sync/metrics.py: LearnerMetrics)."""

    def pushed(self, header: pb.PushHeader, payload_bytes: int, seconds: float, result: int) -> None: ...

    def pulled(self, bytes_by_codec: Mapping[str, int], seconds: float) -> None: ...

    def heartbeat_answered(self, versions: Mapping[int, int]) -> None: ...


class ShardClient:
    """`identity` is the certificate this process presents (services.tls.load_identity);
    None only when the config says plaintext. A learner's calls must present its own. When its
    folder's files change (`diloco certs renew`), the calls from then on present the new one
    on a new channel; calls in flight finish on the old one, which closes with the client."""

    def __init__(self, address: str, rpc: RpcConfig, learner_id: str = "", incarnation: int = 0,
                 wan: LinkEmulation | None = None, observer: TransferObserver | None = None, *,
                 identity: Identity | None):
        self.address = address
        self.wan = wan
        self.observer = observer
        self.rpc = rpc
        self.learner_id = learner_id
        self.incarnation = incarnation
        self._identity = identity
        self._lock = threading.Lock()
        self.channel = open_channel(address, rpc, identity)
        self._stub = pb_grpc.SyncerStub(self.channel)
        self._retired: list[grpc.Channel] = []

    @property
    def stub(self) -> pb_grpc.SyncerStub:
        """The stub for a call made now: on a new channel if the certificate was renewed."""
        with self._lock:
            renewed = self._identity.reloaded() if self._identity else None
            if renewed is not None:
                self._identity = renewed
                self._retired.append(self.channel)
                self.channel = open_channel(self.address, self.rpc, renewed)
                self._stub = pb_grpc.SyncerStub(self.channel)
            return self._stub

    def close(self) -> None:
        with self._lock:
            for channel in [*self._retired, self.channel]:
                channel.close()

    def __enter__(self) -> "ShardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def join(self, region: str, manifest: Sequence[tuple[str, Sequence[int]]]) -> pb.JoinResponse:
        request = pb.JoinRequest(
            learner_id=self.learner_id, incarnation=self.incarnation, region=region,
            manifest=pb.ParameterManifest(tensors=[pb.TensorSpec(name=n, shape=list(s)) for n, s in manifest]))
        return self.stub.Join(request, timeout=self.rpc.deadline_seconds)

    def heartbeat(self, step: int = 0, step_seconds: float = 0.0, tokens_per_second: float = 0.0,
                  held_versions: dict[int, int] | None = None, sync_step: int | None = None,
                  tokens: int = 0, waiting_for: int | None = None, standing_still: bool = False,
                  skipped: tuple[int, ...] = (), timeout: float | None = None) -> pb.HeartbeatResponse:
        """`waiting_for`: the fragment whose result training waits for now, if any;
        `standing_still`: training stands still (an island regrouping); `skipped`: fragments
        whose open round it will not contribute to. `timeout`: the call's deadline (default
        rpc.deadline_seconds)."""
        request = pb.HeartbeatRequest(
            learner_id=self.learner_id, incarnation=self.incarnation, step=step,
            step_seconds=step_seconds, tokens_per_second=tokens_per_second,
            held_versions=held_versions or {}, sync_step=step if sync_step is None else sync_step,
            tokens=tokens, waiting_for_fragment=waiting_for, standing_still=standing_still,
            skipped_fragments=skipped)
        reply = self.stub.Heartbeat(request, timeout=timeout or self.rpc.deadline_seconds)
        if self.observer:
            self.observer.heartbeat_answered(reply.versions)
        return reply

    def leave(self) -> None:
        self.stub.Leave(pb.LeaveRequest(learner_id=self.learner_id, incarnation=self.incarnation),
                        timeout=self.rpc.deadline_seconds)

    def attend(self) -> grpc.Call:
        """Opens this learner's Attend call, which the shard holds until the call is cancelled
        or this process's connection closes (then the shard stops counting the learner at
        once, unless it left first). Returns at once; cancel() ends it."""
        return self.stub.Attend(pb.AttendRequest(learner_id=self.learner_id, incarnation=self.incarnation))

    def push(self, fragment_id: int, values: torch.Tensor | bytes, *, codec: Codec | str,
             block_size: int, kind: int = pb.PUSH_KIND_OUTER_GRADIENT, base_version: int = 0,
             c_steps: int = 0, c_tokens: int = 0, step_seconds: float = 0.0,
             numel: int | None = None, state_hash: str = "", final: bool = False) -> pb.PushResponse:
        """Pushes a tensor (encoded here) or an already-encoded payload (then give numel).
        `state_hash`: a RESTORE's, of the value pushed. `final`: the learner's last outer
        gradient of the fragment."""
        codec = get_codec(codec) if isinstance(codec, (str, int)) else codec
        if isinstance(values, torch.Tensor):
            numel = values.numel()
            payload = codec.encode(values, block_size)
        else:
            payload = values
            if numel is None:
                raise ValueError("push of an encoded payload needs numel")
        chunk_bytes = seed_chunk_bytes(len(payload)) if kind == pb.PUSH_KIND_SEED else CHUNK_BYTES
        header = pb.PushHeader(
            learner_id=self.learner_id, incarnation=self.incarnation, fragment_id=fragment_id,
            kind=kind, base_version=base_version, c_steps=c_steps, c_tokens=c_tokens,
            step_seconds=step_seconds, payload=describe(codec, numel, payload, block_size, chunk_bytes),
            state_hash=state_hash, final=final)

        def requests() -> Iterator[pb.PushRequest]:
            if self.wan:  # the chunks follow the header on the way out: one latency for them all
                self.wan.up.wait_latency()
            for request in push_requests(header, payload, chunk_bytes):
                if self.wan and request.HasField("chunk"):
                    self.wan.up.consume(len(request.chunk.data))
                yield request

        started = time.perf_counter()
        reply = self.stub.PushFragment(requests(), timeout=stream_deadline(self.rpc, len(payload)))
        if self.wan:  # the reply crosses back
            self.wan.down.wait_latency()
        if self.observer:
            self.observer.pushed(header, len(payload), time.perf_counter() - started, reply.result)
        return reply

    def pull(self, fragment_id: int, base_version: int | None = None, *, min_version: int = 0,
             max_wait_seconds: float = 0.0, anchor_hash: str = "", exact: bool = False) -> PullResult:
        """What takes the value held at base_version (its state hash `anchor_hash`; without it, the
        updates after base_version) to the fragment's current value, or a snapshot, waiting up
        to max_wait_seconds for the fragment to reach min_version. `exact`: to the shards' bits,
        never one delta (the updates since, or a snapshot)."""
        request = pb.PullRequest(learner_id=self.learner_id, fragment_id=fragment_id, min_version=min_version,
                                 max_wait_seconds=max_wait_seconds, anchor_hash=anchor_hash, exact=exact)
        if base_version is not None:
            request.base_version = base_version
        started = time.perf_counter()
        if self.wan:  # the request crosses to the shard
            self.wan.up.wait_latency()
        responses = self.stub.PullFragment(request, timeout=max_wait_seconds + stream_deadline(self.rpc, 0))
        items: list[PulledItem] = []
        final_hash, wire_bytes = "", 0
        bytes_by_codec: dict[str, int] = {}
        header, assembler = None, None
        for response in responses:
            if response.HasField("header"):
                if assembler is not None:
                    raise ValueError(f"fragment {fragment_id}: new item before v{header.version} finished")
                header = response.header
                assembler = Reassembler(header.payload)
                final_hash = header.state_hash or final_hash
            else:
                if assembler is None:
                    raise ValueError(f"fragment {fragment_id}: chunk before any item header")
                assembler.add(response.chunk)
                if self.wan:
                    self.wan.down.consume(len(response.chunk.data))
            if assembler is not None and assembler.complete:
                payload = assembler.finish()
                wire_bytes += len(payload)
                codec = get_codec(header.payload.codec).name
                bytes_by_codec[codec] = bytes_by_codec.get(codec, 0) + len(payload)
                items.append(PulledItem(header.kind, header.version, decode_payload(header.payload, payload)))
                header, assembler = None, None
        if assembler is not None:
            raise ValueError(f"fragment {fragment_id}: stream ended inside v{header.version}")
        if self.wan:  # the answer's end reaches the learner a latency after the shard sent it
            self.wan.down.wait_latency()
        if self.observer:
            self.observer.pulled(bytes_by_codec, time.perf_counter() - started)
        return PullResult(fragment_id, items, final_hash, wire_bytes)

    def status(self, timeout: float | None = None) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=timeout or self.rpc.deadline_seconds)
