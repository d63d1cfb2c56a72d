"""A shard's durable state: ShardStore, the Journal the service gives the core, writes it under
`<run.state_dir>/shard-<I>/` and loads it back at a restart (the files and their encoding:
syncer/store_format.py).

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

A push's payload is written while it streams in, so that the disk works during the transfer
rather than after it: at the push's header the log gets a space record, a frame declaring that
the payload's size in raw bytes follows it (a reader steps over them), and the chunks go into
that space as they arrive, while a flusher thread runs the log's fdatasync back to back.
Admission appends a small record naming the space, and the push is acknowledged once an
fdatasync has covered both. On replay the payload's crc32 (verified on receipt, and in the
record's header) is checked again; a mismatch stops the restart with StoreError naming the
file. A space no record names (a push refused, cut off, or still streaming at a crash) holds
nothing of the state. A snapshot starts the log over under the spaces of pushes still
streaming (once the chunks being written are done: they are written outside the log's lock,
so that a fragment's pushes fill their spaces at once): those pushes' records carry their
payload in full instead.

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
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading
from typing import Iterator

import torch

from diloco.services.contract.wire import pb
from diloco.services.contract.state import same_state, state_hash
from diloco.services.files import atomic_write, fsync_path
from diloco.syncer.journal import LoggedClose, LoggedContribution, Manifest, Restored, Spool
from diloco.syncer.counters import Counters
from diloco.syncer.snapshot import ClosedRound, ContributionKey, FragmentSnapshot
from diloco.syncer.store_format import (CLOSE, CONTRIBUTION, FRAME, LENGTH, OFFSET, READABLE_FORMATS, ROUND,
                                        SPACE, SPOOLED, TAG_BYTES, StoreError, frame, grow_file, has_a_record,
                                        load_history, read_frames, read_log, sha256, snapshot_body, sync_data,
                                        update_body, write_atomically, write_file, write_parts_at)

_LOG_GROWTH = 1 << 20  # the least the log file grows by; also an eighth of its size


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
        self._written(write_atomically(self.directory / "manifest.json", [text.encode()]))

    def spool(self, fragment_id: int, payload: pb.PayloadHeader) -> "_LogSpace":
        with self._files(fragment_id) as files:
            start, tag = files.log_end, files.log_tag
            written = self._written(files.write_record(frame([tag, SPACE, OFFSET.pack(payload.payload_bytes)]),
                                                       then_leave=payload.payload_bytes))
        return _LogSpace(files, tag, start, start + written, payload.payload_bytes, self._flusher, self.counters)

    def append(self, fragment_id: int, contribution: LoggedContribution, spool: Spool) -> None:
        header = contribution.header.SerializeToString()
        head = [ROUND.pack(contribution.round), LENGTH.pack(len(header)), header]
        with self._files(fragment_id) as files:
            if isinstance(spool, _LogSpace) and spool.holds_payload():
                record = frame([files.log_tag, SPOOLED, *head, OFFSET.pack(spool.offset)])
            else:  # no space, or a snapshot started the log over while the payload streamed in
                # Written part by part, without joining the parts into one copy, and without reading
                # the payload for its checksum again: its crc32 was verified on receipt.
                record = frame([files.log_tag, CONTRIBUTION, *head],
                               contribution.payload, contribution.header.payload.crc32)
            self._written(files.write_record(record))

    def close_round(self, fragment_id: int, close: LoggedClose) -> None:
        body = json.dumps({"closed": close.closed.__dict__, "base_state_hash": close.base_state_hash}).encode()
        with self._files(fragment_id) as files:
            start = files.log_end
            self._written(files.write_record(frame([files.log_tag, CLOSE, body])))
            try:
                sync_data(files.log())
            except OSError:  # the round stays open: its next record goes over this one
                files.log_end = start
                raise
            files.durable = files.appended

    def sync(self, fragment_id: int) -> None:
        self._fragment_files(fragment_id).sync()

    def commit(self, snapshot: FragmentSnapshot) -> None:
        with self._files(snapshot.fragment_id) as files:
            files.drain()  # the next log goes over the spaces being written
            files.check_open()  # close() may have come meanwhile
            digests = {}  # of the history's update files, by version
            for update in snapshot.history:
                digest = files.committed_updates.get(update.version)
                if digest is None:  # maybe a failed commit's file is there: never trust it
                    body = update_body(update)
                    self._written(write_file(files.folder / f"update-{update.version}", frame(body)))
                    digest = sha256(body)
                digests[update.version] = digest
            next_tag = os.urandom(TAG_BYTES)
            self._written(write_atomically(files.folder / "snapshot",  # the commit point
                                           frame(snapshot_body(snapshot, digests, next_tag))))
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
                files.drain()
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
            elif has_a_record(folder / "round.log"):  # records are only ever written after a seed
                raise StoreError(f"{folder / 'round.log'}: holds contributions, but {folder / 'snapshot'} is missing")
        return Restored(manifest, plan_digest, snapshots, logs)

    def _load_snapshot(self, fragment_id: int, folder: pathlib.Path) -> FragmentSnapshot:
        path = folder / "snapshot"
        bodies, _ = read_frames(path)
        if len(bodies) != 1:
            raise StoreError(f"{path}: torn or corrupted snapshot (length or checksum mismatch)")
        body = bodies[0]
        (meta_length,) = LENGTH.unpack_from(body)
        meta = json.loads(bytes(body[LENGTH.size:LENGTH.size + meta_length]))
        numel, offset = meta["numel"], LENGTH.size + meta_length
        if meta["format"] not in READABLE_FORMATS or meta["fragment_id"] != fragment_id or \
                len(body) != offset + 4 * 4 * numel:
            raise StoreError(f"{path}: not a {' or '.join(READABLE_FORMATS)} snapshot of fragment {fragment_id}")
        value, momentum, residual, period_sum = (
            torch.frombuffer(body, dtype=torch.float32, offset=offset + i * 4 * numel, count=numel)
            for i in range(4))
        digests = dict(meta["history"])
        history = load_history(folder, digests)
        with self._files(fragment_id) as files:
            files.committed_updates = {update.version: digests[update.version] for update in history}
            files.log_tag = bytes.fromhex(meta["log_tag"])
        for path in folder.glob("update-*"):
            # Not in the history: a crash or a failed commit came between writing it and the
            # snapshot naming it. The round will close again, maybe differently: never reuse it.
            if int(path.name.split("-", 1)[1]) not in files.committed_updates:
                path.unlink()
        last_round = meta["last_round"]
        digest = state_hash(value)  # an older diloco's sha256 is checked, then replaced
        if not same_state(value, digest, meta["state_hash"]):
            raise StoreError(f"{path}: the value is not the one whose state hash the snapshot recorded")
        return FragmentSnapshot(
            fragment_id, meta["version"], value, momentum, residual, history, digest,
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
            entries, end = read_log(path, files.log_tag) if path.exists() else ([], 0)
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
        self.log_tag = os.urandom(TAG_BYTES)  # the log's; the committed snapshot names it
        self.allocated = 0  # the log file's size: records are written only below it
        self._log_fd: int | None = None
        # Spaces' chunks written outside self.lock, and what waits for them to be done.
        self.writing = 0
        self.written = threading.Condition(self.lock)
        self.draining = False  # a wait for them: the chunks that come meanwhile are not written

    def write_record(self, record: list, then_leave: int = 0) -> int:
        """Writes the framed record at the log's end, and leaves `then_leave` bytes after it
        for what goes there later (a space's payload); returns the record's size. Called with
        self.lock held."""
        length, _ = FRAME.unpack(record[0])
        self._reserve(self.log_end + FRAME.size + length + then_leave)
        written = write_parts_at(self.log(), record, self.log_end)
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
                sync_data(fd)
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
        # Allocated, not only sized: records then fill blocks already on disk (a full disk
        # refuses the growth, not a write below it), and a filesystem writes them for less.
        grow_file(fd, self.allocated, size)
        sync_data(fd)
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

    def drain(self) -> None:
        """Waits until no space's chunk is being written; called with self.lock held, which
        the wait releases."""
        self.draining = True
        try:
            self.written.wait_for(lambda: self.writing == 0)
        finally:
            self.draining = False

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
        """Writes the chunk outside the log's lock, so that the pushes of a fragment fill their
        spaces at once; the log does not start over or close while a write is in flight."""
        files = self.files
        with files.lock:
            if files.draining:  # the log starts over or closes: the record will hold the payload
                self._void = True
            if self._void or files.closed or files.log_tag != self.tag:
                return
            fd = files.log()
            files.writing += 1  # from here on the finally below counts it out
        written = 0
        try:
            written = write_parts_at(fd, [chunk], self._next)
        except OSError:  # the record written at admission will hold the payload, or refuse the push
            self._void = True
        finally:
            with files.lock:
                files.writing -= 1
                self._next += written
                files.appended += written
                files.written.notify_all()
        if written:
            self.flusher.request(files)
            self.counters.add("journal_bytes", written)

    def holds_payload(self) -> bool:
        """Whether the space, still part of the log, holds the whole payload; called with
        self.files.lock held."""
        return not self._void and self.files.log_tag == self.tag and self._next == self._end
