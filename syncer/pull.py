"""What a pull of a fragment gets: the updates since the learner's version, or the committed
value whole when the history does not reach back that far.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.services.contract.codecs import get_codec
from diloco.services.contract.fragments import Fragment
from diloco.services.contract.payload import describe
from diloco.syncer.refusal import Refusal
from diloco.syncer.snapshot import Encoded, FragmentSnapshot

FP32 = get_codec("fp32")


@dataclass(frozen=True)
class PullPlan:
    snapshot: bool  # items is one fp32 snapshot rather than updates
    items: tuple[Encoded, ...]
    state_hash: str  # of the value after the last item


def ahead(fragment_id: int, version: int, base_version: int) -> Refusal:
    """A push or pull from a version this shard has not reached."""
    return Refusal("future_base_version", "FAILED_PRECONDITION",
                   f"base_version {base_version} is ahead of fragment {fragment_id}'s version {version}: "
                   "the shard lost its state or the learner holds another run's (pull a snapshot and "
                   "re-anchor, or RESTORE it)")


class Pulls:
    """One fragment's pulls, with the fp32 payload of the last value pulled whole, as sent."""

    def __init__(self, fragment: Fragment, block_size: int):
        self.fragment, self.block_size = fragment, block_size
        self._whole: tuple[torch.Tensor, Encoded] | None = None

    def plan(self, committed: FragmentSnapshot | None, base_version: int | None) -> PullPlan:
        """The updates (base_version, version], or one fp32 snapshot if base_version is None
        or older than the history reaches. Needs no lock: the committed record is immutable."""
        if committed is None:
            raise Refusal("unseeded", "FAILED_PRECONDITION", f"fragment {self.fragment.id} has not been seeded yet")
        if base_version is not None and base_version > committed.version:
            raise ahead(self.fragment.id, committed.version, base_version)
        if base_version is not None and base_version >= committed.version - len(committed.history):
            updates = tuple(u for u in committed.history if u.version > base_version)
            return PullPlan(False, updates, committed.state_hash)
        return PullPlan(True, (self._snapshot(committed),), committed.state_hash)

    def _snapshot(self, committed: FragmentSnapshot) -> Encoded:
        """The committed value as an fp32 payload: a view of the tensor's own bytes (a committed
        value is never modified, and fp32 is its layout), described once per value, as its
        checksum reads every byte. Pulls racing on a new value may each describe it: harmless."""
        cached = self._whole
        if cached is not None and cached[0] is committed.value:
            return cached[1]
        payload = memoryview(committed.value.numpy()).cast("B")
        item = Encoded(committed.version, describe(FP32, self.fragment.numel, payload, self.block_size), payload)
        self._whole = (committed.value, item)
        return item
