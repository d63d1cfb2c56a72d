"""A shard's durable state, under `<run.state_dir>/shard-<I>/`:

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
    fragment-<p>/log-size    the size round.log was grown to (see below)

A write-ahead log, so that a round costs its contributions and a small record rather than the
fragment's whole state (16 bytes per parameter): the core writes a snapshot only once the log
has grown to a multiple of its size (syncer.snapshot_log_ratio), and the log starts over after
it. A restart loads the snapshot and replays the log with the same arithmetic: the round's
contributions merged in key order, the close as recorded. Each close record names the state
hash the round closed on, so a replay that does not reach the same bits stops the restart.

Why nothing acknowledged is lost: a push is acknowledged only once its log record is on disk,
and a new version is visible to anyone only once its close record is. A snapshot replaces the
log only when its state holds everything logged (the open round is empty then).

An update file is trusted only as the committed snapshot names it: a snapshot write that failed
(a full disk) can leave update files no snapshot names. So a snapshot (re)writes every update
the last committed snapshot does not hold, and a restart serves an update only if its sha256
matches the one the snapshot recorded; the replayed rounds rebuild the updates since.

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

A push's payload is written while it streams in, so that the disk works during the transfer
rather than after it: at the push's header the log gets a space record, a frame declaring that
the payload's size in raw bytes follows it (a reader steps over them), and the chunks go into
that space as they arrive, while a flusher thread runs the log's fdatasync back to back.
Admission appends a small record naming the space, and the push is acknowledged once an
fdatasync has covered both. On replay the payload's crc32 (verified on receipt, and in the
record's header) is checked again; a mismatch stops the restart with StoreError naming the
file. A space no record names (a push refused, cut off, or still streaming at a crash) holds
nothing of the state. A snapshot starts the log over under the spaces of pushes still
streaming: those pushes' records carry their payload in full instead.

A log that lost bytes must not pass for a log whose tail a crash tore: the first drops what
was never acknowledged, the second may have lost acknowledged contributions and closed rounds,
and the shard would then serve their version numbers again for other values. So the log file
is grown ahead of its records, never written past its end: before a record would cross it, the
file is extended (by at least 1 MiB or an eighth), the new size made durable, and then noted in
log-size. A crash therefore never leaves the file shorter than log-size says; a file that is
stops the restart with StoreError naming both sizes. (A state folder from before log-size gets
one at its first restart.) The bytes past the log's records are zeros or leftovers; a push
streaming in at a crash leaves its space at the end of the log, and the next record is written
over it.

Every file is framed as  u64 length | u32 crc32 | body,  so a torn or corrupted file is
detected, never loaded. A snapshot that fails its check stops the shard with StoreError rather
than let it restart from an older state that learners have already moved past.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import struct
import threading
from typing import Iterator

import torch
from isal.isal_zlib import crc32, crc32_combine

from diloco.services.contract.wire import pb
from diloco.services.files import atomic_write, fsync_path
from diloco.syncer.journal import LoggedClose, LoggedContribution, Manifest, Restored, Spool
from diloco.syncer.counters import Counters
from diloco.syncer.snapshot import ClosedRound, ContributionKey, Encoded, FragmentSnapshot

_FRAME = struct.Struct("<QI")  # body length, crc32 of body
_LENGTH = struct.Struct("<I")  # of an embedded message
_ROUND = struct.Struct("<Q")
_OFFSET = struct.Struct("<Q")  # a space's size, or the offset of a space's record in the log
_TAG_BYTES = 16  # the log's tag: random, so nothing else carries it by chance
# A log record's kind, right after the tag: a contribution with its payload, one whose payload
# is in a space, a space, a round close.
_CONTRIBUTION, _SPOOLED, _SPACE, _CLOSE = b"c", b"p", b"s", b"r"
_LOG_GROWTH = 1 << 20  # the least the log file grows by; also an eighth of its size
_SNAPSHOT_FORMAT = "diloco.syncer-snapshot/6"
_READABLE_FORMATS = ("diloco.syncer-snapshot/5", _SNAPSHOT_FORMAT)  # /5 logs have no spaces

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """Stored state that cannot be trusted; the message names the file."""


def shard_state_dir(state_dir: str | os.PathLike, shard_index: int) -> pathlib.Path:
    return pathlib.Path(state_dir) / f"shard-{shard_index}"


class ShardStore:
    """The Journal the service gives the core. The core calls it for one fragment at a time
    (under that fragment's lock), except for spools, which pushes write while they stream in:
    a fragment's own lock here orders their writes with the log's records, and keeps close()
    from pulling a file out from under a call still running at shutdown."""

    def __init__(self, directory: str | os.PathLike, counters: Counters | None = None):
        self.directory = pathlib.Path(directory)
        self.counters = counters or Counters()  # journal_bytes: what it wrote
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fragments: dict[int, _FragmentFiles] = {}
        self._flusher = _Flusher()

    # ---- Journal ---------------------------------------------------------------------------

    def fix_manifest(self, manifest: Manifest, plan_digest: str) -> None:
        text = json.dumps({"plan_digest": plan_digest, "tensors": [[n, list(s)] for n, s in manifest]})
        self._written(_write_atomically(self.directory / "manifest.json", [text.encode()]))

    def spool(self, fragment_id: int, payload: pb.PayloadHeader) -> "_LogSpace":
        with self._files(fragment_id) as files:
            start, tag = files.log_end, files.log_tag
            written = self._written(files.write_record(_frame([tag, _SPACE, _OFFSET.pack(payload.payload_bytes)]),
                                                       then_leave=payload.payload_bytes))
        return _LogSpace(files, tag, start, start + written, payload.payload_bytes, self._flusher, self.counters)

    def append(self, fragment_id: int, contribution: LoggedContribution, spool: Spool) -> None:
        header = contribution.header.SerializeToString()
        head = [_ROUND.pack(contribution.round), _LENGTH.pack(len(header)), header]
        with self._files(fragment_id) as files:
            if isinstance(spool, _LogSpace) and spool.holds_payload():
                record = _frame([files.log_tag, _SPOOLED, *head, _OFFSET.pack(spool.offset)])
            else:  # no space, or a snapshot started the log over while the payload streamed in
                # Written part by part, without joining the parts into one copy, and without reading
                # the payload for its checksum again: its crc32 was verified on receipt.
                record = _frame([files.log_tag, _CONTRIBUTION, *head],
                                contribution.payload, contribution.header.payload.crc32)
            self._written(files.write_record(record))

    def close_round(self, fragment_id: int, close: LoggedClose) -> None:
        body = json.dumps({"closed": close.closed.__dict__, "base_state_hash": close.base_state_hash}).encode()
        with self._files(fragment_id) as files:
            start = files.log_end
            self._written(files.write_record(_frame([files.log_tag, _CLOSE, body])))
            try:
                _sync_data(files.log())
            except OSError:  # the round stays open: its next record goes over this one
                files.log_end = start
                raise
            files.durable = files.appended

    def sync(self, fragment_id: int) -> None:
        self._fragment_files(fragment_id).sync()

    def commit(self, snapshot: FragmentSnapshot) -> None:
        with self._files(snapshot.fragment_id) as files:
            digests = {}  # of the history's update files, by version
            for update in snapshot.history:
                digest = files.committed_updates.get(update.version)
                if digest is None:  # maybe a failed commit's file is there: never trust it
                    body = _update_body(update)
                    self._written(_write_file(files.folder / f"update-{update.version}", _frame(body)))
                    digest = _sha256(body)
                digests[update.version] = digest
            next_tag = os.urandom(_TAG_BYTES)
            self._written(_write_atomically(files.folder / "snapshot",  # the commit point
                                            _frame(_snapshot_body(snapshot, digests, next_tag))))
            # Everything logged is in the snapshot now: the next log overwrites it, with its own tag.
            files.log_end, files.log_tag = 0, next_tag
            files.durable = files.appended
            for version in sorted(files.committed_updates.keys() - digests.keys()):
                (files.folder / f"update-{version}").unlink(missing_ok=True)
            files.committed_updates = digests

    def close(self) -> None:
        self._flusher.stop()
        with self._lock:
            fragments = list(self._fragments.values())
        for files in fragments:
            with files.lock:
                files.close()

    def _written(self, nbytes: int) -> int:
        self.counters.add("journal_bytes", nbytes)
        return nbytes

    @contextlib.contextmanager
    def _files(self, fragment_id: int) -> Iterator["_FragmentFiles"]:
        files = self._fragment_files(fragment_id)
        with files.lock:
            files.check_open()
            yield files

    def _fragment_files(self, fragment_id: int) -> "_FragmentFiles":
        with self._lock:
            files = self._fragments.get(fragment_id)
            if files is None:
                files = self._fragments[fragment_id] = _FragmentFiles(self.directory, fragment_id)
            return files

    # ---- restart ---------------------------------------------------------------------------

    def load(self) -> Restored:
        manifest_path = self.directory / "manifest.json"
        if not manifest_path.exists():
            return Restored(None, "", {}, {})
        try:
            data = json.loads(manifest_path.read_text())
            manifest: Manifest = tuple((name, tuple(shape)) for name, shape in data["tensors"])
            plan_digest = data["plan_digest"]
        except (ValueError, KeyError, TypeError) as error:
            raise StoreError(f"{manifest_path}: unreadable manifest: {error}") from None
        snapshots, logs = {}, {}
        for folder in sorted(self.directory.glob("fragment-*")):
            fragment_id = int(folder.name.split("-", 1)[1])
            (folder / "snapshot.tmp").unlink(missing_ok=True)  # a snapshot that never got renamed in
            if (folder / "snapshot").exists():
                snapshots[fragment_id] = self._load_snapshot(fragment_id, folder)
                logs[fragment_id] = self._load_log(fragment_id, folder / "round.log")
            elif _has_a_record(folder / "round.log"):  # records are only ever written after a seed
                raise StoreError(f"{folder / 'round.log'}: holds contributions, but {folder / 'snapshot'} is missing")
        return Restored(manifest, plan_digest, snapshots, logs)

    def _load_snapshot(self, fragment_id: int, folder: pathlib.Path) -> FragmentSnapshot:
        path = folder / "snapshot"
        bodies, _ = _read_frames(path)
        if len(bodies) != 1:
            raise StoreError(f"{path}: torn or corrupted snapshot (length or checksum mismatch)")
        body = bodies[0]
        (meta_length,) = _LENGTH.unpack_from(body)
        meta = json.loads(bytes(body[_LENGTH.size:_LENGTH.size + meta_length]))
        numel, offset = meta["numel"], _LENGTH.size + meta_length
        if meta["format"] not in _READABLE_FORMATS or meta["fragment_id"] != fragment_id or \
                len(body) != offset + 4 * 4 * numel:
            raise StoreError(f"{path}: not a {' or '.join(_READABLE_FORMATS)} snapshot of fragment {fragment_id}")
        value, momentum, residual, period_sum = (
            torch.frombuffer(body, dtype=torch.float32, offset=offset + i * 4 * numel, count=numel)
            for i in range(4))
        digests = dict(meta["history"])
        history = _load_history(folder, digests)
        with self._files(fragment_id) as files:
            files.committed_updates = {update.version: digests[update.version] for update in history}
            files.log_tag = bytes.fromhex(meta["log_tag"])
        for path in folder.glob("update-*"):
            # Not in the history: a crash or a failed commit came between writing it and the
            # snapshot naming it. The round will close again, maybe differently: never reuse it.
            if int(path.name.split("-", 1)[1]) not in files.committed_updates:
                path.unlink()
        last_round = meta["last_round"]
        return FragmentSnapshot(
            fragment_id, meta["version"], value, momentum, residual, history, meta["state_hash"],
            meta["merged_contributions"], meta["merged_tokens"], frozenset(ContributionKey(*key) for key in meta["recent_keys"]),
            ClosedRound(**last_round) if last_round else None, period_sum, meta["period_share"])

    def _load_log(self, fragment_id: int, path: pathlib.Path) -> list[LoggedContribution | LoggedClose]:
        with self._files(fragment_id) as files:
            grown_to = files.grown_to()
            size = path.stat().st_size if path.exists() else 0
            if size < grown_to:
                raise StoreError(
                    f"{path}: {size} bytes, but the log was grown to {grown_to} ({path.parent / 'log-size'}): "
                    f"it lost bytes that may hold acknowledged contributions and closed rounds, whose "
                    f"versions learners hold. The shard will not start and serve those versions again. "
                    f"Restore the shard's state folder from a copy, or move {path.parent} away: the "
                    f"learners then give the fragment back at the version they hold (docs/reliability.md)")
            if grown_to == 0:  # a state folder from before log-size: protected from now on
                files.note_size(size)
            entries, end = _read_log(path, files.log_tag) if path.exists() else ([], 0)
            # New records go right after the log's, over a record the crash tore (it was never
            # acknowledged) and over leftovers of logs before the snapshot.
            files.log_end = end
        return entries


class _FragmentFiles:
    def __init__(self, directory: pathlib.Path, fragment_id: int):
        self.folder = directory / f"fragment-{fragment_id}"
        if not self.folder.exists():
            self.folder.mkdir()
            fsync_path(directory)
        self.lock = threading.Lock()
        self.committed_updates: dict[int, str] = {}  # version: sha256, as the committed snapshot names them
        self.closed = False
        self.log_end = 0  # where the log's next record goes
        # Bytes of records written since the process started, and how many of them are durable
        # (an fdatasync, or a snapshot holding them, came after them).
        self.appended = self.durable = 0
        self.sync_lock = threading.Lock()  # one fdatasync of the log at a time
        self.log_tag = os.urandom(_TAG_BYTES)  # the log's; the committed snapshot names it
        self.allocated = 0  # the log file's size: records are written only below it
        self._log_fd: int | None = None

    def write_record(self, record: list, then_leave: int = 0) -> int:
        """Writes the framed record at the log's end, and leaves `then_leave` bytes after it
        for what goes there later (a space's payload); returns the record's size. Called with
        self.lock held."""
        length, _ = _FRAME.unpack(record[0])
        self._reserve(self.log_end + _FRAME.size + length + then_leave)
        written = _write_parts_at(self.log(), record, self.log_end)
        self.log_end += written + then_leave
        self.appended += written
        return written

    def sync(self) -> None:
        """Makes every byte written to the log by now durable. A group commit: the M pushes of
        a round arrive together, and a push that waited for another's fdatasync (or the
        flusher's) usually finds its own record covered by it."""
        with self.lock:
            self.check_open()
            needed = self.appended
            fd = os.dup(self.log())  # its own descriptor: close() may run while this one syncs
        try:
            with self.sync_lock:
                if self.durable >= needed:  # another fdatasync, a round close or a snapshot covered it
                    return
                covers = self.appended  # every byte written by now
                _sync_data(fd)
                self.durable = max(self.durable, covers)
        finally:
            os.close(fd)

    def _reserve(self, end: int) -> None:
        """Grows the log file to hold `end` bytes: extended, the size made durable, then noted
        in log-size, so that the file is never shorter than log-size says."""
        fd = self.log()
        if end <= self.allocated:
            return
        size = max(end, self.allocated + max(_LOG_GROWTH, self.allocated // 8))
        os.ftruncate(fd, size)
        _sync_data(fd)
        self.note_size(size)
        self.allocated = size

    def grown_to(self) -> int:
        """The size log-size notes (0: none noted)."""
        try:
            return int((self.folder / "log-size").read_text())
        except FileNotFoundError:
            return 0
        except ValueError as error:
            raise StoreError(f"{self.folder / 'log-size'}: unreadable: {error}") from None

    def note_size(self, size: int) -> None:
        atomic_write(self.folder / "log-size", str(size).encode())

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"{self.folder}: the store is closed (the shard is stopping)")

    def log(self) -> int:
        """The fd of round.log, opened on first use."""
        if self._log_fd is None:
            self._log_fd = os.open(self.folder / "round.log", os.O_WRONLY | os.O_CREAT, 0o644)
            fsync_path(self.folder)
            self.allocated = os.fstat(self._log_fd).st_size
        return self._log_fd

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
        self.closed = True


class _Flusher:
    """Runs the logs' fdatasync back to back while pushes stream into their spaces, so that
    the disk writes a push's bytes during its transfer: by the time it is admitted, its own
    sync has little left to wait for. One thread per store, started by the first space
    written and idle while nothing is written."""

    def __init__(self):
        self._wake = threading.Condition()
        self._due: set[_FragmentFiles] = set()  # logs written since their last sync started
        self._thread: threading.Thread | None = None
        self._stopped = False

    def request(self, files: _FragmentFiles) -> None:
        with self._wake:
            if self._stopped:
                return
            self._due.add(files)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="log-flusher", daemon=True)
                self._thread.start()
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                due, self._due = self._due, set()
            for files in due:
                try:
                    files.sync()
                except (OSError, StoreError):  # the push's own sync meets the error and refuses the push
                    pass


class _LogSpace:
    """A push's space in the log (see the module docstring): its payload's bytes, written there
    as they arrive."""

    def __init__(self, files: _FragmentFiles, tag: bytes, offset: int, start: int, size: int,
                 flusher: _Flusher, counters: Counters):
        self.files, self.tag, self.flusher, self.counters = files, tag, flusher, counters
        self.offset = offset  # of the space's record
        self._next, self._end = start, start + size  # where the next chunk goes, where the space ends
        self._void = False  # a write failed: the payload goes in its record instead

    def write(self, chunk: bytes) -> None:
        files = self.files
        with files.lock:
            if self._void or files.closed or files.log_tag != self.tag:
                return
            try:
                written = _write_parts_at(files.log(), [chunk], self._next)
            except OSError:  # the record written at admission will hold the payload, or refuse the push
                self._void = True
                return
            self._next += written
            files.appended += written
        self.flusher.request(files)
        self.counters.add("journal_bytes", written)

    def holds_payload(self) -> bool:
        """Whether the space, still part of the log, holds the whole payload; called with
        self.files.lock held."""
        return not self._void and self.files.log_tag == self.tag and self._next == self._end


def _log_entry(path: pathlib.Path, offset: int, body: memoryview,
               spaces: dict[int, memoryview]) -> LoggedContribution | LoggedClose:
    """The record at `offset` as the core takes it; `spaces` are the log's spaces before it."""
    kind, at = bytes(body[_TAG_BYTES:_TAG_BYTES + 1]), _TAG_BYTES + 1
    if kind == _CLOSE:
        record = json.loads(bytes(body[at:]))
        return LoggedClose(ClosedRound(**record["closed"]), record["base_state_hash"])
    (round_number,) = _ROUND.unpack_from(body, at)
    (length,) = _LENGTH.unpack_from(body, at + _ROUND.size)
    start = at + _ROUND.size + _LENGTH.size
    header = pb.PushHeader.FromString(bytes(body[start:start + length]))
    if kind == _CONTRIBUTION:
        return LoggedContribution(round_number, header, (bytes(body[start + length:]),))
    (space_offset,) = _OFFSET.unpack_from(body, start + length)
    payload = spaces.get(space_offset)
    if payload is None or len(payload) != header.payload.payload_bytes or crc32(payload) != header.payload.crc32:
        raise StoreError(
            f"{path}: the contribution record at offset {offset} names its payload in the space at offset "
            f"{space_offset}, which is {'not in the log' if payload is None else 'damaged'}: the contribution "
            f"was acknowledged, so the shard will not drop it. Restore the shard's state folder from a copy")
    return LoggedContribution(round_number, header, (bytes(payload),))


def _load_history(folder: pathlib.Path, digests: dict[int, str]) -> tuple[Encoded, ...]:
    """The stored updates, newest first until one is missing, damaged or not the one the
    snapshot names: a learner that needs an older one pulls a snapshot instead."""
    history: list[Encoded] = []
    for version in sorted(digests, reverse=True):
        path = folder / f"update-{version}"
        bodies, _ = _read_frames(path) if path.exists() else ([], 0)
        if len(bodies) != 1 or _sha256([bodies[0]]) != digests[version]:
            log.warning("%s: missing, damaged or not the update the snapshot names: the history "
                        "starts after version %d (older bases pull a snapshot)", path, version)
            break
        (length,) = _LENGTH.unpack_from(bodies[0])
        header = pb.PayloadHeader.FromString(bytes(bodies[0][_LENGTH.size:_LENGTH.size + length]))
        history.append(Encoded(version, header, bytes(bodies[0][_LENGTH.size + length:])))
    return tuple(reversed(history))


def _update_body(update: Encoded) -> list:
    header = update.header.SerializeToString()
    return [_LENGTH.pack(len(header)), header, update.payload]


def _sha256(parts: list) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _snapshot_body(snapshot: FragmentSnapshot, update_digests: dict[int, str], log_tag: bytes) -> list:
    last_round = snapshot.last_round
    meta = json.dumps({
        "format": _SNAPSHOT_FORMAT,
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
    return [_LENGTH.pack(len(meta)), meta, *tensors]


def _frame(parts: list, payload: tuple[bytes, ...] = (), payload_crc32: int = 0) -> list:
    """length | crc32 | body, as a list of buffers (tensors' memory is not copied). The body is
    the parts, then the payload, whose crc32 the caller already knows."""
    length, crc = 0, 0
    for part in parts:
        view = memoryview(part).cast("B")
        length += view.nbytes
        crc = crc32(view, crc)
    payload_bytes = sum(len(chunk) for chunk in payload)
    crc = crc32_combine(crc, payload_crc32, payload_bytes)
    return [_FRAME.pack(length + payload_bytes, crc), *parts, *payload]


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def _write_parts_at(fd: int, parts: list, offset: int) -> int:
    """Writes the parts one after another at `offset` with as few system calls as the
    kernel's iovec limit allows; returns the bytes written."""
    views = [memoryview(part).cast("B") for part in parts]
    start = offset
    while views:
        written = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += written
        while views and written >= views[0].nbytes:  # drop what is written, keep a partial rest
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return offset - start


def _read_frames(path: pathlib.Path) -> tuple[list[memoryview], int]:
    """The bodies of the intact frames from the start of the file, and where they end."""
    view, bodies, offset = memoryview(_read(path)), [], 0
    while (body := _intact_body(view, offset)) is not None:
        bodies.append(body)
        offset += _FRAME.size + len(body)
    return bodies, offset


def _read_log(path: pathlib.Path, tag: bytes) -> tuple[list[LoggedContribution | LoggedClose], int]:
    """The log's records (the run of intact frames carrying its tag from the start of the
    file, stepping over spaces) and where they end; StoreError if an intact record of the log
    follows the end of that run (see the module docstring)."""
    data = _read(path)
    view, entries, spaces, offset = memoryview(data), [], {}, 0
    trailing_spaces = None  # where the spaces after the last record start: no record names them
    while (body := _intact_body(view, offset)) is not None and body[:_TAG_BYTES] == tag:
        end = offset + _FRAME.size + len(body)
        if bytes(body[_TAG_BYTES:_TAG_BYTES + 1]) == _SPACE:
            (size,) = _OFFSET.unpack_from(body, _TAG_BYTES + 1)
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
    found = data.find(tag, offset + _FRAME.size + 1)
    while found != -1:
        later = found - _FRAME.size
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


def _has_a_record(path: pathlib.Path) -> bool:
    return path.exists() and _intact_body(memoryview(_read(path)), 0) is not None


def _intact_body(view: memoryview, offset: int) -> memoryview | None:
    """The body of the frame at `offset` if it is whole and passes its checksum."""
    if offset + _FRAME.size > len(view):
        return None
    length, crc = _FRAME.unpack_from(view, offset)
    body = view[offset + _FRAME.size:offset + _FRAME.size + length]
    return body if len(body) == length and crc32(body) == crc else None


def _read(path: pathlib.Path) -> bytearray:
    data = bytearray(path.stat().st_size)
    with open(path, "rb") as file:
        file.readinto(data)
    return data


def _write_file(path: pathlib.Path, parts: list) -> int:
    """Writes and fsyncs the file; returns its size."""
    with open(path, "wb") as file:
        size = sum(file.write(memoryview(part).cast("B")) for part in parts)
        file.flush()
        os.fsync(file.fileno())
    return size


def _write_atomically(path: pathlib.Path, parts: list) -> int:
    """Readers see the old file or the new one, whole, whenever the machine stops. Returns
    its size. The temporary file has a fixed name: a crash's leftover is overwritten by the next
    write, and load() removes a snapshot's."""
    return atomic_write(path, *parts, temporary=path.with_name(path.name + ".tmp"))


_sync_data = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync

