"""The anchors a fragment served its learners: per learner of the config, the exact value its
last pull left it holding, so the next pull can be one delta from it (docs/protocol.md, "The
downlink"). Not durable: after a restart a learner's next pull is a snapshot.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class Anchor:
    """What a learner holds of a fragment after a pull."""
    version: int
    value: torch.Tensor  # fp32, never modified once served
    state_hash: str
    on_lineage: bool  # value is the shard's own committed value at `version`
    # rms of what the delta that made it left out, over rms of the delta asked for: how far
    # the anchor is from the shard's value, in units of the pull (0 on the lineage).
    offset: float


class ServedAnchors:
    """Per learner the last two anchors served: a pull whose answer the learner never took (a
    lost reply, a wait it gave up as it stopped) leaves it holding the one before. Only learners
    of the config have records, so they are bounded by the learners the run has (with mTLS a
    pull naming a learner needs its certificate: syncer/guard.py)."""

    def __init__(self, learner_ids: Iterable[str]):
        self._tracked = frozenset(learner_ids)
        self._anchors: dict[str, tuple[Anchor, ...]] = {}  # newest first
        self._lock = threading.Lock()  # pulls of different learners run at once, without the fragment's lock

    def tracks(self, learner_id: str) -> bool:
        return learner_id in self._tracked

    def held(self, learner_id: str, version: int, anchor_hash: str) -> Anchor | None:
        """The record of what the learner holds, if the shard served it that."""
        with self._lock:
            anchors = self._anchors.get(learner_id, ())
        return next((a for a in anchors if (a.version, a.state_hash) == (version, anchor_hash)), None)

    def record(self, learner_id: str, anchor: Anchor) -> None:
        if learner_id in self._tracked:
            with self._lock:
                newest = self._anchors.get(learner_id, ())[:1]
                self._anchors[learner_id] = (anchor, *(a for a in newest if a.state_hash != anchor.state_hash))

    def records(self) -> dict[str, Anchor]:
        """The newest anchor served to each learner."""
        with self._lock:
            return {learner_id: anchors[0] for learner_id, anchors in self._anchors.items()}
