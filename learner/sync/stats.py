"""The counters a learner's sync reports (metrics, final report)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from diloco.services.contract.wire import pb

log = logging.getLogger(__name__)

# Waits for a result at least this long are recorded one by one (when, which fragment, how
# long), so a run's blocked time can be laid beside its failures; shorter ones only add up.
RECORDED_WAIT_SECONDS = 0.1
RECORDED_WAITS = 500  # per incarnation: the report stays small however long the run


@dataclass
class SyncOutcome:
    """What one background push + pull (or re-anchoring) brought back."""
    anchor: torch.Tensor | None  # the new global value, None when there is none to apply
    version: int
    push_result: int = pb.PUSH_RESULT_UNSPECIFIED
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    push_seconds: float | None = None  # from the push's start until the shard held it; None: no push got through
    # From the shard holding the push until the round's result was back, less the result's own
    # transfer (taken to be the push's): how long the push waited in its round for the others'
    # (0 for a push refused as stale, whose pull is a re-anchoring snapshot).
    early_seconds: float = 0.0
    reanchored: bool = False  # the anchor is the shard's value after it lost the one we held
    staged: torch.Tensor | None = None  # the anchor in pinned memory (a model on a GPU): copied there without a wait


@dataclass
class SyncStats:
    """Counters the learner reports. The training thread updates most of them; what other
    threads count goes through `count` (one lock)."""
    syncs_started: int = 0
    syncs_applied: int = 0
    syncs_skipped: int = 0  # shard unreachable: progress kept for the next sync
    syncs_late: int = 0  # applied after the loop stopped waiting for them
    held_steps: int = 0  # steps the sync schedule stood still to fall back into phase
    rephased: int = 0  # times the schedule took the others' phase again after standing still
    refused_stale: int = 0
    syncs_refused: int = 0  # pushes the shard refused with an error (not "unreachable", not "rejoin")
    blocked_seconds: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    exact_end_bytes: int = 0  # of bytes_down: the snapshots taken at the end for the shards' exact bits
    transfer_seconds: float = 0.0  # time pushes and pulls spent on the wire
    pushes: int = 0  # outer gradients the shards held
    push_seconds: float = 0.0  # summed over them: from the push's start until the shard held it
    versions_behind_at_join: int = 0
    reanchored: int = 0  # fragments taken from a shard that served them below our version
    hash_mismatches: int = 0  # pulls whose result did not have the shard's hash: pulled again whole
    heals: int = 0  # times the learner was sick and took the global model back (learner/sync/healing.py)
    # A GPU learner's syncs, across PCIe: outer gradients' payloads (and late results' snapshots)
    # to the host, global values to the device.
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0
    push_results: dict[str, int] = field(default_factory=dict)
    undelivered: dict[int, str] = field(default_factory=dict)  # fragment: why its last push never got through
    waits: list[list] = field(default_factory=list)  # [unix time it began, fragment, seconds, result in], the long ones
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def waited(self, fragment_id: int, seconds: float, result_in: bool) -> None:
        """The training thread waited `seconds` for the fragment's result, just now."""
        self.blocked_seconds += seconds
        if seconds >= RECORDED_WAIT_SECONDS and len(self.waits) < RECORDED_WAITS:
            self.waits.append([round(time.time() - seconds, 3), fragment_id, round(seconds, 3), result_in])

    def counted_pull(self, pull: Callable[[], tuple]) -> tuple:
        """Runs a pull outside a sync (at start, catching up, the final values) and counts its
        bytes and seconds, as a sync's own are: the link's measured rate is bytes over both."""
        started = time.perf_counter()
        answer = pull()
        self.transfer_seconds += time.perf_counter() - started
        self.bytes_down += answer[0].payload_bytes
        return answer

    def copied_to_host(self, nbytes: int) -> None:
        """A copy from the device (the sync threads' and the training thread's)."""
        with self._lock:
            self.device_to_host_bytes += nbytes

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def reanchored_fragment(self, fragment_id: int, ours: int, theirs: int) -> None:
        self.count("reanchored")
        log.warning("fragment %d: re-anchored from version %d to the shard's version %d", fragment_id, ours, theirs)

    def took(self, outcome: SyncOutcome) -> None:
        """A finished sync's transfers and the shard's answer to its push."""
        self.bytes_up += outcome.bytes_up
        self.bytes_down += outcome.bytes_down
        self.transfer_seconds += outcome.seconds
        if outcome.push_seconds is not None:
            self.pushes += 1
            self.push_seconds += outcome.push_seconds
        if not outcome.reanchored:
            name = pb.PushResult.Name(outcome.push_result)
            self.push_results[name] = self.push_results.get(name, 0) + 1
