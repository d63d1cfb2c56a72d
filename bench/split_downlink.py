"""Split rounds' downlink: what learners pull against what they push when rounds close on a
quorum while one learner is slow, with the shards' default anchors (no value kept in memory
beyond the lineage's, the others in their state folders: `syncer.kept_anchors: 0`,
`syncer.spill_anchors: true`), and without the state folder, keeping one value per fragment or
one per learner in memory.

    python bench/split_downlink.py [--steps 900] [--seeds 1 2] [--json PATH]

`diloco sim` runs of the demo's cluster (examples/local-4-regions.yaml: 4 learners, 2 shards,
P=4, int4) with H=25, quorum 2 and learner 2 slowed (`--slow-learner 2`), per seed and setting.
Per run: bytes up and down on the learners' links, their ratio, and the ratio without the exact
final values each learner takes once at the end (a snapshot of every fragment its last pull
left off the shards' lineage: at most one fp32 model per learner), a fixed cost that a longer
run spreads thinner. What the shards answered the pulls with is counted too, how many of those
pulls came from an anchor whose value had been dropped, and what the shards wrote to and read
from their state folders for the anchors.
Target (issue 53): downlink <= 1.25 x uplink.
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
SPLIT = ["--set", "sync.interval_steps=25", "--set", "syncer.quorum=2", "--slow-learner", "2"]
# syncer.kept_anchors and syncer.spill_anchors: the default; without the state folder, one value
# per fragment (the default before the folder) and one per learner of the demo's 4
SETTINGS = ((0, True), (1, False), (4, False))
TARGET = 1.25


def anchors_setting(run: dict) -> str:
    """A run's anchor settings, as the report's table and summary name them."""
    return f"kept {run['kept_anchors']}, " + ("in the state folder" if run["spill_anchors"] else "no folder")


def figures(command: list[str], report: dict, kept: int, spill: bool) -> dict:
    up, down, end = report["bytes_up"], report["bytes_down"], report["bytes_down_exact_end"]
    return {"command": " ".join(command), "kept_anchors": kept, "spill_anchors": spill, "bytes_up": up,
            "bytes_down": down, "ratio": down / up, "ratio_without_end": (down - end) / up, "end_bytes": end,
            "pulls": report["pulls"], "anchor_values_missed": report["anchor_values_missed"],
            "anchor_spill": report["anchor_spill"], "final_eval_loss": report["final_eval_loss"]}


def main() -> int:
    args = seeded_args(__doc__, steps=900)
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for kept, spill in SETTINGS:
                settings = [] if (kept, spill) == SETTINGS[0] else [
                    "--set", f"syncer.kept_anchors={kept}", "--set", f"syncer.spill_anchors={str(spill).lower()}"]
                command, report = sim(CONFIG, pathlib.Path(work) / f"{seed}-{kept}-{spill}",
                                      ["--steps", str(args.steps), *SPLIT, "--seed", str(seed), *settings])
                runs.append({"seed": seed, **figures(command, report, kept, spill)})
                print(json.dumps({k: runs[-1][k] for k in ("seed", "kept_anchors", "spill_anchors", "ratio",
                                                           "ratio_without_end", "pulls")}), flush=True)
    by_setting: dict[str, list[dict]] = {}
    for run in runs:
        by_setting.setdefault(anchors_setting(run), []).append(run)
    median = {name: {key: statistics.median(r[key] for r in group) for key in ("ratio", "ratio_without_end")}
              for name, group in by_setting.items()}
    result = {"steps": args.steps, "seeds": args.seeds, "runs": runs, "target": TARGET,
              "command": seeded_command("bench/split_downlink.py", args),
              "met": median[anchors_setting(runs[0])]["ratio"] <= TARGET}  # the first setting: the default
    for name, m in median.items():
        print(f"{name}: downlink / uplink median {m['ratio']:.2f}, without the exact final values "
              f"{m['ratio_without_end']:.2f} (target <= {TARGET})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
