"""The shard's decisions, with no I/O: who may push, what a push must look like, whether it is
merged, when a round closes, what a pull gets.

The same object serves the gRPC service, the tests and a discrete-event simulator: time comes
from an injected clock (`clock` for every decision, `wall_clock` only to stamp reports),
durability from an injected Journal (the service passes syncer.store.ShardStore; NullJournal
keeps nothing), and every outcome is counted in `counters`. Refusals raise Refusal.

Thread safety: each fragment has a lock held around every change to it; membership and
counters have their own. Lock order: fragment, then membership / counters / plan / closing.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

from diloco.services.contract.config import Config
from diloco.services.contract.fragments import FragmentPlan, plan_for_config
from diloco.services.contract.goodput import fragment_compute_seconds
from diloco.services.contract.payload import ChecksumMismatch, PayloadError, Reassembler, decode_payload, leading_bytes
from diloco.services.contract.state import state_hash
from diloco.services.contract.wire import pb
from diloco.syncer.claims import ClaimBounds
from diloco.syncer.counters import Counters
from diloco.syncer.disk import DiskGuardedJournal
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.journal import (Journal, LoggedClose, LoggedContribution, Manifest, NullJournal, NullSpool,
                                   Restored, Spool)
from diloco.syncer.membership import HeartbeatReport, Membership
from diloco.syncer.merge import contribution_weight
from diloco.syncer.outer import OuterOptimizer
from diloco.syncer.pull import PullPlan
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import ClosedRound, ContributionKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushOutcome:
    result: int  # pb.PushResult
    current_version: int  # the version the contribution was judged against
    staleness: int
    round: int  # the round it counts in (0 if refused)
    committed: bool  # a seed or a round close made a new version


@dataclass(frozen=True)
class FragmentView:
    id: int
    numel: int
    offset_step: int
    tensor_names: tuple[str, ...]
    initialized: bool
    version: int
    state_hash: str
    pending_contributions: int
    last_round: ClosedRound | None
    merged_tokens: int


@dataclass(frozen=True)
class LearnerView:
    id: str
    region: str
    incarnation: int
    alive: bool
    step: int
    staleness: int  # versions behind, summed over this shard's fragments it reported
    seconds_since_heartbeat: float  # age of step and sync_step (a push renews the lease, not them)
    tokens_per_second: float
    sync_step: int
    step_seconds: float
    tokens: int


@dataclass(frozen=True)
class ShardStatus:
    shard_index: int
    plan_digest: str
    fragments: tuple[FragmentView, ...]
    learners: tuple[LearnerView, ...]
    counters: dict[str, float]


class ShardCore:
    def __init__(self, cfg: Config, shard_index: int, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, journal: Journal | None = None,
                 state_location: str = "its journal", counters: Counters | None = None):
        cfg.shard(shard_index)  # validates the index
        self.cfg, self.shard_index = cfg, shard_index
        self.clock, self.wall_clock = clock, wall_clock
        # A full or failing disk refuses the request that needed the write (syncer/disk.py).
        self.journal = DiskGuardedJournal(journal or NullJournal(), state_location)
        self.claims = ClaimBounds.from_config(cfg)
        self.counters = counters or Counters()  # shared with the journal, which counts what it writes
        self.membership = Membership([l.id for l in cfg.learners], cfg.syncer.lease_seconds, self.counters)
        self._plan_lock = threading.Lock()
        # One round close's arithmetic at a time: each already uses every core (torch's
        # threads), and the temporaries of closes on several threads at once would add up.
        # Hashing the new value needs none, so the next close starts during it.
        self._closing = threading.Lock()
        self.manifest: Manifest | None = None
        self.plan: FragmentPlan | None = None
        self.fragments: dict[int, FragmentState] = {}  # the fragments this shard owns
        # Called with (fragment id, ClosedRound) for every round closed, under the fragment's
        # lock: the metrics exporter's round-duration histogram and outer-step counter.
        self.round_listeners: list[Callable[[int, ClosedRound], None]] = []
        self.last_push_at: float | None = None  # when the last push ended, whatever its outcome

    # ---- membership ----------------------------------------------------------------------

    def join(self, learner_id: str, incarnation: int, region: str,
             manifest: Sequence[tuple[str, Sequence[int]]]) -> tuple[str, list[FragmentView]]:
        """(plan digest, this shard's fragments). The first join fixes the manifest."""
        with self.counters.counting_refusals():
            self.membership.check_allowed(learner_id)
            self._fix_manifest(tuple((name, tuple(shape)) for name, shape in manifest))
            self.membership.join(learner_id, incarnation, region, self.clock())
            return self.plan.digest, [self._view(state) for state in self.fragments.values()]

    def heartbeat(self, learner_id: str, incarnation: int, step: int = 0, step_seconds: float = 0.0,
                  tokens_per_second: float = 0.0, held_versions: dict[int, int] | None = None,
                  sync_step: int | None = None, tokens: int = 0) -> dict[int, int]:
        """The current version of every owned fragment. Numbers out of range or implausible
        (syncer/claims.py) are refused before anything, the lease included, changes."""
        with self.counters.counting_refusals():
            report = HeartbeatReport(step, step_seconds, tokens_per_second, held_versions or {},
                                     step if sync_step is None else sync_step, tokens)
            now = self.clock()
            self.claims.check_heartbeat(report, self.membership.record(learner_id, incarnation), now)
            self.membership.heartbeat(learner_id, incarnation, now, report)
            return {fid: state.version for fid, state in self.fragments.items()}

    def run_tokens(self) -> tuple[int, float]:
        """(the whole run's tokens, the live learners' tokens per second), for learners to stop
        on trainer.max_run_tokens. Heartbeats give every learner's count, live or gone; a live
        one's has grown at its rate since. The table is lost with a restart, so the count is
        never less than a fragment's merged tokens, which are durable but lag by the steps
        since each learner's last contribution to it. No learner counts for more than its
        whole step budget at the most tokens per step."""
        now = self.clock()
        learners = self.membership.learners(now)
        budget = self.claims.max_steps * self.claims.tokens_per_step
        heard = sum(min(budget, l.tokens + (l.tokens_per_second * (now - l.heartbeat_at) if l.alive and l.heartbeat_at
                                            else 0.0))
                    for l in learners)
        merged = max((s.committed.merged_tokens for s in self.fragments.values() if s.committed), default=0)
        return max(round(heard), merged), sum(l.tokens_per_second for l in learners if l.alive)

    def leave(self, learner_id: str, incarnation: int) -> None:
        with self.counters.counting_refusals():
            self.membership.leave(learner_id, incarnation, self.clock())

    # ---- pushes --------------------------------------------------------------------------

    def push(self, header: pb.PushHeader, chunks: Iterable[pb.Chunk]) -> PushOutcome:
        """One push: its header, then its payload's chunks as the wire numbers them (the
        reassembly checks each index against the header). Returns only once an admitted
        contribution is durable. Whatever the header alone can refuse is refused before a
        chunk is read."""
        with self.counters.counting_refusals():
            try:
                return self._push(header, iter(chunks))
            except Refusal as refusal:
                # A contribution refused. Not one: a seed that lost the race to seed its
                # fragment, or the retry of a contribution already merged (a duplicate).
                if header.kind == pb.PUSH_KIND_OUTER_GRADIENT and refusal.reason != "duplicate":
                    self.counters.add("contributions.refused")
                raise
            finally:
                self.last_push_at = self.clock()

    def _push(self, header: pb.PushHeader, chunks: Iterator[pb.Chunk]) -> PushOutcome:
        state = self._check_header(header)
        assembler = _reassembler(header.payload)
        if header.kind == pb.PUSH_KIND_OUTER_GRADIENT:
            with state.lock:
                staleness = state.staleness(_key(header))
                if staleness > self.cfg.syncer.max_staleness:
                    return self._refuse_stale(state, staleness)
            spool = self.journal.spool(state.id, header.payload)
        else:  # a seed or restore is written in full by the snapshot it makes
            spool = NullSpool()
        started = self.clock()
        payload = _receive(assembler, chunks, spool)
        transfer_seconds = self.clock() - started
        if header.kind == pb.PUSH_KIND_SEED:
            values = decode_payload(header.payload, b"".join(payload))
            _finite_norm(state, values)
            return self._seed(state, header, values)
        if header.kind == pb.PUSH_KIND_RESTORE:
            values = decode_payload(header.payload, b"".join(payload))
            _finite_norm(state, values)
            return self._restore(state, header, values)
        self._check_norm(state, header.payload, payload)
        return self._contribute(state, header, payload, transfer_seconds, spool)

    def _check_header(self, header: pb.PushHeader) -> FragmentState:
        self.membership.authenticate(header.learner_id, header.incarnation, self.clock())
        state = self._fragment(header.fragment_id)
        if header.kind not in (pb.PUSH_KIND_SEED, pb.PUSH_KIND_OUTER_GRADIENT, pb.PUSH_KIND_RESTORE):
            raise Refusal("bad_kind", "INVALID_ARGUMENT",
                          f"push kind {header.kind} is neither a seed, a restore nor an outer gradient")
        state.check_payload(header)
        if header.kind == pb.PUSH_KIND_SEED:
            if header.base_version != 0:
                raise Refusal("bad_seed", "INVALID_ARGUMENT", f"a seed has base_version 0, got {header.base_version}")
            _check_unseeded(state)
        elif header.kind == pb.PUSH_KIND_RESTORE:
            if header.base_version < 1:
                raise Refusal("bad_restore", "INVALID_ARGUMENT",
                              "a restore has base_version >= 1 (the version of the value it carries), got 0")
            state.check_restorable(header.base_version)
        else:
            for field in ("c_steps", "c_tokens"):
                if getattr(header, field) == 0:
                    raise Refusal(f"zero_{field[2:]}", "INVALID_ARGUMENT",
                                  f"an outer gradient with {field}=0 has no merge weight (w = c_tokens * c_tokens / c_steps)")
            self.claims.check_push(header)
        return state

    def _seed(self, state: FragmentState, header: pb.PushHeader, values: torch.Tensor) -> PushOutcome:
        with state.lock:
            _check_unseeded(state)  # another seed may have landed while this one streamed in
            snapshot = state.seeded(values)
            self.journal.commit(snapshot)
            state.install(snapshot)
        self.counters.add("seeds")
        return PushOutcome(pb.PUSH_RESULT_SEEDED, 0, 0, 0, committed=True)

    def _restore(self, state: FragmentState, header: pb.PushHeader, values: torch.Tensor) -> PushOutcome:
        """The fragment continues from the global value a learner holds at base_version: this
        shard lost it (docs/protocol.md, RESTORE)."""
        if state_hash(values) != header.state_hash:
            raise Refusal("bad_state_hash", "INVALID_ARGUMENT",
                          f"fragment {state.id}: state_hash {header.state_hash[:16]!r} is not the sha256 of the "
                          "restore's decoded value")
        with state.lock:
            state.check_restorable(header.base_version)  # judged again: another may have landed
            snapshot = state.seeded(values, header.base_version)
            self.journal.commit(snapshot)
            state.install(snapshot)
        self.counters.add("fragments.restored")
        log.warning("fragment %d: restored at version %d from learner %r's copy (this shard had lost it)",
                    state.id, header.base_version, header.learner_id)
        return PushOutcome(pb.PUSH_RESULT_RESTORED, header.base_version, 0, 0, committed=True)

    def _check_norm(self, state: FragmentState, header: pb.PayloadHeader, chunks: tuple[bytes, ...]) -> None:
        """Refuses NaN or Inf values and a norm above syncer.max_update_norm. The codec's bound
        from the block scales clears a well-formed push without decoding it (the push path
        then costs little more than receiving the bytes); only a push it cannot clear is
        decoded here."""
        limit = self.cfg.syncer.max_update_norm
        scales = leading_bytes(chunks, state.codec.scale_bytes(header.numel, header.block_size))
        if state.codec.norm_bound(scales, header.numel, header.block_size) <= limit:
            return
        norm = _finite_norm(state, decode_payload(header, b"".join(chunks)))
        if norm > limit:
            raise Refusal("norm_too_large", "INVALID_ARGUMENT",
                          f"fragment {state.id}: outer gradient norm {norm:.4g} exceeds "
                          f"syncer.max_update_norm={limit:.4g}")

    def _contribute(self, state: FragmentState, header: pb.PushHeader, chunks: tuple[bytes, ...],
                    transfer_seconds: float, spool: Spool) -> PushOutcome:
        with state.lock:
            # The state may have moved on while the payload streamed in: judge again.
            self.membership.authenticate(header.learner_id, header.incarnation, self.clock())
            key = _key(header)
            staleness = state.staleness(key)
            if staleness > self.cfg.syncer.max_staleness:
                return self._refuse_stale(state, staleness)
            round_number, version = state.round.number, state.version
            self.journal.append(state.id, LoggedContribution(round_number, header, chunks), spool)
            self._admit(state, header, chunks, staleness, transfer_seconds)
            result = "accepted" if staleness == 0 else "stale_merged"
            self.counters.add(f"contributions.{result}")
            self.counters.add("kept_compute_seconds", fragment_compute_seconds(
                header.c_steps, header.step_seconds, state.fragment.numel, self.plan.total_numel))
            try:
                committed = self._close_if_due(state)
            except Exception:  # a bug, not the disk: the contribution is safe, the ticker retries the close
                log.exception("fragment %d: closing round %d failed", state.id, round_number)
                committed = False
        # Acknowledged only once its record is durable, but synced outside the lock, so that the
        # fragment's other pushes are not held up by the disk. Should the round close first, its
        # snapshot (synced before the new version shows) holds this contribution: the record was
        # needed only until then. An admitted push whose sync fails is refused here, and merged
        # all the same; its retry gets ALREADY_EXISTS, which learners take as delivered.
        self.journal.sync(state.id)
        return PushOutcome(pb.PUSH_RESULT_ACCEPTED if staleness == 0 else pb.PUSH_RESULT_STALE_MERGED,
                           version, staleness, round_number, committed)

    def _admit(self, state: FragmentState, header: pb.PushHeader, chunks: tuple[bytes, ...], staleness: int,
               transfer_seconds: float) -> None:
        """Adds a contribution whose claims are in range (syncer/claims.py). It counts for at
        most one sync period of a learner at the most tokens per step, in weight and tokens."""
        weight = contribution_weight(header.c_tokens, header.c_steps, staleness,
                                     self.cfg.syncer.stale_weight_decay, self.claims.max_weight)
        if header.step_seconds > 0:
            state.grace.step_seconds.observe(header.step_seconds)
        tokens = min(header.c_tokens, self.claims.max_contribution_tokens)
        state.admit(_key(header), header.payload, chunks, weight, tokens, self.clock(), transfer_seconds)

    def _refuse_stale(self, state: FragmentState, staleness: int) -> PushOutcome:
        self.counters.add("contributions.refused_stale")
        return PushOutcome(pb.PUSH_RESULT_REFUSED_STALE, state.version, staleness, 0, committed=False)

    # ---- rounds --------------------------------------------------------------------------

    def tick(self) -> list[int]:
        """Closes every round that is due by time alone (grace passed, leases expired), and
        writes the fragments' full state where it is due. Returns the ids of the fragments
        that got a new version."""
        closed = []
        for state in list(self.fragments.values()):
            with state.lock:
                if self._close_if_due(state):
                    closed.append(state.id)
                if state.snapshot_due():
                    self._write_snapshot(state)
        return closed

    def _write_snapshot(self, state: FragmentState) -> None:
        """Called with state.lock held."""
        try:
            self.journal.commit(state.committed)
        except Refusal:  # a disk that cannot take it (logged once): the log still holds every round, the next tick retries
            return
        state.snapshot_written()
        self.counters.add("snapshots")

    def _close_if_due(self, state: FragmentState) -> bool:
        """Called with state.lock held."""
        if state.failure is not None:
            return False
        started = self.clock()
        # Whom a round waits for: the live learners, or with wait_for_all (synchronous data
        # parallel) every learner still in the run, also while it is down.
        if self.cfg.syncer.wait_for_all:
            live_ids = self.membership.member_ids()
            reason = state.round.synchronous_close_reason(live_ids, self.membership.departed_ids())
        else:
            live_ids = self.membership.live_ids(started)
            reason = state.round.close_reason(live_ids, started, state.grace.seconds())
        if reason is None:
            return False
        round_ = state.round
        closed = state.round.closing(reason, live_ids, started, self.wall_clock())
        try:
            self.journal.close_round(state.id, LoggedClose(closed, state.committed.state_hash))
        except Refusal:  # a disk that cannot take it (logged once): the round stays open, the next push or tick retries
            return False
        state.close(closed, arithmetic=self._closing)
        state.observe_close(round_, self.clock() - started)
        self.counters.add(f"rounds.{reason}")
        for listener in self.round_listeners:
            listener(state.id, closed)
        return True

    # ---- reads ---------------------------------------------------------------------------

    def pull(self, fragment_id: int, base_version: int | None) -> PullPlan:
        with self.counters.counting_refusals():
            state = self._fragment(fragment_id)
            return state.pulls.plan(state.committed, base_version)

    def version(self, fragment_id: int) -> int | None:
        """The fragment's version, None while unseeded (for pulls waiting on it)."""
        with self.counters.counting_refusals():
            committed = self._fragment(fragment_id).committed
        return None if committed is None else committed.version

    def status(self) -> ShardStatus:
        now = self.clock()
        versions = {fid: state.version for fid, state in self.fragments.items()}
        learners = tuple(
            LearnerView(l.id, l.region, l.incarnation, l.alive, l.step,
                        sum(max(0, versions[f] - v) for f, v in l.held_versions.items() if f in versions),
                        now - (l.heartbeat_at or l.last_seen), l.tokens_per_second, l.sync_step, l.step_seconds,
                        l.tokens)
            for l in self.membership.learners(now))
        return ShardStatus(self.shard_index, self.plan.digest if self.plan else "",
                           tuple(self._view(state) for state in self.fragments.values()), learners,
                           self.counters_snapshot())

    def counters_snapshot(self) -> dict[str, float]:
        """Process counters, plus the durable total of merged contributions (it survives
        restarts, so it proves that nothing acknowledged was lost)."""
        counters = self.counters.snapshot()
        counters["state.merged_contributions"] = sum(
            s.committed.merged_contributions for s in self.fragments.values() if s.committed is not None)
        return counters

    # ---- restart -------------------------------------------------------------------------

    def restore(self, restored: Restored) -> None:
        """Adopts what the journal read back: the manifest, each fragment's last state written
        in full, then its log replayed: contributions re-admitted and rounds closed again, in
        their original order. Learners are not restored (see membership.py)."""
        if restored.manifest is None:
            return
        self._fix_manifest(restored.manifest, durable=True)
        if self.plan.digest != restored.plan_digest:
            raise ValueError(f"the stored state was written under fragment plan {restored.plan_digest[:12]}, "
                             f"this config makes plan {self.plan.digest[:12]}: sync settings or shards changed")
        for fid, snapshot in restored.snapshots.items():
            state = self._fragment(fid)
            state.restorable = False
            if snapshot.value.numel() != state.fragment.numel:
                raise ValueError(f"fragment {fid}: stored state has {snapshot.value.numel()} elements, "
                                 f"the plan {state.fragment.numel}")
            state.install(snapshot)
        for fid, entries in restored.log.items():
            self._replay(self._fragment(fid), entries)

    def _replay(self, state: FragmentState, entries: list[LoggedContribution | LoggedClose]) -> None:
        snapshot_version = state.version
        for entry in entries:
            round_number = entry.closed.round if isinstance(entry, LoggedClose) else entry.round
            if state.committed is None or round_number != state.round.number:
                raise ValueError(f"fragment {state.id}: journal holds a record of round {round_number}, "
                                 f"but the open round is {state.round.number}")
            if isinstance(entry, LoggedClose):
                if entry.base_state_hash != state.committed.state_hash:
                    raise ValueError(f"fragment {state.id}: replaying the journal reached version {state.version} "
                                     f"with state hash {state.committed.state_hash[:16]}, but round "
                                     f"{round_number} closed on {entry.base_state_hash[:16]}")
                state.close(entry.closed)
                self.counters.add("replayed_rounds")
                continue
            header = self._in_range(state.id, entry.header)
            self._admit(state, header, entry.payload, state.version - header.base_version, 0.0)
            self.counters.add("contributions.restored")
        log.info("fragment %d: restored version %d: snapshot of version %d, %d rounds replayed from the log, "
                 "%d contributions in the open round", state.id, state.version, snapshot_version,
                 state.version - snapshot_version, state.round.count)

    def _in_range(self, fragment_id: int, header: pb.PushHeader) -> pb.PushHeader:
        """A logged contribution was acknowledged: one whose claims are out of range (logged
        before they were checked, or under a larger bound) is merged with them clamped."""
        try:
            self.claims.check_push(header)
            return header
        except Refusal as refusal:
            log.warning("fragment %d: round.log holds learner %r's contribution from base version %d with a "
                        "claim out of range (%s): merging it with its claims clamped", fragment_id,
                        header.learner_id, header.base_version, refusal.message)
            self.counters.add("contributions.clamped")
            return self.claims.clamped(header)

    # ---- helpers -------------------------------------------------------------------------

    def _fix_manifest(self, manifest: Manifest, durable: bool = False) -> None:
        with self._plan_lock:
            if self.manifest is not None:
                if manifest != self.manifest:
                    raise Refusal("manifest_mismatch", "FAILED_PRECONDITION",
                                  f"manifest differs from the one this run started with (this learner's model is not "
                                  f"the run's): {_difference(self.manifest, manifest)}")
                return
            try:
                plan = plan_for_config(self.cfg, manifest)
            except ValueError as error:
                raise Refusal("bad_manifest", "INVALID_ARGUMENT", f"cannot plan fragments: {error}") from None
            if not durable:
                self.journal.fix_manifest(manifest, plan.digest)
            # Readers take no lock: they must never see the plan without its fragments.
            optimizer = OuterOptimizer.of_run(self.cfg)
            self.fragments = {f.id: FragmentState(f, self.cfg.sync, self.cfg.syncer, optimizer)
                              for f in plan.for_shard(self.shard_index)}
            self.plan, self.manifest = plan, manifest

    def _fragment(self, fragment_id: int) -> FragmentState:
        if self.plan is None:
            raise Refusal("no_plan", "FAILED_PRECONDITION",
                          "no learner has joined yet, so this shard has no fragment plan")
        state = self.fragments.get(fragment_id)
        if state is None:
            if fragment_id < len(self.plan.fragments):
                owner = self.plan.fragments[fragment_id].shard
                message = f"fragment {fragment_id} belongs to shard {owner}, not shard {self.shard_index}"
            else:
                message = f"fragment {fragment_id} does not exist (the plan has {len(self.plan.fragments)})"
            raise Refusal("unknown_fragment", "NOT_FOUND", message)
        return state

    def _view(self, state: FragmentState) -> FragmentView:
        committed, fragment = state.committed, state.fragment  # one record: consistent without a lock
        return FragmentView(
            fragment.id, fragment.numel, fragment.offset_step, tuple(s.name for s in fragment.tensors),
            committed is not None, committed.version if committed else 0,
            committed.state_hash if committed else "", state.round.count,
            committed.last_round if committed else None, committed.merged_tokens if committed else 0)


def _key(header: pb.PushHeader) -> ContributionKey:
    return ContributionKey(header.learner_id, header.incarnation, header.base_version)


def _reassembler(header: pb.PayloadHeader) -> Reassembler:
    """Refuses a payload header that does not add up before anything is written for it."""
    try:
        return Reassembler(header)
    except PayloadError as error:
        raise Refusal("bad_payload_header", "INVALID_ARGUMENT", str(error)) from None


def _receive(assembler: Reassembler, chunks: Iterator[pb.Chunk], spool: Spool) -> tuple[bytes, ...]:
    """The payload, verified, as its chunks, each written to the spool as it arrives."""
    try:
        for chunk in chunks:
            spool.write(assembler.add(chunk))
        return assembler.finish_chunks()
    except ChecksumMismatch as error:
        raise Refusal("checksum", "DATA_LOSS", f"payload corrupted: {error}") from None
    except PayloadError as error:
        raise Refusal("bad_chunks", "INVALID_ARGUMENT", f"bad payload stream: {error}") from None


def _check_unseeded(state: FragmentState) -> None:
    if state.committed is not None:
        raise Refusal("already_seeded", "ALREADY_EXISTS",
                      f"fragment {state.id} is already seeded (the first seed wins): pull it")


def _finite_norm(state: FragmentState, values: torch.Tensor) -> float:
    """The L2 norm, refusing NaN and Inf. One fast pass in the common case: any non-finite
    value makes the norm non-finite, and only then are they counted (a norm that merely
    overflowed is left to the norm bound)."""
    norm = float(torch.linalg.vector_norm(values))
    if not math.isfinite(norm):
        bad = values.numel() - int(torch.isfinite(values).sum())
        if bad:
            raise Refusal("non_finite", "INVALID_ARGUMENT",
                          f"fragment {state.id}: {bad} of {values.numel()} decoded values are NaN or Inf")
    return norm


def _difference(expected: Manifest, got: Manifest) -> str:
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"tensor {index} is {b[0]!r} {list(b[1])}, expected {a[0]!r} {list(a[1])}"
    return f"{len(got)} tensors, expected {len(expected)}"
