"""`diloco plan --suggest`: an operating point from the links. For the plan's model, step time
and links it proposes the sync settings (H, P, tau, codec) under which every learner's own round
trip for one fragment (its push up its link, the result down it, a round trip of latency each)
fits within tau steps with a margin, and a learner waits for a late result one of its steps at
most; it ranks them by the goodput and staleness the planner then predicts for a failure-free
run of the plan's length.

Candidates: P fragments in FRAGMENTS (those the model can be cut into), H = P or 2P steps, each
codec in CODECS; for each, the smallest tau that fits the slowest learner's round trip, kept
only where tau < H.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from diloco.planner.inputs import PlanInputs
from diloco.planner.outcome import PlanResult
from diloco.planner.simulate import simulate
from diloco.services.contract.codecs import get_codec

FRAGMENTS = (8, 16, 24, 48, 96)
CODECS = ("int4", "int8")
MARGIN = 1.25  # a round trip must fit tau steps with this much to spare
# With tau fitted to the links, a result still out at its apply step is late because the others
# reached its round later (their steps jitter apart), not for its own link: wait one step for it
# at most, then merge it late (docs/planning.md).
WAIT_STEPS = 1.0


@dataclass(frozen=True)
class Suggestion:
    interval_steps: int  # H
    fragments: int  # P
    overlap_steps: int  # tau
    codec: str
    round_trip_seconds: float  # the slowest learner's, for one fragment
    result: PlanResult

    @property
    def staleness_zero_share(self) -> float:
        merged = {k: v for k, v in self.result.staleness.items() if k != "refused"}
        return merged.get("0", 0) / sum(merged.values()) if merged and sum(merged.values()) else 0.0

    def settings(self) -> dict:
        """The sync section's settings it suggests, as a cluster config writes them."""
        return {"interval_steps": self.interval_steps, "fragments": self.fragments, "overlap_steps": self.overlap_steps,
                "codec": self.codec, "max_block_steps": WAIT_STEPS}

    def as_json(self) -> dict:
        bandwidth = self.result.bandwidth
        return {"sync": self.settings(), "round_trip_seconds": self.round_trip_seconds,
                "goodput": self.result.goodput.share, "staleness_zero_share": self.staleness_zero_share,
                "staleness": dict(self.result.staleness),
                "wan_gbps_mean_peak": [bandwidth.mean_gbps, bandwidth.peak_gbps] if bandwidth else None}


def round_trip_seconds(inputs: PlanInputs, fragments: int, codec: str) -> float:
    """The slowest learner's push and pull of one fragment over its own link."""
    numel = math.ceil(inputs.model_parameters / fragments)
    wire = get_codec(codec).encoded_size(numel, inputs.sync.codec_block_size) * 8
    return max(wire / (link.up_mbps * 1e6) + wire / (link.down_mbps * 1e6) + 4 * link.latency_ms / 1e3
               for link in (inputs.link(i) for i in range(inputs.num_learners)))


def candidates(inputs: PlanInputs) -> list[PlanInputs]:
    """The plan with each candidate's sync settings, failure-free."""
    step = max(inputs.step_seconds)
    found = []
    for fragments in (p for p in FRAGMENTS if p <= inputs.model_parameters):
        for codec in CODECS:
            tau = max(1, math.ceil(MARGIN * round_trip_seconds(inputs, fragments, codec) / step))
            for interval in (fragments, 2 * fragments):
                if tau < interval:
                    sync = inputs.sync.model_copy(update={"interval_steps": interval, "fragments": fragments,
                                                          "overlap_steps": tau, "codec": codec,
                                                          "max_block_steps": WAIT_STEPS})
                    found.append(dataclasses.replace(inputs, sync=sync, chip_mtbf_hours=None, failures=()))
    return found


def suggest(inputs: PlanInputs) -> list[Suggestion]:
    """Every candidate planned, best first: goodput (to half a point), then merges at staleness
    0 (to a point), then the shortest H (the most syncs: the closer to data parallel's quality,
    BENCHMARKS.md section 1), then the smaller codec."""
    suggestions = [Suggestion(c.sync.interval_steps, c.sync.fragments, c.sync.overlap_steps, c.sync.codec,
                              round_trip_seconds(c, c.sync.fragments, c.sync.codec), simulate(c, "diloco"))
                   for c in candidates(inputs)]
    return sorted(suggestions, key=lambda s: (-round(s.result.goodput.share * 200), -round(s.staleness_zero_share * 100),
                                              s.interval_steps, CODECS.index(s.codec)))


def table(suggestions: list[Suggestion], step_seconds: float) -> str:
    rows = [["H", "P", "tau", "codec", "slowest round trip s", "tau x step s", "goodput", "merges at staleness 0",
             "WAN Gbit/s mean/peak"]]
    for s in suggestions:
        bandwidth = s.result.bandwidth
        rows.append([str(s.interval_steps), str(s.fragments), str(s.overlap_steps), s.codec,
                     f"{s.round_trip_seconds:.2f}", f"{s.overlap_steps * step_seconds:.2f}",
                     f"{s.result.goodput.share:.1%}", f"{s.staleness_zero_share:.1%}",
                     f"{bandwidth.mean_gbps:.2f}/{bandwidth.peak_gbps:.2f}" if bandwidth else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)
