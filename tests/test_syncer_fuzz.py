"""Fuzzing a live shard over real gRPC with mutual TLS (an in-process shard): hypothesis makes
streams of pushes — valid ones, random bytes as chunks, truncated and reordered streams,
header fields that lie (element counts, sizes, checksums, codecs, kinds, versions, learner
ids, and every number a learner claims: c_steps, c_tokens, step_seconds), huge declared sizes,
NaN/Inf payloads, messages that are not protobuf at all, replays of accepted pushes — and
sends them one after another or interleaved. A second test sends heartbeats with every
number of HeartbeatRequest drawn from plausible values and from extremes (NaN, Inf, negative,
subnormal, 2^64-1, beyond the learner's budget).

After every case: the shard answers health checks (on its port and on its plaintext health
port) and Status, every call was answered OK or refused with a specific status code and a
message, a fragment's version grew by exactly the pushes accepted for it and its hash changed
only with its version (nothing refused left a trace), a refused heartbeat left the learner's
record as it was, an honest heartbeat is still answered, and every refusal the core made was
counted.

Learner a is the only live learner, so each accepted push closes a round at once: what a
push changes is visible right after it. Derandomized, so CI runs the same cases every time.
"""
import struct
import threading
import zlib

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.services.client import ShardClient
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import RpcConfig
from diloco.services.contract.payload import describe, iter_chunks
from diloco.services.contract.rpc import open_channel
from diloco.services.contract.wire import pb
from diloco.syncer.service import start_shard
from tests.shard_over_grpc import BLOCK, MANIFEST, identity, write_config

CASES = 400
HEARTBEAT_CASES = 250
T = 8 * 128  # the most tokens per step: write_config's trainer.batch_size x model.seq_len
EXTREME_FLOATS = [float("nan"), float("inf"), -float("inf"), -1.0, -0.0, 5e-324, 1e-7, 1e300, 86_401.0]
EXTREME_INTS = [0, 1, 2**32, 2**63, 2**64 - 1]
# What a shard may answer a hostile push with; never UNKNOWN, INTERNAL or UNAVAILABLE.
REFUSAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED}
MERGED = {pb.PUSH_RESULT_ACCEPTED, pb.PUSH_RESULT_STALE_MERGED}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """Shard 0 with a plaintext health port; a joined and seeded both of its fragments."""
    tmp_path = tmp_path_factory.mktemp("fuzz")
    _, cfg = write_config(tmp_path, limits={"max_chunks_per_push": 512, "max_push_bytes": 1 << 16},
                          max_staleness=2, max_update_norm=1.0e6, lease_seconds=3600.0)
    handle = start_shard(cfg, 0, health_listen="127.0.0.1:0")
    channel = open_channel(f"127.0.0.1:{handle.port}", cfg.rpc, identity(cfg, "a"))
    health_channel = open_channel(f"127.0.0.1:{handle.server.health_port}", RpcConfig(), None)
    try:
        with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, "a", 1, identity=identity(cfg, "a")) as a:
            fragments = {f.fragment_id: f.numel for f in a.join("r", MANIFEST).fragments}
            for fid, numel in fragments.items():
                a.push(fid, torch.zeros(numel), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        world = Shard(handle, channel, health_channel, fragments)
        yield world
    finally:
        channel.close()
        health_channel.close()
        handle.stop()


class Shard:
    def __init__(self, handle, channel, health_channel, fragments):
        self.handle, self.fragments = handle, fragments
        self.push = channel.stream_unary("/diloco.v1.Syncer/PushFragment",
                                         request_serializer=lambda request: request,  # bytes as sent
                                         response_deserializer=pb.PushResponse.FromString)
        self.health = [health_pb2_grpc.HealthStub(c) for c in (channel, health_channel)]
        self.heartbeat = channel.unary_unary("/diloco.v1.Syncer/Heartbeat",
                                             request_serializer=pb.HeartbeatRequest.SerializeToString,
                                             response_deserializer=pb.HeartbeatResponse.FromString)
        self.status = channel.unary_unary("/diloco.v1.Syncer/Status",
                                          request_serializer=pb.StatusRequest.SerializeToString,
                                          response_deserializer=pb.StatusResponse.FromString)
        self.accepted: list[list[bytes]] = []  # every accepted push's messages, for replays

    def state(self):
        return {f.id: (f.version, f.state_hash) for f in self.handle.core.status().fragments}

    def refusals(self):
        return sum(v for k, v in self.handle.core.counters_snapshot().items() if k.startswith("refusals."))


# ---- what hypothesis draws ----------------------------------------------------------------

def _header(fragment, numel, version, values, codec="int4", **fields):
    codec = get_codec(codec)
    block = BLOCK if codec.name != "fp32" else 1
    payload = codec.encode(values, block)
    header = pb.PushHeader(learner_id="a", incarnation=1, fragment_id=fragment,
                           kind=pb.PUSH_KIND_OUTER_GRADIENT, base_version=version, c_steps=4, c_tokens=64,
                           step_seconds=0.1, payload=describe(codec, numel, payload, block))
    return header, payload


@st.composite
def pushes(draw, fragments, versions):
    """One push stream as the bytes of its messages, and what it was drawn as."""
    fragment = draw(st.sampled_from(sorted(fragments)) | st.integers(0, 6))
    numel = fragments.get(fragment, 100)
    version = versions.get(fragment, 0)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    values = torch.randn(numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * scale
    header, payload = _header(fragment, numel, draw(st.sampled_from([version] * 4 + [max(0, version - 1),
                                                                      version + 1, 2**63])), values,
                              codec=draw(st.sampled_from(["int4", "int4", "int4", "int8", "fp32"])))
    special = draw(st.sampled_from([None, None, None, float("nan"), float("inf"), -float("inf")]))
    if special is not None:  # encoders refuse NaN and Inf: write one over the first block scale
        payload = struct.pack("<f", special) + payload[4:]  # (fp32: the first value)
        header.payload.crc32 = zlib.crc32(payload)
    kind = draw(st.sampled_from(["valid", "valid", "random_chunks", "lying_header", "claims", "truncated",
                                 "reordered", "bad_messages", "garbage"]))
    if kind == "claims":  # what the learner says it did: in range, at the bound, or far beyond
        header.c_steps = draw(st.sampled_from([1, 4, 1000, 1001] + EXTREME_INTS))
        header.c_tokens = draw(st.sampled_from([min(tokens, 2**64 - 1) for tokens in (
            1, header.c_steps * T, header.c_steps * T + 1, 10 * header.c_steps * T)] + EXTREME_INTS))
        header.step_seconds = draw(st.sampled_from([0.1, 0.0, 1e-6, 86_400.0] + EXTREME_FLOATS))
    elif kind == "random_chunks":  # random bytes of the right length, checksum and all
        payload = draw(st.binary(min_size=len(payload), max_size=len(payload)))
        header.payload.crc32 = zlib.crc32(payload)
    elif kind == "lying_header":
        field = draw(st.sampled_from(["numel", "payload_bytes", "chunk_count", "crc32", "codec", "block_size",
                                      "kind", "c_steps", "incarnation", "learner_id", "huge", "fragment_id"]))
        if field == "fragment_id":
            header.fragment_id = draw(st.sampled_from([2**32 - 1, 2**31]))
        elif field == "huge":
            header.payload.numel, header.payload.payload_bytes = 2**62, 2**63
        elif field == "learner_id":
            header.learner_id = draw(st.sampled_from(["b", "mallory", "", "a" * 300]))
        elif field == "kind":
            header.kind = draw(st.integers(0, 7))
        elif field in ("c_steps", "incarnation"):
            setattr(header, field, draw(st.integers(0, 3)))
        elif field == "codec":  # an enum: int32 on the wire
            header.payload.codec = draw(st.integers(0, 2**31 - 1))
        else:
            setattr(header.payload, field, draw(st.integers(0, 2**32 - 1)))
    chunk_bytes = draw(st.sampled_from([7, 64, 1 << 20]))
    if header.payload.payload_bytes == len(payload):
        header.payload.chunk_count = -(-len(payload) // chunk_bytes)
    chunks = [pb.PushRequest(chunk=c) for c in iter_chunks(payload, chunk_bytes)]
    messages = [pb.PushRequest(header=header)] + chunks
    if kind == "truncated" and chunks:
        cut = draw(st.integers(0, len(messages) - 1))
        messages = messages[:cut] + ([pb.PushRequest(chunk=pb.Chunk(index=cut - 1, data=chunks[cut - 1].chunk.data[:3]))]
                                     if cut > 1 and draw(st.booleans()) else [])
    elif kind == "reordered" and len(messages) > 2:
        messages = draw(st.permutations(messages))
    elif kind == "bad_messages":
        extra = draw(st.sampled_from([pb.PushRequest(), pb.PushRequest(header=header),
                                      pb.PushRequest(chunk=pb.Chunk(index=2**31, data=b"x" * 100))]))
        messages.insert(draw(st.integers(0, len(messages))), extra)
    wire = [m.SerializeToString() for m in messages]
    if kind == "garbage":  # bytes that are not a PushRequest at all
        wire.insert(draw(st.integers(0, len(wire))), draw(st.sampled_from([b"\xff\xff\xff", b"\x0a\x80", b"\x12"])))
    return kind, fragment, wire


@st.composite
def cases(draw, fragments, versions):
    """A few pushes (or replays of accepted ones), sent one after another or all at once."""
    replays = st.sampled_from(["replay_last", "replay_old"])
    streams = draw(st.lists(pushes(fragments, versions) | replays, min_size=1, max_size=4))
    return streams, draw(st.booleans())


# ---- the test -------------------------------------------------------------------------------

def _send(world, wire, outcomes, index):
    try:
        reply = world.push(iter(wire), timeout=10)
        outcomes[index] = (grpc.StatusCode.OK, reply.result, "")
    except grpc.RpcError as error:
        outcomes[index] = (error.code(), None, error.details() or "")


def test_hostile_pushes_change_nothing_they_are_refused(shard):
    world = shard
    # Versions the pushes are drawn against: hypothesis draws before the case runs.
    versions = {fid: version for fid, (version, _) in world.state().items()}

    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(world.fragments, versions))
    def run(case):
        streams, together = case
        ran.append(case)
        # A replay resends an accepted push: the last (a duplicate) or an older one (stale).
        replay = {"replay_last": -1, "replay_old": 0}
        wires = [world.accepted[replay[s]] if isinstance(s, str) and world.accepted else
                 [] if isinstance(s, str) else s[2] for s in streams]
        before, refused_before = world.state(), world.refusals()
        outcomes = [None] * len(wires)
        if together:
            threads = [threading.Thread(target=_send, args=(world, w, outcomes, i)) for i, w in enumerate(wires)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
        else:
            for i, wire in enumerate(wires):
                _send(world, wire, outcomes, i)

        merged: dict[int, int] = {}
        core_refusals = 0
        for wire, (code, result, details) in zip(wires, outcomes):
            if code == grpc.StatusCode.OK:
                if result in MERGED:
                    fragment = pb.PushRequest.FromString(wire[0]).header.fragment_id
                    merged[fragment] = merged.get(fragment, 0) + 1
                    world.accepted.append(wire)
                else:
                    assert result == pb.PUSH_RESULT_REFUSED_STALE, result
            else:
                assert code in REFUSAL_CODES and details, (code, details)
                core_refusals += "does not parse" not in details  # the RPC layer's, not the core's
        after = world.state()
        for fid, (version, state_hash) in after.items():
            assert version - before[fid][0] == merged.get(fid, 0), (fid, before[fid], after[fid], outcomes)
            if not merged.get(fid):
                assert state_hash == before[fid][1], f"fragment {fid} changed by refused pushes: {outcomes}"
        assert world.refusals() - refused_before == core_refusals, outcomes
        _check_answering(world)
        versions.update({fid: version for fid, (version, _) in after.items()})

    ran = []
    run()
    assert len(ran) >= CASES and world.accepted, (len(ran), len(world.accepted))


def _check_answering(world):
    """Health, Status and an honest heartbeat are answered, whatever came before."""
    for health in world.health:
        reply = health.Check(health_pb2.HealthCheckRequest(service="diloco.v1.Syncer"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    world.status(pb.StatusRequest(), timeout=5)
    reply = world.heartbeat(pb.HeartbeatRequest(learner_id="a", incarnation=1), timeout=5)
    assert 0 <= reply.run_tokens <= 1000 * T  # learner a's budget: trainer.max_steps x T


@st.composite
def heartbeats(draw):
    """A heartbeat of learner a: plausible numbers, some replaced by extremes."""
    step = draw(st.integers(0, 1000))
    step_seconds = draw(st.sampled_from([0.0, 1e-3, 0.05, 2.0]))
    rate = draw(st.integers(1, T)) / step_seconds if step_seconds else 0.0
    fields = {"step": step, "step_seconds": step_seconds, "tokens_per_second": rate,
              "tokens": draw(st.integers(0, step * T)), "sync_step": step + draw(st.integers(0, 7))}
    for field in draw(st.sets(st.sampled_from(sorted(fields) + ["incarnation", "held_versions"]), max_size=2)):
        if field in ("step_seconds", "tokens_per_second"):
            fields[field] = draw(st.sampled_from(EXTREME_FLOATS))
        elif field == "held_versions":
            fields[field] = {draw(st.sampled_from([0, 1, 2**32 - 1])): draw(st.sampled_from(EXTREME_INTS))}
        else:
            fields[field] = draw(st.sampled_from(EXTREME_INTS + [1001, step * T + 1]))
    return pb.HeartbeatRequest(learner_id="a", incarnation=fields.pop("incarnation", 1), **fields)


def _record(world):
    """Learner a as Status reports it, but for the time since its last call."""
    learner = next(l for l in world.handle.core.status().learners if l.id == "a")
    return learner.step, learner.step_seconds, learner.tokens_per_second, learner.tokens, learner.sync_step


def test_hostile_heartbeats_are_refused_and_break_no_learners_heartbeat(shard):
    world = shard

    @settings(max_examples=HEARTBEAT_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=heartbeats())
    def run(request):
        before, refused_before = _record(world), world.refusals()
        try:
            world.heartbeat(request, timeout=5)
            answered.append(request)
            assert _record(world) == (request.step, request.step_seconds, request.tokens_per_second,
                                      request.tokens, request.sync_step)
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), error
            assert error.details()
            assert _record(world) == before and world.refusals() == refused_before + 1
        _check_answering(world)

    answered = []
    run()
    assert answered  # some were plausible
