"""The on-disk format of a shard's state (syncer/store.py writes and reads it): the files under
`<run.state_dir>/shard-<I>/`, their framing, the encodings of snapshots, updates and log
records, and reading them back.

    manifest.json            the model manifest the first join fixed, with the plan digest
    fragment-<p>/snapshot    the fragment's state written in full: value, momentum, residual, the
                             delayed-momentum period sum, version, bookkeeping (replaced
                             atomically: write a temporary file, fsync, rename over, fsync the
                             folder)
    fragment-<p>/update-<v>  an encoded update of the snapshot's history, which learners catch up
                             from (written before the snapshot that lists it with its sha256,
                             removed once it leaves the history)
    fragment-<p>/round.log   the write-ahead log since the snapshot: every contribution admitted
                             (the round number, push header, payload or where its payload is),
                             synced before the push is acknowledged, and every round close
                             (ClosedRound and the state hash it closed on), synced before the new
                             version shows
    fragment-<p>/log-size    the size round.log was grown to (syncer/store.py says why)

Every file is framed as  u64 length | u32 crc32 | body,  so a torn or corrupted file is
detected, never loaded. A snapshot that fails its check stops the shard with StoreError rather
than let it restart from an older state that learners have already moved past.

The log is rewritten in place from its start after each snapshot rather than truncated:
overwriting cached pages is an order of magnitude faster than writing fresh ones. So the bytes
after the log's records are leftovers of earlier logs, whole records or pieces of them. To tell
those from the current log's, each snapshot draws a random 16-byte tag for the log it starts,
and every record of that log starts with it. The tag is written nowhere else and never sent, so
no leftover and no payload a learner chose can carry it. The log's records are one run of frames
from offset 0 (a restart appends right after them, a snapshot starts over at 0); the run ends
at the first frame that is not intact or not tagged. Then:
  - no intact tagged record after that point: it is the end of the log. A record torn there
    by the crash (or damaged there; the two look alike) was the last one written, never
    acknowledged, and is dropped with the leftovers after it;
  - an intact tagged record after it: a record in the middle of the log is damaged, and the
    ones after it may have been acknowledged. The shard stops with StoreError naming the file
    and offset rather than drop them. (A machine that lost power before the log's fdatasync
    can leave this too, with nothing after the offset acknowledged; the message says so.)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import struct

from isal.isal_zlib import crc32, crc32_combine

from diloco.services.contract.wire import pb
from diloco.services.files import atomic_write
from diloco.syncer.journal import LoggedClose, LoggedContribution
from diloco.syncer.snapshot import ClosedRound, Encoded, FragmentSnapshot

FRAME = struct.Struct("<QI")  # body length, crc32 of body
LENGTH = struct.Struct("<I")  # of an embedded message
ROUND = struct.Struct("<Q")
OFFSET = struct.Struct("<Q")  # a space's size, or the offset of a space's record in the log
TAG_BYTES = 16  # the log's tag: random, so nothing else carries it by chance
# A log record's kind, right after the tag: a contribution with its payload, one whose payload
# is in a space, a space, a round close.
CONTRIBUTION, SPOOLED, SPACE, CLOSE = b"c", b"p", b"s", b"r"
SNAPSHOT_FORMAT = "diloco.syncer-snapshot/6"
READABLE_FORMATS = ("diloco.syncer-snapshot/5", SNAPSHOT_FORMAT)  # /5 logs have no spaces

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """Stored state that cannot be trusted; the message names the file."""


def shard_state_dir(state_dir: str | os.PathLike, shard_index: int) -> pathlib.Path:
    return pathlib.Path(state_dir) / f"shard-{shard_index}"


def _log_entry(path: pathlib.Path, offset: int, body: memoryview,
               spaces: dict[int, memoryview]) -> LoggedContribution | LoggedClose:
    """The record at `offset` as the core takes it; `spaces` are the log's spaces before it."""
    kind, at = bytes(body[TAG_BYTES:TAG_BYTES + 1]), TAG_BYTES + 1
    if kind == CLOSE:
        record = json.loads(bytes(body[at:]))
        return LoggedClose(ClosedRound(**record["closed"]), record["base_state_hash"])
    (round_number,) = ROUND.unpack_from(body, at)
    (length,) = LENGTH.unpack_from(body, at + ROUND.size)
    start = at + ROUND.size + LENGTH.size
    header = pb.PushHeader.FromString(bytes(body[start:start + length]))
    if kind == CONTRIBUTION:
        return LoggedContribution(round_number, header, (bytes(body[start + length:]),))
    (space_offset,) = OFFSET.unpack_from(body, start + length)
    payload = spaces.get(space_offset)
    if payload is None or len(payload) != header.payload.payload_bytes or crc32(payload) != header.payload.crc32:
        raise StoreError(
            f"{path}: the contribution record at offset {offset} names its payload in the space at offset "
            f"{space_offset}, which is {'not in the log' if payload is None else 'damaged'}: the contribution "
            f"was acknowledged, so the shard will not drop it. Restore the shard's state folder from a copy")
    return LoggedContribution(round_number, header, (bytes(payload),))


def load_history(folder: pathlib.Path, digests: dict[int, str]) -> tuple[Encoded, ...]:
    """The stored updates, newest first until one is missing, damaged or not the one the
    snapshot names: a learner that needs an older one pulls a snapshot instead."""
    history: list[Encoded] = []
    for version in sorted(digests, reverse=True):
        path = folder / f"update-{version}"
        bodies, _ = read_frames(path) if path.exists() else ([], 0)
        if len(bodies) != 1 or sha256([bodies[0]]) != digests[version]:
            log.warning("%s: missing, damaged or not the update the snapshot names: the history "
                        "starts after version %d (older bases pull a snapshot)", path, version)
            break
        (length,) = LENGTH.unpack_from(bodies[0])
        header = pb.PayloadHeader.FromString(bytes(bodies[0][LENGTH.size:LENGTH.size + length]))
        history.append(Encoded(version, header, bytes(bodies[0][LENGTH.size + length:])))
    return tuple(reversed(history))


def update_body(update: Encoded) -> list:
    header = update.header.SerializeToString()
    return [LENGTH.pack(len(header)), header, update.payload]


def sha256(parts: list) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def snapshot_body(snapshot: FragmentSnapshot, update_digests: dict[int, str], log_tag: bytes) -> list:
    last_round = snapshot.last_round
    meta = json.dumps({
        "format": SNAPSHOT_FORMAT,
        "fragment_id": snapshot.fragment_id,
        "version": snapshot.version,
        "numel": snapshot.value.numel(),
        "state_hash": snapshot.state_hash,
        "merged_contributions": snapshot.merged_contributions,
        "merged_tokens": snapshot.merged_tokens,
        "recent_keys": sorted(list(key) for key in snapshot.recent_keys),
        "last_round": last_round.__dict__ if last_round else None,
        "history": sorted(update_digests.items()),  # [version, sha256 of its update file's body]
        "period_share": snapshot.period_share,
        "log_tag": log_tag.hex(),  # of the round this snapshot opens
    }).encode()
    tensors = [t.contiguous().numpy()
               for t in (snapshot.value, snapshot.momentum, snapshot.residual, snapshot.period_sum)]
    return [LENGTH.pack(len(meta)), meta, *tensors]


def frame(parts: list, payload: tuple[bytes, ...] = (), payload_crc32: int = 0) -> list:
    """length | crc32 | body, as a list of buffers (tensors' memory is not copied). The body is
    the parts, then the payload, whose crc32 the caller already knows."""
    length, crc = 0, 0
    for part in parts:
        view = memoryview(part).cast("B")
        length += view.nbytes
        crc = crc32(view, crc)
    payload_bytes = sum(len(chunk) for chunk in payload)
    crc = crc32_combine(crc, payload_crc32, payload_bytes)
    return [FRAME.pack(length + payload_bytes, crc), *parts, *payload]


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def write_parts_at(fd: int, parts: list, offset: int) -> int:
    """Writes the parts one after another at `offset` with as few system calls as the
    kernel's iovec limit allows; returns the bytes written."""
    views = [memoryview(part).cast("B") for part in parts]
    start = offset
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += written
        while views and written >= views[0].nbytes:  # drop what is written, keep a partial rest
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return offset - start


def read_frames(path: pathlib.Path) -> tuple[list[memoryview], int]:
    """The bodies of the intact frames from the start of the file, and where they end."""
    view, bodies, offset = memoryview(_read(path)), [], 0
    while (body := _intact_body(view, offset)) is not None:
        bodies.append(body)
        offset += FRAME.size + len(body)
    return bodies, offset


def read_log(path: pathlib.Path, tag: bytes) -> tuple[list[LoggedContribution | LoggedClose], int]:
    """The log's records (the run of intact frames carrying its tag from the start of the
    file, stepping over spaces) and where they end; StoreError if an intact record of the log
    follows the end of that run (see the module docstring)."""
    data = _read(path)
    view, entries, spaces, offset = memoryview(data), [], {}, 0
    trailing_spaces = None  # where the spaces after the last record start: no record names them
    while (body := _intact_body(view, offset)) is not None and body[:TAG_BYTES] == tag:
        end = offset + FRAME.size + len(body)
        if bytes(body[TAG_BYTES:TAG_BYTES + 1]) == SPACE:
            (size,) = OFFSET.unpack_from(body, TAG_BYTES + 1)
            trailing_spaces = offset if trailing_spaces is None else trailing_spaces
            if end + size > len(data):  # a push streaming in at the crash (a log from before log-size)
                break
            spaces[offset] = view[end:end + size]
            end += size
        else:
            entries.append(_log_entry(path, offset, body, spaces))
            trailing_spaces = None
        offset = end
    # A record torn at `offset` may hold the tag right after its frame header: look past that.
    found = data.find(tag, offset + FRAME.size + 1)
    while found != -1:
        later = found - FRAME.size
        if _intact_body(view, later) is not None:
            raise StoreError(
                f"{path}: the record at offset {offset} is damaged, and an intact record of the log "
                f"follows at offset {later}: the contributions from offset {offset} on may have "
                f"been acknowledged, so the shard will not drop them. If the machine lost power (nothing "
                f"after a torn record was acknowledged then), truncate the file to {offset} bytes and "
                f"delete {path.parent / 'log-size'} to drop them; otherwise restore the shard's state "
                f"folder from a copy")
        found = data.find(tag, found + 1)
    # Pushes streaming in at the crash: the next record goes over their spaces.
    return entries, offset if trailing_spaces is None else trailing_spaces


def has_a_record(path: pathlib.Path) -> bool:
    return path.exists() and _intact_body(memoryview(_read(path)), 0) is not None


def _intact_body(view: memoryview, offset: int) -> memoryview | None:
    """The body of the frame at `offset` if it is whole and passes its checksum."""
    if offset + FRAME.size > len(view):
        return None
    length, crc = FRAME.unpack_from(view, offset)
    body = view[offset + FRAME.size:offset + FRAME.size + length]
    return body if len(body) == length and crc32(body) == crc else None


def _read(path: pathlib.Path) -> bytearray:
    data = bytearray(path.stat().st_size)
    with open(path, "rb") as file:
        file.readinto(data)
    return data


def write_file(path: pathlib.Path, parts: list) -> int:
    """Writes and fsyncs the file; returns its size."""
    with open(path, "wb") as file:
        size = sum(file.write(memoryview(part).cast("B")) for part in parts)
        file.flush()
        os.fsync(file.fileno())
    return size


def write_atomically(path: pathlib.Path, parts: list) -> int:
    """Readers see the old file or the new one, whole, whenever the machine stops. Returns
    its size. The temporary file has a fixed name: a crash's leftover is overwritten by the next
    write, and load() removes a snapshot's."""
    return atomic_write(path, *parts, temporary=path.with_name(path.name + ".tmp"))


sync_data = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync



def grow_file(fd: int, size: int, to: int) -> None:
    """Extends the file from `size` to `to` bytes, its blocks allocated where the system can
    (macOS has no posix_fallocate: sized only)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, size, to - size)
    else:
        os.ftruncate(fd, to)
