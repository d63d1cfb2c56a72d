"""The same links two ways: paced by the learners (localcluster/wan.py) and shaped by the kernel
(`diloco sim --kernel-links`: network namespaces, tc tbf).

    python bench/kernel_links.py [--steps 300] [--seeds 1 2 3] [--json PATH]      (root)

`diloco sim` runs of the demo's cluster (examples/local-4-regions.yaml: 4 learners, 2 shards,
H=50, P=4, int4) on mixed links, each way per region (us-east 50/100, us-west 5/20, us-central
20/20, us-south 2/10 Mbit/s), once per seed with each kind of link. Per run: goodput, the
learners' blocked seconds, the global model's loss, and per learner the rate its pushes and
pulls achieved (bytes over their time on the wire) and, with kernel links, the bytes the
kernel let through each way. Target (issue 56): goodput and blocked share within a few points
of each other, the median over seeds (one seed's kernel runs have ranged 11 points), or the
difference explained. This kernel has no netem: no latency either way.
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

CONFIG = "examples/local-4-regions.yaml"
LINKS = "us-east=50/100,us-west=5/20,us-central=20,us-south=2/10"
GOODPUT_POINTS = 0.03  # "within a few points"


def figures(command: str, report: dict) -> dict:
    provisioned = report["provisioned_seconds"]
    return {
        "command": command,
        "goodput": report["goodput"],
        "blocked_share": report["badput_seconds"]["blocked"] / provisioned,
        "blocked_seconds": sum(l["blocked_seconds"] for l in report["per_learner"].values()),
        "final_eval_loss": report["final_eval_loss"],
        "state_hashes_agree": report["state_hashes_agree"],
        "learner_links": {learner_id: {key: link.get(key) for key in ("up_mbps", "down_mbps", "bytes", "bytes_per_second",
                                                              "kernel_bytes_up", "kernel_bytes_down")}
                  for learner_id, link in report["links"].items()},
    }


def main() -> int:
    args = seeded_args(__doc__, steps=300)
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for kind, flags in (("paced", []), ("kernel", ["--kernel-links"])):
                command, report = sim(CONFIG, pathlib.Path(work) / f"{seed}-{kind}",
                                      ["--steps", str(args.steps), "--seed", str(seed), "--wan-mbps", LINKS, *flags])
                runs.append({"seed": seed, "shaping": kind, **figures(" ".join(command), report)})
                print(json.dumps({k: runs[-1][k] for k in ("seed", "shaping", "goodput", "blocked_share",
                                                           "final_eval_loss")}), flush=True)
    by = {(run["seed"], run["shaping"]): run for run in runs}
    differences = [by[seed, "kernel"]["goodput"] - by[seed, "paced"]["goodput"] for seed in args.seeds]
    blocked = [by[seed, "kernel"]["blocked_share"] - by[seed, "paced"]["blocked_share"] for seed in args.seeds]
    result = {"steps": args.steps, "seeds": args.seeds, "links": LINKS, "runs": runs,
              "command": seeded_command("bench/kernel_links.py", args),
              "goodput_kernel_minus_paced": differences, "blocked_kernel_minus_paced": blocked,
              "median_goodput_difference": statistics.median(differences),
              "median_blocked_difference": statistics.median(blocked), "goodput_points": GOODPUT_POINTS}
    result["met"] = max(abs(result["median_goodput_difference"]), abs(result["median_blocked_difference"])) <= GOODPUT_POINTS
    print(f"goodput, kernel less paced: {', '.join(f'{d * 100:+.1f}' for d in differences)} points (median "
          f"{result['median_goodput_difference'] * 100:+.1f}); blocked share {', '.join(f'{d * 100:+.1f}' for d in blocked)} "
          f"points (median {result['median_blocked_difference'] * 100:+.1f}; within {GOODPUT_POINTS:.0%}: {result['met']})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
