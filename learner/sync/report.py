"""What a learner did, across its incarnations, as JSON for `diloco sim` and people.

Each incarnation (process start) has a record; the records ride along in the learner's state
(DecoupledDiLoCo.state_dict), so a restarted learner's report still shows the lives before it.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

from diloco.learner.sync.streaming import StreamingSync
from diloco.services.process import LIFE_STARTED_ENV
from diloco.services.files import atomic_write

log = logging.getLogger(__name__)


class Report:
    def __init__(self, path: pathlib.Path, learner_id: str, region: str, restored: dict | None, parameters: int):
        self.path = path
        self.learner_id = learner_id
        self.region = region
        self.parameters = parameters  # of the model, each synced (tied) tensor once
        saved = restored or {}
        self.evaluations: list[list[float]] = saved.get("evaluations", [])  # [unix time, step, tokens, loss]
        # The same of the global model it held then (`diloco learner --eval-global`).
        self.global_evaluations: list[list[float]] = saved.get("global_evaluations", [])
        self.incarnations: list[dict] = saved.get("incarnations", [])
        self.island_checks = 0  # rank-equality checks passed (diloco learner --verify-island)
        self.island: dict | None = None  # an island of replica groups: its groups' changes
        self.current: dict = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="report")
        self._written: Future | None = None

    def persistent(self) -> dict:
        return {"evaluations": self.evaluations, "global_evaluations": self.global_evaluations,
                "incarnations": self.incarnations}

    def begin_incarnation(self, incarnation: int, restored_step: int, startup: float, restore: float,
                          behind: int) -> None:
        now = time.time()
        self.current = {"incarnation": incarnation, "started": now, "recorded_at": now, "restored_step": restored_step,
                        "startup_seconds": startup, "restore_seconds": restore,
                        "versions_behind_at_join": behind, "steps": 0, "compute_seconds": 0.0,
                        "loop_seconds": 0.0, "evaluation_seconds": 0.0, "checkpoint_seconds": 0.0,
                        "regroup_seconds": 0.0, "wan_seconds": 0.0, "wan_overlap_seconds": 0.0}
        self.incarnations.append(self.current)

    def spent(self, category: str, seconds: float) -> None:
        """Training-time work besides steps: category "evaluation", "checkpoint" or "regroup"
        (an island regrouping; badput restore, apart from the life's own join and pull)."""
        self.current[f"{category}_seconds"] += seconds

    def waited_for_wan(self, seconds: float, overlap_seconds: float) -> None:
        """Data parallel behind an emulated link (learner/trainer/wan_allreduce.py): a step
        waited `seconds` for its all-reduce (not compute: badput blocked), whose buckets
        overlapped its backward pass for `overlap_seconds`."""
        self.current["wan_seconds"] += seconds
        self.current["wan_overlap_seconds"] += overlap_seconds

    def step(self, compute_seconds: float, loop_seconds: float) -> None:
        self.current["steps"] += 1
        self.current["compute_seconds"] += compute_seconds
        self.current["loop_seconds"] += loop_seconds

    def training_ended(self) -> None:
        """Training ended: its budget is spent, or it was stopped and its syncs are flushed.
        The learner's provisioned time ends here; catching up and the last evaluation follow."""
        self.current["training_ended_at"] = time.time()

    def evaluation(self, step: int, tokens: int, loss: float, global_loss: float | None = None) -> None:
        """The validation loss of the learner's model and (given) of the global model it holds."""
        now = time.time()
        self.evaluations.append([now, step, tokens, loss])
        if global_loss is None:
            log.info("learner %s step %d: validation loss %.4f", self.learner_id, step, loss)
            return
        self.global_evaluations.append([now, step, tokens, global_loss])
        log.info("learner %s step %d: validation loss %.4f, of the global model it holds %.4f", self.learner_id,
                 step, loss, global_loss)

    def update(self, sync: StreamingSync | None) -> None:
        """Copies the sync counters of this incarnation into its record. `recorded_at`: what a
        kill after this write destroys is from then on (diloco sim counts it as lost)."""
        self.current["recorded_at"] = time.time()
        if sync:
            stats = sync.stats
            self.current.update(
                blocked_seconds=stats.blocked_seconds, bytes_up=stats.bytes_up, bytes_down=stats.bytes_down,
                exact_end_bytes=stats.exact_end_bytes, transfer_seconds=stats.transfer_seconds,
                pushes=stats.pushes, push_seconds=stats.push_seconds,
                syncs_started=stats.syncs_started,
                syncs_applied=stats.syncs_applied, syncs_skipped=stats.syncs_skipped,
                syncs_late=stats.syncs_late, held_steps=stats.held_steps, rephased=stats.rephased, refused_stale=stats.refused_stale,
                reanchored=stats.reanchored, syncs_refused=stats.syncs_refused,
                hash_mismatches=stats.hash_mismatches, heals=stats.heals,
                undelivered={str(fid): why for fid, why in stats.undelivered.items()}, waits=list(stats.waits))

    def write(self, phase: str, steps: int, tokens: int, world_size: int, sync: StreamingSync | None,
              background: bool = False) -> None:
        """phase: "training", "catching_up" (budget spent) or "done"; `tokens`: the whole
        island's. The record is taken now; `background`: the file is written (and synced) on
        the report's own thread, off the training thread's time. Writes land in order; a
        failed one is raised by the next write or by flush."""
        self.update(sync)
        body = {"learner_id": self.learner_id, "region": self.region, "phase": phase,
                "steps": steps, "tokens": tokens, "world_size": world_size, "parameters": self.parameters,
                "island_checks": self.island_checks,
                "evaluations": self.evaluations, "global_evaluations": self.global_evaluations,
                "incarnations": self.incarnations}
        if self.island:
            body["island"] = self.island
        if sync:
            body["fragments"] = {str(fid): {"version": v, "state_hash": h}
                                 for fid, (v, h) in sync.fragment_hashes().items()}
        encoded = json.dumps(body, indent=1).encode()
        self.flush()
        if background:
            self._written = self._writer.submit(atomic_write, self.path, encoded)
        else:
            atomic_write(self.path, encoded)

    def flush(self) -> None:
        """Returns once the last write is on disk."""
        written, self._written = self._written, None
        if written is not None:
            written.result()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown()


def process_started() -> float:
    """When this process started (or, in a warm standby, this life), on time.monotonic's clock.
    /proc/self/stat's start time is in clock ticks since boot, the clock CLOCK_BOOTTIME reads.
    (psutil's create_time adds the boot time of /proc/stat, which is whole seconds: a start-up
    measured with it was up to 1 s long.)"""
    if LIFE_STARTED_ENV in os.environ:
        return float(os.environ[LIFE_STARTED_ENV])
    fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22, starttime; the split began at field 3
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - age
