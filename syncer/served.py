"""The anchors a fragment served its learners: per learner of the config, the exact value its
last pull left it holding, so the next pull can be one delta from it (docs/protocol.md, "The
downlink"). Not durable: after a restart a learner's next pull is a snapshot.

The values in memory are bounded whatever the number of learners: besides the committed value
(the shard's own) and the lineage's value one version before it, at most `kept` of them per
fragment. Values only a learner's anchor before its newest refers to go first (they serve only
a pull whose reply was lost), then values on the lineage (a learner anchored there still gets
exact updates), then the least recently served. A value that leaves memory while a learner's
newest anchor refers to it goes to the disk, where the shard has a folder for them
(syncer/anchor_spill.py), and stays there while one does; the others are dropped. A record
whose value was dropped keeps its version and hash; its learner's next pull is the updates
since, or a snapshot.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch

from diloco.syncer.anchor_spill import AnchorSpill


@dataclass(frozen=True)
class Anchor:
    """What a learner holds of a fragment after a pull."""
    version: int
    value: torch.Tensor | None  # fp32, never modified once served; None once out of memory (ServedAnchors)
    state_hash: str
    on_lineage: bool  # value is the shard's own committed value at `version`
    # rms of what the delta that made it left out, over rms of the delta asked for: how far
    # the anchor is from the shard's value, in units of the pull (0 on the lineage).
    offset: float


class ServedAnchors:
    """Per learner the last two anchors served: a pull whose answer the learner never took (a
    lost reply, a wait it gave up as it stopped) leaves it holding the one before. Only learners
    of the config have records, so they are bounded by the learners the run has (with mTLS a
    pull naming a learner needs its certificate: syncer/guard.py); their values in memory by
    `kept`, those on `spill`'s disk by the learners' number (newest anchors only)."""

    def __init__(self, learner_ids: Iterable[str], kept: int, spill: AnchorSpill | None = None):
        self._tracked = frozenset(learner_ids)
        self._kept = kept
        self._spill = spill
        self._anchors: dict[str, tuple[Anchor, ...]] = {}  # newest first
        self._values: OrderedDict[str, torch.Tensor] = OrderedDict()  # by hash, least recently served first
        self._writing: dict[str, torch.Tensor] = {}  # by hash: out of memory once on the disk
        self._on_disk: set[str] = set()
        self._lock = threading.Lock()  # pulls of different learners run at once, without the fragment's lock

    def tracks(self, learner_id: str) -> bool:
        return learner_id in self._tracked

    def held(self, learner_id: str, version: int, anchor_hash: str) -> Anchor | None:
        """The record of what the learner holds, if the shard served it that."""
        with self._lock:
            anchors = self._anchors.get(learner_id, ())
        return next((a for a in anchors if (a.version, a.state_hash) == (version, anchor_hash)), None)

    def value(self, anchor: Anchor) -> torch.Tensor | None:
        """The anchor's value: in memory, or read back from the disk; None once dropped."""
        if anchor.value is not None:
            return anchor.value
        with self._lock:
            writing = self._writing.get(anchor.state_hash)
            on_disk = anchor.state_hash in self._on_disk
        if writing is not None or not on_disk:
            return writing
        return self._spill.read(anchor.state_hash)

    def record(self, learner_id: str, anchor: Anchor, own: torch.Tensor, own_version: int) -> frozenset[str]:
        """Records what the learner holds now; takes the values beyond `kept` besides `own`
        (the committed value, at `own_version`) and the lineage's value one version before it
        out of memory, to the disk or dropped, and returns their hashes. The value one version
        back stays while a learner holds it: such a learner pulls the shared update, and in
        rounds every learner contributes to, all of them do, so writing it would be wasted."""
        if learner_id not in self._tracked:
            return frozenset()
        with self._lock:
            newest = self._anchors.get(learner_id, ())[:1]
            self._anchors[learner_id] = (anchor, *(a for a in newest if a.state_hash != anchor.state_hash))
            if anchor.value is not None:
                self._values[anchor.state_hash] = anchor.value
                self._values.move_to_end(anchor.state_hash)
            out, to_disk = self._beyond_kept(own, own_version)
            self._writing.update(to_disk)
        for state_hash, value in to_disk.items():  # without the lock: other pulls go on meanwhile
            written = self._spill.write(state_hash, value)
            with self._lock:
                del self._writing[state_hash]
                if written:
                    self._on_disk.add(state_hash)
        if to_disk:  # a learner may have moved off a value while it was written
            self._forget_unreferenced()
        return out

    def records(self) -> dict[str, Anchor]:
        """The newest anchor served to each learner."""
        with self._lock:
            return {learner_id: anchors[0] for learner_id, anchors in self._anchors.items()}

    def retrievable(self, state_hash: str) -> bool:
        """Whether the value of that hash is in memory or on the disk."""
        with self._lock:
            return state_hash in self._values or state_hash in self._writing or state_hash in self._on_disk

    def values_kept(self, own: torch.Tensor) -> int:
        """How many values the records keep besides `own`."""
        with self._lock:
            return sum(value is not own for value in self._values.values())

    def _beyond_kept(self, own: torch.Tensor, own_version: int) -> tuple[frozenset[str], dict[str, torch.Tensor]]:
        """Takes the values beyond `kept` out of memory (under the lock): their hashes, and
        those of them a newest anchor refers to and the disk does not hold yet, to write there."""
        self._forget_unreferenced_locked()
        every = [a for held in self._anchors.values() for a in held]
        newest = {held[0].state_hash for held in self._anchors.values()}
        lineage = {a.state_hash for a in every if a.on_lineage}
        one_back = {a.state_hash for a in every if a.on_lineage and a.version == own_version - 1}
        extra = sorted((h for h, value in self._values.items() if value is not own and h not in one_back),
                       key=lambda h: (h in newest, h not in lineage))  # stable: least recently served first
        out = frozenset(extra[:max(0, len(extra) - self._kept)])
        if not out:
            return out, {}
        for learner_id, anchors in self._anchors.items():
            self._anchors[learner_id] = tuple(dataclasses.replace(a, value=None) if a.state_hash in out
                                              else a for a in anchors)
        to_disk = {h: self._values[h] for h in out
                   if self._spill is not None and h in newest and h not in self._on_disk and h not in self._writing}
        for gone in out:
            del self._values[gone]
        return out, to_disk

    def _forget_unreferenced(self) -> None:
        with self._lock:
            self._forget_unreferenced_locked()

    def _forget_unreferenced_locked(self) -> None:
        """Lets go of the values no anchor refers to any longer in memory, and on disk of those
        no newest anchor refers to (a pull from the one before, after a lost reply, is rare)."""
        in_memory = {a.state_hash for anchors in self._anchors.values() for a in anchors if a.value is not None}
        for gone in [h for h in self._values if h not in in_memory]:
            del self._values[gone]
        newest = {anchors[0].state_hash for anchors in self._anchors.values()}
        for gone in self._on_disk - newest:
            self._spill.delete(gone)
            self._on_disk.discard(gone)
