"""What the shard reports of itself (Join's fragments, Status): read-only records of its
fragments and learners, each consistent on its own without a lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.membership import Learner
from diloco.syncer.served import Anchor
from diloco.syncer.snapshot import ClosedRound


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
    served: dict[str, Anchor]  # by learner: the anchor its last pull left (syncer/served.py)


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


def fragment_view(state: FragmentState) -> FragmentView:
    committed, fragment = state.committed, state.fragment  # one record: consistent without a lock
    return FragmentView(
        fragment.id, fragment.numel, fragment.offset_step, tuple(s.name for s in fragment.tensors),
        committed is not None, committed.version if committed else 0,
        committed.state_hash if committed else "", state.round.count,
        committed.last_round if committed else None, committed.merged_tokens if committed else 0,
        state.pulls.served.records())


def learner_views(learners: Iterable[Learner], versions: dict[int, int], now: float) -> tuple[LearnerView, ...]:
    """`versions`: this shard's fragments' versions, which a learner's staleness is counted against."""
    return tuple(
        LearnerView(l.id, l.region, l.incarnation, l.alive, l.step,
                    sum(max(0, versions[f] - v) for f, v in l.held_versions.items() if f in versions),
                    now - (l.heartbeat_at or l.last_seen), l.tokens_per_second, l.sync_step, l.step_seconds,
                    l.tokens)
        for l in learners)
