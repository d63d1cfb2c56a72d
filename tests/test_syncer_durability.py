"""The shard's store: a restart restores the committed state and the open round bit for bit,
and torn or damaged files are detected instead of loaded. (The kill -9 of a real shard
process is in test_syncer_service.py.)"""
import errno
import hashlib
import os
import threading
import time
import zlib

import pytest
import torch
from hypothesis import given, strategies as st

from diloco.services.contract.state import apply_update, state_hash
from diloco.services.contract.payload import decode_payload
from diloco.services.contract.wire import pb

from diloco.syncer.core import ShardCore
from diloco.syncer.journal import NullSpool
from diloco.syncer.refusal import Refusal
from diloco.syncer import fragment_state, store, store_format
from diloco.syncer.store import ShardStore, StoreError
from tests.shard_harness import LEARNERS, MANIFEST, Shard, delta, make_config


def restarted(shard: Shard, directory, rejoin=()) -> ShardCore:
    """A new core restored from `directory`, as a restarted process would be; `shard` now
    pushes to it, once the learners in `rejoin` have joined again."""
    store = ShardStore(directory)
    core = ShardCore(shard.cfg, 0, clock=shard.clock, journal=store)
    core.restore(store.load())
    for learner in rejoin:
        core.join(learner, 1, "r", MANIFEST)
    shard.core = core
    return core


def views(core: ShardCore):
    return [(f.id, f.version, f.state_hash, f.pending_contributions, f.last_round, f.merged_tokens)
            for f in core.status().fragments]


def test_restart_restores_committed_state_and_open_round_bit_for_bit(tmp_path):
    cfg = make_config(codec="int4", quorum=3)
    shard = Shard(cfg, journal=ShardStore(tmp_path))
    twin = Shard(cfg)  # the same inputs, never restarted
    n = shard.numel()
    for version in range(3):
        for i, learner in enumerate(LEARNERS):
            for s in (shard, twin):
                s.push(learner, 0, delta(10 * version + i, n), base=version)
    for s in (shard, twin):  # two of three, one of them stale, one a learner's last: the round stays open
        s.push("a", 0, delta(100, n), base=3, final=True)
        s.core.join("b", 2, "r", MANIFEST)  # b restarted and still holds version 2
        s.push("b", 0, delta(101, n), base=2, incarnation=2, c_tokens=7)
    before = views(shard.core)
    assert before[0][1:4] == (3, twin.core.status().fragments[0].state_hash, 2)
    assert before[0][5] == 9 * 1000  # the merged contributions' c_tokens

    original = shard.core.fragments[0].committed
    core = restarted(shard, tmp_path, rejoin=LEARNERS)  # the old process is simply gone: no close, no flush
    assert views(core) == before
    assert sorted(c.final for c in core.fragments[0].round.contributions.values()) == [False, True]
    # The rejoined learners have not reported their tokens yet: the run's count is the merged one.
    assert core.run_tokens() == (9 * 1000, 0.0)
    restored = core.fragments[0].committed
    for name in ("value", "momentum", "residual"):
        assert torch.equal(getattr(restored, name), getattr(original, name)), name
    assert [(u.version, u.payload) for u in restored.history] == [(u.version, u.payload) for u in original.history]
    counters = core.counters_snapshot()
    # Nothing was written in full since the seed: the restart replayed the three rounds' nine
    # contributions and closes, then re-admitted the open round's two.
    assert not counters.get("snapshots")
    assert (counters["replayed_rounds"], counters["contributions.restored"], counters["state.merged_contributions"]) \
        == (3, 11, 9)

    # The restored round still refuses duplicates and closes exactly like the twin's.
    with pytest.raises(Refusal, match="already contributed"):
        shard.push("a", 0, delta(100, n), base=3)
    for s in (shard, twin):
        s.push("c", 0, delta(102, n), base=3, c_tokens=30)
    assert core.status().fragments[0].version == 4
    assert core.status().fragments[0].state_hash == twin.core.status().fragments[0].state_hash
    # The run's token count: the restored round's contributions kept their c_tokens.
    assert core.status().fragments[0].merged_tokens == 9 * 1000 + 1000 + 7 + 30


def test_a_round_replayed_before_anyone_rejoined_waits_for_every_live_learner(tmp_path):
    store = ShardStore(tmp_path)
    shard = Shard(make_config(quorum=3, lease_seconds=60.0, grace={"mode": "fixed", "seconds": 60.0}),
                  journal=store)
    shard.push("a", 0, delta(1, shard.numel()))
    store.close()
    shard.clock.advance(1.0)
    core = restarted(shard, tmp_path, rejoin=LEARNERS)  # every learner joined after the round opened
    assert core.tick() == []
    shard.push("b", 0, delta(2, shard.numel()))
    assert core.tick() == []  # c, live, has not contributed
    shard.push("c", 0, delta(3, shard.numel()))
    assert shard.version() == 1 and core.fragments[0].committed.last_round.contributors == 3


def test_a_torn_log_record_is_dropped_and_the_log_stays_appendable(tmp_path):
    cfg = make_config(quorum=3)
    shard = Shard(cfg, journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    log = tmp_path / "fragment-0" / "round.log"
    data = bytearray(log.read_bytes())
    end = log_end(log.parent)
    intact = bytes(data[:end])
    data[end:end + end // 2] = intact[:end // 2]  # the crash cut the second record short
    log.write_bytes(bytes(data))

    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    assert core.status().fragments[0].pending_contributions == 1
    shard.push("b", 0, delta(2, n))  # lands over the torn record, right after the whole one
    assert log.read_bytes().startswith(intact)
    assert restarted(shard, tmp_path).status().fragments[0].pending_contributions == 2


def test_a_push_that_streams_in_across_a_snapshot_is_logged_whole_with_its_payload(tmp_path, monkeypatch):
    """c's push streams into a space of the log; meanwhile the round closes on a and b, and
    the snapshot starts the log over under that space. c's record then carries its payload,
    written without joining its chunks, in as many pwritev calls as the kernel's iovec limit
    needs (1024 on Linux; 7 here, so a push of a few hundred chunks takes many calls); the
    restored round holds the same bytes."""
    monkeypatch.setattr(store_format, "IOV_MAX", 7)
    shard = Shard(make_config(quorum=2, snapshot_log_ratio=0), journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    shard.push("b", 0, delta(2, n))
    values = delta(3, n)

    def with_a_snapshot_midway(chunks):
        for index, chunk in enumerate(chunks):
            if index == 9:
                shard.clock.advance(2.0)  # past the grace window
                assert shard.core.tick() == [0] and shard.core.counters.snapshot()["snapshots"] == 1
            yield chunk

    header, chunks = shard.push_parts("c", 0, values, chunk_bytes=3)
    reply = shard.core.push(header, with_a_snapshot_midway(chunks))
    assert (reply.result, reply.round) == (pb.PUSH_RESULT_STALE_MERGED, 2)
    assert [kind for _, _, kind in log_frames(tmp_path / "fragment-0")] == [store_format.CONTRIBUTION]
    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    (pending,) = core.fragments[0].round.contributions.values()
    assert b"".join(pending.chunks) == values.numpy().tobytes()


class HeldChunkWrite:
    """Holds the first chunk a push thread named `pusher` writes into its space (a write of
    one part: records are written in several) until release() is called."""

    def __init__(self, monkeypatch, pusher: str):
        self.in_flight, self.released = threading.Event(), threading.Event()
        write = store.write_parts_at

        def held(fd, parts, offset):
            if threading.current_thread().name == pusher and len(parts) == 1 and not self.in_flight.is_set():
                self.in_flight.set()
                self.released.wait(10)
            return write(fd, parts, offset)

        monkeypatch.setattr(store, "write_parts_at", held)

    def release(self):
        self.released.set()


def pushing(name: str, shard: Shard, header, chunks) -> tuple[threading.Thread, list]:
    replies = []
    thread = threading.Thread(target=lambda: replies.append(shard.core.push(header, chunks)), name=name)
    thread.start()
    return thread, replies


def test_the_pushes_of_a_fragment_write_their_chunks_at_once(tmp_path, monkeypatch):
    """c's chunk is being written (held here, as a slow disk would): a's push meanwhile writes
    its own chunks and is acknowledged."""
    shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
    n = shard.numel()
    held = HeldChunkWrite(monkeypatch, "c-push")
    c, _ = pushing("c-push", shard, *shard.push_parts("c", 0, delta(3, n), chunk_bytes=64))
    assert held.in_flight.wait(10)
    a, replies = pushing("a-push", shard, *shard.push_parts("a", 0, delta(1, n), chunk_bytes=64))
    a.join(10)
    acknowledged = [reply.result for reply in replies]  # before c's chunk is written
    held.release()
    c.join(10)
    assert acknowledged == [pb.PUSH_RESULT_ACCEPTED]
    assert sorted(key.learner_id for key in restarted(shard, tmp_path).fragments[0].round.contributions) == ["a", "c"]


def test_a_snapshot_waits_for_the_chunk_being_written_and_the_push_is_logged_with_its_payload(tmp_path, monkeypatch):
    """The snapshot that starts the log over under c's space waits until c's chunk in flight
    is written (else the chunk could land on the new log's records); c's later chunks are not
    written into the old log, and its record carries its payload."""
    shard = Shard(make_config(quorum=2, snapshot_log_ratio=0), journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    shard.push("b", 0, delta(2, n))
    held = HeldChunkWrite(monkeypatch, "c-push")
    values = delta(3, n)
    c, replies = pushing("c-push", shard, *shard.push_parts("c", 0, values, chunk_bytes=64))
    assert held.in_flight.wait(10)
    shard.clock.advance(2.0)  # past the grace window
    ticks = []
    ticking = threading.Thread(target=lambda: ticks.append(shard.core.tick()))
    ticking.start()
    ticking.join(0.3)
    assert ticking.is_alive()  # the snapshot waits for c's chunk
    held.release()
    ticking.join(10)
    c.join(10)
    assert ticks == [[0]] and shard.core.counters.snapshot()["snapshots"] == 1
    assert [(reply.result, reply.round) for reply in replies] == [(pb.PUSH_RESULT_STALE_MERGED, 2)]
    assert [kind for _, _, kind in log_frames(tmp_path / "fragment-0")] == [store_format.CONTRIBUTION]
    (pending,) = restarted(shard, tmp_path, rejoin=LEARNERS).fragments[0].round.contributions.values()
    assert b"".join(pending.chunks) == values.numpy().tobytes()


def test_on_a_system_without_posix_fallocate_the_log_grows_by_its_size_alone(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "posix_fallocate")  # macOS
    shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
    shard.push("a", 0, delta(1, shard.numel()))
    log = tmp_path / "fragment-0" / "round.log"
    assert log.stat().st_size == int((log.parent / "log-size").read_text()) > 0
    assert [key.learner_id for key in restarted(shard, tmp_path).fragments[0].round.contributions] == ["a"]


@pytest.mark.parametrize("how", ["cut off", "refused"])
def test_a_space_no_record_names_is_stepped_over_by_the_restart(tmp_path, how):
    """b's push streamed into a space of the log, then was cut off (or refused once all of it
    was in): the space stays, between records of acknowledged pushes, and holds nothing of
    the state."""
    shard = Shard(make_config(quorum=3, max_update_norm=1.0), journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    if how == "cut off":
        header, chunks = shard.push_parts("b", 0, delta(2, n), chunk_bytes=64)
        with pytest.raises(ConnectionResetError):
            shard.core.push(header, (chunk if index < 2 else _reset() for index, chunk in enumerate(chunks)))
    else:
        with pytest.raises(Refusal, match="norm"):
            shard.push("b", 0, delta(2, n, scale=10.0))
    shard.push("c", 0, delta(3, n))
    assert [kind for _, _, kind in log_frames(tmp_path / "fragment-0")] == \
        [store_format.SPACE, store_format.SPOOLED, store_format.SPACE, store_format.SPACE, store_format.SPOOLED]
    expected = {key: b"".join(c.chunks) for key, c in shard.core.fragments[0].round.contributions.items()}
    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    assert {key: b"".join(c.chunks) for key, c in core.fragments[0].round.contributions.items()} == expected
    assert [key.learner_id for key in expected] == ["a", "c"]


def test_a_push_whose_payload_header_does_not_add_up_writes_nothing_to_the_log(tmp_path):
    """Refused before its space is made: a payload_bytes that its numel does not take would
    otherwise reserve that much log."""
    shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
    shard.push("a", 0, delta(1, shard.numel()))
    log = tmp_path / "fragment-0" / "round.log"
    before = log.read_bytes()
    header, chunks = shard.push_parts("b", 0, delta(2, shard.numel()))
    header.payload.payload_bytes = 1 << 40
    with pytest.raises(Refusal, match="payload_bytes=1099511627776") as refused:
        shard.core.push(header, chunks)
    assert (refused.value.status, refused.value.reason) == ("INVALID_ARGUMENT", "bad_payload_header")
    assert log.read_bytes() == before
    shard.push("b", 0, delta(2, shard.numel()))
    assert [key.learner_id for key in restarted(shard, tmp_path).fragments[0].round.contributions] == ["a", "b"]


def test_a_crash_while_a_push_streams_in_ends_the_log_at_its_space(tmp_path):
    """The push's space holds part of its payload and no record names it: the log ends where
    the space starts, and the next record is written there."""
    shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    header, chunks = shard.push_parts("b", 0, delta(2, n), chunk_bytes=64)
    with pytest.raises(ConnectionResetError):
        shard.core.push(header, (chunk if index < 2 else _reset() for index, chunk in enumerate(chunks)))
    log = tmp_path / "fragment-0" / "round.log"
    space, length, _ = log_frames(log.parent)[2]
    assert log.read_bytes()[space + length - 64:space + length] == bytes(64)  # the process died here

    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    assert [key.learner_id for key in core.fragments[0].round.contributions] == ["a"]
    shard.push("c", 0, delta(3, n))
    assert log_frames(log.parent)[2][0] == space
    assert [key.learner_id for key in restarted(shard, tmp_path).fragments[0].round.contributions] == ["a", "c"]


def test_a_streaming_pushs_bytes_are_synced_while_it_streams_and_close_stops_the_flusher(tmp_path):
    """Nothing calls sync while the chunks arrive: the flusher's fdatasync makes them durable,
    so the push's own sync at admission has little left to do."""
    threads_before = set(threading.enumerate())
    journal = ShardStore(tmp_path)
    shard = Shard(make_config(quorum=3), journal=journal)
    synced_while_streaming = []

    def wait_for_the_flusher(chunks):
        for index, chunk in enumerate(chunks):
            if index == 2:
                files = journal._fragments[0]
                deadline = time.monotonic() + 10
                while files.durable < files.appended and time.monotonic() < deadline:
                    time.sleep(0.01)
                synced_while_streaming.append(files.durable == files.appended)
            yield chunk

    header, chunks = shard.push_parts("a", 0, delta(1, shard.numel()), chunk_bytes=16)
    shard.core.push(header, wait_for_the_flusher(chunks))
    assert synced_while_streaming == [True]
    journal.close()
    assert not [thread for thread in set(threading.enumerate()) - threads_before if thread.name == "log-flusher"]


def _reset():
    raise ConnectionResetError("the learner's stream broke")


@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_a_records_checksum_comes_from_the_payloads_verified_crc32_without_reading_it(head, payload):
    """The log's frame checksum covers the whole record; the payload's part of it is combined
    from the crc32 checked on receipt, and must equal zlib's over the bytes."""
    frame = store_format.frame([head], (payload,), zlib.crc32(payload))
    assert frame[0] == store_format.FRAME.pack(len(head) + len(payload), zlib.crc32(head + payload))


def test_records_of_a_round_already_merged_are_skipped(tmp_path):
    """After a round closes its records stay in the log until the next round overwrites
    them; they must not count twice."""
    shard = Shard(make_config(), journal=ShardStore(tmp_path), joined=("a", "b"))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    shard.push("b", 0, delta(2, n))  # closes round 1; its two records are still in the log
    original = shard.core.status().fragments[0]
    fragment = restarted(shard, tmp_path, rejoin=("a", "b")).status().fragments[0]
    assert (fragment.version, fragment.pending_contributions) == (1, 0)
    assert fragment.state_hash == original.state_hash
    shard.push("a", 0, delta(3, n), base=1)  # round 2's record overwrites round 1's first one
    fragment = restarted(shard, tmp_path).status().fragments[0]
    assert (fragment.version, fragment.pending_contributions) == (1, 1)


def test_a_damaged_snapshot_never_loads_and_an_unfinished_one_is_ignored(tmp_path):
    shard = Shard(make_config(), journal=ShardStore(tmp_path), joined=("a",))
    shard.push("a", 0, delta(1, shard.numel()))
    folder = tmp_path / "fragment-0"
    (folder / "snapshot.tmp").write_bytes(b"half a snapshot")  # the crash hit before the rename
    original = views(shard.core)
    assert views(restarted(shard, tmp_path)) == original
    assert not (folder / "snapshot.tmp").exists()

    data = bytearray((folder / "snapshot").read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / "snapshot").write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupted"):
        ShardStore(tmp_path).load()


def test_a_state_written_in_format_5_restores_and_a_format_this_version_does_not_read_is_refused(
        tmp_path, monkeypatch):
    """Format 5 logs carry every payload in its record (no spaces): an upgraded shard replays
    them and appends its own records after them."""
    with monkeypatch.context() as older:
        older.setattr(store_format, "SNAPSHOT_FORMAT", "diloco.syncer-snapshot/5")
        older.setattr(ShardStore, "spool", lambda self, fragment_id, payload: NullSpool())
        shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
        shard.push("a", 0, delta(1, shard.numel()))
        original = views(shard.core)
    assert [kind for _, _, kind in log_frames(tmp_path / "fragment-0")] == [store_format.CONTRIBUTION]
    assert views(restarted(shard, tmp_path, rejoin=LEARNERS)) == original
    shard.push("b", 0, delta(2, shard.numel()))
    assert restarted(shard, tmp_path).status().fragments[0].pending_contributions == 2

    with monkeypatch.context() as newer:
        newer.setattr(store_format, "SNAPSHOT_FORMAT", "diloco.syncer-snapshot/7")
        Shard(make_config(), journal=ShardStore(tmp_path / "newer"), joined=("a",))
    with pytest.raises(StoreError, match=r"snapshot: not a diloco.syncer-snapshot/5 or diloco.syncer-snapshot/6 "):
        ShardStore(tmp_path / "newer").load()


def test_a_state_folder_hashed_with_sha256_by_older_code_restores_and_goes_on_with_xxh3(tmp_path, monkeypatch):
    """Before xxh3-128 the state hash was a sha256: the snapshot's and each logged close's are
    checked against the values with sha256 at the restart, which then hashes with xxh3."""
    def sha256(values):
        return hashlib.sha256(values.contiguous().view(-1).numpy().data).hexdigest()

    with monkeypatch.context() as older:
        older.setattr(fragment_state, "state_hash", sha256)
        shard = Shard(make_config(codec="int4", quorum=3), journal=ShardStore(tmp_path))
        for version in range(2):
            for i, learner in enumerate(LEARNERS):
                shard.push(learner, 0, delta(10 * version + i, shard.numel()), base=version)
        recorded, value = shard.core.status().fragments[0].state_hash, shard.value().clone()
    assert recorded == sha256(value)
    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    assert core.counters_snapshot()["replayed_rounds"] == 2  # each close checked against its sha256
    assert torch.equal(shard.value(), value) and core.status().fragments[0].state_hash == state_hash(value)
    shard.push("a", 0, delta(30, shard.numel()), base=2)  # and it goes on
    assert restarted(shard, tmp_path, rejoin=LEARNERS).status().fragments[0].pending_contributions == 1


def test_a_lost_update_file_shortens_the_history_to_a_snapshot(tmp_path):
    shard = Shard(make_config(), journal=ShardStore(tmp_path), joined=("a",))
    for version in range(3):
        shard.push("a", 0, delta(version, shard.numel()), base=version)
    (tmp_path / "fragment-0" / "update-2").write_bytes(b"garbage")
    core = restarted(shard, tmp_path)
    assert [u.version for u in core.pull(0, 2).items] == [3]
    assert core.pull(0, 1).snapshot  # update 2 is gone: a learner at 1 gets the whole value


def test_an_update_file_no_snapshot_names_is_never_reused(tmp_path):
    """A crash between writing update-2 and renaming in the snapshot that names it (or bytes
    that are not what the snapshot recorded): the restart rebuilds version 2 from the log and
    serves that, never the file."""
    shard = Shard(make_config(codec="int4", snapshot_log_ratio=0), journal=ShardStore(tmp_path), joined=("a",))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))  # version 1
    shard.core.tick()  # written in full, with update-1
    at_version_1 = shard.value().clone()
    folder = tmp_path / "fragment-0"
    (folder / "update-2").write_bytes((folder / "update-1").read_bytes())  # the crash's leftover
    restarted(shard, tmp_path, rejoin=("a",))
    shard.push("a", 0, delta(2, n), base=1)  # the real version 2
    plan = restarted(shard, tmp_path).pull(0, 1)
    value = at_version_1.clone()
    for update in plan.items:
        apply_update(value, decode_payload(update.header, update.payload))
    assert torch.equal(value, shard.value()) and state_hash(value) == plan.state_hash


def log_end(folder) -> int:
    """Where the fragment's log, as written, ends (the rest of the file is zeros or leftovers)."""
    offset, length, _ = log_frames(folder)[-1]
    return offset + length


def log_frames(folder) -> list[tuple[int, int, bytes]]:
    """(offset, length, kind) of each frame of the fragment's log as written, up to the first
    of an earlier log; a space's length counts the payload bytes after its frame."""
    data = (folder / "round.log").read_bytes()
    tag = data[store_format.FRAME.size:store_format.FRAME.size + store_format.TAG_BYTES]
    frames, offset = [], 0
    while offset + store_format.FRAME.size + store_format.TAG_BYTES <= len(data):
        length, _ = store_format.FRAME.unpack_from(data, offset)
        body = data[offset + store_format.FRAME.size:offset + store_format.FRAME.size + length]
        if body[:store_format.TAG_BYTES] != tag:
            break
        kind = body[store_format.TAG_BYTES:store_format.TAG_BYTES + 1]
        space = (store_format.OFFSET.unpack_from(body, store_format.TAG_BYTES + 1)[0]
                 if kind == store_format.SPACE else 0)
        frames.append((offset, store_format.FRAME.size + length + space, kind))
        offset += store_format.FRAME.size + length + space
    return frames


@pytest.mark.parametrize("where", ["space's length", "contribution record", "payload"])
def test_a_damaged_record_in_the_middle_of_the_round_stops_the_restart_naming_the_file_and_offset(tmp_path, where):
    """Both contributions were acknowledged: dropping the intact second one with the damaged
    first would lose it silently. Each push left a space holding its payload and a record
    naming the space."""
    shard = Shard(make_config(quorum=3), journal=ShardStore(tmp_path))
    n = shard.numel()
    shard.push("a", 0, delta(1, n))
    shard.push("b", 0, delta(2, n))
    log = tmp_path / "fragment-0" / "round.log"
    (space, space_length, _), (record, record_length, _), (next_space, _, _), _ = log_frames(log.parent)
    data = bytearray(log.read_bytes())
    data[{"space's length": space + 2, "contribution record": record + record_length // 2,
          "payload": space + space_length // 2}[where]] ^= 0x10
    log.write_bytes(bytes(data))
    expected = {
        "space's length": rf"the record at offset {space} is damaged.*follows at offset {record}",
        "contribution record": rf"the record at offset {record} is damaged.*follows at offset {next_space}",
        "payload": rf"the contribution record at offset {record} names its payload in the space at offset "
                   rf"{space}, which is damaged"}[where]
    with pytest.raises(StoreError, match=rf"{log}: {expected}"):
        ShardStore(tmp_path).load()


@pytest.mark.parametrize("how", ["torn", "damaged"])
def test_the_rounds_last_record_torn_or_damaged_is_dropped_with_the_leftovers_after_it(tmp_path, how):
    """Round 2's records overwrite round 1's; the crash tore b's last record, the one naming
    its payload's space (or it was damaged: the two look alike at the end of the round). a's
    record stays, b's and round 1's leftovers go."""
    shard = Shard(make_config(quorum=3, snapshot_log_ratio=0), journal=ShardStore(tmp_path))
    n = shard.numel()
    for i, learner in enumerate(LEARNERS):  # round 1 closes with three records and its close in the log
        shard.push(learner, 0, delta(i, n))
    shard.core.tick()  # written in full: the next log starts over at 0
    log = tmp_path / "fragment-0" / "round.log"
    round_1 = log.read_bytes()
    shard.push("a", 0, delta(10, n), base=1)
    shard.push("b", 0, delta(11, n), base=1)
    data = bytearray(log.read_bytes())
    *_, (second, length, kind) = log_frames(log.parent)
    assert kind == store_format.SPOOLED
    middle = second + length // 2
    if how == "torn":  # the write stopped half way: the rest is still round 1's record
        data[middle:second + length] = round_1[middle:second + length]
    else:
        data[middle] ^= 0x01
    log.write_bytes(bytes(data))

    core = restarted(shard, tmp_path, rejoin=LEARNERS)
    assert (core.fragments[0].version, core.fragments[0].round.count) == (1, 1)
    assert [key.learner_id for key in core.fragments[0].round.contributions] == ["a"]
    shard.push("b", 0, delta(11, n), base=1)  # written over the dropped record
    assert restarted(shard, tmp_path).fragments[0].round.count == 2


def test_a_snapshot_the_disk_cannot_take_leaves_the_log_in_charge_until_one_can(tmp_path, monkeypatch):
    """The disk fills while the full state is written (update files already there): nothing is
    lost, a restart replays the log since the last snapshot, and the next tick with room writes it."""
    shard = Shard(make_config(codec="int4", snapshot_log_ratio=0), journal=ShardStore(tmp_path), joined=("a",))
    n = shard.numel()

    def disk_full(path, parts):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(store, "write_atomically", disk_full)
        for version in range(3):
            shard.push("a", 0, delta(version, n), base=version)
            shard.core.tick()
    assert (tmp_path / "fragment-0" / "update-3").exists()  # written, named by no snapshot
    assert shard.version() == 3 and not shard.core.counters.snapshot().get("snapshots")
    expected = shard.core.status().fragments[0].state_hash
    core = restarted(shard, tmp_path)
    assert (core.status().fragments[0].state_hash, core.counters_snapshot()["replayed_rounds"]) == (expected, 3)
    core.tick()
    assert core.counters_snapshot()["snapshots"] == 1
    restored = restarted(shard, tmp_path)
    assert restored.status().fragments[0].state_hash == expected and not restored.counters_snapshot().get("replayed_rounds")
    assert [u.version for u in restored.pull(0, 0).items] == [1, 2, 3]


def test_an_update_file_that_is_not_the_one_the_snapshot_names_is_never_served(tmp_path):
    shard = Shard(make_config(codec="int4", snapshot_log_ratio=0), journal=ShardStore(tmp_path), joined=("a",))
    for version in range(2):
        shard.push("a", 0, delta(version, shard.numel()), base=version)
        shard.core.tick()
    folder = tmp_path / "fragment-0"
    (folder / "update-2").write_bytes((folder / "update-1").read_bytes())  # whole, checksum and all
    core = restarted(shard, tmp_path)
    assert [u.version for u in core.fragments[0].committed.history] == []
    assert core.pull(0, 1).snapshot  # a learner at version 1 gets the whole value, not update-1's bytes
    assert not (folder / "update-1").exists() and not (folder / "update-2").exists()


@pytest.mark.parametrize("cut", ["inside a record", "at a record's end"])
def test_a_log_that_lost_bytes_stops_the_restart_instead_of_serving_its_versions_again(tmp_path, cut):
    """Three rounds closed in the log (no snapshot since the seed). A crash can only tear what
    was never acknowledged; a file cut short lost closed rounds whose versions learners hold."""
    shard = Shard(make_config(snapshot_log_ratio=1000.0), journal=ShardStore(tmp_path))
    n = shard.numel()
    for version in range(3):
        for i, learner in enumerate(LEARNERS):
            shard.push(learner, 0, delta(10 * version + i, n), base=version)
    assert shard.version() == 3
    log = tmp_path / "fragment-0" / "round.log"
    frames = log_frames(log.parent)
    offset, length, _ = frames[len(frames) // 2]
    os.truncate(log, offset + length // 2 if cut == "inside a record" else offset + length)
    with pytest.raises(StoreError, match=rf"{log}: \d+ bytes, but the log was grown to \d+ .*will not start"):
        ShardStore(tmp_path).load()


def test_a_state_folder_from_before_log_size_gets_one_at_its_restart(tmp_path):
    shard = Shard(make_config(snapshot_log_ratio=1000.0), journal=ShardStore(tmp_path))
    for i, learner in enumerate(LEARNERS):
        shard.push(learner, 0, delta(i, shard.numel()))
    log = tmp_path / "fragment-0" / "round.log"
    (log.parent / "log-size").unlink()
    assert restarted(shard, tmp_path).status().fragments[0].version == 1
    assert int((log.parent / "log-size").read_text()) == log.stat().st_size
    os.truncate(log, log_end(log.parent))
    with pytest.raises(StoreError, match="but the log was grown to"):
        ShardStore(tmp_path).load()
