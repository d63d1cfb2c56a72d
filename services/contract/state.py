"""The bit-exactness contract between shard and learner: one way to apply a decoded update,
and one hash of a fragment's value. Both sides call these, so equal hashes after the same
chain of updates mean equal bits."""
from __future__ import annotations

import hashlib

import torch
import xxhash

HASH_NAME = "xxh3-128"
# diloco hashed values with sha256 before: state folders written then hold such hashes (64 hex
# digits, against xxh3-128's 32), and a peer that sends one runs that older code.
LEGACY_HASH_NAME, LEGACY_HASH_DIGITS = "sha256", 64


def state_hash(values: torch.Tensor) -> str:
    """xxh3-128 of a fragment's fp32 value, hex: equal hashes mean equal bits. It guards the
    bits against bugs and damage (another apply, a torn transfer), not against a peer that
    lies (mTLS and the shards' checks do that); a sha256 of a large fragment cost more than
    the round's own arithmetic on a busy host, xxh3 about a tenth of a copy of it."""
    return xxhash.xxh3_128_hexdigest(_fp32_bytes(values))


def is_legacy_hash(digest: str) -> bool:
    """Written by an older diloco (a sha256)."""
    return len(digest) == LEGACY_HASH_DIGITS


def same_state(values: torch.Tensor, values_hash: str, recorded: str) -> bool:
    """Whether `recorded`, a state hash written down earlier, is that of `values`, whose
    state_hash is `values_hash`; a recorded sha256 (a state folder an older diloco wrote) is checked
    against the values' sha256."""
    if is_legacy_hash(recorded):
        return hashlib.sha256(_fp32_bytes(values)).hexdigest() == recorded
    return values_hash == recorded


def _fp32_bytes(values: torch.Tensor) -> memoryview:
    """The fp32 value's own buffer, as hashes read it: no copy of an fp32 tensor."""
    return values.detach().to(torch.float32).contiguous().view(-1).numpy().data


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
    if is_legacy_hash(expected_hash):
        raise StateHashMismatch(f"fragment {fragment_id}: the shard hashes values with {LEGACY_HASH_NAME}, this "
                                f"learner with {HASH_NAME}: the shard runs an older diloco; run one "
                                "version across the cluster")
    digest = state_hash(value)
    if digest != expected_hash:
        raise StateHashMismatch(f"fragment {fragment_id}: the value at v{version} after this pull "
                                f"has {HASH_NAME} {digest[:12]}, the shard's {expected_hash[:12]}")
    return value
