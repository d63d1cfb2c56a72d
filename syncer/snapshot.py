"""A fragment's committed state as records: FragmentSnapshot, what a fragment keeps across a
restart but its open round, and the records in it (the encoded updates learners catch up from,
how the last round closed, the keys of the contributions merged).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from diloco.services.contract.wire import pb

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
    close_reason: str  # "all", "others_waiting", "quorum_grace" or "all_left"
    contributors: int  # distinct learners
    closed_unix_seconds: float
    duration_seconds: float  # from the round's first contribution to its close
    share: float  # of the live learners the round held, with an ordinary contribution (see FragmentState.close)
    final_share: float = 0.0  # of the live learners, with their last contribution


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
