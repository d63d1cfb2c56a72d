"""The bit-exactness contract between shard and learner: one way to apply a decoded update,
and one hash of a fragment's value. Both sides call these, so equal hashes after the same
chain of updates mean equal bits."""
from __future__ import annotations

import hashlib

import torch


def state_hash(values: torch.Tensor) -> str:
    """sha256 of a fragment's fp32 value: equal hashes mean equal bits."""
    flat = values.detach().to(torch.float32).contiguous().view(-1)
    return hashlib.sha256(flat.numpy().data).hexdigest()  # the buffer itself: no copy of it


def apply_update(value: torch.Tensor, update: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The one way a decoded update is applied, on shards and learners alike, so both hold
    the same bits after the same chain of updates: in place, or into `out` (value unchanged,
    one pass where a copy and an add would take two)."""
    return value.add_(update) if out is None else torch.add(value, update, out=out)


class StateHashMismatch(ValueError):
    """A value after a pull is not the one whose hash the shard sent with it."""


def check_pulled(fragment_id: int, version: int, value: torch.Tensor, expected_hash: str) -> torch.Tensor:
    """`value`, if it has the state hash the shard sent for the fragment at `version`; else
    StateHashMismatch naming both hashes."""
    if state_hash(value) != expected_hash:
        raise StateHashMismatch(f"fragment {fragment_id}: the value at v{version} after this pull "
                                f"has sha256 {state_hash(value)[:12]}, the shard's {expected_hash[:12]}")
    return value
