"""How the shard process uses glibc's allocator: keep freed memory for the next round while
rounds come back to back, give it back to the system once the shard is idle.

Every round allocates and frees the same large tensors (decoded pushes, the merge, the outer
step). glibc hands blocks this large back to the kernel at once, so every round would fault in
each page again, which on a VM costs more than the arithmetic done on it. Kept, they make the
shard's footprint its peak: the fragment state (16 bytes per parameter), the history, the open
rounds' pushes and one round close's temporaries. Between rounds only the first two are needed,
so an idle shard releases the rest (the Ticker calls release_freed_memory when IdleRelease says
so). Idle means a pause longer than the run's own between rounds: with steps of a second or more
a shard pauses between every two rounds, and released then, each round would fault its
temporaries in afresh on the round trip learners wait for.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8  # glibc mallopt parameters
TOP_PAD_BYTES = 64 << 20


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator keeps its own counsel
        return None


def keep_freed_memory() -> None:
    """Pushes are received on many threads, each allocating from a heap of its own arena; the
    trim threshold does not stop glibc from unmapping such a heap once it is all free, only
    the top pad does. Without it each push faulted its megabytes in afresh (bench/history.md
    has the page faults bench/syncer_push.py counted either way). One arena for every
    thread: a round is closed on whichever thread brings its last push, and memory one
    thread's arena kept could not serve the next close on another."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 40)
    libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES)
    libc.mallopt(M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


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
