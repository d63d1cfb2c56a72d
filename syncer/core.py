"""The shard's decisions, with no I/O: who may push, what a push must look like, whether it is
merged, when a round closes, what a pull gets.

The same object serves the gRPC service, the tests and a discrete-event simulator: time comes
from an injected clock (`clock` for every decision, `wall_clock` only to stamp reports),
durability from an injected Journal (the service passes syncer.store.ShardStore; NullJournal
keeps nothing), and every outcome is counted in `counters`. Refusals raise Refusal.

ShardCore is the entry; each of its jobs has a module: the fragments it owns (owned.py),
receiving and checking a push (intake.py), admitting it (admission.py), closing rounds and
writing snapshots (closing.py), a restart's replay (replay.py), what it reports (views.py).

Thread safety: each fragment has a lock held around every change to it; membership and
counters have their own. Lock order: fragment, then membership / counters / plan / closing.
"""
from __future__ import annotations

import pathlib
import time
from typing import Callable, Iterable, Iterator, Sequence

from diloco.services.contract.config import Config
from diloco.services.contract.fragments import FragmentPlan
from diloco.services.contract.wire import pb
from diloco.syncer.admission import Admission, PushOutcome, contribution_key
from diloco.syncer.claims import ClaimBounds
from diloco.syncer.closing import RoundCloser, RoundListener
from diloco.syncer.counters import Counters
from diloco.syncer.disk import DiskGuardedJournal
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.intake import PushChecks, finite_value, reassembler, receive, until_seeded
from diloco.syncer.journal import Journal, Manifest, NullJournal, NullSpool, Restored
from diloco.syncer.membership import HeartbeatReport, Membership
from diloco.syncer.owned import OwnedFragments
from diloco.syncer.pull import PullPlan
from diloco.syncer.refusal import Refusal
from diloco.syncer.replay import JournalReplay
from diloco.syncer.views import FragmentView, ShardStatus, fragment_view, learner_views


class ShardCore:
    def __init__(self, cfg: Config, shard_index: int, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, journal: Journal | None = None,
                 state_location: str = "its journal", counters: Counters | None = None,
                 anchor_folder: pathlib.Path | None = None):
        cfg.shard(shard_index)  # validates the index
        self.cfg, self.shard_index = cfg, shard_index
        self.clock, self.wall_clock = clock, wall_clock
        # A full or failing disk refuses the request that needed the write (syncer/disk.py).
        self.journal = DiskGuardedJournal(journal or NullJournal(), state_location)
        self.claims = ClaimBounds.from_config(cfg)
        self.counters = counters or Counters()  # shared with the journal, which counts what it writes
        self.membership = Membership([l.id for l in cfg.learners], cfg.syncer.lease_seconds, self.counters)
        # Anchors' values beyond syncer.kept_anchors go to anchor_folder (None: dropped).
        self.owned = OwnedFragments(cfg, shard_index, self.journal, self.counters, anchor_folder)
        # Called with (fragment id, ClosedRound) for every round closed, under the fragment's
        # lock: the metrics exporter's round-duration histogram and outer-step counter.
        self.round_listeners: list[RoundListener] = []
        self.closer = RoundCloser(cfg, self.membership, self.journal, self.counters, self.round_listeners,
                                  clock, wall_clock)
        self.checks = PushChecks(cfg, self.claims, self.membership, self.owned, clock)
        self.admission = Admission(cfg, self.claims, self.membership, self.owned, self.journal, self.closer,
                                   self.counters, clock)
        # When the last push or pull ended, whatever its outcome: the Ticker gives freed memory
        # back once the shard has been idle a moment (a pull can read an anchor back from disk).
        self.last_busy_at: float | None = None

    @property
    def fragments(self) -> dict[int, FragmentState]:
        """The fragments this shard owns; none before the first join fixes the plan."""
        return self.owned.states

    @property
    def plan(self) -> FragmentPlan | None:
        return self.owned.plan

    @property
    def manifest(self) -> Manifest | None:
        return self.owned.manifest

    # ---- membership ----------------------------------------------------------------------

    def join(self, learner_id: str, incarnation: int, region: str,
             manifest: Sequence[tuple[str, Sequence[int]]]) -> tuple[str, list[FragmentView]]:
        """(plan digest, this shard's fragments). The first join fixes the manifest."""
        with self.counters.counting_refusals():
            self.membership.check_allowed(learner_id)
            self.owned.fix(tuple((name, tuple(shape)) for name, shape in manifest))
            self.membership.join(learner_id, incarnation, region, self.clock())
            return self.plan.digest, [fragment_view(state) for state in self.fragments.values()]

    def heartbeat(self, learner_id: str, incarnation: int, step: int = 0, step_seconds: float = 0.0,
                  tokens_per_second: float = 0.0, held_versions: dict[int, int] | None = None,
                  sync_step: int | None = None, tokens: int = 0, waiting_for: int | None = None,
                  standing_still: bool = False, skipped: frozenset[int] = frozenset()) -> dict[int, int]:
        """The current version of every owned fragment. Numbers out of range or implausible
        (syncer/claims.py) are refused before anything, the lease included, changes.
        `waiting_for`: the fragment whose result the learner's training waits for now;
        `standing_still`: its training stands still (an island regrouping); `skipped`: fragments
        whose open round it will not contribute to (its push was refused or never sent)."""
        with self.counters.counting_refusals():
            report = HeartbeatReport(step, step_seconds, tokens_per_second, held_versions or {},
                                     step if sync_step is None else sync_step, tokens, waiting_for,
                                     standing_still, skipped)
            now = self.clock()
            self.claims.check_heartbeat(report, self.membership.record(learner_id, incarnation), now)
            self.membership.heartbeat(learner_id, incarnation, now, report)
            return {fid: state.version for fid, state in self.fragments.items()}

    def attend(self, learner_id: str, incarnation: int) -> int:
        """A joined learner holds an Attend call open: the call's number, for `absent`."""
        with self.counters.counting_refusals():
            return self.membership.attend(learner_id, incarnation, self.clock())

    def absent(self, learner_id: str, incarnation: int, attendance: int) -> None:
        """Attend call `attendance` ended without a Leave: the learner stops counting now; the
        next tick closes the rounds that waited only for it."""
        self.membership.absent(learner_id, incarnation, attendance, self.clock())

    def run_tokens(self) -> tuple[int, float]:
        """(the whole run's tokens, the live learners' tokens per second), for learners to stop
        on trainer.max_run_tokens. Heartbeats give every learner's count, live or gone; a live
        one's has grown at its rate since. The table is lost with a restart, so the count is
        never less than a fragment's merged tokens, which are durable but lag by the steps
        since each learner's last contribution to it. No learner counts for more than its
        whole step budget at the most tokens per step."""
        heard, rate = self.membership.reported_tokens(self.clock(), self.claims.max_steps * self.claims.tokens_per_step)
        merged = max((s.committed.merged_tokens for s in self.fragments.values() if s.committed), default=0)
        return max(round(heard), merged), rate

    def leave(self, learner_id: str, incarnation: int) -> None:
        with self.counters.counting_refusals():
            self.membership.leave(learner_id, incarnation, self.clock())

    # ---- pushes --------------------------------------------------------------------------

    def push(self, header: pb.PushHeader, chunks: Iterable[pb.Chunk],
             transfer_seconds: float | None = None) -> PushOutcome:
        """One push: its header, then its payload's chunks as the wire numbers them (the
        reassembly checks each index against the header). Returns only once an admitted
        contribution is durable. Whatever the header alone can refuse is refused before a
        chunk is read. `transfer_seconds`: how long the payload took on the wire, where the
        clock cannot see it (the planner's stands still during a call); None: timed here."""
        with self.counters.counting_refusals():
            try:
                return self._push(header, iter(chunks), transfer_seconds)
            except Refusal as refusal:
                # A contribution refused. Not one: a seed that lost the race to seed its
                # fragment, or the retry of a contribution already merged (a duplicate).
                if header.kind == pb.PUSH_KIND_OUTER_GRADIENT and refusal.reason != "duplicate":
                    self.counters.add("contributions.refused")
                if refusal.reason == "norm_outlier":  # names the learner: status and metrics show it
                    self.counters.add(f"outliers.{header.learner_id}")
                raise
            finally:
                self.last_busy_at = self.clock()

    def _push(self, header: pb.PushHeader, chunks: Iterator[pb.Chunk], transfer_seconds: float | None) -> PushOutcome:
        state = self.checks.check_header(header)
        assembler = reassembler(header.payload)
        if header.kind == pb.PUSH_KIND_OUTER_GRADIENT:
            with state.lock:
                staleness = state.staleness(contribution_key(header))
                if staleness > self.cfg.syncer.max_staleness:
                    return self.admission.refuse_stale(state, staleness)
            spool = self.journal.spool(state.id, header.payload)
        else:  # a seed or restore is written in full by the snapshot it makes
            spool = NullSpool()
            if header.kind == pb.PUSH_KIND_SEED:
                chunks = until_seeded(state, chunks)
        started = self.clock()
        with self.membership.receiving(header.learner_id, header.incarnation, self.clock):
            payload = receive(assembler, chunks, spool)
        if transfer_seconds is None:
            transfer_seconds = self.clock() - started
        if header.kind == pb.PUSH_KIND_SEED:
            return self.admission.seed(state, finite_value(state, header.payload, payload))
        if header.kind == pb.PUSH_KIND_RESTORE:
            return self.admission.restore(state, header, finite_value(state, header.payload, payload))
        self.checks.check_norm(state, header.payload, payload)
        return self.admission.contribute(state, header, payload, transfer_seconds, spool)

    # ---- rounds --------------------------------------------------------------------------

    def tick(self) -> list[int]:
        """Closes every round that is due by time alone (grace passed, leases expired), and
        writes the fragments' full state where it is due. Returns the ids of the fragments
        that got a new version."""
        return self.closer.tick(list(self.fragments.values()))

    # ---- reads ---------------------------------------------------------------------------

    def pull(self, fragment_id: int, base_version: int | None, learner_id: str = "",
             anchor_hash: str = "", exact: bool = False) -> PullPlan:
        """What takes `learner_id` from the value it holds at base_version (state hash
        `anchor_hash`) to the fragment's current value (syncer/pull.py); `exact`: to its bits."""
        with self.counters.counting_refusals():
            state = self.owned.get(fragment_id)
            try:
                plan = state.pulls.plan(state.committed, base_version, learner_id, anchor_hash, exact)
            finally:
                self.last_busy_at = self.clock()
        self.counters.add(f"pulls.{plan.answer}")
        self.counters.add(f"pull_bytes.{plan.answer}", sum(len(item.payload) for item in plan.items))
        if plan.anchor_value_dropped:
            self.counters.add("anchor_values_missed")
        return plan

    def version(self, fragment_id: int) -> int | None:
        """The fragment's version, None while unseeded (for pulls waiting on it)."""
        with self.counters.counting_refusals():
            committed = self.owned.get(fragment_id).committed
        return None if committed is None else committed.version

    def status(self) -> ShardStatus:
        now = self.clock()
        versions = {fid: state.version for fid, state in self.fragments.items()}
        return ShardStatus(self.shard_index, self.plan.digest if self.plan else "",
                           tuple(fragment_view(state) for state in self.fragments.values()),
                           learner_views(self.membership.learners(now), versions, now), self.counters_snapshot())

    def counters_snapshot(self) -> dict[str, float]:
        """Process counters, plus the durable total of merged contributions (it survives
        restarts, so it proves that nothing acknowledged was lost)."""
        counters = self.counters.snapshot()
        counters["state.merged_contributions"] = sum(
            s.committed.merged_contributions for s in self.fragments.values() if s.committed is not None)
        return counters

    # ---- restart -------------------------------------------------------------------------

    def restore(self, restored: Restored) -> None:
        """Adopts what the journal read back (syncer/replay.py). Learners are not restored
        (see membership.py)."""
        JournalReplay(self.owned, self.admission, self.claims, self.counters).restore(restored)
