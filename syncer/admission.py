"""Admitting a checked push: a seed or restore installed as the fragment's value, an outer
gradient judged again under the fragment's lock (the state may have moved on while it streamed
in), logged, added to the open round, and the round closed if that made it due.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from diloco.services.contract.config import Config
from diloco.services.contract.goodput import fragment_compute_seconds
from diloco.services.contract.state import state_hash
from diloco.services.contract.wire import pb
from diloco.syncer.claims import ClaimBounds
from diloco.syncer.closing import RoundCloser
from diloco.syncer.counters import Counters
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.intake import check_unseeded
from diloco.syncer.journal import Journal, LoggedContribution, Spool
from diloco.syncer.membership import Membership
from diloco.syncer.merge import contribution_weight
from diloco.syncer.owned import OwnedFragments
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import ContributionKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushOutcome:
    result: int  # pb.PushResult
    current_version: int  # the version the contribution was judged against
    staleness: int
    round: int  # the round it counts in (0 if refused)
    committed: bool  # a seed or a round close made a new version


def contribution_key(header: pb.PushHeader) -> ContributionKey:
    return ContributionKey(header.learner_id, header.incarnation, header.base_version)


class Admission:
    def __init__(self, cfg: Config, claims: ClaimBounds, membership: Membership, owned: OwnedFragments,
                 journal: Journal, closer: RoundCloser, counters: Counters, clock: Callable[[], float]):
        self.rules, self.claims, self.membership, self.owned = cfg.syncer, claims, membership, owned
        self.journal, self.closer, self.counters, self.clock = journal, closer, counters, clock

    def seed(self, state: FragmentState, values: torch.Tensor) -> PushOutcome:
        with state.lock:
            check_unseeded(state)  # another seed may have landed while this one streamed in
            snapshot = state.seeded(values)
            self.journal.commit(snapshot)
            state.install(snapshot)
        self.counters.add("seeds")
        return PushOutcome(pb.PUSH_RESULT_SEEDED, 0, 0, 0, committed=True)

    def restore(self, state: FragmentState, header: pb.PushHeader, values: torch.Tensor) -> PushOutcome:
        """The fragment continues from the global value a learner holds at base_version: this
        shard lost it (docs/protocol.md, RESTORE)."""
        if state_hash(values) != header.state_hash:
            raise Refusal("bad_state_hash", "INVALID_ARGUMENT",
                          f"fragment {state.id}: state_hash {header.state_hash[:16]!r} is not the state hash of "
                          "the restore's decoded value")
        with state.lock:
            state.check_restorable(header.base_version)  # judged again: another may have landed
            snapshot = state.seeded(values, header.base_version)
            self.journal.commit(snapshot)
            state.install(snapshot)
        self.counters.add("fragments.restored")
        log.warning("fragment %d: restored at version %d from learner %r's copy (this shard had lost it)",
                    state.id, header.base_version, header.learner_id)
        return PushOutcome(pb.PUSH_RESULT_RESTORED, header.base_version, 0, 0, committed=True)

    def contribute(self, state: FragmentState, header: pb.PushHeader, chunks: tuple[bytes, ...],
                   transfer_seconds: float, spool: Spool) -> PushOutcome:
        with state.lock:
            # The state may have moved on while the payload streamed in: judge again.
            self.membership.authenticate(header.learner_id, header.incarnation, self.clock())
            staleness = state.staleness(contribution_key(header))
            if staleness > self.rules.max_staleness:
                return self.refuse_stale(state, staleness)
            round_number, version = state.round.number, state.version
            self.journal.append(state.id, LoggedContribution(round_number, header, chunks), spool)
            self.admit(state, header, chunks, staleness, transfer_seconds)
            result = "accepted" if staleness == 0 else "stale_merged"
            self.counters.add(f"contributions.{result}")
            self.counters.add("kept_compute_seconds", fragment_compute_seconds(
                header.c_steps, header.step_seconds, state.fragment.numel, self.owned.plan.total_numel))
            try:
                committed = self.closer.close_if_due(state)
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

    def admit(self, state: FragmentState, header: pb.PushHeader, chunks: tuple[bytes, ...], staleness: int,
              transfer_seconds: float) -> None:
        """Adds a contribution whose claims are in range (syncer/claims.py). It counts for at
        most one sync period of a learner at the most tokens per step, in weight and tokens."""
        weight = contribution_weight(header.c_tokens, header.c_steps, staleness,
                                     self.rules.stale_weight_decay, self.claims.max_weight)
        if header.step_seconds > 0:
            state.grace.step_seconds.observe(header.step_seconds)
        tokens = min(header.c_tokens, self.claims.max_contribution_tokens)
        state.admit(contribution_key(header), header.payload, chunks, weight, tokens, self.clock(), transfer_seconds,
                    header.step_seconds, final=header.final)

    def refuse_stale(self, state: FragmentState, staleness: int) -> PushOutcome:
        self.counters.add("contributions.refused_stale")
        return PushOutcome(pb.PUSH_RESULT_REFUSED_STALE, state.version, staleness, 0, committed=False)
