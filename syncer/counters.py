"""Every decision the shard makes, counted.

Plain names and numbers, shared by the gRPC service (Status.counters), the tests and a
simulator; the metrics exporter turns `family.label` into `diloco_syncer_<family>_total
{label}`. They count since the process started, like any Prometheus counter: a restarted shard
starts from zero (what survives a restart is the state itself, see store.py).

Families: contributions.<result> (accepted, stale_merged, refused_stale, refused: any other
refusal of an outer gradient once its header is read but a duplicate's, restored, clamped:
restored with its claims brought into range), seeds, fragments.restored (a RESTORE taken),
refusals.<reason>, rounds.<close reason>, learners.<event> (joined, rejoined, left, expired),
outliers.<learner id> (its pushes refused as outliers: syncer/outliers.py), revoked.<learner
id> (its calls refused: its certificate is revoked), kept_compute_seconds, journal_bytes
(written to the state folder), snapshots (full writes of a fragment's state), replayed_rounds
(closed again from the log at a restart), pulls.<answer> (syncer/pull.py's PULL_ANSWERS: what
encoding work the downlink cost), pull_bytes.<answer> (their payload bytes: where the downlink
goes), anchor_values_missed (pulls from an anchor whose value was dropped, syncer.spill_anchors:
the updates since or a snapshot where one delta would have done), anchor_values_spilled and
anchor_spill_bytes (anchors' values written to the state folder as they left memory),
anchor_values_loaded (read back from it for a pull: syncer/anchor_spill.py), memory_releases
(an idle shard gave the memory of its last rounds back: syncer/memory.py).
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Iterator

from diloco.syncer.refusal import Refusal


class Counters:
    def __init__(self):
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(int)

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    @contextlib.contextmanager
    def counting_refusals(self) -> Iterator[None]:
        """Counts a Refusal on its way out to the caller, under refusals.<reason>."""
        try:
            yield
        except Refusal as refusal:
            self.add(f"refusals.{refusal.reason}")
            raise
