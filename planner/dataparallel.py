"""The data-parallel baselines, walked from one fleet change (a failure, a repair) to the next.
Their slices are the fleet's failure units: M x S (planner/failures.py).

- dp: every step needs every slice. A failure stops the whole job until every slice is up
  again (down, for every slice); the job then reloads its last checkpoint (restore) and the
  training since that checkpoint is done again (lost). A step takes the slowest slice's step
  time and, across regions, the gradient all-reduce over the WAN beyond the backward pass
  (planner/allreduce.py); what faster slices wait, and what every slice waits for the WAN, is
  blocked.
- elastic: a failure costs every slice that is up a reconfiguration pause (restore) and the step
  in progress (lost); the job goes on without the failed slice, at a smaller batch, and takes
  it back after its repair (another pause). The failed slice is down meanwhile.

Training is counted in steps of the slowest training slice; kept compute is each slice's own
step time per kept step (goodput, services/contract/goodput.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

from diloco.planner import allreduce
from diloco.planner.failures import FailureModel
from diloco.planner.inputs import PlanInputs
from diloco.planner.outcome import Bandwidth, Ledger, PlanResult, Uptime

Progress = Callable[[float], None]  # called with the virtual seconds reached, once per segment


@dataclass(frozen=True)
class Segment:
    """A stretch of the run in which no unit fails or comes back."""
    start: float
    end: float
    down: frozenset[int]
    changed: bool  # a unit failed or came back at `start`
    failed: bool  # a unit failed at `start`


def segments(failures: FailureModel, end: float) -> Iterator[Segment]:
    """The run cut at every fleet change before `end` (inf: endless)."""
    down: set[int] = set()
    start, changed, failed = 0.0, False, False
    for change in failures.changes():
        if change.at >= end:
            break
        if change.at > start:
            yield Segment(start, change.at, frozenset(down), changed, failed)
            start, changed, failed = change.at, False, False
        changed = True
        failed = failed or not change.up
        (down.discard if change.up else down.add)(change.unit)
    if end > start:
        yield Segment(start, end, frozenset(down), changed, failed)


def simulate_dp(inputs: PlanInputs, failures: FailureModel, progress: Progress) -> PlanResult:
    m = inputs.num_slices
    regions = allreduce.regions_of(inputs, range(m))
    step = allreduce.step_seconds(inputs, max(inputs.slice_step_seconds(u) for u in range(m)), regions)
    own_steps = sum(inputs.slice_step_seconds(u) for u in range(m))
    # The training time that trains the run's tokens; inf for a run of fixed wall time.
    needed = inputs.target_tokens / inputs.batch_tokens * step if inputs.target_tokens else math.inf
    checkpoint = inputs.checkpoint_minutes * 60
    ledger, uptime = Ledger(), Uptime()
    kept = since_checkpoint = restore_left = 0.0
    end, count = 0.0, 0
    for segment in segments(failures, inputs.duration_seconds):
        if segment.failed:
            count += 1
            ledger.add("lost", since_checkpoint * m)
            since_checkpoint, restore_left = 0.0, inputs.restore_minutes * 60
        end = segment.end
        if segment.down:
            ledger.add("down", (segment.end - segment.start) * m)
            progress(end)
            continue
        restore = min(restore_left, segment.end - segment.start)
        ledger.add("restore", restore * m)
        restore_left -= restore
        train = min(segment.end - segment.start - restore, needed - kept - since_checkpoint)
        uptime.training(segment.start + restore, True)
        since_checkpoint += train
        kept_now = math.floor(since_checkpoint / checkpoint) * checkpoint
        kept, since_checkpoint = kept + kept_now, since_checkpoint - kept_now
        end = segment.start + restore + train
        uptime.training(end, False)
        progress(end)
        if kept + since_checkpoint >= needed:
            break
    kept += since_checkpoint  # the run ends with a checkpoint
    steps = kept / step
    ledger.kept = steps * own_steps
    ledger.add("blocked", steps * (m * step - own_steps))
    ledger.provisioned = end * m
    return PlanResult("dp", inputs.chips, inputs.num_learners, end, ledger.goodput(), uptime.share(end),
                      round(steps * inputs.batch_tokens), inputs.batch_tokens / step, count,
                      wan_bandwidth(inputs, {len(regions): steps}, end), step_seconds=step,
                      slices=inputs.slices_per_learner)


def simulate_elastic(inputs: PlanInputs, failures: FailureModel, progress: Progress) -> PlanResult:
    m = inputs.num_slices
    units = frozenset(range(m))
    target = inputs.target_tokens or math.inf
    ledger, uptime = Ledger(), Uptime()
    tokens, pause_left, end, count = 0.0, 0.0, 0.0, 0
    steps_by_regions: dict[int, int] = {}  # steps taken across this many regions
    partial = 0.0  # unit-seconds of the step in progress when the last segment ended
    for segment in segments(failures, inputs.duration_seconds):
        count += segment.failed
        if segment.changed:  # the step in progress is aborted; the job reconfigures
            ledger.add("lost", partial)
            pause_left = inputs.reconfigure_seconds
        partial, end = 0.0, segment.end
        length = segment.end - segment.start
        ledger.add("down", length * len(segment.down))
        up = units - segment.down
        if not up:
            progress(end)
            continue
        pause = min(pause_left, length)
        ledger.add("restore", pause * len(up))
        pause_left -= pause
        regions = allreduce.regions_of(inputs, up)
        step = allreduce.step_seconds(inputs, max(inputs.slice_step_seconds(u) for u in up), regions)
        own = sum(inputs.slice_step_seconds(u) for u in up)
        tokens_per_step = inputs.learner_tokens_per_step() * len(up) / inputs.slices_per_learner
        available = length - pause  # inf: the last segment of a budget run
        needed = math.ceil((target - tokens) / tokens_per_step) if target < math.inf else math.inf
        if needed * step <= available:
            steps, end = needed, segment.start + pause + needed * step
        else:
            steps = math.floor(available / step)
            partial = (available - steps * step) * len(up)
        uptime.training(segment.start + pause, True)
        uptime.training(end, False)
        tokens += steps * tokens_per_step
        steps_by_regions[len(regions)] = steps_by_regions.get(len(regions), 0) + steps
        ledger.kept += steps * own
        ledger.add("blocked", steps * (step * len(up) - own))
        progress(end)
        if tokens >= target:
            break
    ledger.provisioned = end * m
    failure_free = inputs.batch_tokens / allreduce.step_seconds(
        inputs, max(inputs.slice_step_seconds(u) for u in units), allreduce.regions_of(inputs, units))
    return PlanResult("elastic", inputs.chips, inputs.num_learners, end, ledger.goodput(), uptime.share(end),
                      round(tokens), failure_free, count, wan_bandwidth(inputs, steps_by_regions, end),
                      slices=inputs.slices_per_learner)


def wan_bandwidth(inputs: PlanInputs, steps_by_regions: dict[int, float], end: float) -> Bandwidth | None:
    """The all-reduce's traffic through each region's link, both directions (None: one region,
    no WAN): per link over the run, and while an all-reduce runs, at the slowest link's pace."""
    per_link = sum(2 * allreduce.link_bytes_per_step(inputs, r) * steps for r, steps in steps_by_regions.items())
    widest = max((r for r, steps in steps_by_regions.items() if steps), default=1)
    if widest < 2:
        return None
    regions = {inputs.region(i) for i in range(inputs.num_learners)}
    peak = 2 * allreduce.link_bytes_per_step(inputs, widest) * 8 / 1e9 / allreduce.allreduce_seconds(inputs, regions)
    total = sum(2 * allreduce.link_bytes_per_step(inputs, r) * r * steps for r, steps in steps_by_regions.items())
    return Bandwidth(per_link * 8 / 1e9 / end if end else 0.0, peak, round(total), round(total / 2), round(total / 2))
