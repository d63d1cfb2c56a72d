"""The shard over real gRPC: bad input refused with its status and no state change (in-process
shard), concurrent learners ending with the shard's exact bits, and kill -9 of a shard process
losing nothing it acknowledged (real `diloco syncer` processes)."""
import contextlib
import itertools
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.learner.sync.pulled import value_after
from diloco.learner.sync.shard_errors import refusal_reason
from diloco.services.client import ShardClient
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.rpc import open_channel
from diloco.services.contract.config import RpcConfig
from diloco.services.contract.payload import describe, iter_chunks
from diloco.services.contract.state import state_hash
from diloco.services.contract.wire import pb
from diloco.syncer.core import ShardCore
from diloco.syncer.service import start_shard
from tests.cluster_watch import wait_until
from tests.shard_over_grpc import BLOCK, LEARNERS, MANIFEST, identity, outer_gradient, write_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- bad input: one in-process shard, each request refused without a trace ----------------

@pytest.fixture(scope="module")
def bad_input_shard(tmp_path_factory):
    """Shard 0, with fragment `seeded` at version 3 and fragment `unseeded` untouched. Learner a
    is live; b restarted (incarnation 2) and left; c never joined."""
    tmp_path = tmp_path_factory.mktemp("bad-input")
    # The seeded fragment holds ones: the outlier rule bounds a push at 1000 x its norm.
    _, cfg = write_config(tmp_path, max_staleness=1, max_update_norm=100.0, outlier_norm_factor=1000.0)
    handle = start_shard(cfg, 0)
    clients = []
    try:
        def client(learner, incarnation=1):
            clients.append(ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, learner, incarnation,
                                       identity=identity(cfg, learner)))
            return clients[-1]
        a = client("a")
        reply = a.join("r", MANIFEST)
        seeded, unseeded = (f.fragment_id for f in reply.fragments)
        numel = {f.fragment_id: f.numel for f in reply.fragments}
        a.push(seeded, torch.ones(numel[seeded]), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        for version in range(3):  # a alone is live: every push closes a round
            a.push(seeded, torch.full((numel[seeded],), 0.01), codec="int4", block_size=BLOCK,
                   base_version=version, c_steps=4, c_tokens=64)
        client("b").join("r", MANIFEST)
        b2 = client("b", 2)
        b2.join("r", MANIFEST)
        b2.leave()
        yield handle, cfg, client, seeded, unseeded, numel
    finally:
        for c in clients:
            c.close()
        handle.stop()


def _nan_scale(payload: bytes) -> bytes:
    """int4 layout (services/contract/codecs.py): fp32 block scales first; a NaN scale decodes to NaN."""
    return torch.tensor([float("nan")]).numpy().tobytes() + payload[4:]


def _bad_pushes(seeded, unseeded, other_shard, numel):
    """(name, reason, status code, words in the message, [PushRequest])"""
    n = numel[seeded]

    def stream(header, chunks):
        return [pb.PushRequest(header=header)] + chunks

    def case(name, reason, code, words, **kwargs):
        fragment = kwargs.pop("fragment", seeded)
        return name, reason, code, words, stream(*outer_gradient(fragment, numel.get(fragment, n), **kwargs))

    def edited(name, reason, code, words, edit, **kwargs):
        header, chunks = outer_gradient(seeded, n, **kwargs)
        chunks = edit(header, chunks)
        return name, reason, code, words, stream(header, chunks)

    def nan_payload(header, chunks):
        payload = _nan_scale(b"".join(c.chunk.data for c in chunks))
        header.payload.CopyFrom(describe(get_codec("int4"), n, payload, BLOCK))
        return [pb.PushRequest(chunk=c) for c in iter_chunks(payload)]

    def set_payload(**fields):
        def edit(header, chunks):
            for name, value in fields.items():
                setattr(header.payload, name, value)
            return chunks
        return edit

    I, F, N = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND
    return [
        case("unknown fragment", "unknown_fragment", N, "does not exist", fragment=99),
        case("another shard's fragment", "unknown_fragment", N, "belongs to shard 1", fragment=other_shard),
        case("unseeded fragment", "unseeded", F, "not been seeded", fragment=unseeded),
        case("wrong codec", "wrong_codec", I, "must be int4, got int8", codec="int8"),
        case("wrong block size", "wrong_block_size", I, f"must be {BLOCK}, got 64", block=64),
        edited("wrong element count", "wrong_numel", I, f"has {n} elements", set_payload(numel=n + 1)),
        edited("payload size and header disagree", "bad_payload_header", I, "payload_bytes",
               set_payload(payload_bytes=7)),
        edited("checksum mismatch", "checksum", grpc.StatusCode.DATA_LOSS, "crc32",
               lambda h, c: (setattr(h.payload, "crc32", h.payload.crc32 ^ 1), c)[1]),
        edited("missing chunk", "bad_chunks", I, "missing chunk 1", lambda h, c: c[:1] + c[2:], chunk_bytes=16),
        edited("truncated stream", "bad_chunks", I, "received", lambda h, c: c[:-1], chunk_bytes=16),
        edited("extra chunk", "bad_chunks", I, "beyond chunk_count",
               lambda h, c: c + [pb.PushRequest(chunk=pb.Chunk(index=len(c), data=b"x"))], chunk_bytes=16),
        edited("reordered chunks", "bad_chunks", I, "expected 1", lambda h, c: [c[0], c[2], c[1]] + c[3:],
               chunk_bytes=16),
        edited("second header", "bad_stream", I, "one PushHeader", lambda h, c: [pb.PushRequest(header=h)] + c),
        ("chunk before the header", "bad_stream", I, "starts with a PushHeader",
         outer_gradient(seeded, n)[1]),
        edited("NaN after decoding", "non_finite", I, "NaN or Inf", nan_payload),
        case("norm above the bound", "norm_too_large", I, "max_update_norm", values=torch.full((n,), 50.0)),
        case("an outlier", "norm_outlier", I, "outlier_norm_factor=1000", values=torch.full((n,), 2000.0)),
        case("no steps", "zero_steps", I, "c_steps=0", c_steps=0),
        case("unknown kind", "bad_kind", I, "neither a seed", kind=pb.PUSH_KIND_UNSPECIFIED),
        case("duplicate of a merged contribution", "duplicate", grpc.StatusCode.ALREADY_EXISTS,
             "already contributed", base=2),
        case("base version from the future", "future_base_version", F, "ahead of", base=9),
        case("second seed", "already_seeded", grpc.StatusCode.ALREADY_EXISTS, "already seeded",
             kind=pb.PUSH_KIND_SEED, codec="fp32", base=0),
        case("seed not in fp32", "wrong_codec", I, "must be fp32", kind=pb.PUSH_KIND_SEED, fragment=unseeded, base=0),
        case("learner never joined", "not_joined", F, "has not joined", learner="c"),
        case("old incarnation", "old_incarnation", F, "replaced by incarnation 2", learner="b"),
        case("learner that left", "not_live", F, "has left", learner="b", incarnation=2),
        case("id not in the config", "unknown_learner_id", grpc.StatusCode.PERMISSION_DENIED,
             "not in the cluster config", learner="mallory"),
    ]


def _fragments(client):
    return [f.SerializeToString() for f in client.status().fragments]


def test_each_bad_push_is_refused_with_its_status_and_changes_nothing(bad_input_shard):
    handle, cfg, client, seeded, unseeded, numel = bad_input_shard
    a = client("a")
    plan = a.join("r", MANIFEST)  # rejoining is harmless, and tells us the whole plan
    owned = {f.fragment_id for f in plan.fragments}
    other_shard = next(i for i in range(cfg.sync.fragments) if i not in owned)
    for name, reason, code, words, requests in _bad_pushes(seeded, unseeded, other_shard, numel):
        before, counted = _fragments(a), a.status().counters
        # Each push comes from the learner its header names, holding that learner's certificate.
        pusher = client(requests[0].header.learner_id) if requests[0].HasField("header") else a
        with pytest.raises(grpc.RpcError) as info:
            pusher.stub.PushFragment(iter(requests), timeout=10)
        assert info.value.code() == code, f"{name}: {info.value.code()} {info.value.details()}"
        assert words in info.value.details(), f"{name}: {info.value.details()}"
        assert refusal_reason(info.value) == reason, name  # in the trailing metadata, for the learner
        assert _fragments(a) == before, f"{name} changed the shard's state"
        key = f"refusals.{reason}"
        assert a.status().counters[key] == counted.get(key, 0) + 1, name


def test_too_stale_is_an_answer_not_an_error(bad_input_shard):
    handle, cfg, client, seeded, unseeded, numel = bad_input_shard
    a = client("a")
    before = _fragments(a)
    header, chunks = outer_gradient(seeded, numel[seeded], base=1)  # version 3, max_staleness 1
    reply = a.stub.PushFragment(iter([pb.PushRequest(header=header)] + chunks), timeout=10)
    assert (reply.result, reply.current_version, reply.staleness) == (pb.PUSH_RESULT_REFUSED_STALE, 3, 2)
    assert _fragments(a) == before


def test_membership_and_pull_refusals_over_the_wire(bad_input_shard):
    handle, cfg, client, seeded, unseeded, numel = bad_input_shard
    cases = [
        (lambda: client("c").heartbeat(), grpc.StatusCode.FAILED_PRECONDITION, "has not joined"),
        (lambda: client("mallory").join("r", MANIFEST), grpc.StatusCode.PERMISSION_DENIED, "not in the cluster"),
        (lambda: client("c").join("r", MANIFEST[:-1]), grpc.StatusCode.FAILED_PRECONDITION, "expected 8"),
        (lambda: client("a").pull(42), grpc.StatusCode.NOT_FOUND, "does not exist"),
        (lambda: client("a").pull(seeded, 7), grpc.StatusCode.FAILED_PRECONDITION, "ahead of"),
        (lambda: client("a").pull(unseeded), grpc.StatusCode.FAILED_PRECONDITION, "not been seeded"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert (info.value.code(), words in info.value.details()) == (code, True), info.value.details()


# ---- the seed race ------------------------------------------------------------------------

class _SlowUplink:
    """A learner's uplink that takes `seconds_per_chunk` per chunk, counting the bytes that went
    out; `before_first` runs as the first chunk is about to leave."""

    def __init__(self, seconds_per_chunk: float, before_first):
        self.latency_seconds, self.sent = 0.0, 0
        self._seconds, self._before_first = seconds_per_chunk, before_first

    def book(self, count: int) -> float:
        return time.monotonic()

    def consume(self, count: int) -> None:
        if self.sent == 0:
            self._before_first()
        self.sent += count
        time.sleep(self._seconds)

    def wait_latency(self) -> None:
        pass


def test_a_seed_that_loses_the_race_on_a_slow_link_stops_within_a_fraction_of_its_upload(tmp_path):
    """Every learner seeds the fragments it finds unseeded, and the first seed in wins. A seed
    is cut into several chunks however small the fragment, so a loser on a slow link is refused
    at its next chunk instead of uploading the whole value the shard no longer needs."""
    _, cfg = write_config(tmp_path)
    handle = start_shard(cfg, 0)
    manifest = [(f"w{i}", (50_000,)) for i in range(4)]  # 200 kB in fp32 per fragment
    fast, slow = (ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, learner, 1, identity=identity(cfg, learner))
                  for learner in ("a", "b"))
    try:
        fragment = fast.join("r", manifest).fragments[0]
        slow.join("r", manifest)
        value = torch.randn(fragment.numel)

        def the_fast_learner_seeds_first():
            fast.push(fragment.fragment_id, value, codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)

        uplink = _SlowUplink(0.5, the_fast_learner_seeds_first)
        slow.wan = type("Link", (), {"up": uplink, "down": uplink})()
        with pytest.raises(grpc.RpcError) as refused:
            slow.push(fragment.fragment_id, value, codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert 0 < uplink.sent < 4 * fragment.numel  # the fp32 value: 4 bytes each
    finally:
        for client in (fast, slow):
            client.close()
        handle.stop()


# ---- real shard processes ------------------------------------------------------------------

class ShardProcess:
    def __init__(self, config_path, cfg, index, log_dir):
        self.config_path, self.index, self.address = config_path, index, cfg.shards[index].address
        self.cfg = cfg
        self.log_path = log_dir / f"shard-{index}.log"
        self.process = None

    def start(self):
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "diloco", "syncer", "--config", str(self.config_path),
                 "--shard-index", str(self.index), "--listen", self.address, "--drain-seconds", "1"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        with open_channel(self.address, RpcConfig(), identity(self.cfg, None)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self.log_path.read_text()
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise TimeoutError(f"shard {self.index} not serving after {timeout}s:\n{self.log_path.read_text()}")

    def kill(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=15)


@pytest.fixture
def cluster(tmp_path):
    """Two `diloco syncer` processes with the config's addresses; (config, shards)."""
    def start(**syncer):
        path, cfg = write_config(tmp_path, **syncer)
        shards.extend(ShardProcess(path, cfg, i, tmp_path) for i in range(len(cfg.shards)))
        for shard in shards:
            shard.start()
        for shard in shards:
            shard.wait_serving()
        return cfg, shards

    shards: list[ShardProcess] = []
    try:
        yield start
    finally:
        for shard in shards:
            shard.kill()


class Learner:
    """What a learner does to the shards, minus training: random outer gradients, pulls, and
    the recovery a real one needs (retry when a shard is down, rejoin when it forgot us)."""

    def __init__(self, learner_id, cfg, gate, max_delay=0.0):
        self.id, self.cfg, self.gate = learner_id, cfg, gate
        self.max_delay = max_delay  # seconds of "training" before a push, drawn uniformly
        self.clients = [ShardClient(s.address, cfg.rpc, learner_id, time.time_ns(), identity=identity(cfg, learner_id))
                        for s in cfg.shards]
        self.generator = torch.Generator().manual_seed(sum(map(ord, learner_id)))
        self.values, self.versions, self.owner = {}, {}, {}
        self.acked = []  # (shard, fragment, round) of every acknowledged contribution
        self.syncs = 0

    def join(self, shard):
        reply = self.clients[shard].join("r", MANIFEST)
        for info in reply.fragments:
            self.owner[info.fragment_id] = shard
            if not info.initialized:
                try:
                    self.clients[shard].push(info.fragment_id, torch.randn(info.numel, generator=self.generator),
                                             codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ALREADY_EXISTS:  # another learner was first
                        raise
            self._apply(info.fragment_id, self.clients[shard].pull(info.fragment_id, self.versions.get(info.fragment_id)))

    def sync(self, fragment):
        """Push an outer gradient against the held version, pull the round's result."""
        shard = self.owner[fragment]
        with self.gate.passage(shard) as is_open:
            if not is_open:
                time.sleep(0.02)
                return
            time.sleep(self.max_delay * float(torch.rand(1, generator=self.generator)))
            client, version = self.clients[shard], self.versions[fragment]
            values = torch.randn(self.values[fragment].numel(), generator=self.generator) * 0.01
            try:
                try:
                    reply = client.push(fragment, values, codec="int4", block_size=BLOCK, base_version=version,
                                        c_steps=8, c_tokens=512, step_seconds=0.01)
                    if reply.result == pb.PUSH_RESULT_REFUSED_STALE:
                        self._apply(fragment, client.pull(fragment, version))
                        return
                    self.acked.append((shard, fragment, reply.round))
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ALREADY_EXISTS:  # stored before, ack lost in a crash
                        raise
                self._apply(fragment, client.pull(fragment, version, min_version=version + 1, max_wait_seconds=1))
                self.syncs += 1
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the shard restarted: rejoin
                    self.join(shard)
                elif error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    time.sleep(0.05)
                else:
                    raise

    def catch_up(self):
        for fragment, shard in self.owner.items():
            self._apply(fragment, self.clients[shard].pull(fragment, self.versions[fragment]))

    def _apply(self, fragment, result):
        if result.items:
            self.values[fragment] = value_after(result, self.values.get(fragment))
            self.versions[fragment] = result.version
            assert state_hash(self.values[fragment]) == result.state_hash, (self.id, fragment, result.version)

    def close(self):
        for client in self.clients:
            client.close()


class Gate:
    """Lets the test close a shard to new calls and wait until none is in flight."""

    def __init__(self):
        self.closed, self.in_flight = set(), 0
        self.condition = threading.Condition()

    @contextlib.contextmanager
    def passage(self, shard):
        """Yields whether the shard is open; while it is, the call counts as in flight."""
        with self.condition:
            is_open = shard not in self.closed
            self.in_flight += is_open
        try:
            yield is_open
        finally:
            with self.condition:
                self.in_flight -= is_open
                self.condition.notify_all()

    def close(self, shard):
        with self.condition:
            self.closed.add(shard)
            assert self.condition.wait_for(lambda: self.in_flight == 0, timeout=15)

    def open(self, shard):
        with self.condition:
            self.closed.discard(shard)


def run_learners(learners, until, timeout=40.0):
    """Each learner syncs every fragment in turn, on its own thread, until `until()`."""
    errors = []

    def loop(learner):
        try:
            while not until():
                for fragment in sorted(learner.owner):
                    if until():
                        break
                    learner.sync(fragment)
        except BaseException as error:  # surfaces in the test thread
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(learner,), daemon=True) for learner in learners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a learner thread is stuck"
    if errors:
        raise errors[0]


def shard_statuses(cfg) -> list:
    statuses = []
    for shard in cfg.shards:
        with ShardClient(shard.address, cfg.rpc, identity=identity(cfg, None)) as client:
            statuses.append(client.status())
    return statuses


def assert_identical_bits(learners, cfg):
    # A learner's last pull gives up after 1 s: on a loaded machine its round may still be in
    # its grace window then. The learners catch up once the shards are quiet: no version and no
    # open round changed for a second (a round waiting for a learner that stopped stays open).
    def shards_now():
        return [(f.fragment_id, f.version, f.pending_contributions)
                for status in shard_statuses(cfg) for f in status.fragments]

    deadline, last, quiet_since = time.monotonic() + 20, None, time.monotonic()
    while time.monotonic() - quiet_since < 1.0 and time.monotonic() < deadline:
        now = shards_now()
        if now != last:
            last, quiet_since = now, time.monotonic()
        time.sleep(0.1)
    for learner in learners:
        learner.catch_up()
    statuses = shard_statuses(cfg)
    hashes = {f.fragment_id: (f.version, f.state_hash) for status in statuses for f in status.fragments}
    for learner in learners:
        assert {f: (learner.versions[f], state_hash(v)) for f, v in learner.values.items()} == hashes, learner.id
    for fragment in hashes:
        assert all(torch.equal(l.values[fragment], learners[0].values[fragment]) for l in learners)
    return statuses


def test_concurrent_learners_end_with_the_shards_exact_bits(cluster):
    cfg, shards = cluster(quorum=1)  # with a 0.2 s grace window
    gate = Gate()
    # c is slow: rounds often close without it, and it contributes from an older version.
    learners = [Learner(learner, cfg, gate, max_delay=0.4 if learner == "c" else 0.0) for learner in LEARNERS]
    try:
        for learner in learners:
            for shard in range(len(shards)):
                learner.join(shard)
        run_learners(learners, until=lambda: min(l.syncs for l in learners) >= 12)
        statuses = assert_identical_bits(learners, cfg)
        assert all(f.version >= 3 for status in statuses for f in status.fragments)
        for shard, status in enumerate(statuses):  # every acknowledged push was counted as such
            acked = sum(1 for l in learners for s, _, _ in l.acked if s == shard)
            counters = status.counters
            assert counters["contributions.accepted"] + counters["contributions.stale_merged"] == acked
            assert counters["rounds.all"] and counters["rounds.quorum_grace"]
    finally:
        for learner in learners:
            learner.close()
    for shard in shards:  # SIGTERM: drain, exit 0
        assert shard.terminate() == 0, shard.log_path.read_text()
        assert f"shard {shard.index} serving on" in shard.log_path.read_text()


def test_a_shard_whose_log_lost_bytes_refuses_to_start_rather_than_serve_its_versions_again(cluster):
    """Three rounds of one fragment closed on shard 0 and only in its log (no snapshot since
    the seed); the shard is stopped and its log cut short. Restarted, it must not come back at
    an older version and reuse the version numbers learners already applied."""
    cfg, shards = cluster(quorum=3, lease_seconds=3600.0, snapshot_log_ratio=1000.0)
    shard = shards[0]
    clients = {learner: ShardClient(shard.address, cfg.rpc, learner, 1, identity=identity(cfg, learner))
               for learner in LEARNERS}
    try:
        fragment = next(f for f in clients["a"].join("r", MANIFEST).fragments)
        for learner in LEARNERS[1:]:
            clients[learner].join("r", MANIFEST)
        clients["a"].push(fragment.fragment_id, torch.zeros(fragment.numel), codec="fp32", block_size=BLOCK,
                          kind=pb.PUSH_KIND_SEED)
        for version in range(3):
            for learner in LEARNERS:
                clients[learner].push(fragment.fragment_id, torch.full((fragment.numel,), 0.01), codec="int4",
                                      block_size=BLOCK, base_version=version, c_steps=4, c_tokens=64,
                                      step_seconds=0.1)
            assert clients["a"].pull(fragment.fragment_id, version, min_version=version + 1,
                                     max_wait_seconds=10).version == version + 1
    finally:
        for client in clients.values():
            client.close()
    assert shard.terminate() == 0
    log = pathlib.Path(cfg.run.state_dir) / "shard-0" / f"fragment-{fragment.fragment_id}" / "round.log"
    os.truncate(log, 2000)  # inside the second round's records
    shard.start()
    assert shard.process.wait(timeout=60) != 0
    assert f"{log}: 2000 bytes, but the log was grown to" in shard.log_path.read_text()


def test_kill_9_loses_no_acknowledged_contribution(cluster):
    # K = every learner: an open round stays open across the restart until learners rejoin.
    cfg, shards = cluster(quorum=3)
    victim = shards[1]
    gate = Gate()
    learners = [Learner(learner, cfg, gate) for learner in LEARNERS]
    acked_on_victim = lambda: sum(1 for l in learners for s, _, _ in l.acked if s == victim.index)
    try:
        for learner in learners:
            for shard in range(len(shards)):
                learner.join(shard)
        killed, killer_errors = threading.Event(), []

        def kill_when_busy():
            try:
                wait_until(lambda: acked_on_victim() >= 8, 30, "the victim to acknowledge 8 pushes", poll=0.005)
                victim.kill()  # mid-run: pushes and pulls are in flight
                gate.close(victim.index)  # the acknowledgements so far are all there will be
            except BaseException as error:  # surfaces in the test thread
                killer_errors.append(error)
            finally:
                killed.set()

        killer = threading.Thread(target=kill_when_busy, daemon=True)
        killer.start()
        run_learners(learners, until=killed.is_set)
        killer.join(5)
        if killer_errors:
            raise killer_errors[0]

        acked = [(fragment, round_) for l in learners for s, fragment, round_ in l.acked if s == victim.index]
        victim.start()
        victim.wait_serving()
        with ShardClient(victim.address, cfg.rpc, identity=identity(cfg, None)) as client:
            status = client.status()
        restored = {f.fragment_id: f for f in status.fragments}
        for fragment, f in restored.items():
            rounds = [r for frag, r in acked if frag == fragment]
            assert max(rounds, default=0) <= f.version + 1, (fragment, rounds, f)
            # Acknowledged in the open round: still pending there (unacknowledged ones may be too).
            assert rounds.count(f.version + 1) <= f.pending_contributions, (fragment, rounds, f)
        assert len(acked) <= status.counters["state.merged_contributions"] + sum(
            f.pending_contributions for f in restored.values())

        gate.open(victim.index)  # learners find the shard forgot them, rejoin, and carry on
        progress = acked_on_victim()
        run_learners(learners, until=lambda: acked_on_victim() >= progress + 9)
        statuses = assert_identical_bits(learners, cfg)
        after = {f.fragment_id: f.version for f in statuses[victim.index].fragments}
        assert all(after[f] > restored[f].version for f in restored)
    finally:
        for learner in learners:
            learner.close()


def test_kill_9_at_random_points_of_rounds_and_snapshots_restores_an_uninterrupted_runs_bits(cluster):
    """Three learners push a fixed sequence of rounds to shard 0 while it is killed at random
    moments (pushes, round closes, snapshots; a snapshot every few rounds) and restarted. Each
    push is retried until acknowledged (ALREADY_EXISTS: it was). The shard must end with the
    bits of an in-process twin that saw each push once and never stopped."""
    # wait_for_all: a round closes with all three contributions, also on a restarted shard that
    # only some have joined again (else the first to rejoin would close a restored round early).
    cfg, shards = cluster(quorum=3, wait_for_all=True, lease_seconds=3600.0, snapshot_log_ratio=0.3)
    victim, rounds, rng = shards[0], 12, random.Random(20)
    manifest = [(f"w{i}", (40_000,)) for i in range(8)]  # 100k parameters per fragment: 1.6 MB snapshots
    twin = ShardCore(cfg, 0)
    clients = {l: ShardClient(victim.address, cfg.rpc, l, 1, identity=identity(cfg, l)) for l in LEARNERS}
    fragments = {}

    def join_all():
        for learner in LEARNERS:
            fragments.update((f.fragment_id, f.numel) for f in clients[learner].join("r", manifest).fragments)

    def delivered(learner, push):
        """Retries a push until the shard holds it; after a failure every learner joins again
        first, so no round closes on a restarted shard that knows only some of them."""
        for _ in range(400):
            try:
                push(clients[learner])
                return
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return
            time.sleep(0.05)
            with contextlib.suppress(grpc.RpcError):
                join_all()
        raise AssertionError(f"{learner}'s push never got through:\n{victim.log_path.read_text()}")

    def kill_soon():
        """SIGKILL a moment into the push that starts now: while it streams, logs, closes the
        round or writes a snapshot. Then restart."""
        time.sleep(rng.uniform(0.0, 0.05))
        victim.kill()
        victim.start()
        victim.wait_serving()

    try:
        join_all()
        for learner in LEARNERS:
            twin.join(learner, 1, "r", manifest)
        for fid, numel in fragments.items():
            seed = torch.randn(numel, generator=torch.Generator().manual_seed(fid))
            delivered("a", lambda c: c.push(fid, seed, codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED))
            twin.push(*push_parts_for(cfg, "a", fid, seed, kind=pb.PUSH_KIND_SEED))
        pushes = list(itertools.product(range(1, rounds + 1), LEARNERS, fragments.items()))
        kill_at, killers = sorted(rng.sample(range(len(pushes)), 4)), []
        for index, (round_, learner, (fid, numel)) in enumerate(pushes):
            if index in kill_at:
                killers.append(threading.Thread(target=kill_soon))
                killers[-1].start()
            outer = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * round_ + 10 * fid + ord(learner)))
            claims = dict(base_version=round_ - 1, c_steps=8, c_tokens=8 * 64, step_seconds=0.1)
            delivered(learner, lambda c: c.push(fid, outer * 0.01, codec="int4", block_size=BLOCK, **claims))
            twin.push(*push_parts_for(cfg, learner, fid, outer * 0.01, **claims))
            if killers:
                killers[-1].join(60)  # one kill at a time: the next push waits for the restart
        status = clients["a"].status()
        expected = {f.id: (rounds, f.state_hash) for f in twin.status().fragments}
        assert {f.fragment_id: (f.version, f.state_hash) for f in status.fragments} == expected
        assert status.counters["state.merged_contributions"] == rounds * len(LEARNERS) * len(fragments)
        restores = re.findall(r"restored version (\d+): snapshot of version (\d+), (\d+) rounds replayed",
                              victim.log_path.read_text())
        assert len(restores) == 2 * len(kill_at)  # a line per fragment and restart
        assert any(int(snapshot) > 0 for _, snapshot, _ in restores)  # snapshots were written...
        assert any(int(replayed) > 0 for _, _, replayed in restores)  # ...and rounds replayed after them
    finally:
        for client in clients.values():
            client.close()


def push_parts_for(cfg, learner, fid, values, *, kind=pb.PUSH_KIND_OUTER_GRADIENT, **claims):
    """The header and chunks of the push a ShardClient sends, for a core in this process."""
    codec = get_codec("fp32" if kind == pb.PUSH_KIND_SEED else cfg.sync.codec)
    payload = codec.encode(values, BLOCK)
    header = pb.PushHeader(learner_id=learner, incarnation=1, fragment_id=fid, kind=kind,
                           payload=describe(codec, values.numel(), payload, BLOCK), **claims)
    return header, iter_chunks(payload)


# ---- a full disk, a port in use, a state folder that cannot be written ---------------------

def test_a_full_disk_refuses_pushes_with_resource_exhausted_naming_the_state_folder(tmp_path, caplog):
    _, cfg = write_config(tmp_path, lease_seconds=3600.0, grace={"mode": "fixed", "seconds": 600.0})
    handle = start_shard(cfg, 0)
    store, full = handle.store, threading.Event()
    refused = {name: 0 for name in ("spool", "append", "close_round", "commit")}
    for name in refused:  # the disk fills up under the running shard
        def failing(*args, write=getattr(store, name), name=name):
            if full.is_set():
                refused[name] += 1
                raise OSError(28, "No space left on device")
            return write(*args)
        setattr(store, name, failing)
    try:
        with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, "a", 1, identity=identity(cfg, "a")) as a, \
                ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, "b", 1, identity=identity(cfg, "b")) as b:
            fragment, numel = next((f.fragment_id, f.numel) for f in a.join("r", MANIFEST).fragments)
            b.join("r", MANIFEST)
            a.push(fragment, torch.zeros(numel), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
            push = dict(codec="int4", block_size=BLOCK, c_steps=4, c_tokens=64, step_seconds=0.1)
            a.push(fragment, torch.full((numel,), 0.01), **push)  # accepted; the round waits for b
            full.set()
            time.sleep(0.5)  # ten ticks
            with pytest.raises(grpc.RpcError) as info:
                b.push(fragment, torch.full((numel,), 0.02), **push)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(store.directory) in info.value.details()
            assert handle.core.counters_snapshot()["refusals.disk_full"] == 1
            b.leave()  # a's round is due now: the ticker tries to commit it, every tick
            wait_until(lambda: refused["close_round"] >= 2, 10, "the ticker to try twice to close a's round")
            assert handle.core.version(fragment) == 0
            full.clear()
            wait_until(lambda: handle.core.version(fragment) == 1, 10,
                       "a's round to close once the disk has room")  # a's contribution was kept
    finally:
        handle.stop()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("diloco.syncer")]
    assert sum("cannot write the shard's state" in m for m in messages) == 1, messages
    assert not any(r.exc_info for r in caplog.records)


def test_an_idle_shard_counts_the_time_it_gives_its_freed_memory_back(tmp_path):
    """Once a pause has lasted long enough (syncer/memory.py, on a fake clock in
    test_syncer_memory.py), and not again while the pause goes on."""
    _, cfg = write_config(tmp_path, lease_seconds=3600.0)
    handle = start_shard(cfg, 0)
    try:
        with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, "a", 1, identity=identity(cfg, "a")) as a:
            fragment, numel = next((f.fragment_id, f.numel) for f in a.join("r", MANIFEST).fragments)
            a.push(fragment, torch.zeros(numel), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
            wait_until(lambda: a.status().counters.get("memory_releases") == 1, 10, "a release once idle")
            time.sleep(2.5)  # idle on: no second release
            assert a.status().counters.get("memory_releases") == 1
    finally:
        handle.stop()


def _start_fails(config_path, *args):
    result = subprocess.run([sys.executable, "-m", "diloco", "syncer", "--config", str(config_path),
                             "--shard-index", "0", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "syncer:" in line]
    return result.returncode, ours, result.stdout + result.stderr


def test_a_shard_whose_port_is_taken_says_so_in_one_line(tmp_path):
    path, cfg = write_config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, lines, output = _start_fails(path, "--listen", f"127.0.0.1:{taken.getsockname()[1]}")
    assert code != 0 and "Traceback" not in output, output
    assert len(lines) == 1 and "port is in use" in lines[0], output


def test_a_shard_whose_state_folder_cannot_be_written_says_so_in_one_line(tmp_path):
    path, cfg = write_config(tmp_path)
    not_a_folder = tmp_path / "state-file"
    not_a_folder.write_text("")
    code, lines, output = _start_fails(path, "--listen", "127.0.0.1:0", "--state-dir", str(not_a_folder))
    assert code != 0 and "Traceback" not in output, output
    assert len(lines) == 1 and str(not_a_folder) in lines[0], output
