"""The local cluster's emulated WAN link (localcluster/wan.py), on an injected clock: each
direction paces bytes at its own rate, transfers queue behind each other, and the latency is
waited once per crossing without occupying the link."""
import pytest
import torch

from diloco.localcluster.wan import WanLink
from diloco.services.client import ShardClient
from diloco.services.contract.config import LinkConfig
from diloco.services.contract.wire import pb
from diloco.syncer.service import start_shard
from tests.cluster_config import tiny_cluster


class FakeTime:
    """A clock that stands still unless `advance`; records every sleep asked for."""

    def __init__(self, advance: bool):
        self.now = 0.0
        self.advance = advance
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if self.advance:
            self.now += seconds


def link(time: FakeTime, **settings) -> WanLink:
    return WanLink(LinkConfig(**settings), clock=time.clock, sleep=time.sleep)


def test_each_direction_takes_its_bytes_at_its_own_rate():
    time = FakeTime(advance=True)
    wan = link(time, up_mbps=8.0, down_mbps=2.0)  # 1 MB/s up, 0.25 MB/s down
    wan.up.consume(500_000)
    wan.down.consume(500_000)
    assert time.slept == pytest.approx([0.5, 2.0])


def test_transfers_in_flight_at_once_queue_behind_each_other_and_idle_time_is_no_credit():
    time = FakeTime(advance=False)  # two calls at the same instant, as two shards' pushes
    wan = link(time, up_mbps=8.0, down_mbps=8.0)
    wan.up.consume(1_000_000)
    wan.up.consume(1_000_000)
    assert time.slept == pytest.approx([1.0, 2.0])
    time.now = 100.0  # idle long after: the next transfer still takes its own time
    wan.up.consume(1_000_000)
    assert time.slept[-1] == pytest.approx(1.0)


def test_latency_is_waited_per_crossing_and_does_not_occupy_the_link():
    time = FakeTime(advance=False)
    wan = link(time, up_mbps=8.0, down_mbps=4.0, latency_ms=30.0)
    wan.up.wait_latency()
    wan.up.wait_latency()  # a second call in flight waits in parallel, not behind the first
    wan.up.consume(1_000_000)
    wan.down.wait_latency()
    assert time.slept == pytest.approx([0.03, 0.03, 1.0, 0.03])


def test_a_direction_without_a_rate_is_not_paced():
    time = FakeTime(advance=True)
    wan = link(time, up_mbps=8.0, latency_ms=0.0)
    wan.down.consume(10_000_000)
    wan.down.wait_latency()
    assert time.slept == []


def test_a_shard_clients_push_and_pull_wait_the_latency_each_way_and_their_bytes_at_that_ways_rate(tmp_path):
    # A real shard in this process; only the clock is the test's, so the client's waits are
    # the computed ones: a call's latency out and back, and its payload at its direction's rate.
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, tls={"mode": "plaintext"}, sync={"fragments": 1})
    handle = start_shard(cfg, 0, listen=cfg.shards[0].address, state_dir=tmp_path / "state")
    time = FakeTime(advance=True)
    wan = link(time, up_mbps=8.0, down_mbps=2.0, latency_ms=40.0)  # 1 MB/s up, 0.25 MB/s down
    learner = cfg.learners[0]
    try:
        with ShardClient(cfg.shards[0].address, cfg.rpc, learner.id, 1, wan, identity=None) as client:
            info = client.join(learner.region, [("w", (50_000,))]).fragments[0]
            client.push(info.fragment_id, torch.zeros(info.numel), codec="fp32", block_size=128,
                        kind=pb.PUSH_KIND_SEED)
            pushed = time.slept[:]
            pulled = client.pull(info.fragment_id)
    finally:
        handle.stop()
    assert pushed[0] == pushed[-1] == pytest.approx(0.04)
    assert sum(pushed[1:-1]) == pytest.approx(info.numel * 4 / 1e6)
    waits = time.slept[len(pushed):]
    assert waits[0] == waits[-1] == pytest.approx(0.04)
    assert pulled.payload_bytes > 0 and sum(waits[1:-1]) == pytest.approx(pulled.payload_bytes / 0.25e6)


def test_booking_takes_the_link_without_waiting_and_says_when_the_bytes_are_through():
    time = FakeTime(advance=False)
    wan = link(time, up_mbps=8.0, down_mbps=8.0)
    assert wan.up.book(1_000_000) == pytest.approx(1.0)
    assert wan.up.book(1_000_000) == pytest.approx(2.0)  # behind the first
    assert time.slept == []
    assert link(time).down.book(10) == time.now  # uncapped: through at once
