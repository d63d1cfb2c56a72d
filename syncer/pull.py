"""What a pull of a fragment gets (docs/protocol.md, "The downlink"): one delta from the anchor
the shard last served the learner, the next update of the shards' own lineage, or the committed
value whole; for a request without an anchor hash (an older client), or from a lineage anchor
whose value the shard no longer keeps (syncer.kept_anchors), the updates since its version, or
the value whole when the history does not reach back that far.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from diloco.services.contract.codecs import Codec, get_codec
from diloco.services.contract.fragments import Fragment
from diloco.services.contract.payload import describe
from diloco.services.contract.state import HASH_NAME, LEGACY_HASH_NAME, apply_update, is_legacy_hash, state_hash
from diloco.syncer.refusal import Refusal
from diloco.syncer.served import Anchor, ServedAnchors
from diloco.syncer.snapshot import Encoded, FragmentSnapshot

FP32 = get_codec("fp32")


# What a pull was answered with (counted as pulls.<answer>, diloco_syncer_pulls_total):
# nothing new, the lineage's shared update, a delta encoded for it, a delta another pull of the
# same (anchor, value) pair encoded, the updates since its version (an older client, or an anchor
# whose value was dropped), a snapshot.
PULL_ANSWERS = ("nothing", "lineage_update", "delta_encoded", "delta_reused", "updates", "snapshot")


@dataclass(frozen=True)
class PullPlan:
    snapshot: bool  # items is one fp32 snapshot rather than updates
    items: tuple[Encoded, ...]
    state_hash: str  # of the value after the last item
    answer: str  # one of PULL_ANSWERS
    # The shard served the learner's anchor but had dropped its value (syncer.kept_anchors), so
    # the answer is the updates since or a snapshot where one delta would have done.
    anchor_value_dropped: bool = False


def ahead(fragment_id: int, version: int, base_version: int) -> Refusal:
    """A push or pull from a version this shard has not reached."""
    return Refusal("future_base_version", "FAILED_PRECONDITION",
                   f"base_version {base_version} is ahead of fragment {fragment_id}'s version {version}: "
                   "the shard lost its state or the learner holds another run's (pull a snapshot and "
                   "re-anchor, or RESTORE it)")


class Pulls:
    """One fragment's pulls: the anchors it served (ServedAnchors), the fp32 payload of the
    last value pulled whole, as sent, and the deltas to the committed value from the anchors
    pulled since it was committed: learners that hold the same bits (the same anchor hash) get
    the same delta, encoded once, and then hold the same anchor tensor."""

    def __init__(self, fragment: Fragment, codec: Codec, block_size: int, served: ServedAnchors):
        self.fragment, self.codec, self.block_size = fragment, codec, block_size
        self.served = served
        self._whole: tuple[torch.Tensor, Encoded] | None = None
        self._deltas: dict[str, tuple[Encoded, Anchor]] = {}  # by anchor hash, to `_deltas_to`
        self._deltas_to: torch.Tensor | None = None  # the committed value they lead to
        self._deltas_lock = threading.Lock()

    def plan(self, committed: FragmentSnapshot | None, base_version: int | None, learner_id: str = "",
             anchor_hash: str = "", exact: bool = False) -> PullPlan:
        """What takes the caller from what it holds to the committed value; `exact`: to its
        bits (a learner ending its run), so never a delta. Needs no lock: the committed record
        and the served anchors are immutable."""
        if committed is None:
            raise Refusal("unseeded", "FAILED_PRECONDITION", f"fragment {self.fragment.id} has not been seeded yet")
        if base_version is not None and base_version > committed.version:
            raise ahead(self.fragment.id, committed.version, base_version)
        if is_legacy_hash(anchor_hash):
            raise Refusal("legacy_state_hash", "FAILED_PRECONDITION",
                          f"fragment {self.fragment.id}: the pull names its anchor by a {LEGACY_HASH_NAME}, this shard "
                          f"hashes values with {HASH_NAME}: the learner runs an older diloco; run one version "
                          "across the cluster")
        if base_version is None and self.served.tracks(learner_id):
            return self._snapshot_for(learner_id, committed)
        if base_version is None or not anchor_hash or not self.served.tracks(learner_id):
            return self._chain_or_snapshot(committed, base_version)
        anchor = self.served.held(learner_id, base_version, anchor_hash)
        if base_version == committed.version and (anchor is not None or anchor_hash == committed.state_hash):
            if anchor is None:  # on the lineage, as a learner holding the seed at version 0 is
                self._record(learner_id, _lineage(committed), committed)
            return PullPlan(False, (), anchor_hash, "nothing")
        if anchor is None:  # the shard restarted, a reply was lost, or another learner's value
            return self._snapshot_for(learner_id, committed)
        if anchor.on_lineage and base_version == committed.version - 1 and committed.history \
                and committed.history[-1].version == committed.version:
            self._record(learner_id, _lineage(committed), committed)  # the shared update: the shards' bits
            return PullPlan(False, (committed.history[-1],), committed.state_hash, "lineage_update")
        if exact:  # the updates since, on the lineage and within the history, else a snapshot
            if not anchor.on_lineage:
                return self._snapshot_for(learner_id, committed)
            self._record(learner_id, _lineage(committed), committed)
            return self._chain_or_snapshot(committed, base_version)
        delta = self._shared_delta(committed, anchor)
        if delta is None:  # its value was dropped (syncer.kept_anchors, no disk) and no pull from it encoded one
            if not anchor.on_lineage:
                return dataclasses.replace(self._snapshot_for(learner_id, committed), anchor_value_dropped=True)
            self._record(learner_id, _lineage(committed), committed)  # the updates since: the shards' bits
            return dataclasses.replace(self._chain_or_snapshot(committed, base_version), anchor_value_dropped=True)
        item, received, encoded = delta
        self._record(learner_id, received, committed)
        return PullPlan(False, (item,), received.state_hash, "delta_encoded" if encoded else "delta_reused")

    def _record(self, learner_id: str, anchor: Anchor, committed: FragmentSnapshot) -> None:
        """Records the learner's anchor. The deltas go that no learner's newest anchor is the
        source of any longer, or that led to a value the served anchors dropped; one whose value
        went to the disk stays without it. A delta from a dropped value stays: learners that
        hold those bits still share it."""
        out = self.served.record(learner_id, anchor, committed.value, committed.version)
        sources = {held.state_hash for held in self.served.records().values()}
        with self._deltas_lock:
            deltas = {}
            for source, (item, result) in self._deltas.items():
                if result.state_hash in out:
                    if not self.served.retrievable(result.state_hash):
                        continue
                    result = dataclasses.replace(result, value=None)  # on the disk: the delta stays, not the value
                if source in sources:
                    deltas[source] = (item, result)
            self._deltas = deltas

    def _shared_delta(self, committed: FragmentSnapshot, anchor: Anchor) -> tuple[Encoded, Anchor, bool] | None:
        """The delta from `anchor` to the committed value, encoded by the first pull that asks
        for it since the value was committed (pulls of the same pair wait for it); True when
        this call encoded it. None when nobody did and the anchor's value was dropped."""
        with self._deltas_lock:
            if self._deltas_to is not committed.value:
                self._deltas, self._deltas_to = {}, committed.value
            cached = self._deltas.get(anchor.state_hash)
            if cached is not None:
                return (*cached, False)
            held = self.served.value(anchor)  # from the disk where it left memory
            if held is None:
                return None
            self._deltas[anchor.state_hash] = self._delta(committed, held)
            return (*self._deltas[anchor.state_hash], True)

    def _delta(self, committed: FragmentSnapshot, held: torch.Tensor) -> tuple[Encoded, Anchor]:
        """One encoded delta from the value a learner holds to the committed value, and what
        the learner holds after adding it (the same apply_update it uses: the same bits)."""
        asked = committed.value - held
        payload = self.codec.encode(asked, self.block_size)
        decoded = self.codec.decode(payload, self.fragment.numel, self.block_size)
        value = apply_update(held, decoded, out=torch.empty_like(held))
        asked_rms = float(asked.norm())
        offset = float(asked.sub_(decoded).norm()) / asked_rms if asked_rms > 0 else 0.0
        item = Encoded(committed.version, describe(self.codec, self.fragment.numel, payload, self.block_size), payload)
        return item, Anchor(committed.version, value, state_hash(value), False, offset)

    def _chain_or_snapshot(self, committed: FragmentSnapshot, base_version: int | None) -> PullPlan:
        """The updates (base_version, version], or one fp32 snapshot if base_version is None
        or older than the history reaches."""
        if base_version is not None and base_version >= committed.version - len(committed.history):
            updates = tuple(u for u in committed.history if u.version > base_version)
            return PullPlan(False, updates, committed.state_hash, "updates")
        return PullPlan(True, (self._snapshot(committed),), committed.state_hash, "snapshot")

    def _snapshot_for(self, learner_id: str, committed: FragmentSnapshot) -> PullPlan:
        self._record(learner_id, _lineage(committed), committed)
        return PullPlan(True, (self._snapshot(committed),), committed.state_hash, "snapshot")

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


def _lineage(committed: FragmentSnapshot) -> Anchor:
    """The committed value itself as a learner's anchor (no copy)."""
    return Anchor(committed.version, committed.value, committed.state_hash, True, 0.0)
