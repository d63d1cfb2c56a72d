"""One fragment on its shard: its committed state, its open round (syncer/open_round.py) and
its pulls (syncer/pull.py).

The committed state (syncer/snapshot.py FragmentSnapshot) is a record of the global value,
Nesterov buffer, error-feedback residual, version and the encoded updates learners catch up
from. A seed is computed in full, made durable, then installed. A round close is decided first
(ClosedRound: everything besides the logged contributions that determines it), the decision is
made durable, and only then applied: in place on the buffers only the fragment reads
(momentum, residual, period sum), into a new tensor for the value, which readers (pulls,
Status) take without a lock. So a close needs about half again the fragment's memory rather
than twice it, a journal failure leaves the fragment as it was, and replaying the same
decisions after a restart gives the same bits.
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Iterable

import torch

from diloco.services.contract.state import state_hash
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.config import SyncConfig, SyncerConfig
from diloco.services.contract.fragments import Fragment
from diloco.services.contract.payload import describe
from diloco.services.contract.wire import pb
from diloco.syncer.anchor_spill import AnchorSpill
from diloco.syncer.grace import GraceWindow
from diloco.syncer.open_round import OpenRound, PendingContribution
from diloco.syncer.outer import OuterOptimizer
from diloco.syncer.pull import FP32, Pulls, ahead
from diloco.syncer.refusal import Refusal
from diloco.syncer.served import ServedAnchors
from diloco.syncer.snapshot import SNAPSHOT_BYTES_PER_PARAM, ClosedRound, ContributionKey, Encoded, FragmentSnapshot


class FragmentState:
    def __init__(self, fragment: Fragment, sync: SyncConfig, syncer: SyncerConfig, optimizer: OuterOptimizer,
                 learner_ids: Iterable[str] = (), spill: AnchorSpill | None = None):
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
        self.pulls = Pulls(fragment, self.codec, self.block_size, ServedAnchors(learner_ids, syncer.kept_anchors, spill))
        self.round = OpenRound(1, fragment.numel, syncer)
        self.logged_bytes = 0  # payload bytes of the contributions logged since the last full write
        self.failure: str | None = None  # set while a close is part way (under the lock), and left set if it fails
        # A learner may RESTORE the fragment's global value (docs/protocol.md) while nothing
        # here can be lost by it: no durable state when the process started, and since then
        # no contribution admitted and no round closed.
        self.restorable = True
        self._value_norm = (-1, 0.0)  # (version, L2 norm of its global value): computed once per version
        self._value_norm_lock = threading.Lock()  # pushes racing after a close wait for one pass, not one each

    @property
    def id(self) -> int:
        return self.fragment.id

    @property
    def version(self) -> int:
        return self.committed.version if self.committed is not None else 0

    # ---- whether a push can be taken ---------------------------------------------------

    def staleness(self, key: ContributionKey) -> int:
        """How many versions the contribution is behind; refuses what can never be merged."""
        committed = self.committed
        if committed is None:
            raise Refusal("unseeded", "FAILED_PRECONDITION",
                          f"fragment {self.id} has not been seeded: push its initial value "
                          "(PUSH_KIND_SEED) first")
        self.check_not_failed()
        if key.base_version > committed.version:
            raise ahead(self.id, committed.version, key.base_version)
        if key in self.round.contributions or key in committed.recent_keys:
            raise Refusal("duplicate", "ALREADY_EXISTS",
                          f"learner {key.learner_id!r} incarnation {key.incarnation} already "
                          f"contributed to fragment {self.id} from base version {key.base_version}")
        return committed.version - key.base_version

    def value_norm(self) -> float:
        """The L2 norm of the committed global value (the outlier rule's reference): computed
        by the close that made it, or once by the first push after a seed, restore or restart."""
        committed = self.committed  # one record: its version and value belong together
        with self._value_norm_lock:
            version, norm = self._value_norm
            if version != committed.version:
                norm = float(torch.linalg.vector_norm(committed.value))
                self._value_norm = (committed.version, norm)
        return norm

    def check_not_failed(self) -> None:
        if self.failure is not None:
            raise Refusal("fragment_failed", "INTERNAL",
                          f"{self.failure}: restart the shard, which replays the round from its journal")

    def check_restorable(self, base_version: int) -> None:
        """A RESTORE at base_version would lose nothing here (see `restorable`)."""
        if not (self.restorable and (self.committed is None or self.version < base_version)):
            raise Refusal("not_restorable", "ALREADY_EXISTS",
                          f"fragment {self.id} is at version {self.version} on this shard: pull it")

    # ---- the open round ------------------------------------------------------------------

    def admit(self, key: ContributionKey, header: pb.PayloadHeader, chunks: tuple[bytes, ...], weight: float,
              tokens: int, now: float, transfer_seconds: float, step_seconds: float, final: bool = False) -> None:
        """Adds a checked outer gradient (finite, within the norm bound) to the open round;
        `final`: its learner's last."""
        self.restorable = False
        self.round.admit(key, PendingContribution(header, chunks, weight, tokens, final), now, transfer_seconds,
                         self.grace.close_by(now, step_seconds, transfer_seconds))
        self.logged_bytes += sum(len(chunk) for chunk in chunks)

    # ---- the next committed state ------------------------------------------------------

    def seeded(self, values: torch.Tensor, version: int = 0) -> FragmentSnapshot:
        """The fragment holding `values` at `version` with no history: a seed (version 0), or
        a restore of the global value a learner holds. Momentum and residual start at zero."""
        zeros = torch.zeros(self.fragment.numel)
        return FragmentSnapshot(self.id, version, values, zeros, zeros.clone(), (), state_hash(values), 0, 0,
                                frozenset(), None, zeros.clone(), 0.0)

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

        A learner's last contribution (its budget spent) counts plainly for its share: the
        weighted mean of a round's last contributions, lr 1, no momentum, added to the
        ordinary ones' outer step. The outer step's extrapolation (momentum, RDA's norm) is
        corrected by the inner steps that follow it; after a learner's last contribution none
        of its steps follow, and a round of only last contributions is the learners' final
        models averaged: what the run ends with.

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
        period_sum, period_share = committed.period_sum, committed.period_share
        with arithmetic:  # the part with fragment-sized temporaries; the hash below needs none
            update = None
            if closed.share > 0:
                step = round_.merged()
                if closed.share != 1.0:  # times 1.0 changes no bit: a pass saved on every full round
                    step.mul_(closed.share)
                # A round that starts its period finds period_sum zero: adding step to it and
                # zeroing it again would be two passes over the fragment for nothing.
                starts_period = period_share == 0
                period_share += closed.share
                if period_share >= 1.0 - 1e-9:
                    delta = step if starts_period else period_sum.add_(step)
                    update = self.optimizer.end_period(committed.momentum, delta, step)
                    if not starts_period:
                        period_sum.zero_()
                    period_share = 0.0
                else:
                    period_sum.add_(step)
                    update = step.mul_(-self.optimizer.lr)
            if closed.final_share > 0:
                last = round_.merged(final=True).mul_(-closed.final_share)
                update = last if update is None else update.add_(last)
            self._feedback.residual = committed.residual
            # Into a new tensor: pulls read the old one without a lock. Applied as learners
            # apply the decoded update (apply_update): the same bits.
            payload, value = self._feedback.compress_apply(update, committed.value)
            del update
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
        self.round = OpenRound(version + 1, self.fragment.numel, self.rules)
        self.failure = None
        self.value_norm()  # here rather than in the next round's first pushes, which wait for their answers

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
        self.round = OpenRound(snapshot.version + 1, self.fragment.numel, self.rules)
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
        self.grace.close_seconds.observe(close_seconds)

