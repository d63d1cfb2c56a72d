"""Virtual time: a clock the cores read, and the queue of what happens next."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable


class VirtualClock:
    """The injectable clock of ShardCore and LearnerSchedule: seconds into the run."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EventQueue:
    """Actions at virtual times, run in time order (ties in the order they were queued)."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time, self.clock.now), next(self._order), action))

    def run(self, end: float, done: Callable[[], bool], progress: Callable[[float], None]) -> None:
        """Runs actions until `end`, until `done()`, or until none is left; the clock then
        reads the time the run stopped."""
        while self._heap and not done():
            time, _, action = self._heap[0]
            if time >= end:
                break
            heapq.heappop(self._heap)
            self.clock.now = time
            action()
            progress(time)
        if not done() and end != float("inf"):
            self.clock.now = end
