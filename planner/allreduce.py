"""Data parallel's gradient all-reduce when its slices span regions: what a step pays for the WAN.

A cross-region job reduces inside each region over its own interconnect (part of the step time
given), all-reduces across the regions over the WAN, and broadcasts back inside each region. A
ring over R regions sends 2 (R - 1) / R of the gradient's bytes through every region's link
each way (reduce-scatter, then all-gather), in 2 (R - 1) hops; the slowest link sets the pace,
and a hop between two regions takes their two links' latencies. DDP reduces bucket by bucket as
the backward pass produces them, so the all-reduce overlaps the backward pass
(`backward_share` of the step) and only what is left of it adds to the step. One region: no WAN.
"""
from __future__ import annotations

from collections.abc import Iterable

from diloco.planner.inputs import PlanInputs

GRADIENT_BYTES = {"bf16": 2, "fp32": 4}


def regions_of(inputs: PlanInputs, slices: Iterable[int]) -> set[str]:
    """The regions data-parallel slices are in (a slice is in its learner unit's region)."""
    return {inputs.region(unit // inputs.slices_per_learner) for unit in slices}


def link_bytes_per_step(inputs: PlanInputs, regions: int) -> float:
    """What one step's all-reduce sends through each region's link, each way."""
    gradient = inputs.model_parameters * GRADIENT_BYTES[inputs.gradient_dtype]
    return 2 * (regions - 1) / regions * gradient if regions > 1 else 0.0


def allreduce_seconds(inputs: PlanInputs, regions: set[str]) -> float:
    """One step's all-reduce across `regions` over their WAN links (0 within one region)."""
    if len(regions) < 2:
        return 0.0
    links = [inputs.region_link(region) for region in regions]
    slowest_bps = min(min(link.up_mbps, link.down_mbps) for link in links) * 1e6
    hop_seconds = 2 * max(link.latency_ms for link in links) / 1e3
    return link_bytes_per_step(inputs, len(regions)) * 8 / slowest_bps + 2 * (len(regions) - 1) * hop_seconds


def step_seconds(inputs: PlanInputs, compute_seconds: float, regions: set[str]) -> float:
    """A data-parallel step: its compute, plus the all-reduce beyond the backward pass it overlaps."""
    exposed = allreduce_seconds(inputs, regions) - inputs.backward_share * compute_seconds
    return compute_seconds + max(0.0, exposed)
