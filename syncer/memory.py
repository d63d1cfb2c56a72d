"""When a shard gives back the memory it keeps (services/memory.py: the shard process starts
with keep_freed_memory). Kept, the shard's footprint is its peak: the fragment state (16 bytes
per parameter), the history, the open rounds' pushes and one round close's temporaries. At rest
only the first two are needed, so an idle shard releases the rest (the Ticker calls
release_freed_memory when IdleRelease says so). Idle means a pause longer than the run's own
between rounds: with steps of a second or more a shard pauses between every two rounds, and
released then, each round would fault its temporaries in afresh on the round trip learners
wait for.
"""
from __future__ import annotations


class IdleRelease:
    """When an idle shard gives its freed memory back, from when pushes and pulls last came,
    with no clock of its own: once per pause, when the pause has lasted `factor` times the
    longest one between them so far, at least `min_seconds` and at most `max_seconds` (a shard
    whose learners stopped gives its memory back within that)."""

    def __init__(self, min_seconds: float = 1.0, factor: float = 2.0, max_seconds: float = 300.0):
        self.min_seconds, self.factor, self.max_seconds = min_seconds, factor, max_seconds
        self.longest_pause = 0.0  # between two moments busy, as seen
        self._seen_busy: float | None = None
        self._released_after: float | None = None

    def due(self, now: float, last_busy: float | None) -> bool:
        """Whether to release now, the last push or pull having come at `last_busy` (None: none
        yet). Call it every tick: the pauses it learns are between the busy moments it sees."""
        if last_busy is None:
            return False
        if self._seen_busy is not None and last_busy != self._seen_busy:
            self.longest_pause = max(self.longest_pause, last_busy - self._seen_busy)
        self._seen_busy = last_busy
        if last_busy == self._released_after:
            return False
        if now - last_busy < min(self.max_seconds, max(self.min_seconds, self.factor * self.longest_pause)):
            return False
        self._released_after = last_busy
        return True
