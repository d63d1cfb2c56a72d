"""Data parallel's gradient all-reduce behind an emulated WAN link (`diloco sim --mode dp` with
`--wan-mbps` or `links`): what a cross-region job pays for its gradients, on this machine.

The real all-reduce runs (gloo over loopback); a DDP communication hook then holds each bucket
back until a ring across the run's regions would have carried it: each region's link carries
2 (R - 1) / R of the bucket's bytes each way at once, every step of the ring waits for its
slowest link, and the ring's 2 (R - 1) hops each cross two links' latency. Every rank books the
bucket on every region's link, so all ranks hold it back alike, at the slowest link's pace.
Buckets go out as the backward pass produces them, so the links' time overlaps the backward
pass as far as DDP's buckets allow (planner/allreduce.py is the planner's model of the same).
A harness hands the links in (services/client.py: emulate_links); without one the gradients
take the real network and nothing is paced.
"""

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from diloco.services.client import LinkEmulation


class PacedAllReduce:
    """A DDP communication hook (`ddp.register_comm_hook(None, paced.hook)`) and what it cost
    each step: `take_step()` after the backward pass returns the seconds the step waited for
    the link beyond the real all-reduce, and the seconds in which buckets were in flight while
    the backward pass still ran (what DDP could overlap)."""

    def __init__(self, ring: list[LinkEmulation], regions: int, clock: Callable[[], float] = time.monotonic):
        """`ring`: the emulated links of the `regions` regions the job spans (an uncapped one
        adds no time, and is not in it)."""
        self.ring, self.regions, self._clock = ring, regions, clock
        self._lock = threading.Lock()
        self._first_ready = self._last_ready = self._real_done = self._released = None

    def ring_bytes(self, bucket_bytes: int) -> int:
        """What one rank's link carries each way for a bucket of this size."""
        return 2 * (self.regions - 1) * bucket_bytes // self.regions

    # DDP checks these annotations as objects: this module does not postpone them.
    def hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        now = self._clock()
        buffer = bucket.buffer()
        sent = self.ring_bytes(buffer.numel() * buffer.element_size())
        hops = 2 * (self.regions - 1)
        through = max(max(link.up.book(sent), link.down.book(sent)) for link in self.ring)
        paced_until = through + hops * max(link.up.latency_seconds + link.down.latency_seconds for link in self.ring)
        with self._lock:
            self._first_ready = now if self._first_ready is None else self._first_ready
            self._last_ready = now
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        buffer.div_(dist.get_world_size())
        reduced = dist.all_reduce(buffer, async_op=True).get_future()

        def release(value: torch.Tensor) -> None:
            with self._lock:
                self._released = max(self._released or 0.0, self._clock())
            out.set_result(value)

        def done(future: torch.futures.Future) -> None:
            try:
                value = future.value()[0]
            except Exception as error:  # a peer died: DDP raises it from the backward pass
                out.set_exception(error)
                return
            real = self._clock()
            with self._lock:
                self._real_done = max(self._real_done or 0.0, real)
            if paced_until > real:
                threading.Timer(paced_until - real, release, (value,)).start()
            else:
                release(value)

        reduced.add_done_callback(done)
        return out

    def take_step(self) -> tuple[float, float]:
        """(seconds waited for the link, seconds of overlap) of the step whose buckets have
        all been released; (0, 0) for a step without an all-reduce (a dropped step)."""
        with self._lock:
            if self._released is None:
                return 0.0, 0.0
            waited = max(0.0, self._released - max(self._last_ready, self._real_done))
            overlap = self._last_ready - self._first_ready
            self._first_ready = self._last_ready = self._real_done = self._released = None
        return waited, overlap
