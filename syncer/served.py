"""The anchors a fragment served its learners: per learner of the config, the exact value its
last pull left it holding, so the next pull can be one delta from it (docs/protocol.md, "The
downlink"). Not durable: after a restart a learner's next pull is a snapshot.

The values are bounded whatever the number of learners: besides the committed value (the
shard's own), at most `kept` of them per fragment. Values only a learner's anchor before its
newest refers to go first (they serve only a pull whose reply was lost), then values on the
lineage (a learner anchored there still gets exact updates), then the least recently served.
A record whose value was dropped keeps its version and hash; its learner's next pull is the
updates since, or a snapshot.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class Anchor:
    """What a learner holds of a fragment after a pull."""
    version: int
    value: torch.Tensor | None  # fp32, never modified once served; None once dropped (ServedAnchors)
    state_hash: str
    on_lineage: bool  # value is the shard's own committed value at `version`
    # rms of what the delta that made it left out, over rms of the delta asked for: how far
    # the anchor is from the shard's value, in units of the pull (0 on the lineage).
    offset: float


class ServedAnchors:
    """Per learner the last two anchors served: a pull whose answer the learner never took (a
    lost reply, a wait it gave up as it stopped) leaves it holding the one before. Only learners
    of the config have records, so they are bounded by the learners the run has (with mTLS a
    pull naming a learner needs its certificate: syncer/guard.py); their values by `kept`."""

    def __init__(self, learner_ids: Iterable[str], kept: int):
        self._tracked = frozenset(learner_ids)
        self._kept = kept
        self._anchors: dict[str, tuple[Anchor, ...]] = {}  # newest first
        self._values: OrderedDict[str, torch.Tensor] = OrderedDict()  # by hash, least recently served first
        self._lock = threading.Lock()  # pulls of different learners run at once, without the fragment's lock

    def tracks(self, learner_id: str) -> bool:
        return learner_id in self._tracked

    def held(self, learner_id: str, version: int, anchor_hash: str) -> Anchor | None:
        """The record of what the learner holds, if the shard served it that."""
        with self._lock:
            anchors = self._anchors.get(learner_id, ())
        return next((a for a in anchors if (a.version, a.state_hash) == (version, anchor_hash)), None)

    def record(self, learner_id: str, anchor: Anchor, own: torch.Tensor) -> frozenset[str]:
        """Records what the learner holds now; drops the values beyond `kept` besides `own`
        (the committed value) and returns their hashes."""
        if learner_id not in self._tracked:
            return frozenset()
        with self._lock:
            newest = self._anchors.get(learner_id, ())[:1]
            self._anchors[learner_id] = (anchor, *(a for a in newest if a.state_hash != anchor.state_hash))
            if anchor.value is not None:
                self._values[anchor.state_hash] = anchor.value
                self._values.move_to_end(anchor.state_hash)
            return self._drop_beyond_kept(own)

    def records(self) -> dict[str, Anchor]:
        """The newest anchor served to each learner."""
        with self._lock:
            return {learner_id: anchors[0] for learner_id, anchors in self._anchors.items()}

    def values_kept(self, own: torch.Tensor) -> int:
        """How many values the records keep besides `own`."""
        with self._lock:
            return sum(value is not own for value in self._values.values())

    def _drop_beyond_kept(self, own: torch.Tensor) -> frozenset[str]:
        referenced = {a.state_hash for anchors in self._anchors.values() for a in anchors if a.value is not None}
        for gone in [h for h in self._values if h not in referenced]:
            del self._values[gone]
        newest = {anchors[0].state_hash for anchors in self._anchors.values()}
        lineage = {a.state_hash for anchors in self._anchors.values() for a in anchors if a.on_lineage}
        extra = sorted((h for h, value in self._values.items() if value is not own),
                       key=lambda h: (h in newest, h not in lineage))  # stable: least recently served first
        dropped = frozenset(extra[:max(0, len(extra) - self._kept)])
        if dropped:
            for learner_id, anchors in self._anchors.items():
                self._anchors[learner_id] = tuple(dataclasses.replace(a, value=None) if a.state_hash in dropped
                                                  else a for a in anchors)
            for gone in dropped:
                del self._values[gone]
        return dropped
