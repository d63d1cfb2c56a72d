"""The WAN of the local cluster: each learner's link to the shards (Config.link: its own, its
region's, or rpc.wan_mbps) emulated in its shard clients. Each direction paces the bytes of
every chunk at its rate, and every call waits the one-way latency on its way out and again on
its way back (ShardClient: before a push's first message and a pull's request, and before its
reply is taken in), so a call costs one round trip more than its bytes. Heartbeats and joins
are not paced: the emulated link carries the sync traffic only."""
from __future__ import annotations

import threading
import time
from typing import Callable

from diloco.services.contract.config import LinkConfig


class PacedDirection:
    """One direction of an emulated link: n bytes occupy it for n / rate seconds, one
    transfer after another, as serialisation on a real link does (no burst credit). The
    latency does not occupy it: calls in flight at once each wait it in parallel."""

    def __init__(self, mbps: float | None, latency_seconds: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.bytes_per_second = mbps * 1e6 / 8 if mbps else None  # None: uncapped
        self.latency_seconds = latency_seconds
        self._clock = clock
        self._sleep = sleep
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def consume(self, count: int) -> None:
        if self.bytes_per_second is None:
            return
        with self._lock:
            start = max(self._clock(), self._busy_until)
            self._busy_until = start + count / self.bytes_per_second
            done_at = self._busy_until
        self._sleep(max(0.0, done_at - self._clock()))

    def wait_latency(self) -> None:
        if self.latency_seconds:
            self._sleep(self.latency_seconds)


class WanLink:
    """An emulated WAN link of one learner, shared by its clients of every shard: `up` carries
    its pushes, `down` its pulls."""

    def __init__(self, link: LinkConfig, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        latency = link.latency_ms / 1000
        self.up = PacedDirection(link.up_mbps, latency, clock, sleep)
        self.down = PacedDirection(link.down_mbps, latency, clock, sleep)
