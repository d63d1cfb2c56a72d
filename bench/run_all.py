"""Runs every benchmark fresh on this machine and writes BENCHMARKS.md, bench/results.json and
the plots under bench/plots/.

    python bench/run_all.py                    # the full run: about two hours on 2 cores
    python bench/run_all.py --quick            # tiny sizes, a few minutes: for development
    python bench/run_all.py --quick --sections transport --out /tmp/b   # a subset, elsewhere
    python bench/run_all.py --sections user_loop,hf --merge   # run these again, keep the rest

Twelve sections (issues #8, #17, #34, #35 and #55), all but the ninth from real processes talking gRPC on loopback:
1. quality: final validation loss of the global model against data parallel (`diloco sim
   --mode dp`: one torch.distributed job, gradients averaged every step) at the same model,
   data, seed and tokens, several H, seeds for the headline rows, one learner alone;
2. bandwidth: bytes on the wire per token from the same runs, and the Gbit/s a learner of a
   1B or 12B model would need at a 1 s step;
3. goodput: diloco and dp under SIGKILLs of learners at three failure rates;
4. overlap: bench/overlap.py; 5. transport and syncer: bench/syncer_push.py and bench/syncer_scale.py;
6. recovery: bench/recovery.py; 7. user loop: bench/user_loop.py (the API in a plain PyTorch
loop against the same loop with sync off); 8. hf: bench/hf_overlap.py (a Hugging Face Llama); 9. plan: `diloco plan`'s
goodput at 150k to 2.4M chips (dp, elastic, Decoupled DiLoCo M = 2 to 16, two failure models; about
half an hour, never in CI) and its own speed on one day of 2.4M chips; 9b. suggest: `diloco plan
--suggest` at the seeds' point (the settings it proposes and what it plans for them); 10. calibration: `diloco sim`
runs of the demo's cluster at three failure rates, with shard kills and with mixed links, each
beside `diloco plan --calibrate-from` its report; 11. islands: bench/island.py (learner islands of
torchft replica groups losing groups, their leaders too, against the same run without kills);
12. sick_learner: bench/sick_learner.py (one learner's model scaled x1000, NaN or bit-flipped);
13. kernel_links: bench/kernel_links.py (the demo on mixed links, paced by the learners and shaped
by the kernel in network namespaces; needs root); 14. own_link: bench/own_link.py (the demo on
mixed links against uniform fast links, with and without waiting for a learner's own slow link);
15. split_downlink: bench/split_downlink.py (split rounds' downlink against their uplink, by how many
anchor values a shard keeps).
Commands run one after another, never two at once, so timings do not compete with each other
(other tenants of the machine still may: timings are medians of repeats). Every row of
BENCHMARKS.md names its command; the runner only adds where the output goes (--run-dir,
--report, --json, --quiet). With --merge the sections run replace theirs in the existing
bench/results.json and every other figure stays as it was; the header names both runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench import doc_figures  # noqa: E402
from bench.report import render  # noqa: E402
from diloco.services.contract.config import load_config  # noqa: E402
from diloco.localcluster.chaos import Chaos  # noqa: E402

SECTIONS = ("quality", "user_quality", "bandwidth", "goodput", "overlap", "transport", "recovery", "user_loop", "hf", "plan",
            "suggest", "calibration", "island", "sick_learner", "kernel_links", "own_link",
            "split_downlink")
# The global model within this of data parallel at equal tokens, by M, for H <= 50 (issue 28).
QUALITY_TARGETS = {4: 0.03, 8: 0.05}
QUALITY_TARGET_MAX_H = 50
ALONE_MARGIN = 0.05  # at least this much lower a loss than one learner alone on its share of the tokens
STREAMING_DILOCO_RATIO = 400  # anchor: fewer bits than dp at equal loss
PAPER_GOODPUT = {"diloco": 0.88, "dp": 0.27}  # anchor: Decoupled DiLoCo at a high failure rate
PROJECTED_MODELS = {"1B": 1e9, "12B": 12e9}
SIM_CONFIG = "bench/cluster.yaml"
# Goodput is a property of the whole system at a realistic step time: the demo's cluster
# (2 shards, 4 learners, its model) rather than the small model of the quality runs.
GOODPUT_CONFIG = "examples/local-4-regions.yaml"
GOODPUT_OVERRIDES = ("trainer.eval_every=250", "trainer.checkpoint_every=25")
SIM_POLL_SECONDS = 0.5  # how often `diloco sim` acts on its failure schedule
PLAN_CONFIG = "examples/plan/datacenter.yaml"  # the example failure model of docs/planning.md
# The milder failure model: chips four times as reliable as Llama 3's, the same repairs.
PLAN_FAILURE_MODELS = {"example": (), "milder": ("--chip-mtbf-hours", "200000")}
# The seeds' headline point: a 12B model on four US regions' 2-5 Gbit/s links, 20x faster than
# conventional synchronisation (docs/planning.md); data parallel pays for its all-reduce there.
PAPER_POINT = ("--modes", "dp,elastic,diloco", "--chips", "16384", "--learners", "4", "--chip-mtbf-hours", "null",
               "--hours", "0.25", "--wan-gbps", "2,5,2,5", "--interval-steps", "48", "--overlap-steps", "4")
PAPER_SPEEDUP = 20
# `diloco plan --suggest` at that point, failure-free (a tenth of an hour each candidate), and what
# issue 53 asks of its suggestion there.
SUGGEST_POINT = ("--chips", "16384", "--learners", "4", "--chip-mtbf-hours", "null", "--hours", "0.1",
                 "--wan-gbps", "2,5,2,5", "--suggest")
SUGGEST_TARGETS = {"goodput": 0.95, "staleness_zero_share": 0.99}
# At 1.2M chips, as docs/planning.md quotes the paper (its failure model is not public).
PAPER_PLAN = {"dp": 0.27, "elastic": 0.58, "diloco M=8": 0.88, "diloco M=16": 0.93}
# The calibration runs: the demo as it is (checkpoints every 10 steps, an evaluation every 50), links
# capped at 20 Mbit/s each way, or mixed per region (rates up/down and one-way latencies).
CALIBRATION_LINKS = ("--wan-mbps", "20")
CALIBRATION_MIXED_LINKS = ("--wan-mbps", "us-east=50/100,us-west=5/20,us-central=20,us-south=2/10",
                           "--wan-latency-ms", "us-east=10,us-west=40,us-central=20,us-south=60")


@dataclass(frozen=True)
class QualityRun:
    """One diloco configuration of section 1, run once per seed, each beside dp of that seed."""
    family: str  # gpt (the built-in GPT) or llama (model.family=llama, same sizes)
    learners: int
    H: int
    codec: str
    seeds: tuple[int, ...] = (1,)
    learner_script: str | None = None  # a user's own loop around DecoupledDiLoCo instead of `diloco learner`


@dataclass(frozen=True)
class Profile:
    """The sizes of one run of the runner."""
    name: str
    steps: int  # inner steps per learner in the quality runs: H=100 syncs each fragment steps/100 times
    quality: tuple[QualityRun, ...]
    goodput_learners: int
    goodput_seconds: float  # each goodput run lasts this long
    down_shares: tuple[float, ...]  # share of time each learner is down (SIGKILLed, not restarted yet)
    restart_delay: float
    overlap: tuple[str, ...]  # arguments of bench/overlap.py
    transport: tuple[str, ...]  # of bench/syncer_push.py
    scale: tuple[str, ...]  # of bench/syncer_scale.py
    recovery: tuple[str, ...]  # of bench/recovery.py
    user_loop: tuple[str, ...]  # of bench/user_loop.py
    gpu_shaped: tuple[str, ...]  # of bench/user_loop.py with the GPU-shaped step (also run with --keep-freed-memory)
    hf: tuple[str, ...]  # of bench/hf_overlap.py
    plan: tuple[str, ...]  # of `diloco plan` for the goodput table, besides the config and failure model
    plan_speed: tuple[str, ...]  # of `diloco plan` for its speed figure
    calibration_seconds: float  # each calibration run lasts this long
    calibration_mtbfs: tuple[float, ...]  # learner failure rates (--chaos-mtbf); the middle one also with
    calibration_shard_mtbf: float  # shard kills, and with mixed links
    calibration_dp_steps: int  # data parallel's steps over the 20 Mbit/s links (half as many over mixed links)
    island: tuple[str, ...]  # of bench/island.py
    sick_learner: tuple[str, ...]  # of bench/sick_learner.py
    kernel_links: tuple[str, ...]  # of bench/kernel_links.py
    own_link: tuple[str, ...]  # of bench/own_link.py
    split_downlink: tuple[str, ...]  # of bench/split_downlink.py
    user_quality: tuple[tuple[str, ...], ...]  # of each run of bench/user_quality.py


SEEDS = (1, 2, 3)  # of the headline rows
PLAIN_LOOP = "bench/plain_loop.py"  # the user-loop path: torch.optim.AdamW in a plain loop
FULL = Profile("full", steps=3000, quality=(
    QualityRun("gpt", 4, 10, "int4"), QualityRun("gpt", 4, 25, "int4", SEEDS), QualityRun("gpt", 4, 50, "int4"),
    QualityRun("gpt", 4, 100, "int4", SEEDS), QualityRun("gpt", 4, 25, "bf16"),
    QualityRun("gpt", 4, 25, "int4", SEEDS, learner_script=PLAIN_LOOP),
    QualityRun("gpt", 8, 25, "int4"), QualityRun("gpt", 8, 100, "int4"),
    QualityRun("llama", 4, 10, "int4"), QualityRun("llama", 4, 25, "int4"), QualityRun("llama", 4, 50, "int4", SEEDS)),
               goodput_learners=4, goodput_seconds=120, down_shares=(0.05, 0.10, 0.25), restart_delay=12.0,
               overlap=("--steps", "80", "--repeats", "3", "--wan-mbps", "50", "5"),
               # 8 iterations: at 16M a push phase takes a tenth of a second, and single ones vary by +-20 %
               transport=("--params", "16000000", "--rounds", "8", "--shards", "1", "2", "--memory-state"), scale=(),
               recovery=("--sizes", "2x64", "4x256", "4x512", "--kills", "3"),
               user_loop=("--pairs", "3"),
               gpu_shaped=("--step", "gpu-shaped", "--sizes", "25M", "85M", "--steps", "300", "--pairs", "3"),
               hf=("--steps", "300", "--repeats", "3"),
               plan=("--chips", "153600,307200,614400,1228800,2457600", "--learners", "2,4,8,16", "--hours", "6",
                     "--wan-gbps", "20"),
               plan_speed=("--chips", "2457600", "--learners", "16", "--hours", "24"),
               calibration_seconds=120, calibration_mtbfs=(200, 90, 40), calibration_shard_mtbf=40,
               calibration_dp_steps=20,
               island=("--steps", "600", "--chaos-replicas", "30", "--chaos-islands", "1"),
               sick_learner=("--steps", "600", "--seeds", "1", "2", "3"),
               kernel_links=("--steps", "300", "--seeds", "1", "2", "3"),
               own_link=("--steps", "600", "--seeds", "1", "2", "3"),
               split_downlink=("--steps", "900", "--seeds", "1", "2"),
               user_quality=(("--steps", "600", "--ablations"),
                             ("--steps", "3000", "--intervals", "25", "--seeds", "1", "--lr-multipliers", "1", "2",
                              "--no-no-wait-row")))
QUICK = Profile("quick", steps=60, quality=(QualityRun("gpt", 2, 10, "int4"), QualityRun("gpt", 2, 25, "int4", (1, 2)),
                                             QualityRun("gpt", 2, 25, "int4", (1, 2), learner_script=PLAIN_LOOP)),
                goodput_learners=2, goodput_seconds=20, down_shares=(0.25,), restart_delay=4.0,
                overlap=("--steps", "30", "--repeats", "1", "--wan-mbps", "5"),
                transport=("--params", "1000000", "--rounds", "1", "--shards", "1", "2", "--memory-state"),
                scale=("--params", "4000000", "--compare-params", "0", "--rounds", "2", "--anchors-params", "4000000"),
                recovery=("--sizes", "2x64", "--kills", "1"),
                user_loop=("--pairs", "1", "--sizes", "demo"),
                gpu_shaped=("--step", "gpu-shaped", "--sizes", "25M", "--steps", "32", "--pairs", "1"),
                hf=("--steps", "60", "--repeats", "1"),
                plan=("--chips", "153600,307200", "--learners", "2,4", "--hours", "0.05", "--wan-gbps", "20"),
                plan_speed=("--chips", "153600", "--learners", "4", "--hours", "0.1"),
                calibration_seconds=30, calibration_mtbfs=(20,), calibration_shard_mtbf=15, calibration_dp_steps=4,
                island=("--steps", "100", "--chaos-replicas", "5", "--chaos-islands", "1"),
                sick_learner=("--steps", "80", "--seeds", "1"),
                kernel_links=("--steps", "60", "--seeds", "1"),
                own_link=("--steps", "60", "--seeds", "1"),
                split_downlink=("--steps", "60", "--seeds", "1"),
                user_quality=(("--steps", "60", "--intervals", "25", "--seeds", "1", "--lr-multipliers", "1",
                               "--no-no-wait-row"),))


class Runner:
    """Runs commands one at a time, keeps their output under `work`, and remembers each
    command as a user would type it (without the flags that only say where output goes)."""

    def __init__(self, work: pathlib.Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, shown: list[str], argv: list[str], timeout: float = 1800) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {shlex.join(shown)}", flush=True)
        with open(self.work / f"{name}.log", "w") as log:
            result = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        # Scripts with a target exit 1 when it is missed; their figures are still the result.
        if result.returncode not in (0, 1):
            raise RuntimeError(f"{shlex.join(shown)} exited with {result.returncode}; see {self.work / name}.log")

    def sim(self, name: str, flags: list[str], config: str = SIM_CONFIG) -> dict:
        """One `diloco sim` run; its JSON report with the command that made it."""
        shown = ["diloco", "sim", "--config", config, *flags]
        report = self.work / f"{name}.json"
        self.run(name, shown, [sys.executable, "-m", "diloco", "sim", "--config", config, *flags,
                               "--quiet", "--run-dir", str(self.work / "runs" / name), "--report", str(report)])
        return {**json.loads(report.read_text()), "command": shlex.join(shown)}

    def plan(self, name: str, flags: list[str]) -> dict:
        """One `diloco plan` run: its results (JSON, each with its speed) and the command."""
        shown = ["diloco", "plan", "--config", PLAN_CONFIG, *flags]
        output = self.work / f"{name}.json"
        self.run(name, shown, [sys.executable, "-m", "diloco", "plan", "--config", PLAN_CONFIG, *flags,
                               "--quiet", "--json", str(output)])
        return {"results": json.loads(output.read_text()), "command": shlex.join(shown)}

    def calibrate(self, name: str, report: dict) -> dict:
        """`diloco plan --calibrate-from` the report of sim run `name`: its rows and the command."""
        shown = ["diloco", "plan", "--calibrate-from", "REPORT"]
        output = self.work / f"{name}.json"
        self.run(name, shown, [sys.executable, "-m", "diloco", "plan", "--calibrate-from",
                               str(self.work / f"{report}.json"), "--json", str(output)])
        return json.loads(output.read_text())

    def script(self, name: str, script: str, args: tuple[str, ...], timeout: float = 1800) -> dict:
        """One bench/ script run with --json; its figures with the command that made them."""
        shown = ["python", script, *args]
        output = self.work / f"{name}.json"
        output.unlink(missing_ok=True)
        self.run(name, shown, [sys.executable, script, *args, "--json", str(output)], timeout=timeout)
        return {**json.loads(output.read_text()), "command": shlex.join(shown)}


# ---- 1 and 2: quality and bandwidth, from the same runs ------------------------------------

FAMILY_FLAGS = {"gpt": [], "llama": ["--set", "model.family=llama"]}


def quality_runs(runner: Runner, profile: Profile) -> dict:
    """Every diloco configuration once per seed, and data parallel (`--mode dp`, one
    torch.distributed job) with the same family, M, seed and steps beside it; one learner
    alone on one learner's share of the tokens; and one learner slowed 2x."""
    dp_runs: dict[tuple[str, int, int], dict] = {}

    def common(family: str, learners: int, seed: int, steps: int) -> list[str]:
        return ["--learners", str(learners), "--shards", "1", "--steps", str(steps), "--seed", str(seed),
                *FAMILY_FLAGS[family]]

    def dp(family: str, learners: int, seed: int) -> dict:
        if (family, learners, seed) not in dp_runs:
            dp_runs[family, learners, seed] = runner.sim(
                f"quality-{family}-dp-m{learners}-s{seed}", [*common(family, learners, seed, profile.steps),
                                                              "--mode", "dp"])
        return dp_runs[family, learners, seed]

    rows = []
    for run in profile.quality:
        loop = ["--learner-script", run.learner_script] if run.learner_script else []
        diloco = [runner.sim(f"quality-{run.family}-m{run.learners}-h{run.H}-{run.codec}{'-own' if loop else ''}-s{seed}",
                             [*common(run.family, run.learners, seed, profile.steps), *loop,
                              "--set", f"syncer.quorum={run.learners}",  # K = M, as the demo
                              "--set", f"sync.interval_steps={run.H}", "--set", f"sync.codec={run.codec}"])
                  for seed in run.seeds]
        rows.append({"diloco": diloco, "dp": [dp(run.family, run.learners, seed) for seed in run.seeds]})
    alone = runner.sim("quality-gpt-alone", [*common("gpt", 1, 1, profile.steps), "--mode", "dp"])
    # One learner 2x slower, on the run's token budget: every learner trains what it can until
    # the run has its tokens, and dp trains the same tokens the diloco run ended with (a few
    # percent off the budget: the shards' count is estimated between heartbeats).
    first = profile.quality[0]
    tokens_per_step = load_config(ROOT / SIM_CONFIG).tokens_per_step()
    slowed = runner.sim(f"quality-m{first.learners}-h{first.H}-{first.codec}-slow2x",
                        [*common("gpt", first.learners, 1, 1_000_000), "--set", f"syncer.quorum={first.learners}",
                         "--set", f"sync.interval_steps={first.H}", "--set", f"sync.codec={first.codec}",
                         "--slow-learner", "2",
                         "--set", f"trainer.max_run_tokens={first.learners * profile.steps * tokens_per_step}"])
    dp_steps = round(slowed["tokens"] / (first.learners * tokens_per_step))
    slowed_dp = runner.sim(f"quality-dp-m{first.learners}-{dp_steps}-steps",
                           [*common("gpt", first.learners, 1, dp_steps), "--mode", "dp"])
    rows.append({"diloco": [slowed], "dp": [slowed_dp]})
    return {"rows": rows, "alone": alone, "steps": profile.steps}


def run_figures(report: dict) -> dict:
    """The figures of one sim run that the tables show."""
    return {"final_eval_loss": report["final_eval_loss"], "initial_eval_loss": report["initial_eval_loss"],
            "final_eval_loss_learners": report["final_eval_loss_learners"],
            "wall_seconds": report["wall_seconds"], "tokens": report["tokens"], "goodput": report["goodput"],
            "steps_per_learner": report["inner_steps"] / report["learners"],
            "bytes": report["bytes_up"] + report["bytes_down"], "state_hashes_agree": report["state_hashes_agree"],
            "command": report["command"]}


def loss_curve(report: dict) -> list[tuple[int, float]]:
    """(run tokens, validation loss) at every evaluation: the mean over the learners' own models
    at each step (diloco's global model exists only at the end), dp's one model."""
    by_step: dict[int, list[tuple[int, float]]] = {}
    for learner in report["per_learner"].values():
        for _, step, tokens, loss in learner["evaluations"]:
            by_step.setdefault(step, []).append((tokens, loss))
    ranks = report["learners"] if report["mode"] == "dp" else 1  # dp's report counts every rank's tokens
    return [(round(statistics.mean(t for t, _ in points) * report["learners"] / ranks),
             statistics.mean(loss for _, loss in points)) for step, points in sorted(by_step.items())]


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def quality_section(runs: dict) -> dict:
    alone = runs["alone"]["final_eval_loss"]
    rows = []
    for pair in runs["rows"]:
        diloco, dp = pair["diloco"], pair["dp"]
        first = diloco[0]
        losses = [r["final_eval_loss"] for r in diloco]
        dp_losses = [r["final_eval_loss"] for r in dp]
        vs_dp = statistics.median(losses) / statistics.median(dp_losses) - 1
        learners, interval = first["learners"], first["config"]["H"]
        target = QUALITY_TARGETS.get(learners) if interval <= QUALITY_TARGET_MAX_H else None
        step_seconds = [l["step_seconds"] for l in first["per_learner"].values()]
        rows.append({"model": first["config"]["model"], "learners": learners, "H": interval, "P": first["config"]["P"],
                     "codec": first["config"]["codec"], "slow_learner": first["config"]["slow_learner"],
                     "learner_script": first["config"].get("learner_script"),
                     # Measured: the first learner's mean step time over the others' median.
                     "slow_learner_step_ratio": step_seconds[0] / statistics.median(step_seconds[1:]),
                     "seeds": [r["seed"] for r in diloco],
                     "diloco_losses": losses, "dp_losses": dp_losses,
                     "diloco_spread": spread(losses), "dp_spread": spread(dp_losses),
                     "diloco": run_figures(first), "dp": run_figures(dp[0]),
                     "loss_vs_dp": vs_dp, "target": target, "within_target": target is None or vs_dp <= target,
                     "loss_vs_alone": statistics.median(losses) / alone - 1,
                     "curves": {"diloco": loss_curve(first), "dp": loss_curve(dp[0])}})
    for row in rows:
        row["better_than_alone"] = row["loss_vs_alone"] <= -ALONE_MARGIN
    # The run-to-run spread of a configuration: the largest over every row run with several seeds.
    seed_spread = max([max(r["diloco_spread"], r["dp_spread"]) for r in rows if len(r["seeds"]) > 1], default=0.0)
    monotone = []
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["slow_learner"] == 1.0 and not row["learner_script"]:
            groups.setdefault((row["model"], row["learners"], row["codec"]), []).append(row)
    for (model, learners, codec), group in groups.items():
        group.sort(key=lambda r: r["H"])
        for smaller, larger in zip(group, group[1:]):
            worse = statistics.median(smaller["diloco_losses"]) - statistics.median(larger["diloco_losses"])
            monotone.append({"model": model, "learners": learners, "codec": codec, "H": [smaller["H"], larger["H"]],
                             "smaller_minus_larger": worse, "within_spread": worse <= seed_spread})
    # The user-loop path beside the built-in learner at the same settings and seeds.
    user_loop = []
    for row in rows:
        if row["learner_script"]:
            built_in = next(r for r in rows if not r["learner_script"] and r["slow_learner"] == 1.0 and all(
                r[k] == row[k] for k in ("model", "learners", "H", "codec", "seeds")))
            difference = statistics.median(row["diloco_losses"]) - statistics.median(built_in["diloco_losses"])
            user_loop.append({"script": row["learner_script"], "model": row["model"], "learners": row["learners"],
                              "H": row["H"], "codec": row["codec"], "user_minus_built_in": difference,
                              "within_spread": abs(difference) <= seed_spread})
    return {"targets": QUALITY_TARGETS, "target_max_H": QUALITY_TARGET_MAX_H, "alone_margin": ALONE_MARGIN,
            "steps": runs["steps"], "alone": run_figures(runs["alone"]), "seed_spread": seed_spread,
            "monotone": monotone, "user_loop": user_loop, "rows": rows}


def link_needs(report: dict) -> dict:
    """Bytes per token and per parameter, and what a 1B / 12B model would need at a 1 s step.

    A diloco learner syncs every parameter once per H steps: bytes per parameter per sync is
    the run's bytes (up and down, join pulls included) over the parameter-syncs it made. At a
    1 s step a learner then needs that many bytes per parameter every H seconds on average,
    and one fragment's worth within tau seconds for the sync to overlap. Data parallel (H=1,
    one fragment, tau=0) moves its bytes every step, so both needs are the same."""
    cfg, params = report["config"], report["model_parameters"]
    syncs_per_parameter = report["inner_steps"] / cfg["H"]  # summed over learners
    per_parameter_sync = (report["bytes_up"] + report["bytes_down"]) / (syncs_per_parameter * params)
    needs = {}
    for model, size in PROJECTED_MODELS.items():
        bits = per_parameter_sync * size * 8
        needs[model] = {"average_gbps": bits / cfg["H"] / 1e9,
                        "within_tau_gbps": bits / cfg["P"] / max(cfg["tau"], 1) / 1e9}
    return {"bytes_per_token": (report["bytes_up"] + report["bytes_down"]) / report["tokens"],
            "bytes_per_parameter_per_sync": per_parameter_sync,
            "up_bytes_per_parameter_per_sync": report["bytes_up"] / (syncs_per_parameter * params),
            "at_1s_step": needs,
            "command": report["command"]}


def bandwidth_section(runs: dict) -> dict:
    rows = []
    for pair in runs["rows"]:
        diloco, dp = pair["diloco"][0], pair["dp"][0]
        if diloco["config"]["slow_learner"] != 1.0 or diloco["config"].get("learner_script"):
            continue  # the user-loop row moves what the built-in learner's does
        ours, theirs = link_needs(diloco), link_needs(dp)
        rows.append({"model": diloco["config"]["model"], "learners": diloco["learners"],
                     "H": diloco["config"]["H"], "P": diloco["config"]["P"],
                     "tau": diloco["config"]["tau"], "codec": diloco["config"]["codec"],
                     "model_parameters": diloco["model_parameters"], "diloco": ours, "dp": theirs,
                     "dp_over_diloco": theirs["bytes_per_token"] / ours["bytes_per_token"]})
    return {"anchor_dp_over_diloco": STREAMING_DILOCO_RATIO, "rows": rows}


# ---- 3: goodput under failures -------------------------------------------------------------

def scheduled_down_share(profile: Profile, mtbf: float, seed: int) -> float:
    """The share of learner time that `diloco sim --seed SEED` keeps learners down, from its
    failure schedule alone (the sim's Chaos, stepped as the sim polls; nothing is started)."""
    chaos = Chaos("learner", profile.goodput_learners, mtbf, profile.restart_delay, random.Random(seed), now=0.0)
    for tick in range(int(profile.goodput_seconds / SIM_POLL_SECONDS)):
        now = tick * SIM_POLL_SECONDS
        for index in chaos.due_kills(now):
            chaos.killed(index, now)
        for downtime in chaos.due_restarts(now):
            chaos.restarted(downtime, now)
    chaos.end(profile.goodput_seconds)
    return sum(chaos.down_seconds) / (profile.goodput_learners * profile.goodput_seconds)


def goodput_section(runner: Runner, profile: Profile) -> dict:
    """Each learner is SIGKILLed at exponential intervals and restarted after restart_delay:
    down for delay / (mtbf + delay) of the time on average. A short run holds only a few
    failures, so one schedule can miss that average by a factor of two: each rate runs with
    the first seed whose schedule is within a fifth of the target. dp and diloco get the same
    seed, so the same failure schedule (and the same model initialisation and data order)."""
    rows = []
    for share in profile.down_shares:
        mtbf = profile.restart_delay * (1 - share) / share
        seed = next(seed for seed in range(1, 1000)
                    if abs(scheduled_down_share(profile, mtbf, seed) - share) <= share / 5)
        flags = ["--learners", str(profile.goodput_learners), "--steps", "1000000",
                 "--duration", f"{profile.goodput_seconds:g}", "--chaos-mtbf", f"{mtbf:g}",
                 "--restart-delay", f"{profile.restart_delay:g}", "--seed", str(seed),
                 "--no-warm-restarts",  # a dp job's ranks restart as new processes: both modes pay the same start-up
                 *(arg for override in GOODPUT_OVERRIDES for arg in ("--set", override))]
        row = {"target_down_share": share, "chaos_mtbf_seconds": mtbf, "seed": seed}
        for mode in ("diloco", "dp"):
            report = runner.sim(f"goodput-{mode}-down{round(share * 100)}", [*flags, "--mode", mode],
                                config=GOODPUT_CONFIG)
            row[mode] = {"goodput": report["goodput"], "down_share": report["badput_seconds"]["down"] / report["provisioned_seconds"],
                         "badput_share": {k: v / report["provisioned_seconds"] for k, v in report["badput_seconds"].items()},
                         "restarts": report["restarts"]["learners"], "inner_steps": report["inner_steps"],
                         "final_eval_loss": report.get("final_eval_loss"),
                         "command": report["command"]}
        rows.append(row)
    return {"anchor": PAPER_GOODPUT, "config": GOODPUT_CONFIG, "learners": profile.goodput_learners,
            "seconds": profile.goodput_seconds,
            "restart_delay": profile.restart_delay, "rows": rows}


# ---- 9: planning at datacenter scale ---------------------------------------------------------

def plan_figures(result: dict) -> dict:
    """What the section shows of one planned run (the JSON of `diloco plan` has every figure)."""
    goodput = result["goodput"]
    return {"mode": result["mode"], "learners": result["learners"], "chips": result["chips"],
            "hours": result["seconds"] / 3600, "goodput": goodput["share"], "failures": result["failures"], "uptime": result["uptime"],
            "tokens": result["tokens"], "tokens_per_second": result["tokens_per_second"],
            "badput_share": {k: v / goodput["provisioned_seconds"] for k, v in goodput["badput_seconds"].items()},
            "wan_gbps_mean_peak": [result["bandwidth"]["mean_gbps"], result["bandwidth"]["peak_gbps"]]
            if result["bandwidth"] else None, "speed": result["speed"]}


def plan_section(runner: Runner, profile: Profile) -> dict:
    """Goodput of every mode at every fleet size and M under each failure model, and the
    planner's own speed on one day of 2.4M chips at M = 16 (the example's links: 5 Gbit/s)."""
    models = []
    for name, flags in PLAN_FAILURE_MODELS.items():
        run = runner.plan(f"plan-{name}", [*flags, *profile.plan])
        models.append({"name": name, "flags": list(flags), "command": run["command"],
                       "rows": [plan_figures(result) for result in run["results"]]})
    speed = runner.plan("plan-speed", list(profile.plan_speed))
    point = runner.plan("plan-paper-point", list(PAPER_POINT))
    return {"config": PLAN_CONFIG, "paper": PAPER_PLAN, "models": models,
            "speed": {"command": speed["command"], "rows": [plan_figures(result) for result in speed["results"]]},
            "paper_point": {"command": point["command"], "paper_speedup": PAPER_SPEEDUP,
                            "rows": [plan_figures(result) for result in point["results"]]}}


def suggest_section(runner: Runner) -> dict:
    """The settings `diloco plan --suggest` proposes at the seeds' point, every candidate with
    what the planner predicts for it, best first."""
    run = runner.plan("plan-suggest", list(SUGGEST_POINT))
    (point,) = run["results"]
    best = point["suggestions"][0]
    return {**point, "command": run["command"], "targets": SUGGEST_TARGETS,
            "met": all(best[key] >= target for key, target in SUGGEST_TARGETS.items())}


# ---- 10: the planner against the local cluster ----------------------------------------------

def calibration_runs(profile: Profile) -> list[tuple[str, list[str]]]:
    """(name, flags of diloco sim) of each calibration run: every failure rate, then the middle
    one with shard kills and with mixed links."""
    middle = profile.calibration_mtbfs[len(profile.calibration_mtbfs) // 2]
    runs = [(f"mtbf{mtbf:g}", ["--chaos-mtbf", f"{mtbf:g}", *CALIBRATION_LINKS]) for mtbf in profile.calibration_mtbfs]
    return runs + [("shard-kills", ["--chaos-mtbf", f"{middle:g}", "--chaos-shards", f"{profile.calibration_shard_mtbf:g}",
                                    *CALIBRATION_LINKS]),
                   ("mixed-links", ["--chaos-mtbf", f"{middle:g}", *CALIBRATION_MIXED_LINKS])]


def calibration_section(runner: Runner, profile: Profile) -> dict:
    """Each run of the demo's cluster under kills, then the planner configured from its report
    (its measured step and start-up times, links, kills) beside what it measured. One seed each;
    the machine's load during each run is kept (other tenants share its cores)."""
    rows = []
    for name, flags in calibration_runs(profile):
        sim_name = f"calibration-{name}"
        report = runner.sim(sim_name, ["--learners", str(profile.goodput_learners), "--steps", "1000000",
                                       "--duration", f"{profile.calibration_seconds:g}",
                                       "--restart-delay", f"{profile.restart_delay:g}", "--seed", "1", *flags],
                            config=GOODPUT_CONFIG)
        load = os.getloadavg()[0]
        planned = runner.calibrate(f"{sim_name}-plan", sim_name)
        rows.append({"name": name, "command": report["command"], "load_1min": load, "rows": planned["rows"],
                     "learner_kills": len(planned["inputs"]["failures"]),
                     "shard_kills": len(planned["inputs"]["shard_outages"]),
                     "step_seconds": planned["inputs"]["step_seconds"],
                     "startup_seconds": planned["inputs"]["startup_seconds"]})
    return {"config": GOODPUT_CONFIG, "seconds": profile.calibration_seconds, "restart_delay": profile.restart_delay,
            "plan_command": "diloco plan --calibrate-from REPORT", "rows": rows,
            "dp_rows": [calibrated_dp(runner, name, flags) for name, flags in dp_calibration_runs(profile)]}


def dp_calibration_runs(profile: Profile) -> list[tuple[str, list[str]]]:
    """(name, flags of diloco sim) of data parallel's runs: its all-reduce over the same links."""
    steps = profile.calibration_dp_steps
    return [("dp-20", ["--mode", "dp", "--steps", str(steps), *CALIBRATION_LINKS]),
            ("dp-mixed-links", ["--mode", "dp", "--steps", str(max(1, steps // 2)), *CALIBRATION_MIXED_LINKS])]


def calibrated_dp(runner: Runner, name: str, flags: list[str]) -> dict:
    """A data-parallel job of the demo's cluster over capped links, and the planner's dp beside it."""
    sim_name = f"calibration-{name}"
    report = runner.sim(sim_name, ["--learners", "4", "--seed", "1", *flags], config=GOODPUT_CONFIG)
    planned = runner.calibrate(f"{sim_name}-plan", sim_name)
    return {"name": name, "command": report["command"], "load_1min": os.getloadavg()[0], "rows": planned["rows"],
            "compute_seconds": planned["inputs"]["step_seconds"][0],
            "backward_share": planned["inputs"]["backward_share"]}


# ---- the machine and the whole run ---------------------------------------------------------

def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    memory_kb = next(int(line.split()[1]) for line in pathlib.Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(memory_kb / 2**20, 1), "torch": torch.__version__,
            "python": platform.python_version(), "os": platform.platform(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def merged(previous: dict, fresh: dict, sections: list[str]) -> dict:
    """`previous` results with `sections` taken from the `fresh` run. The header keeps the run
    that made the rest; `later_runs` says which sections came from which later run, so that no
    figure is credited to a machine, date or commit it was not measured on."""
    later = {"sections": sections, **{key: fresh[key] for key in ("profile", "machine", "runner")}}
    earlier = [{**run, "sections": [s for s in run["sections"] if s not in sections]}
               for run in previous.get("later_runs", [])]
    return {**previous, **{name: fresh[name] for name in sections},
            "later_runs": [run for run in earlier if run["sections"]] + [later]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a few minutes, for development")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=str(ROOT), help="where BENCHMARKS.md, bench/results.json and bench/plots/ go")
    parser.add_argument("--merge", action="store_true",
                        help="replace only these sections in the existing bench/results.json under --out")
    parser.add_argument("--work", default=str(ROOT / ".diloco" / "bench"), help="run directories and raw reports")
    args = parser.parse_args()
    wanted = args.sections.split(",")
    if unknown := set(wanted) - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    profile = QUICK if args.quick else FULL
    runner = Runner(pathlib.Path(args.work))
    started = time.monotonic()
    results: dict = {"machine": machine(), "profile": profile.name}
    if "quality" in wanted or "bandwidth" in wanted:
        runs = quality_runs(runner, profile)
        if "quality" in wanted:
            results["quality"] = quality_section(runs)
        if "bandwidth" in wanted:
            results["bandwidth"] = bandwidth_section(runs)
    if "user_quality" in wanted:
        results["user_quality"] = {"runs": [runner.script(f"user_quality-{i}", "bench/user_quality.py", args,
                                                          timeout=4 * 3600)
                                            for i, args in enumerate(profile.user_quality)]}
    if "goodput" in wanted:
        results["goodput"] = goodput_section(runner, profile)
    if "overlap" in wanted:
        results["overlap"] = runner.script("overlap", "bench/overlap.py", profile.overlap)
    if "transport" in wanted:
        results["transport"] = {**runner.script("transport", "bench/syncer_push.py", profile.transport),
                                "scale": runner.script("transport-scale", "bench/syncer_scale.py", profile.scale)}
    if "recovery" in wanted:
        results["recovery"] = runner.script("recovery", "bench/recovery.py", profile.recovery)
    if "user_loop" in wanted:
        results["user_loop"] = {**runner.script("user_loop", "bench/user_loop.py", profile.user_loop),
                                "gpu_shaped": runner.script("user_loop-gpu-shaped", "bench/user_loop.py",
                                                            profile.gpu_shaped),
                                "gpu_shaped_kept": runner.script("user_loop-gpu-shaped-kept", "bench/user_loop.py",
                                                                 (*profile.gpu_shaped, "--keep-freed-memory"))}
    if "hf" in wanted:
        results["hf"] = runner.script("hf", "bench/hf_overlap.py", profile.hf)
    if "plan" in wanted:
        results["plan"] = plan_section(runner, profile)
    if "suggest" in wanted:
        results["suggest"] = suggest_section(runner)
    if "calibration" in wanted:
        results["calibration"] = calibration_section(runner, profile)
    if "island" in wanted:
        results["island"] = runner.script("island", "bench/island.py", profile.island)
    if "sick_learner" in wanted:
        results["sick_learner"] = runner.script("sick_learner", "bench/sick_learner.py", profile.sick_learner)
    if "kernel_links" in wanted:
        results["kernel_links"] = runner.script("kernel_links", "bench/kernel_links.py", profile.kernel_links)
    if "own_link" in wanted:
        results["own_link"] = runner.script("own_link", "bench/own_link.py", profile.own_link)
    if "split_downlink" in wanted:
        results["split_downlink"] = runner.script("split_downlink", "bench/split_downlink.py", profile.split_downlink)
    results["runner"] = {"command": shlex.join(["python", "bench/run_all.py", *sys.argv[1:]]),
                         "wall_seconds": time.monotonic() - started}
    out = pathlib.Path(args.out)
    (out / "bench").mkdir(parents=True, exist_ok=True)
    written = merged(json.loads((out / "bench" / "results.json").read_text()), results, wanted) if args.merge else results
    (out / "bench" / "results.json").write_text(json.dumps(written, indent=1))
    render(written, out)
    if out.resolve() == ROOT.resolve():  # the figures the README and docs quote
        doc_figures.rewrite(written)
    print(f"done in {results['runner']['wall_seconds'] / 60:.1f} min: {out / 'BENCHMARKS.md'}, "
          f"{out / 'bench' / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
