"""Whether the shard can write its state, as the journal's last write found it.

A full disk fails every push and every round close until space comes back: the condition is
logged once when it starts and once when it ends, not for every call, and each request it
turns down is refused with RESOURCE_EXHAUSTED (disk or quota full) or UNAVAILABLE (any other
I/O error) naming the state folder, so that learners retry later. What the journal wrote
before stays valid (syncer/journal.py Journal: a failed call changes nothing).
"""
from __future__ import annotations

import errno
import logging
import threading
from typing import Callable, TypeVar

from diloco.services.contract.wire import pb
from diloco.syncer.journal import Journal, LoggedClose, LoggedContribution, Manifest, Spool
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import FragmentSnapshot

Result = TypeVar("Result")

log = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskCondition:
    def __init__(self, where: str):
        self.where = where  # the state folder, for messages
        self._lock = threading.Lock()
        self._failing: OSError | None = None

    def write(self, call: Callable[[], Result]) -> Result:
        """Runs a journal write; an OSError becomes the Refusal of the request that needed it."""
        try:
            result = call()
        except OSError as error:
            raise self._failed(error) from None
        if self._failing is not None:  # read without the lock: the common case costs nothing
            self._recovered()
        return result

    def _failed(self, error: OSError) -> Refusal:
        full = error.errno in _FULL
        with self._lock:
            if self._failing is None or self._failing.errno != error.errno:
                log.error("cannot write the shard's state in %s: %s; refusing pushes and leaving rounds open "
                          "until it can", self.where, error.strerror or error)
            self._failing = error
        return Refusal("disk_full" if full else "disk_error", "RESOURCE_EXHAUSTED" if full else "UNAVAILABLE",
                       f"the shard cannot write its state in {self.where}: {error.strerror or error} "
                       "(retry later; nothing it acknowledged is lost)")

    def _recovered(self) -> None:
        with self._lock:
            if self._failing is None:
                return
            self._failing = None
        log.warning("writing the shard's state in %s again", self.where)


class DiskGuardedJournal:
    """A Journal whose every write goes through one DiskCondition: what the core gives the
    journal either lands, or the request that needed it is refused as the condition says."""

    def __init__(self, journal: Journal, where: str):
        self._journal = journal
        self._disk = DiskCondition(where)

    def fix_manifest(self, manifest: Manifest, plan_digest: str) -> None:
        self._disk.write(lambda: self._journal.fix_manifest(manifest, plan_digest))

    def spool(self, fragment_id: int, payload: pb.PayloadHeader) -> Spool:
        return self._disk.write(lambda: self._journal.spool(fragment_id, payload))

    def append(self, fragment_id: int, contribution: LoggedContribution, spool: Spool) -> None:
        self._disk.write(lambda: self._journal.append(fragment_id, contribution, spool))

    def sync(self, fragment_id: int) -> None:
        self._disk.write(lambda: self._journal.sync(fragment_id))

    def close_round(self, fragment_id: int, close: LoggedClose) -> None:
        self._disk.write(lambda: self._journal.close_round(fragment_id, close))

    def commit(self, snapshot: FragmentSnapshot) -> None:
        self._disk.write(lambda: self._journal.commit(snapshot))
