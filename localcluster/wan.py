"""The WAN of the local cluster: each learner's link to the shards capped at rpc.wan_mbps
(each way), emulated in its shard clients by pacing the bytes of every chunk."""
from __future__ import annotations

import threading
import time


class PacedDirection:
    """One direction of an emulated link: n bytes occupy it for n / rate seconds, one
    transfer after another, as serialisation on a real link does (no burst credit)."""

    def __init__(self, bytes_per_second: float):
        self.rate = bytes_per_second
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def consume(self, count: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            self._busy_until = start + count / self.rate
            done_at = self._busy_until
        time.sleep(max(0.0, done_at - time.monotonic()))


class WanLink:
    """An emulated WAN link of one learner, shared by its clients of every shard."""

    def __init__(self, mbps: float):
        self.up = PacedDirection(mbps * 1e6 / 8)
        self.down = PacedDirection(mbps * 1e6 / 8)
