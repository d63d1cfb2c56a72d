"""Which replica group leads an island: the one holding an exclusive lock on a file in the
learner's state folder, which the island's groups share (as they share its checkpoint).

The kernel releases a lock when its holder dies, however it dies, so at most one group leads
at a time and a dead leader's lock is free at once for the next. flock locks a file within one
machine (or one Kubernetes pod's volume); the groups of an island share one.

Each taking of the lease starts a new term (the file keeps the count): a leader of a later term
outranks every group that followed an earlier one (learner/island/replica_groups.py).
"""
from __future__ import annotations

import fcntl
import os
import pathlib


class LeaderLease:
    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._fd: int | None = None
        self.term = 0  # of the lead this process holds; 0 until it takes the lease

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Takes the lease unless another process holds it; True when this one holds it."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not inherited across exec: a child process must not keep a dead leader's lease.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        with os.fdopen(os.dup(fd), "r+") as file:
            previous = file.read().split()
            self.term = (int(previous[0]) if previous and previous[0].isdigit() else 0) + 1
            file.seek(0)
            file.truncate()
            file.write(f"{self.term} {os.getpid()}\n")  # the pid for an operator: which process leads
        self._fd = fd
        return True

    @staticmethod
    def holder(path: str | os.PathLike) -> int | None:
        """The pid of the process that last took the lease at `path` (None: never taken). It holds
        it still only while it runs."""
        fields = _fields(path)
        return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else None

    def taken_before(self) -> bool:
        """Whether some process has held this lease: the island has had a leader."""
        fields = _fields(self.path)
        return bool(fields) and fields[0].isdigit() and int(fields[0]) > 0

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the lock
            self._fd = None


def _fields(path: str | os.PathLike) -> list[str]:
    """What the lease's file says: its term and the pid that took it (nothing: never taken)."""
    try:
        return pathlib.Path(path).read_text().split()
    except OSError:
        return []
