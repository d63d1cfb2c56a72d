"""`diloco plan`'s outputs: a table for people, JSON for programs, a plot of goodput against chips."""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from itertools import groupby

from diloco.planner.outcome import PlanResult
from diloco.services.contract.goodput import BADPUT, REMAINDER

# The categories a planned run shows; start-up, evaluation and checkpoint only where it was given their cost.
PLANNED_BADPUT = tuple(c for c in BADPUT if c not in ("startup", "evaluation", "checkpoint")) + (REMAINDER,)


@dataclass(frozen=True)
class Speed:
    """How fast the planner simulated one run: kept out of PlanResult, which the inputs alone
    determine."""
    wall_seconds: float
    events: int  # diloco: actions of the event queue; dp, elastic: stretches between fleet changes

    def as_json(self) -> dict:
        return {"wall_seconds": self.wall_seconds, "events": self.events,
                "events_per_second": self.events / self.wall_seconds if self.wall_seconds else 0.0}


def table(results: list[PlanResult]) -> str:
    categories = [c for c in (*BADPUT, REMAINDER)
                  if c in PLANNED_BADPUT or any(r.goodput.badput_seconds.get(c) for r in results)]
    sliced = any(r.slices > 1 for r in results)  # S shown where a learner is more than one slice
    header = ["mode", "M", *(["S"] if sliced else []), "chips", "goodput", *categories, "uptime", "tokens/s",
              "of failure-free", "failures", "WAN Gbit/s mean/peak", "staleness 0/1/2+/refused"]
    rows = [header]
    for r in results:
        shares = r.goodput.badput_shares()
        rows.append([r.mode, str(r.learners), *([str(r.slices)] if sliced else []), f"{r.chips:,}", f"{r.goodput.share:.1%}",
                     *(f"{shares[c]:.1%}" for c in categories), f"{r.uptime:.1%}",
                     f"{r.tokens_per_second:.3g}", f"{r.effective_share:.1%}", str(r.failures),
                     f"{r.bandwidth.mean_gbps:.2f}/{r.bandwidth.peak_gbps:.2f}" if r.bandwidth else "-",
                     _staleness(r.staleness) if r.staleness else "-"])
    return _aligned(rows)


def time_to_train(results: list[PlanResult]) -> str:
    """Each run's wall time to train the same tokens (the most any mode of its fleet kept), at
    the rate it kept them, and how many times faster than data parallel of the same fleet."""
    fleets: dict[tuple, list[PlanResult]] = {}
    for r in results:
        fleets.setdefault((r.chips, r.learners, r.slices), []).append(r)
    rows = [["mode", "M", "chips", "tokens", "hours to train them", "speed-up over dp"]]
    for fleet in fleets.values():
        tokens = max(r.tokens for r in fleet)
        dp = next((r for r in fleet if r.mode == "dp"), None)
        for r in fleet:
            hours = tokens / r.tokens_per_second / 3600 if r.tokens_per_second else math.inf
            faster = dp.tokens_per_second and r.tokens_per_second / dp.tokens_per_second if dp else None
            rows.append([r.mode, str(r.learners), f"{r.chips:,}", f"{tokens:.3g}", f"{hours:.3g}",
                         f"{faster:.1f}x" if faster else "-"])
    return _aligned(rows)


def speed_table(results: list[PlanResult], speeds: list[Speed]) -> str:
    rows = [["mode", "M", "chips", "wall s", "events", "events/s", "virtual s per wall s"]]
    for r, speed in zip(results, speeds):
        wall = max(speed.wall_seconds, 1e-9)
        rows.append([r.mode, str(r.learners), f"{r.chips:,}", f"{speed.wall_seconds:.2f}", f"{speed.events:,}",
                     f"{speed.events / wall:,.0f}", f"{r.seconds / wall:,.0f}"])
    total = sum(speed.wall_seconds for speed in speeds)
    return _aligned(rows) + f"\nsimulated in {total:.1f} s of wall time"


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _staleness(counts: dict[str, int]) -> str:
    merged = {int(k): v for k, v in counts.items() if k != "refused"}
    later = sum(v for k, v in merged.items() if k >= 2)
    return f"{merged.get(0, 0)}/{merged.get(1, 0)}/{later}/{counts['refused']}"


def write_json(results: list[PlanResult], speeds: list[Speed], path: pathlib.Path) -> None:
    path.write_text(json.dumps([{**r.as_json(), "speed": speed.as_json()} for r, speed in zip(results, speeds)],
                               indent=1))


def plot(results: list[PlanResult], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ordered = sorted(results, key=lambda r: (r.label, r.chips))
    for label, points in groupby(ordered, key=lambda r: r.label):
        points = list(points)
        ax.plot([p.chips for p in points], [p.goodput.share for p in points], marker="o", label=label)
    ax.set(xscale="log", xlabel="chips", ylabel="goodput", ylim=(0, 1.02),
           title="goodput against fleet size (diloco plan)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
