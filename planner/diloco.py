"""Decoupled DiLoCo in virtual time, its decisions made by the real cores.

Real: one syncer ShardCore (NullJournal, the virtual clock) owns every fragment and decides
what it does with each push (merged, stale, refused), when each round closes (every live
learner, or quorum then grace; leases expiring) and the versions; each learner's
LearnerSchedule decides when each fragment syncs, when its result is due, how long the
learner may wait for it, when the schedule holds, and when the run's token budget is spent.
Pushes are a real push header and payload chunks of one-element fragments with the learner's
real metadata (base version, c_steps, c_tokens, step time); heartbeats are real calls.

Modelled: time and bytes. A step takes the learner's step time; a push or pull takes its bytes
(the codec's size of a fragment of the real model) over the learner's region link, one
transfer at a time in each direction, plus the link's latency; a round close takes the
fragment's parameters at the syncer's round-close throughput. A learner's process takes its
start-up time before it joins, and each step its loop's other work (step_overhead_seconds). Its
heartbeats keep their own time, every heartbeat_seconds from a moment of the first interval
drawn from the seed, not from a step's start (the real learner's thread is not timed to its
steps). A learner that fails ends its Attend call (the shard stops waiting for it at once)
and loses the steps its fragments have not delivered, or those since its last checkpoint, and
the step in progress; after its repair and start-up it rejoins with a new incarnation and
pulls the whole model (fp32) before it trains again. A shard that is down fails its
fragments' pushes and pulls at once (those syncs are skipped, as a learner skips a sync to a
shard it cannot reach), and a learner (re)joining waits until every shard is back. A learner
of several slices trains on without a failed one, on fewer tokens per step; where that is its
leader slice, another takes the lead: the learner loses what a failed one loses and restores
as a restarted one does, without a repair or a start-up (planner/island.py).

Each job has a module: a learner's state (learner_model.py), its training and syncs
(training.py), failures, repairs and restarts (restarts.py), where the time went
(accounting.py), the syncer's side (syncer_model.py); DilocoRun wires them on one event queue.
"""
from __future__ import annotations

import math
from typing import Callable

from diloco.planner.accounting import RunAccounts
from diloco.planner.events import EventQueue, VirtualClock
from diloco.planner.failures import FailureModel
from diloco.planner.inputs import PlanInputs
from diloco.planner.learner_model import Learner
from diloco.planner.outcome import Ledger, PlanResult
from diloco.planner.restarts import Restarts
from diloco.planner.syncer_model import FP32, FRAGMENT_NUMEL, SyncerModel
from diloco.planner.training import Training
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import Config, parse_config
from diloco.services.contract.fragments import plan_for_config


def core_config(inputs: PlanInputs) -> Config:
    """The cluster config the cores run under: the plan's sync and syncer sections, fp32
    one-element fragments (their bytes are modelled), no step budget (the run's length is the
    plan's)."""
    m = inputs.num_learners
    return parse_config({
        "shards": [{"address": "127.0.0.1:1", "metrics_port": 0}],
        "learners": [{"id": f"learner-{i}", "region": inputs.region(i), "metrics_port": 0}
                     for i in range(m)],
        "sync": {**inputs.sync.model_dump(mode="json"), "codec": "fp32"},
        "syncer": {**inputs.syncer.model_dump(mode="json"), "max_tokens_per_step": inputs.learner_tokens_per_step()},
        "trainer": {"max_steps": 1 << 40, "heartbeat_seconds": inputs.heartbeat_seconds,
                    "max_run_tokens": inputs.target_tokens},
    }, source="planner core config")


class DilocoRun:
    def __init__(self, inputs: PlanInputs, failures: FailureModel):
        self.inputs = inputs
        self.clock = VirtualClock()
        self.queue = EventQueue(self.clock)
        cfg = core_config(inputs)
        manifest = [(f"fragment.{i}", (FRAGMENT_NUMEL,)) for i in range(inputs.sync.fragments)]
        self.plan = plan_for_config(cfg, manifest)
        ledger = Ledger()
        self.learners = [Learner(i, inputs, self.clock, ledger) for i in range(inputs.num_learners)]
        self.accounts = RunAccounts(inputs, self.clock, ledger, self.learners)
        codec = get_codec(inputs.sync.codec)
        numel = math.ceil(inputs.model_parameters / inputs.sync.fragments)  # balanced fragments
        # The syncer answers pulls down the learners' links, which their training (below) owns.
        self.syncer = SyncerModel(inputs, cfg, self.clock, self.queue, self.learners,
                                  lambda learner, fid, answer: self.training.answer_pull(learner, fid, answer),
                                  close_seconds=numel / inputs.syncer_params_per_second)
        self.core = self.syncer.core
        self.training = Training(inputs, cfg, self.plan, self.clock, self.queue, self.syncer, self.accounts,
                                 update_bytes=codec.encoded_size(numel, inputs.sync.codec_block_size))
        self.restarts = Restarts(inputs, self.clock, self.queue, self.learners, self.syncer, self.training,
                                 self.accounts, failures.changes(), manifest,
                                 snapshot_bytes=FP32.encoded_size(numel, inputs.sync.codec_block_size))

    def run(self, progress: Callable[[float], None]) -> PlanResult:
        self.restarts.begin([f.id for f in self.plan.fragments])
        for outage in self.inputs.shard_outages:
            self.queue.at(outage.at_seconds, lambda shard=outage.shard: self.syncer.shard_failed(shard))
        self.queue.run(self.inputs.duration_seconds, self._over, progress)
        return self.accounts.result(self.syncer)

    def _over(self) -> bool:
        """A budget run is over once no learner is training and none has yet to finish."""
        return (self.inputs.target_tokens is not None and any(l.phase == "finished" for l in self.learners)
                and not any(l.phase in ("training", "restore", "failover") for l in self.learners))


def simulate_diloco(inputs: PlanInputs, failures: FailureModel, progress: Callable[[float], None]) -> PlanResult:
    return DilocoRun(inputs, failures).run(progress)
