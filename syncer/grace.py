"""How long a round that has reached quorum waits for stragglers.

Waiting lets slower learners' work count; waiting too long blocks every learner, because each
one needs the round's result tau inner steps after it pushed. Decoupled DiLoCo therefore sizes
the window to fit into that overlap slack:

    grace = gamma * (tau * step_time - quorum_time - sync_time),   0 <= grace <= cap

from moving averages of
- step_time: the learners' mean inner-step time (each push reports it),
- quorum_time: from a round's first contribution until the K-th learner's,
- sync_time: what a sync costs besides waiting: receiving one push plus the outer step (the
  downlink carries as many bytes as the uplink, so the push's transfer time stands for both).

Until every average has a sample the window is the cap. mode "fixed" always uses the cap.

Adaptive, the round also closes no later than any contributor already in it can take: one
whose push arrived at a, after t seconds on the wire, applies the result tau of its own steps
after it started pushing, and its pull takes about as long as its push, so

    close by  a + gamma * (tau * its step time - 2 * t - close time)

A contributor with no such slack (its own link outlasts the overlap) is merged late whatever
the round does, and sets no deadline: a slower learner never makes the faster ones wait.
"""
from __future__ import annotations

import math

SMOOTHING = 0.2  # weight of the newest sample in each moving average


class MovingAverage:
    def __init__(self, smoothing: float = SMOOTHING):
        self.smoothing = smoothing
        self.value: float | None = None

    def observe(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.smoothing * (sample - self.value)


class GraceWindow:
    def __init__(self, mode: str, cap_seconds: float, gamma: float, overlap_steps: int):
        self.mode, self.cap_seconds, self.gamma, self.overlap_steps = mode, cap_seconds, gamma, overlap_steps
        self.step_seconds = MovingAverage()
        self.quorum_seconds = MovingAverage()
        self.sync_seconds = MovingAverage()
        self.close_seconds = MovingAverage()  # the outer step alone

    def seconds(self) -> float:
        averages = (self.step_seconds.value, self.quorum_seconds.value, self.sync_seconds.value)
        if self.mode == "fixed" or None in averages:
            return self.cap_seconds
        step, quorum, sync = averages
        slack = self.overlap_steps * step - quorum - sync
        return min(self.cap_seconds, max(0.0, self.gamma * slack))

    def close_by(self, arrived_at: float, step_seconds: float, transfer_seconds: float) -> float:
        """The latest close that leaves a contributor (its push in at `arrived_at` after
        `transfer_seconds` on the wire) its result in time; inf for none."""
        if self.mode == "fixed" or step_seconds <= 0:
            return math.inf
        slack = self.overlap_steps * step_seconds - 2 * transfer_seconds - (self.close_seconds.value or 0.0)
        return arrived_at + self.gamma * slack if slack > 0 else math.inf
