"""Mixed links against uniform fast links, and a learner that does not wait for its own slow
link (`sync.wait_for_own_link: false`).

    python bench/own_link.py [--steps 600] [--seeds 1 2 3] [--json PATH]

`diloco sim` runs of the demo's cluster (examples/local-4-regions.yaml: 4 learners, 2 shards,
H=50, P=4, tau=3, K=4, int4), per seed: on uncapped links ("uniform fast"); on the mixed links
of bench/kernel_links.py, paced by the learners (us-east 50/100, us-west 5/20, us-central 20/20,
us-south 2/10 Mbit/s), once with every learner waiting for its results ("mixed, waits") and
once with a learner whose own push and pull outlast tau steps training on and merging them late
("mixed, own link late": in effect its own tau, the progress trained meanwhile kept); and both
the uniform and the own-link runs again with every wait capped at one of the learner's steps
(`sync.max_block_steps: 1`, "... wait <= 1 step": a result late by the learners' jitter is
merged a step late). Per run: the global model's loss, goodput, the share of provisioned time
blocked, and per learner its blocked seconds. Target (issue 53): mixed links with the learners'
own tau and the capped wait within the seed spread of uniform fast links at the default, in
quality, and <= 2 % of the time blocked.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.demo_sim import seeded_args, seeded_command, sim  # noqa: E402
from bench.kernel_links import CONFIG, LINKS  # noqa: E402

OWN_LINK_LATE = ["--wan-mbps", LINKS, "--set", "sync.wait_for_own_link=false"]
ONE_STEP_WAIT = ["--set", "sync.max_block_steps=1"]
KINDS = {"uniform fast": [], "mixed, waits": ["--wan-mbps", LINKS], "mixed, own link late": OWN_LINK_LATE,
         "uniform fast, wait <= 1 step": ONE_STEP_WAIT, "mixed, own link late, wait <= 1 step": OWN_LINK_LATE + ONE_STEP_WAIT}
TARGET_KIND = "mixed, own link late, wait <= 1 step"
BLOCKED_TARGET = 0.02


def figures(command: list[str], report: dict) -> dict:
    return {"command": " ".join(command), "final_eval_loss": report["final_eval_loss"], "goodput": report["goodput"],
            "blocked_share": report["badput_seconds"]["blocked"] / report["provisioned_seconds"],
            "learners": {lid: {key: learner.get(key) for key in ("blocked_seconds", "push_seconds", "step_seconds")}
                         for lid, learner in report["per_learner"].items()}}


def main() -> int:
    args = seeded_args(__doc__, steps=600)
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for kind, flags in KINDS.items():
                command, report = sim(CONFIG, pathlib.Path(work) / f"{seed}-{len(runs)}",
                                      ["--steps", str(args.steps), "--seed", str(seed), *flags])
                runs.append({"seed": seed, "kind": kind, **figures(command, report)})
                print(json.dumps({k: runs[-1][k] for k in ("seed", "kind", "final_eval_loss", "goodput",
                                                           "blocked_share")}), flush=True)
    loss = {kind: [r["final_eval_loss"] for r in runs if r["kind"] == kind] for kind in KINDS}
    blocked = {kind: statistics.median(r["blocked_share"] for r in runs if r["kind"] == kind) for kind in KINDS}
    uniform = (min(loss["uniform fast"]), max(loss["uniform fast"]))
    own = statistics.median(loss[TARGET_KIND])
    result = {"steps": args.steps, "seeds": args.seeds, "links": LINKS, "runs": runs,
              "command": seeded_command("bench/own_link.py", args),
              "median_loss": {kind: statistics.median(values) for kind, values in loss.items()},
              "uniform_loss_range": uniform, "median_blocked_share": blocked, "blocked_target": BLOCKED_TARGET,
              "target_kind": TARGET_KIND, "met": uniform[0] <= own <= uniform[1] and blocked[TARGET_KIND] <= BLOCKED_TARGET}
    for kind in KINDS:
        print(f"{kind}: global loss median {result['median_loss'][kind]:.4f} "
              f"({', '.join(f'{v:.4f}' for v in loss[kind])}); blocked share median {blocked[kind]:.1%}")
    print(f"{TARGET_KIND} within the uniform runs' spread ({uniform[0]:.4f}-{uniform[1]:.4f}) and <= "
          f"{BLOCKED_TARGET:.0%} blocked: {result['met']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
