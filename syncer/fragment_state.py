"""One fragment on its shard: the committed state and the open round.

The committed state (FragmentSnapshot) is a record of the global value, Nesterov buffer,
error-feedback residual, version and the encoded updates learners catch up from. A seed is
computed in full, made durable, then installed. A round close is decided first (ClosedRound:
everything besides the logged contributions that determines it), the decision is made
durable, and only then applied: in place on the buffers only the fragment reads (momentum,
residual, period sum), into a new tensor for the value, which readers (pulls, Status) take
without a lock. So a close needs about half again the fragment's memory rather than twice it,
a journal failure leaves the fragment as it was, and replaying the same decisions after a
restart gives the same bits.

The open round holds what arrived since: a running merge of the contributions and the
bookkeeping that decides when it closes.
"""
from __future__ import annotations

import math
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

from diloco.services.contract.state import apply_update, state_hash
from diloco.services.contract.codecs import ErrorFeedback, get_codec
from diloco.services.contract.config import SyncConfig, SyncerConfig
from diloco.services.contract.fragments import Fragment
from diloco.services.contract.payload import decode_payload, describe
from diloco.services.contract.wire import pb
from diloco.syncer.grace import GraceWindow
from diloco.syncer.merge import RoundAccumulator
from diloco.syncer.outer import OuterOptimizer
from diloco.syncer.refusal import Refusal

FP32 = get_codec("fp32")
SNAPSHOT_BYTES_PER_PARAM = 16  # fp32 value, momentum, residual and period sum


class ContributionKey(NamedTuple):
    """What makes a contribution unique: the same key twice is a duplicate."""
    learner_id: str
    incarnation: int
    base_version: int


@dataclass(frozen=True)
class Encoded:
    """An encoded tensor at a version: an update (history) or a snapshot of the value."""
    version: int
    header: pb.PayloadHeader
    payload: bytes | memoryview


@dataclass(frozen=True)
class ClosedRound:
    """How a round closed: with the round's logged contributions, all a replay needs."""
    round: int
    close_reason: str  # "all" or "quorum_grace"
    contributors: int  # distinct learners
    closed_unix_seconds: float
    duration_seconds: float  # from the round's first contribution to its close
    share: float  # of the live learners the round held (see FragmentState.closing)


@dataclass(frozen=True)
class FragmentSnapshot:
    """Everything a fragment keeps across a restart except the open round, whose
    contributions the journal records one by one."""
    fragment_id: int
    version: int
    value: torch.Tensor  # fp32 global value; never modified once in a snapshot
    # The fragment's own buffers: the next round close advances them in place.
    momentum: torch.Tensor
    residual: torch.Tensor  # what the encoded updates have not delivered yet
    history: tuple[Encoded, ...]  # the updates to versions version-len+1 .. version
    state_hash: str
    merged_contributions: int  # since the seed
    merged_tokens: int  # their c_tokens: the run's tokens, up to this version
    recent_keys: frozenset[ContributionKey]  # merged, and not yet too stale to be sent again
    last_round: ClosedRound | None
    # Delayed Nesterov: the share-scaled outer gradients of the sync period in progress, and
    # how much of a period (in live learners' shares) they make up.
    period_sum: torch.Tensor
    period_share: float


@dataclass(frozen=True)
class PullPlan:
    snapshot: bool  # items is one fp32 snapshot rather than updates
    items: tuple[Encoded, ...]
    state_hash: str  # of the value after the last item


@dataclass(frozen=True)
class PendingContribution:
    """An admitted outer gradient as it arrived: decoded only when its round closes."""
    header: pb.PayloadHeader
    chunks: tuple[bytes, ...]  # the payload as received
    weight: float
    tokens: int  # c_tokens


class OpenRound:
    """What arrived since the last version. Contributions are kept encoded (an eighth of their
    fp32 size in int4) and merged when the round closes, so a push is acknowledged without
    decoding it."""

    def __init__(self, number: int, numel: int, merge: str):
        self.number = number  # closing it produces version `number`
        self.numel, self.merge = numel, merge
        self.contributions: dict[ContributionKey, PendingContribution] = {}
        self.contributors: set[str] = set()
        self.first_at: float | None = None
        self.quorum_at: float | None = None  # when the K-th distinct learner contributed
        self.transfer_seconds = 0.0  # summed over contributions

    @property
    def count(self) -> int:
        return len(self.contributions)

    @property
    def quorum_seconds(self) -> float:
        return self.quorum_at - self.first_at if self.quorum_at is not None else 0.0

    @property
    def mean_transfer_seconds(self) -> float:
        return self.transfer_seconds / self.count if self.count else 0.0

    def merged(self) -> torch.Tensor:
        """The merged outer gradient. Contributions are folded in key order, not arrival
        order, so a round rebuilt from the journal after a restart merges to the same bits."""
        accumulator = RoundAccumulator(self.numel, self.merge)
        total = math.fsum(c.weight for c in self.contributions.values())
        if total == 0:  # every weight decayed to nothing
            return torch.zeros(self.numel)
        delta = torch.empty(self.numel)  # every contribution is decoded into this one buffer
        for key in sorted(self.contributions):
            contribution = self.contributions[key]
            decode_payload(contribution.header, b"".join(contribution.chunks), out=delta)
            accumulator.add(delta, contribution.weight / total, float(torch.linalg.vector_norm(delta)))
        return accumulator.merged()


class FragmentState:
    def __init__(self, fragment: Fragment, sync: SyncConfig, syncer: SyncerConfig, optimizer: OuterOptimizer):
        self.fragment = fragment
        self.lock = threading.Lock()  # held by the core around every change
        self.codec = get_codec(sync.codec)
        self.block_size = sync.codec_block_size
        self.rules = syncer
        self.optimizer = optimizer
        self.grace = GraceWindow(syncer.grace.mode, syncer.grace.seconds, syncer.grace.gamma,
                                 sync.overlap_steps)
        self._feedback = ErrorFeedback(self.codec, fragment.numel, self.block_size)
        self.committed: FragmentSnapshot | None = None  # None until seeded
        self._snapshot_item: tuple[torch.Tensor, Encoded] | None = None  # the last value pulled whole, as sent
        self.round = OpenRound(1, fragment.numel, syncer.merge)
        self.logged_bytes = 0  # payload bytes of the contributions logged since the last full write
        self.failure: str | None = None  # set while a close is part way (under the lock), and left set if it fails
        # A learner may RESTORE the fragment's global value (docs/protocol.md) while nothing
        # here can be lost by it: no durable state when the process started, and since then
        # no contribution admitted and no round closed.
        self.restorable = True

    @property
    def id(self) -> int:
        return self.fragment.id

    @property
    def version(self) -> int:
        return self.committed.version if self.committed is not None else 0

    # ---- what a push must look like ----------------------------------------------------

    def check_payload(self, header: pb.PushHeader) -> None:
        """Seeds and restores are fp32 values; outer gradients use the cluster codec and block size."""
        value = header.kind in (pb.PUSH_KIND_SEED, pb.PUSH_KIND_RESTORE)
        expected = FP32 if value else self.codec
        payload = header.payload
        if payload.codec != expected.wire:
            raise Refusal("wrong_codec", "INVALID_ARGUMENT",
                          f"fragment {self.id}: a {_KIND_NAMES[header.kind]} must be "
                          f"{expected.name}, got {_codec_name(payload.codec)}")
        if not value and payload.block_size != self.block_size:
            raise Refusal("wrong_block_size", "INVALID_ARGUMENT",
                          f"fragment {self.id}: codec block size must be {self.block_size}, "
                          f"got {payload.block_size}")
        if payload.numel != self.fragment.numel:
            raise Refusal("wrong_numel", "INVALID_ARGUMENT",
                          f"fragment {self.id} has {self.fragment.numel} elements, "
                          f"the push has {payload.numel}")

    def staleness(self, key: ContributionKey) -> int:
        """How many versions the contribution is behind; refuses what can never be merged."""
        committed = self.committed
        if committed is None:
            raise Refusal("unseeded", "FAILED_PRECONDITION",
                          f"fragment {self.id} has not been seeded: push its initial value "
                          "(PUSH_KIND_SEED) first")
        self.check_not_failed()
        if key.base_version > committed.version:
            raise self._ahead(key.base_version)
        if key in self.round.contributions or key in committed.recent_keys:
            raise Refusal("duplicate", "ALREADY_EXISTS",
                          f"learner {key.learner_id!r} incarnation {key.incarnation} already "
                          f"contributed to fragment {self.id} from base version {key.base_version}")
        return committed.version - key.base_version

    def check_not_failed(self) -> None:
        if self.failure is not None:
            raise Refusal("fragment_failed", "INTERNAL",
                          f"{self.failure}: restart the shard, which replays the round from its journal")

    def check_restorable(self, base_version: int) -> None:
        """A RESTORE at base_version would lose nothing here (see `restorable`)."""
        if not (self.restorable and (self.committed is None or self.version < base_version)):
            raise Refusal("not_restorable", "ALREADY_EXISTS",
                          f"fragment {self.id} is at version {self.version} on this shard: pull it")

    def _ahead(self, base_version: int) -> Refusal:
        return Refusal("future_base_version", "FAILED_PRECONDITION",
                       f"base_version {base_version} is ahead of fragment {self.id}'s version {self.version}: "
                       "the shard lost its state or the learner holds another run's (pull a snapshot and "
                       "re-anchor, or RESTORE it)")

    # ---- the open round ------------------------------------------------------------------

    def admit(self, key: ContributionKey, header: pb.PayloadHeader, chunks: tuple[bytes, ...], weight: float,
              tokens: int, now: float, transfer_seconds: float) -> None:
        """Adds a checked outer gradient (finite, within the norm bound) to the open round."""
        round_ = self.round
        self.restorable = False
        round_.contributions[key] = PendingContribution(header, chunks, weight, tokens)
        self.logged_bytes += sum(len(chunk) for chunk in chunks)
        round_.contributors.add(key.learner_id)
        round_.transfer_seconds += transfer_seconds
        if round_.first_at is None:
            round_.first_at = now
        if round_.quorum_at is None and len(round_.contributors) >= self.rules.quorum:
            round_.quorum_at = now

    def close_reason(self, live_ids: frozenset[str], now: float) -> str | None:
        """"all" once every live learner has contributed; "quorum_grace" once at least K
        have and the grace window has passed since the K-th. With nobody live (say, just
        after a shard restart, before learners rejoin) only quorum and grace can close."""
        round_ = self.round
        if round_.count == 0:
            return None
        if live_ids and live_ids <= round_.contributors:
            return "all"
        if round_.quorum_at is not None and now - round_.quorum_at >= self.grace.seconds():
            return "quorum_grace"
        return None

    def synchronous_close_reason(self, member_ids: frozenset[str], departed_ids: frozenset[str]) -> str | None:
        """wait_for_all (synchronous data parallel): "all" once every learner still in the run,
        down or not, has contributed and, counting those that already left, at least K have
        (so the first round waits for learners that have not joined yet)."""
        contributors = self.round.contributors
        if member_ids <= contributors and len(contributors | departed_ids) >= self.rules.quorum \
                and self.round.count > 0:
            return "all"
        return None

    # ---- the next committed state ------------------------------------------------------

    def seeded(self, values: torch.Tensor, version: int = 0) -> FragmentSnapshot:
        """The fragment holding `values` at `version` with no history: a seed (version 0), or
        a restore of the global value a learner holds. Momentum and residual start at zero."""
        zeros = torch.zeros(self.fragment.numel)
        return FragmentSnapshot(self.id, version, values, zeros, zeros.clone(), (), state_hash(values), 0, 0,
                                frozenset(), None, zeros.clone(), 0.0)

    def closing(self, reason: str, live_ids: frozenset[str], now: float, unix_now: float) -> ClosedRound:
        """The decision to close the open round for `reason`: with the round's logged
        contributions, all `close` needs. Changes nothing."""
        round_ = self.round
        return ClosedRound(round_.number, reason, len(round_.contributors), unix_now, now - round_.first_at,
                           share=len(round_.contributors) / len(live_ids | round_.contributors))

    def close(self, closed: ClosedRound, arithmetic: AbstractContextManager = nullcontext()) -> None:
        """Merges the open round as `closed` decided and installs the next version: outer
        step, encode the update with error feedback, apply exactly the decoded update. Call it
        only once the decision is durable: it advances momentum, residual and period sum in
        place, so a failure part way leaves them undefined (`failure` says so). `arithmetic`
        is held around the part that allocates fragment-sized temporaries.

        A round that holds only some of the live learners counts for their share: learners
        that are not in lockstep reach the shard at different times, so with a small quorum
        one sync period's contributions land in several rounds, and applying each at full
        strength would multiply the outer step by up to M. Scaled by the share of live
        learners present, the rounds of one period add up to one step on the merged outer
        gradient.

        Momentum is delayed the same way (Liu et al. 2024, "Asynchronous Local-SGD", delayed
        Nesterov): a partial round is a plain step -lr*g; when the shares add up to a whole
        period, the momentum buffer takes the period's sum and the round applies the rest
        of the Nesterov step. Momentum on every partial round compounds stale outer
        gradients and, measured on the demo, made the loss climb. A round with every live
        learner is exactly the plain DiLoCo outer step."""
        committed, round_ = self.committed, self.round
        if closed.round != round_.number:
            raise ValueError(f"fragment {self.id}: a close of round {closed.round}, but round {round_.number} is open")
        self.failure = f"fragment {self.id}: applying round {round_.number} failed part way"
        with arithmetic:  # the part with fragment-sized temporaries; the hash below needs none
            step = round_.merged()
            if closed.share != 1.0:  # times 1.0 changes no bit: a pass saved on every full round
                step.mul_(closed.share)
            period_sum = committed.period_sum.add_(step)
            period_share = committed.period_share + closed.share
            if period_share >= 1.0 - 1e-9:
                update = self.optimizer.end_period(committed.momentum, period_sum, step)
                period_sum.zero_()
                period_share = 0.0
            else:
                update = step.mul_(-self.optimizer.lr)
            self._feedback.residual = committed.residual
            payload, decoded = self._feedback.compress(update, in_place=True)
            del update, step
            # Into a new tensor: pulls read the old one without a lock. The same call learners
            # use: same bits on both sides.
            value = apply_update(committed.value, decoded, out=torch.empty_like(committed.value))
            del decoded
        version = committed.version + 1
        update_record = Encoded(version, describe(self.codec, self.fragment.numel, payload, self.block_size),
                                payload)
        oldest_mergeable = version - self.rules.max_staleness
        recent = frozenset(k for k in committed.recent_keys | round_.contributions.keys()
                           if k.base_version >= oldest_mergeable)
        self.committed = FragmentSnapshot(
            self.id, version, value, committed.momentum, self._feedback.residual,
            self._history(committed.history + (update_record,)),
            state_hash(value), committed.merged_contributions + round_.count,
            committed.merged_tokens + sum(c.tokens for c in round_.contributions.values()), recent,
            closed, period_sum, period_share)
        self.round = OpenRound(version + 1, self.fragment.numel, self.rules.merge)
        self.failure = None

    def _history(self, updates: tuple[Encoded, ...]) -> tuple[Encoded, ...]:
        """The newest updates, at most history_versions, while a chain of them is smaller
        than the fp32 snapshot a learner further behind pulls instead."""
        kept, chain_bytes = [], 0
        for update in reversed(updates[-self.rules.history_versions:]):
            chain_bytes += len(update.payload)
            if chain_bytes > FP32.encoded_size(self.fragment.numel, self.block_size):
                break
            kept.append(update)
        return tuple(reversed(kept))

    def install(self, snapshot: FragmentSnapshot) -> None:
        """Adopts a state written in full (a seed, a restore, or one read back from disk) and
        opens the round that follows it."""
        self.committed = snapshot
        self.round = OpenRound(snapshot.version + 1, self.fragment.numel, self.rules.merge)
        self.logged_bytes = 0

    def snapshot_due(self) -> bool:
        """Whether to write the committed state in full: once the contributions logged since
        the last full write add up to syncer.snapshot_log_ratio times its size, so a round's
        durable bytes stay a small multiple of what it received and a restart replays a
        bounded log. Only between rounds: the next log starts empty."""
        return (self.committed is not None and self.round.count == 0 and self.failure is None and self.logged_bytes > 0
                and self.logged_bytes >= self.rules.snapshot_log_ratio * SNAPSHOT_BYTES_PER_PARAM * self.fragment.numel)

    def snapshot_written(self) -> None:
        self.logged_bytes = 0

    def observe_close(self, round_: OpenRound, close_seconds: float) -> None:
        self.grace.quorum_seconds.observe(round_.quorum_seconds)
        self.grace.sync_seconds.observe(round_.mean_transfer_seconds + close_seconds)

    # ---- reads ---------------------------------------------------------------------------

    def pull(self, base_version: int | None) -> PullPlan:
        """The updates (base_version, version], or one fp32 snapshot if base_version is None
        or older than the history reaches. Needs no lock: the committed record is immutable."""
        committed = self.committed
        if committed is None:
            raise Refusal("unseeded", "FAILED_PRECONDITION", f"fragment {self.id} has not been seeded yet")
        if base_version is not None and base_version > committed.version:
            raise self._ahead(base_version)
        if base_version is not None and base_version >= committed.version - len(committed.history):
            updates = tuple(u for u in committed.history if u.version > base_version)
            return PullPlan(False, updates, committed.state_hash)
        return PullPlan(True, (self._snapshot(committed),), committed.state_hash)

    def _snapshot(self, committed: FragmentSnapshot) -> Encoded:
        """The committed value as an fp32 payload: a view of the tensor's own bytes (a committed
        value is never modified, and fp32 is its layout), described once per value, as its
        checksum reads every byte. Pulls racing on a new value may each describe it: harmless."""
        cached = self._snapshot_item
        if cached is not None and cached[0] is committed.value:
            return cached[1]
        payload = memoryview(committed.value.numpy()).cast("B")
        item = Encoded(committed.version, describe(FP32, self.fragment.numel, payload, self.block_size), payload)
        self._snapshot_item = (committed.value, item)
        return item


_KIND_NAMES = {pb.PUSH_KIND_SEED: "seed", pb.PUSH_KIND_RESTORE: "restore", pb.PUSH_KIND_OUTER_GRADIENT: "outer gradient"}


def _codec_name(wire: int) -> str:
    try:
        return get_codec(wire).name
    except ValueError:
        return f"unknown codec {wire}"
