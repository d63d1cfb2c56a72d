"""Elastic islands, local: learner islands of replica groups losing groups in a `diloco sim` run.

    python bench/island.py [--replica-groups 2] [--chaos-replicas 30] [--chaos-islands 1] [--steps 600]
                           [--heartbeat-timeout 2] [--json PATH]

Two runs of the same `diloco sim` command on examples/local-4-regions.yaml with two learners,
each an island of R replica groups (learner/island/replica_groups.py): one without failures, one where
every group of the first learner's island, the leading one too, is SIGKILLed at exponential
intervals (`--chaos-replicas`, mean seconds per group) and restarted 3 s later. The second
learner loses nothing: its blocked seconds, against the run without failures, are what the
first island's losses cost the other learners. For each kill: the seconds until the island's
leader (a new one, where the leader was killed) trained a step without the group (the leader's
own record of the groups in each step) and, after the group's restart, until it trained with it
again. Then what the losses cost the run: the learners' blocked seconds (waiting for a round's
result) and the run's badput against the run without failures, the takeovers of a lead (each a
new incarnation of the learner, from its checkpoint), steps dropped, tokens, and whether every
group and the shards agree on the bits at the end.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def sim(run_dir: pathlib.Path, flags: list[str]) -> tuple[list[str], dict, dict[str, dict]]:
    """One `diloco sim` run: its command, its report and its learners' own reports."""
    command = ["diloco", "sim", "--config", "examples/local-4-regions.yaml", *flags]
    subprocess.run([sys.executable, "-m", "diloco", *command[1:], "--quiet", "--run-dir", str(run_dir)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    learners = {path.parent.name.removeprefix("learner-"): json.loads(path.read_text())
                for path in sorted(run_dir.glob("state/learner-*/report.json"))}
    return command, json.loads((run_dir / "report.json").read_text()), learners


def figures(report: dict, learners: dict[str, dict]) -> dict:
    recoveries = [r for island in report["islands"].values() for r in island["recoveries"]]
    trained_again = [r["trained_again_seconds"] for r in recoveries if r["trained_again_seconds"] is not None]
    rejoined = [r["rejoined_seconds_after_restart"] for r in recoveries
                if r["rejoined_seconds_after_restart"] is not None]
    return {
        "wall_seconds": report["wall_seconds"], "goodput": report["goodput"], "badput_seconds": report["badput_seconds"],
        "final_eval_loss": report["final_eval_loss"], "tokens": report["tokens"],
        "kills": len(recoveries), "recoveries": recoveries,
        "trained_again_seconds_median": statistics.median(trained_again) if trained_again else None,
        "trained_again_seconds_max": max(trained_again, default=None),
        "leader_kills": sum(r["led"] for r in recoveries),
        "trained_again_after_leader_kill_seconds": [r["trained_again_seconds"] for r in recoveries if r["led"]],
        "rejoined_seconds_median": statistics.median(rejoined) if rejoined else None,
        "dropped_steps": sum(island["dropped_steps"] for island in report["islands"].values()),
        "takeovers": sum(len(r["incarnations"]) - 1 for r in learners.values()),
        "blocked_seconds": {name: learner["blocked_seconds"] for name, learner in report["per_learner"].items()},
        "learner_restarts": report["restarts"]["learners"],
        "spared_learners": report["config"]["spared_islands"],  # their islands lost no group
        "state_hashes_agree": report["state_hashes_agree"],
        "groups_verified_identical": {name: (r.get("island", {}).get("verified") or {}).get("groups")
                                      for name, r in learners.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-groups", type=int, default=2)
    parser.add_argument("--chaos-replicas", type=float, default=30.0)
    parser.add_argument("--chaos-islands", type=int, default=1, help="how many learners' islands lose groups")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0,
                        help="island.heartbeat_timeout_seconds: how long a dead group's silence takes to notice")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a config override for both runs (diloco sim --set)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    flags = ["--learners", "2", "--replica-groups", str(args.replica_groups), "--steps", str(args.steps),
             "--seed", str(args.seed), "--restart-delay", "3",
             "--set", f"island.heartbeat_timeout_seconds={args.heartbeat_timeout}",
             *(flag for override in args.overrides for flag in ("--set", override))]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("without_failures", []), ("groups_killed", ["--chaos-replicas", str(args.chaos_replicas),
                                                                    "--chaos-islands", str(args.chaos_islands)])):
            command, report, learners = sim(pathlib.Path(tmp) / name, flags + extra)
            results[name] = {"command": " ".join(command), **figures(report, learners)}
    base, chaos = results["without_failures"], results["groups_killed"]
    print(f"{'':32} {'without failures':>18} {'groups killed':>18}")
    for key in ("wall_seconds", "goodput", "final_eval_loss", "tokens", "kills", "leader_kills", "takeovers",
                "dropped_steps", "learner_restarts"):
        print(f"{key:32} {base[key]!s:>18} {chaos[key]!s:>18}")
    for category in chaos["badput_seconds"]:
        print(f"{'badput s ' + category:32} {base['badput_seconds'][category]:18.1f} "
              f"{chaos['badput_seconds'][category]:18.1f}")
    for name in base["blocked_seconds"]:
        print(f"{'blocked seconds ' + name:32} {base['blocked_seconds'][name]:18.2f} {chaos['blocked_seconds'][name]:18.2f}")
    for name in chaos["spared_learners"]:
        print(f"{name} lost no group: blocked {chaos['blocked_seconds'][name]:.2f} s, "
              f"{base['blocked_seconds'][name]:.2f} s without failures")
    print(f"trained again after a kill: median {chaos['trained_again_seconds_median']} s, "
          f"max {chaos['trained_again_seconds_max']} s; with the group again {chaos['rejoined_seconds_median']} s "
          f"after its restart (median); after a leader's kill {chaos['trained_again_after_leader_kill_seconds']} s")
    print(f"state hashes agree: {base['state_hashes_agree']} / {chaos['state_hashes_agree']}; groups verified "
          f"identical at the end: {chaos['groups_verified_identical']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
