"""The global model of a user's own loop against data parallel: BENCHMARKS.md section 1's user-loop rows.

    python bench/user_quality.py [--steps 600] [--intervals 10 25 50] [--seeds 1 2 3] [--json PATH]

`diloco sim` runs of bench/user_llama.yaml: a transformers LlamaForCausalLM in a plain loop
with torch AdamW (bench/plain_loop.py), 4 learners, on the transformers package's own sources.
Data parallel (`--mode dp`: the 4 learners as one torch.distributed job, gradients averaged
every step, one AdamW) runs with its lr at each of --lr-multipliers x the learners' (seed 1);
the best is the baseline, run again for every seed. Each H runs seed 1; the headline H every
seed, and once more with `sync.max_block_seconds=0` (learners that never wait for a result).
One learner alone trains one learner's share of the tokens. --ablations runs the headline H
again for seed 1 with one setting changed at a time (ABLATIONS). Per run: the global model's final
validation loss (what `diloco export` gives), the learners' own models just before they left,
and the global model they held against their own over the run (`global_vs_local`).
Targets (issue 52): the global model at most the learners' own; within 5 % of the best data
parallel at 600 steps (3 % at 3,000); monotone in H; at least 5 % better than one learner alone;
not waiting within the seeds' spread of waiting.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.demo_sim import sim  # noqa: E402
from diloco.services.contract.config import load_config  # noqa: E402

CONFIG = "bench/user_llama.yaml"
SCRIPT = "bench/plain_loop.py"
LEARNERS = 4
# One setting changed at a time from bench/user_llama.yaml: the merge, and the DiLoCo paper's
# outer momentum with and without waiting for late results.
ABLATIONS = {"syncer.merge=mean": ["syncer.merge=mean"],
             "syncer.outer_optimizer.momentum=0.9": ["syncer.outer_optimizer.momentum=0.9"],
             "momentum 0.9, sync.max_block_seconds=0": ["syncer.outer_optimizer.momentum=0.9",
                                                        "sync.max_block_seconds=0"]}
DP_TARGET = {600: 0.05, 3000: 0.03}  # the global model within this of the best data parallel
ALONE_MARGIN = 0.05


def figures(command: list[str], report: dict) -> dict:
    return {"command": " ".join(command), "final_eval_loss": report["final_eval_loss"],
            "final_eval_loss_learners": report["final_eval_loss_learners"],
            "global_vs_local": report.get("global_vs_local", []), "goodput": report["goodput"],
            "tokens": report["tokens"], "wall_seconds": report["wall_seconds"]}


def median_row(runs: list[dict]) -> dict:
    losses = [run["final_eval_loss"] for run in runs]
    own = [run["final_eval_loss_learners"] for run in runs if run["final_eval_loss_learners"] is not None]
    return {"seeds": [run["seed"] for run in runs], "loss": statistics.median(losses),
            "low": min(losses), "high": max(losses), "learners": statistics.median(own) if own else None,
            "command": runs[0]["command"], "curve": runs[0]["global_vs_local"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--intervals", type=int, nargs="+", default=[10, 25, 50], help="H of each diloco row")
    parser.add_argument("--headline", type=int, default=25, help="the H run with every seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--lr-multipliers", type=float, nargs="+", default=[1, 2, 4],
                        help="data parallel's lr as these times the learners'; the best is the baseline")
    parser.add_argument("--no-wait-row", action=argparse.BooleanOptionalAction, default=True,
                        help="the headline H again with sync.max_block_seconds=0")
    parser.add_argument("--ablations", action="store_true", help="the headline H with each of ABLATIONS, seed 1")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    lr = load_config(ROOT / CONFIG).trainer.inner_optimizer.lr
    common = ["--learners", str(LEARNERS), "--shards", "1", "--steps", str(args.steps),
              "--set", f"syncer.quorum={LEARNERS}"]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        def run(kind: str, seed: int, flags: list[str], **labels) -> dict:
            run_dir = pathlib.Path(work) / f"{kind}-{seed}-{len(runs)}"
            command, report = sim(CONFIG, run_dir, ["--seed", str(seed), *flags])
            result = {"kind": kind, "seed": seed, **labels, **figures(command, report)}
            runs.append(result)
            print(json.dumps({k: result[k] for k in ("kind", "seed", *labels, "final_eval_loss",
                                                     "final_eval_loss_learners")}), flush=True)
            return result

        dp = [run("dp", args.seeds[0], [*common, "--mode", "dp", "--set", f"trainer.inner_optimizer.lr={m * lr}"],
                  lr_multiplier=m) for m in args.lr_multipliers]
        best = min(dp, key=lambda r: r["final_eval_loss"])["lr_multiplier"]
        dp_flags = [*common, "--mode", "dp", "--set", f"trainer.inner_optimizer.lr={best * lr}"]
        for seed in args.seeds[1:]:
            run("dp", seed, dp_flags, lr_multiplier=best)
        for H in args.intervals:
            for seed in args.seeds if H == args.headline else args.seeds[:1]:
                run("diloco", seed, [*common, "--learner-script", SCRIPT, "--set", f"sync.interval_steps={H}"],
                    H=H, max_block_seconds=None)
        if args.no_wait_row:
            for seed in args.seeds:
                run("diloco", seed, [*common, "--learner-script", SCRIPT, "--set", f"sync.interval_steps={args.headline}",
                                     "--set", "sync.max_block_seconds=0"], H=args.headline, max_block_seconds=0.0)
        if args.ablations:
            for name, sets in ABLATIONS.items():
                run("ablation", args.seeds[0], [*common, "--learner-script", SCRIPT, "--set",
                                                f"sync.interval_steps={args.headline}",
                                                *(flag for key in sets for flag in ("--set", key))], setting=name)
        alone = run("alone", args.seeds[0], ["--learners", "1", "--shards", "1", "--steps", str(args.steps),
                                             "--mode", "dp"])

    dp_row = median_row([r for r in runs if r["kind"] == "dp" and r["lr_multiplier"] == best])
    rows = []
    for H in args.intervals:
        for wait in (None, 0.0):
            chosen = [r for r in runs if r["kind"] == "diloco" and r["H"] == H and r["max_block_seconds"] == wait]
            if chosen:
                row = {"H": H, "max_block_seconds": wait, **median_row(chosen)}
                row["vs_dp"] = row["loss"] / dp_row["loss"] - 1
                row["vs_alone"] = row["loss"] / alone["final_eval_loss"] - 1
                row["vs_learners"] = row["loss"] / row["learners"] - 1 if row["learners"] else None
                rows.append(row)
    waiting = [r for r in rows if r["max_block_seconds"] is None]
    headline = next(r for r in waiting if r["H"] == args.headline)
    no_wait = next((r for r in rows if r["max_block_seconds"] == 0.0), None)
    spread = max(headline["high"] - headline["low"], dp_row["high"] - dp_row["low"])
    target = DP_TARGET.get(args.steps, DP_TARGET[3000])
    result = {
        "steps": args.steps, "learners": LEARNERS, "seeds": args.seeds, "config": CONFIG, "script": SCRIPT,
        "lr": lr, "dp_by_lr": {str(r["lr_multiplier"]): r["final_eval_loss"] for r in dp}, "dp_best_multiplier": best,
        "dp": dp_row, "alone": {"loss": alone["final_eval_loss"], "command": alone["command"]}, "rows": rows,
        "runs": runs, "dp_target": target, "alone_margin": ALONE_MARGIN,
        "ablations": [{"setting": r["setting"], "loss": r["final_eval_loss"], "learners": r["final_eval_loss_learners"],
                       "vs_dp": r["final_eval_loss"] / dp_row["loss"] - 1, "command": r["command"]}
                      for r in runs if r["kind"] == "ablation"],
        "global_at_most_learners": all(r["vs_learners"] is not None and r["vs_learners"] <= 0 for r in rows),
        "monotone": all(a["loss"] <= b["loss"] + spread for a, b in zip(waiting, waiting[1:])),
        "spread": spread,
        "no_wait_vs_wait": no_wait["loss"] - headline["loss"] if no_wait else None,
    }
    result["met"] = {
        "global_at_most_learners": result["global_at_most_learners"],
        "vs_dp": all(r["vs_dp"] <= target for r in waiting),
        "monotone": result["monotone"],
        "vs_alone": all(r["vs_alone"] <= -ALONE_MARGIN for r in rows),
        "no_wait": no_wait is None or abs(result["no_wait_vs_wait"]) <= spread,
    }
    print(f"data parallel (lr x{best:g}): {dp_row['loss']:.4f}; one learner alone {alone['final_eval_loss']:.4f}")
    for row in rows:
        print(f"H={row['H']}{' no waiting' if row['max_block_seconds'] == 0.0 else ''}: global {row['loss']:.4f} "
              f"({row['low']:.4f}-{row['high']:.4f}, seeds {row['seeds']}), learners' own {row['learners']:.4f}, "
              f"vs dp {row['vs_dp']:+.1%} (target <= {target:.0%}), vs alone {row['vs_alone']:+.1%}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(result["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
