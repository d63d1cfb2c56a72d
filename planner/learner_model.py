"""The learner side of a Decoupled DiLoCo plan: what the planner keeps of each learner unit (its
real LearnerSchedule, its island, its links to the syncer, its counts), on which
planner/training.py and planner/restarts.py act; planner/diloco.py says what is real and what
is modelled.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from diloco.learner.sync.schedule import LearnerSchedule
from diloco.planner.events import VirtualClock
from diloco.planner.inputs import PlanInputs
from diloco.planner.island import STATE_BYTES_PER_PARAMETER, Island
from diloco.planner.outcome import Ledger

PEAK_WINDOW_SECONDS = 60.0


class Link:
    """One learner's link to the syncer in one direction: transfers one at a time."""

    def __init__(self, mbps: float, latency_seconds: float):
        self.bytes_per_second = mbps * 1e6 / 8
        self.latency_seconds = latency_seconds
        self.free_at = 0.0
        self.bytes_total = 0
        self.bytes_by_window: Counter[int] = Counter()  # bytes moved in each minute

    def send(self, now: float, nbytes: int) -> float:
        """Queues a transfer; returns when its last byte has arrived."""
        start = max(now, self.free_at)
        end = self.free_at = start + nbytes / self.bytes_per_second
        self.bytes_total += nbytes
        window = int(start // PEAK_WINDOW_SECONDS)
        while end > start and window * PEAK_WINDOW_SECONDS < end:  # spread over the windows it spans
            overlap = min(end, (window + 1) * PEAK_WINDOW_SECONDS) - max(start, window * PEAK_WINDOW_SECONDS)
            self.bytes_by_window[window] += nbytes * overlap / (end - start)
            window += 1
        return end + self.latency_seconds


@dataclass(frozen=True)
class Result:
    """A sync's answer as it reaches the learner."""
    version: int
    applied: bool  # a new global value (False: the push was refused for another reason than staleness)


class Learner:
    """One learner unit: its schedule (the real one) and what the simulation tracks around it."""

    def __init__(self, index: int, inputs: PlanInputs, clock: VirtualClock, ledger: Ledger):
        self.index = index
        self.id = f"learner-{index}"
        self.step_seconds = inputs.learner_step_seconds(index)
        self.overhead_seconds = inputs.learner_step_overhead_seconds(index)  # per step, not kept
        self.push_overhead_seconds = inputs.learner_push_overhead_seconds(index)
        self.startup_seconds = inputs.learner_startup_seconds(index)
        self.tokens_per_step = inputs.learner_tokens_per_step()  # every slice training
        transfer = inputs.model_parameters * STATE_BYTES_PER_PARAMETER * 8 / (inputs.island_gbps * 1e9)
        self.island = Island(inputs.slices_per_learner, clock, ledger, inputs.island_reconfigure_seconds,
                             self.startup_seconds, transfer, inputs.island_leader_loss == "failover")
        self.region = inputs.region(index)
        link = inputs.link(index)
        self.up = Link(link.up_mbps, link.latency_ms / 1000)
        self.down = Link(link.down_mbps, link.latency_ms / 1000)
        # A learner's heartbeat thread keeps its own time, not its steps' (learner/sync/session.py):
        # each start of its heartbeats is at a moment drawn from this, the same for a seed.
        self.heartbeat_phases = random.Random(f"{inputs.seed}/heartbeats/{index}")
        self.incarnation = 0
        self.attendance = 0  # its Attend call on the shard, which ends when it fails
        self.life = 0  # bumped by every failure and rejoin: events of an earlier life are void
        # startup (its process), restore (pulling the model), training, failover (its island's new
        # leader restores: the island books it), down, finished
        self.phase = "startup"
        self.phase_since = 0.0
        self.steps = self.tokens = 0
        self.checkpointed_steps = self.checkpointed_tokens = 0  # as of its last checkpoint (checkpoint_steps)
        self.checkpointed_held: dict[int, int] | None = None  # the versions that checkpoint holds
        self.lost_seconds = 0.0
        self.schedule: LearnerSchedule | None = None
        self.held: dict[int, int] = {}  # fragment -> version of the global value it holds
        self.delivered_tokens: dict[int, int] = {}  # fragment -> c_tokens merged, not yet applied
        self.results: dict[int, Result] = {}  # arrived, waiting for their apply step
        self.to_apply: list[int] = []  # fragments due at the last step, in order
        self.blocked_since: float | None = None
        self.blocks = 0  # waits begun: a wait's time limit ends only its own wait
        self.aborts = 0  # steps aborted by a reconfiguration of its island: their end is void
        self.last_step_end = 0.0  # or the end of the evaluation or checkpoint after it
        self.after_step = 0.0  # the loop's work after the last step: bookkeeping, an evaluation, a checkpoint

    @property
    def training(self) -> bool:
        return self.phase == "training"

    def step_tokens(self) -> int:
        """The tokens of one step: the training slices' share of its batch."""
        return self.tokens_per_step * len(self.island.training) // self.island.slices

    def full_steps(self, tokens: int) -> float:
        """How many steps of all its slices these tokens are: the compute they cost, in steps."""
        return tokens / self.tokens_per_step
