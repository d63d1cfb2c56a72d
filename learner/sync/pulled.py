"""Applying a pull to the global value a learner holds: a snapshot replaces it, updates add in
order, and the result must have the state hash the shard sent (bit-for-bit agreement with
the shard is what lets every learner hold the same global model)."""
from __future__ import annotations

import torch

from diloco.services.client import PullResult
from diloco.services.contract.state import apply_update, check_pulled
from diloco.services.contract.wire import pb


def value_after(result: PullResult, base: torch.Tensor | None) -> torch.Tensor | None:
    """The fragment's value after the pull's items on `base` (left as it was; the items'
    values are consumed). Raises StateHashMismatch unless the result has the hash the shard
    sent: a wrong base, or an update that is not the one that made its version."""
    # The result's decoded items are this pull's own: the value is built in their buffers
    # rather than in new ones (a fragment-sized allocation costs its page faults).
    value = base  # left as it was: the first update writes base + update over the update
    for item in result.items:
        if item.kind == pb.PAYLOAD_KIND_SNAPSHOT:
            value = item.values
        elif value is None:
            raise ValueError(f"fragment {result.fragment_id}: update to v{item.version} without a base value")
        elif value is base:
            value = apply_update(base, item.values, out=item.values)
        else:
            apply_update(value, item.values)
    if value is base and base is not None:
        value = base.clone()
    if result.items and result.state_hash:
        check_pulled(result.fragment_id, result.version, value, result.state_hash)
    return value
