"""How our processes use glibc's allocator: keep freed memory for the next sync or round instead
of handing it back to the kernel, and give it back on request.

A shard's round and a learner's sync allocate and free the same fragment-sized tensors every
time (decoded pushes and pulls, the merge, the outer step, the snapshot of a fragment). glibc
maps blocks above its mmap threshold (at most 32 MB, so a fragment of 8M parameters or more
always) afresh and unmaps them when freed, and a thread's arena unmaps a heap once it is all
free, so each would fault every page in again, which on a VM costs more than the arithmetic
done on it (bench/history.md). Kept, a process's footprint is its peak.

The same settings for any process, without code: GLIBC_TUNABLES (docs/gpus.md).
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8  # glibc mallopt parameters
TOP_PAD_BYTES = 64 << 20
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 1 << 40
# The same, for a process started with them in its environment.
GLIBC_TUNABLES = (f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}:"
                  f"glibc.malloc.trim_threshold={TRIM_THRESHOLD_BYTES}:glibc.malloc.top_pad={TOP_PAD_BYTES}")


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator keeps its own counsel
        return None


def keep_freed_memory() -> None:
    """Call it first, before the process starts threads. One arena for every thread: the
    trim threshold does not stop glibc from unmapping a thread arena's heap once it is all
    free (only the top pad does), a thread arena cannot hold a block above 64 MB at all, and
    memory one thread's arena kept could not serve the next round or sync on another."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES)
    libc.mallopt(M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
