"""`diloco plan --calibrate-from REPORT`: the planner configured as a `diloco sim` run was, and
its prediction beside what the run measured.

From the run's report it takes the cluster (learners, regions, shards, links), the algorithm's
settings, the model's size, each learner's measured step time, start-up time and a push's time
besides the wire (compressing, the call, the shard's durable write), what an
evaluation and a checkpoint copy take (every trainer.eval_every and checkpoint_every steps) and
the loop's other work per step (one figure each for the run), and the chaos schedule (each kill, and the restart after it, as an injected failure and its repair;
each shard kill as a shard outage). The planner then predicts the rest: blocked, lost, restore,
down and start-up time, goodput, bytes each way and outer steps.

A data-parallel run (`diloco sim --mode dp`, links capped, no kills) is planned as the
planner's dp: from the run it takes a step's compute time and how long DDP's buckets overlapped
the backward pass, and predicts the step with its all-reduce over the links, the share of the
training time blocked on the WAN and the steps trained in it.
"""
from __future__ import annotations

import json
import math
import pathlib
import statistics
from dataclasses import dataclass

from diloco.planner.inputs import PlanInputs, load_inputs
from diloco.planner.outcome import PlanResult
from diloco.planner.simulate import simulate
from diloco.services.contract.codecs import get_codec
from diloco.services.contract.config import parse_config

UNCAPPED_MBPS = 1000.0  # a link the run left uncapped: loopback, as fast as the processes go
# One shard closing rounds on this machine's 2 cores (BENCHMARKS.md §5: 41 M parameters per second).
LOCAL_SYNCER_PARAMS_PER_SECOND = 41e6
# The run's time that the planner predicts, by category; of the rest it takes how long one
# evaluation, one checkpoint copy and one step's bookkeeping (other) take from the run.
PREDICTED = ("startup", "restore", "blocked", "lost", "down")
TAKEN = ("evaluation", "checkpoint", "other")


class CalibrationError(ValueError):
    """A report the planner cannot be configured from; the message says what is missing."""


def inputs_from_report(report: dict) -> PlanInputs:
    """The plan of the run that wrote `report` (diloco sim's JSON)."""
    missing = [key for key in ("cluster_config", "started_at", "per_learner", "links", "chaos_events")
               if key not in report]
    if missing:
        raise CalibrationError(f"the report has no {', '.join(missing)}: rerun diloco sim with this version")
    if report.get("mode") not in ("diloco", "dp"):
        raise CalibrationError(f"a {report.get('mode')} run: only a diloco or dp run can be planned")
    cfg = parse_config(report["cluster_config"], source="the report's cluster_config")
    if report["mode"] == "dp":
        return _dp_inputs(report, cfg)
    learners = [report["per_learner"][learner.id] for learner in cfg.learners]
    steps_run = sum(learner["steps_run"] for learner in learners)
    if not steps_run:
        raise CalibrationError("no learner trained a step in the run")
    per_step = {category: report["badput_seconds"][category] / steps_run for category in TAKEN}
    start = report["started_at"]
    chaos = sorted(report["chaos_events"], key=lambda event: event["time"])
    m = len(cfg.learners)
    return load_inputs({
        "chips": m, "learners": m, "chip_mtbf_hours": None, "seed": report["seed"],
        "hours": report["wall_seconds"] / 3600,
        "step_seconds": _each([learner["step_seconds"] for learner in learners]),
        "startup_seconds": _each([statistics.mean(learner["startup_seconds"]) if learner["startup_seconds"] else None
                                  for learner in learners]),
        "step_overhead_seconds": [per_step["other"]], "pull_at_start": True,
        "push_overhead_seconds": [_push_overhead(report, cfg, learner) for learner in cfg.learners],
        "evaluation_every_steps": cfg.trainer.eval_every, "checkpoint_steps": cfg.trainer.checkpoint_every,
        "evaluation_seconds": per_step["evaluation"] * cfg.trainer.eval_every,
        "checkpoint_seconds": per_step["checkpoint"] * cfg.trainer.checkpoint_every,
        "batch_tokens": m * cfg.tokens_per_step(),
        "sync": cfg.sync, "syncer": cfg.syncer, "heartbeat_seconds": cfg.trainer.heartbeat_seconds,
        "model_parameters": report["model_parameters"], "links": _links(report, cfg),
        "syncer_params_per_second": LOCAL_SYNCER_PARAMS_PER_SECOND, "shards": len(cfg.shards),
        "failures": [{"learner": event["index"], "at_seconds": event["time"] - start,
                      "repair_minutes": (_restart(chaos, event, report) - event["time"]) / 60}
                     for event in chaos if event["event"] == "kill" and event["kind"] == "learner"],
        "shard_outages": [{"shard": event["index"], "at_seconds": event["time"] - start,
                           "seconds": _restart(chaos, event, report) - event["time"]}
                          for event in chaos if event["event"] == "kill" and event["kind"] == "shard"],
    }, source="the plan of the report")


def _dp_inputs(report: dict, cfg) -> PlanInputs:
    """The planner's dp as the data-parallel job ran: its ranks, links, model and compute step;
    the run's training time (its steps and their waits) is the plan's length."""
    if any(event["event"] == "kill" for event in report["chaos_events"]):
        raise CalibrationError("a dp run with kills: the planner's dp is set beside a run without --chaos-mtbf")
    (job,) = report["per_learner"].values()
    if not job["steps_run"]:
        raise CalibrationError("the data-parallel job trained no step in the run")
    m = len(cfg.learners)
    compute = job["step_seconds"]
    return load_inputs({
        "chips": m, "learners": m, "chip_mtbf_hours": None, "seed": report["seed"],
        "hours": (job["steps_run"] * compute + job["wan_seconds"]) / 3600, "step_seconds": [compute],
        "batch_tokens": m * cfg.tokens_per_step(), "restore_minutes": 0.0,
        "model_parameters": report["model_parameters"], "links": _links(report, cfg), "gradient_dtype": "fp32",
        "backward_share": min(1.0, job["wan_overlap_seconds"] / job["steps_run"] / compute),
    }, source="the plan of the report")


def _each(values: list[float | None]) -> list[float]:
    """One value per learner; a learner without one (it never trained) gets the others' mean."""
    known = [v for v in values if v]
    return [v if v else statistics.mean(known) if known else 0.0 for v in values]


def _push_overhead(report: dict, cfg, learner) -> float:
    """A learner's mean push time less what its bytes take on its link (a round trip for the
    call, one fragment's encoded size at its rate); 0 if it pushed nothing."""
    measured = report["per_learner"][learner.id].get("push_seconds")
    if measured is None:
        return 0.0
    link = report["links"][learner.id]
    numel = math.ceil(report["model_parameters"] / cfg.sync.fragments)
    wire_bytes = get_codec(cfg.sync.codec).encoded_size(numel, cfg.sync.codec_block_size)
    wire = wire_bytes * 8 / ((link["up_mbps"] or UNCAPPED_MBPS) * 1e6) + 2 * link["latency_ms"] / 1000
    return max(measured - wire, 0.0)


def _links(report: dict, cfg) -> dict:
    """Each region's link as the run configured it, in the order the learners are spread over them."""
    links = {}
    for learner in cfg.learners:
        link = report["links"][learner.id]
        links.setdefault(learner.region, {"up_mbps": link["up_mbps"] or UNCAPPED_MBPS,
                                          "down_mbps": link["down_mbps"] or UNCAPPED_MBPS,
                                          "latency_ms": link["latency_ms"]})
    return links


def _restart(chaos: list[dict], kill: dict, report: dict) -> float:
    """When the process a kill took down was started again (the run's end if never)."""
    return next((event["time"] for event in chaos if event["event"] == "restart" and event["kind"] == kill["kind"]
                 and event["index"] == kill["index"] and event["time"] >= kill["time"]),
                report["started_at"] + report["wall_seconds"])


@dataclass(frozen=True)
class Row:
    figure: str
    predicted: float
    measured: float
    unit: str  # "share": of provisioned time (dp: of training time); "MB"; "count"; "seconds"

    @property
    def difference(self) -> float:
        """Predicted less measured: points of a share, else the ratio predicted / measured."""
        if self.unit == "share":
            return self.predicted - self.measured
        return self.predicted / self.measured if self.measured else float("inf")

    def as_json(self) -> dict:
        return {"figure": self.figure, "predicted": self.predicted, "measured": self.measured, "unit": self.unit,
                "difference": self.difference}


def compare(report: dict, inputs: PlanInputs, result: PlanResult) -> list[Row]:
    """The planner's figures beside the run's: goodput and each badput category as shares of
    provisioned time, bytes each way, inner and outer steps (dp: compare_dp)."""
    if report["mode"] == "dp":
        return compare_dp(report, inputs, result)
    planned = result.goodput.badput_shares()
    provisioned = report["provisioned_seconds"]
    measured = {category: seconds / provisioned for category, seconds in report["badput_seconds"].items()}
    rows = [Row("goodput", result.goodput.share, report["goodput"], "share")]
    rows += [Row(category, planned[category], measured[category], "share") for category in PREDICTED + TAKEN]
    rows += [Row("MB up", result.bandwidth.bytes_up / 1e6, report["bytes_up"] / 1e6, "MB"),
             Row("MB down", result.bandwidth.bytes_down / 1e6, report["bytes_down"] / 1e6, "MB"),
             Row("inner steps kept", result.tokens / inputs.learner_tokens_per_step(), report["inner_steps"], "count"),
             Row("outer steps", result.syncer.versions, report["outer_steps"], "count")]
    return rows


def compare_dp(report: dict, inputs: PlanInputs, result: PlanResult) -> list[Row]:
    """A data-parallel job's step with its all-reduce, the share of its training time blocked
    on the links, and the steps it trained in that time."""
    (job,) = report["per_learner"].values()
    training = job["steps_run"] * job["step_seconds"] + job["wan_seconds"]
    return [Row("step seconds", result.step_seconds, training / job["steps_run"], "seconds"),
            Row("blocked", result.goodput.badput_shares()["blocked"], job["wan_seconds"] / training, "share"),
            Row("steps", result.tokens / inputs.batch_tokens, job["steps_run"], "count")]


def table(rows: list[Row]) -> str:
    def shown(row: Row, value: float) -> str:
        if row.unit == "share":
            return f"{value:.1%}"
        return f"{value:.3f}" if row.unit == "seconds" else f"{value:.2f}" if row.unit == "MB" else f"{value:.0f}"

    lines = [("figure", "planned", "measured", "difference")]
    for row in rows:
        difference = (f"{row.difference * 100:+.1f} pp" if row.unit == "share" else f"x{row.difference:.2f}")
        lines.append((row.figure, shown(row, row.predicted), shown(row, row.measured), difference))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                     for line in lines)


def calibrate(report_path: pathlib.Path) -> tuple[PlanInputs, PlanResult, list[Row]]:
    report = json.loads(report_path.read_text())
    inputs = inputs_from_report(report)
    result = simulate(inputs, report["mode"])
    return inputs, result, compare(report, inputs, result)
