"""Who may call a shard, and how much one caller may ask of it, over real gRPC with mutual TLS
(an in-process shard): learner identity per call, read-only calls for any certificate of the
run's CA, and the limits — streams per peer, declared push size and chunk count, a model too
large, and pushes that trickle (slow loris), cut off with their partial data discarded."""
import threading
import time

import grpc
import pytest
import torch

from diloco.services.client import ShardClient
from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.state import state_hash
from diloco.services.contract.tls import learner_name, load_identity
from diloco.services.contract.wire import pb
from diloco.syncer.service import start_shard
from tests.shard_over_grpc import MANIFEST, identity, outer_gradient, write_config

IDLE_SECONDS = 0.5
LIMITS = {"push_idle_seconds": IDLE_SECONDS, "max_streams_per_peer": 2, "max_chunks_per_push": 64,
          "max_push_bytes": 4096, "max_parameters": 10_000}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """Shard 0 with mutual TLS; learner a joined and seeded its first fragment (version 0)."""
    tmp_path = tmp_path_factory.mktemp("auth")
    # A push of a few hundred bytes may take rpc.deadline_seconds (x 1.0003).
    _, cfg = write_config(tmp_path, limits=LIMITS, rpc={"deadline_seconds": 2.0})
    handle = start_shard(cfg, 0)
    clients = []

    def client(learner, cert=None):
        """A client calling as `learner`, presenting the certificate of `cert` (default: its own;
        None for the operator's)."""
        clients.append(ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, learner or "", 1,
                                   identity=identity(cfg, learner if cert is None else cert or None)))
        return clients[-1]

    try:
        a = client("a")
        fragments = a.join("r", MANIFEST).fragments
        seeded = fragments[0]
        a.push(seeded.fragment_id, torch.ones(seeded.numel), codec="fp32", block_size=32, kind=pb.PUSH_KIND_SEED)
        yield handle, cfg, client, seeded.fragment_id, seeded.numel
    finally:
        for c in clients:
            c.close()
        handle.stop()


def _state(handle):
    return [(f.id, f.version, f.state_hash, f.pending_contributions, sorted(f.served.items()))
            for f in handle.core.status().fragments]


def _refused(call, code, words, handle, reason):
    """Runs `call`, which must fail with `code` and `words`, count `reason` and change nothing."""
    before, counted = _state(handle), handle.core.counters_snapshot().get(f"refusals.{reason}", 0)
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert (info.value.code(), words in (info.value.details() or "")) == (code, True), info.value.details()
    assert _state(handle) == before
    assert handle.core.counters_snapshot()[f"refusals.{reason}"] == counted + 1


def _push(client, fragment, numel, **kwargs):
    header, chunks = outer_gradient(fragment, numel, base=0, **kwargs)
    return client.stub.PushFragment(iter([pb.PushRequest(header=header)] + chunks), timeout=10)


def test_learner_calls_need_that_learners_certificate(shard):
    handle, _, client, fragment, numel = shard
    operator, a_as_b = client("a", cert=""), client("b", cert="a")
    seed_hash = state_hash(torch.ones(numel))
    assert client("a").pull(fragment, 0, anchor_hash=seed_hash).items == []  # a holds the seed: served it
    U, P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    for who, code, reason, words in ((operator, U, "unauthenticated", "spiffe://diloco/operator"),
                                     (a_as_b, P, "wrong_learner", "learner 'a''s: it may not act as learner 'b'")):
        _refused(lambda: who.join("r", MANIFEST), code, words, handle, reason)
        _refused(lambda: who.heartbeat(), code, words, handle, reason)
        _refused(lambda: who.leave(), code, words, handle, reason)
        _refused(lambda: next(who.attend()), code, words, handle, reason)
        _refused(lambda: _push(operator if who is operator else client("a"), fragment, numel,
                               learner=who.learner_id), code, words, handle, reason)
        # A pull naming a learner moves the anchor the shard serves that learner from.
        _refused(lambda: who.pull(fragment, 0, anchor_hash=seed_hash), code, words, handle, reason)
    # Reading needs only a certificate of the run's CA.
    reader = client("", cert="")
    assert operator.status().fragments and reader.pull(fragment).version == 0
    assert reader.pull(fragment, 0, anchor_hash=seed_hash).items == []
    # The rightful learner still may.
    assert client("a").heartbeat().versions[fragment] == 0


def test_without_a_certificate_of_the_run_there_is_no_connection(shard, tmp_path):
    handle, cfg, _, _, _ = shard
    issue_cluster_certs(cfg, tmp_path)  # the same names, another CA
    for who in (None, load_identity(cfg, learner_name("a"), tmp_path / learner_name("a"))):
        with ShardClient(f"127.0.0.1:{handle.port}", cfg.rpc, "a", 1, identity=who) as stranger:
            with pytest.raises(grpc.RpcError) as info:
                stranger.heartbeat()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_declared_sizes_beyond_the_limits_are_refused_before_any_payload(shard):
    handle, _, client, fragment, numel = shard
    a = client("a")
    for field, value, reason, words in (("chunk_count", 65, "too_many_chunks", "limits.max_chunks_per_push=64"),
                                        ("payload_bytes", 5000, "push_too_large", "limits.max_push_bytes=4096")):
        header, _ = outer_gradient(fragment, numel, base=0)
        setattr(header.payload, field, value)
        _refused(lambda: a.stub.PushFragment(iter([pb.PushRequest(header=header)]), timeout=10),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, words, handle, reason)


def test_a_first_join_declaring_a_model_beyond_the_limit_fixes_no_plan(shard):
    _, cfg, _, _, _ = shard
    fresh = start_shard(cfg, 1)  # no manifest yet: the first Join would fix it
    try:
        with ShardClient(f"127.0.0.1:{fresh.port}", cfg.rpc, "c", 1, identity=identity(cfg, "c")) as c:
            _refused(lambda: c.join("r", [(f"huge.{i}", (100, 101)) for i in range(4)]), grpc.StatusCode.INVALID_ARGUMENT,
                     "40400 parameters, more than limits.max_parameters=10000",
                     fresh, "bad_manifest")
            assert fresh.core.plan is None
            assert c.join("r", MANIFEST).fragments  # a model within the limit is planned
    finally:
        fresh.stop()


class Trickle:
    """A push stream that sends its header and first chunk, then one chunk every `gap`
    seconds (forever, with gap None) until released; its call runs in the background."""

    def __init__(self, client, fragment, numel, gap=None):
        header, chunks = outer_gradient(fragment, numel, base=0, chunk_bytes=8)
        self.requests = [pb.PushRequest(header=header)] + chunks
        self.gap, self.released = gap, threading.Event()
        self.future = client.stub.PushFragment.future(self._stream(), timeout=30)

    def _stream(self):
        yield self.requests[0]
        for request in self.requests[1:]:
            yield request
            if self.released.wait(self.gap):
                return

    def outcome(self):
        try:
            self.future.result(timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()
        finally:
            self.released.set()


def test_a_stalled_push_is_cut_off_and_discarded(shard):
    handle, _, client, fragment, numel = shard
    before = _state(handle)
    code, details = Trickle(client("a"), fragment, numel).outcome()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "limits.push_idle_seconds" in details, details
    assert _state(handle) == before
    assert handle.core.counters_snapshot()["refusals.push_stalled"] >= 1


def test_a_push_trickling_past_its_deadline_is_cut_off(shard):
    """Chunks come often enough for the idle limit, but the whole push outlasts the deadline a
    client would give its size (rpc.deadline_seconds per MiB)."""
    handle, _, client, fragment, numel = shard
    before = _state(handle)
    code, details = Trickle(client("a"), fragment, numel, gap=IDLE_SECONDS / 4).outcome()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "rpc.deadline_seconds" in details, details
    assert _state(handle) == before


def test_streams_per_peer_are_limited_and_given_back(shard):
    handle, _, client, fragment, numel = shard
    a = client("a")

    def pull_code():
        try:
            a.pull(fragment)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()

    def waiting_pull():
        """A pull waiting for a version that is not coming: it holds a stream slot."""
        return a.stub.PullFragment(pb.PullRequest(learner_id="a", fragment_id=fragment, base_version=0,
                                                  min_version=99, max_wait_seconds=20), timeout=30)

    # Hold both of a's slots. A probe may take a slot just as a waiting pull arrives, which
    # is then refused itself: start it again until a probe is refused while both wait.
    waiting, deadline = [waiting_pull(), waiting_pull()], time.monotonic() + 10
    while pull_code() != grpc.StatusCode.RESOURCE_EXHAUSTED or any(call.done() for call in waiting):
        assert time.monotonic() < deadline, "two waiting pulls never held both stream slots"
        waiting = [waiting_pull() if call.done() else call for call in waiting]
        time.sleep(0.05)
    _refused(lambda: a.pull(fragment), grpc.StatusCode.RESOURCE_EXHAUSTED, "limits.max_streams_per_peer=2",
             handle, "too_many_streams")
    # Another learner has slots of its own; a's come back once its calls end.
    assert client("b").pull(fragment).version == 0
    for call in waiting:
        call.cancel()
    deadline = time.monotonic() + 10
    while pull_code() != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "the stream slots were not given back"
        time.sleep(0.05)
