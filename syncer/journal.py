"""What the core asks of durability, and the records it hands over: the Journal protocol and
its Spool, the logged contributions and round closes, what a restart reads back (Restored),
and NullJournal, which keeps nothing (tests and simulations). syncer/store.py is the journal
on disk; syncer/disk.py turns its OSErrors into refusals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from diloco.services.contract.wire import pb
from diloco.syncer.snapshot import ClosedRound, FragmentSnapshot

Manifest = tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in model order


@dataclass(frozen=True)
class LoggedContribution:
    """An admitted contribution as the journal records it: enough to admit it again."""
    round: int
    header: pb.PushHeader
    payload: tuple[bytes, ...]  # encoded, the chunks as received


@dataclass(frozen=True)
class LoggedClose:
    """A round close as the journal records it: with the round's contributions, enough to
    close it again with the same bits."""
    closed: ClosedRound
    base_state_hash: str  # of the value the round was applied to: a replay that reaches another diverged


class Spool(Protocol):
    """Where a push's payload is written while it streams in, before the push is judged, so
    that the disk works while the network does. Its bytes count for nothing until append
    names the spool; a push refused or cut off leaves them unused."""

    def write(self, chunk: bytes) -> None: ...


class Journal(Protocol):
    """Where the core makes its state durable: a write-ahead log per fragment of contributions
    and round closes, and from time to time the fragment's whole state, after which the log
    starts over. fix_manifest, close_round and commit return only once what they were given
    survives a crash; append only writes the record (its payload may already be in the
    spool it names), and sync makes every record appended before it durable (so that the
    slow part runs outside the fragment's lock). If a call raises, the core changes nothing;
    an OSError (a full or failing disk) refuses the request that needed the write
    (syncer/disk.py)."""

    def fix_manifest(self, manifest: Manifest, plan_digest: str) -> None: ...

    def spool(self, fragment_id: int, payload: pb.PayloadHeader) -> Spool: ...

    def append(self, fragment_id: int, contribution: LoggedContribution, spool: Spool) -> None: ...

    def sync(self, fragment_id: int) -> None: ...

    def close_round(self, fragment_id: int, close: LoggedClose) -> None: ...

    def commit(self, snapshot: FragmentSnapshot) -> None: ...


class NullSpool:
    """Writes nothing: the whole payload goes in the contribution's record, if anywhere."""

    def write(self, chunk: bytes) -> None:
        pass


class NullJournal:
    """Keeps nothing: for tests and simulations that need no durability."""

    def fix_manifest(self, manifest: Manifest, plan_digest: str) -> None:
        pass

    def spool(self, fragment_id: int, payload: pb.PayloadHeader) -> Spool:
        return NullSpool()

    def append(self, fragment_id: int, contribution: LoggedContribution, spool: Spool) -> None:
        pass

    def sync(self, fragment_id: int) -> None:
        pass

    def close_round(self, fragment_id: int, close: LoggedClose) -> None:
        pass

    def commit(self, snapshot: FragmentSnapshot) -> None:
        pass


@dataclass(frozen=True)
class Restored:
    """What a journal read back after a restart."""
    manifest: Manifest | None
    plan_digest: str  # of the plan the state was written under
    snapshots: dict[int, FragmentSnapshot]
    log: dict[int, list[LoggedContribution | LoggedClose]]  # per fragment, since its snapshot, in order
