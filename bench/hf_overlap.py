"""Overlap with a Hugging Face model: inner-step time of examples/hf/train.py (a tiny
LlamaForCausalLM in its user's own loop, AdamW, CPU) with sync on against the same script with
`--no-sync` (DecoupledDiLoCo(enabled=False)).

    python bench/hf_overlap.py [--steps 300] [--repeats 3] [--json PATH]

One shard and one learner, so every round closes as soon as the learner's contribution
arrives; a fresh shard for every pair of runs. Runs alternate (sync off, sync on, ...) so
machine noise hits both alike; the ratio is of the medians of the mean loop seconds per step
(the user's step plus `sync.step()`, as the learner's report counts them). Target: <= 1.02.
bench/run_all.py runs it as its section 8.
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
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.one_learner import one_learner_config  # noqa: E402
from diloco.localcluster.cluster import LocalCluster  # noqa: E402

EXAMPLE = ROOT / "examples" / "hf"
TARGET_RATIO = 1.02


def seconds_per_step(cluster: LocalCluster, *flags: str) -> float:
    """Runs the example to the end of its budget; its mean loop seconds per step."""
    learner_id = cluster.cfg.learners[0].id
    subprocess.run([sys.executable, str(EXAMPLE / "train.py"), "--config", str(cluster.config_path),
                    "--learner-id", learner_id, "--catch-up-seconds", "0", *flags],
                   check=True, capture_output=True, timeout=1800)
    life = json.loads(cluster.learner_report_path(learner_id).read_text())["incarnations"][-1]
    return life["loop_seconds"] / life["steps"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here (bench/run_all.py reads them)")
    args = parser.parse_args()
    off, on = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = one_learner_config(EXAMPLE / "cluster.yaml", pathlib.Path(tmp) / "state", args.steps)
            cluster = LocalCluster(cfg, pathlib.Path(tmp) / "run")
            try:
                cluster.start_shards()
                off.append(seconds_per_step(cluster, "--no-sync"))
                on.append(seconds_per_step(cluster))
            finally:
                cluster.stop()
    result = {"steps": args.steps, "repeats": args.repeats, "target_ratio": TARGET_RATIO, "H": cfg.sync.interval_steps,
              "P": cfg.sync.fragments, "tau": cfg.sync.overlap_steps, "codec": cfg.sync.codec,
              "sync_off_step_seconds": statistics.median(off),
              "sync_on_step_seconds": statistics.median(on), "ratio": statistics.median(on) / statistics.median(off),
              "pair_ratios": [b / a for a, b in zip(off, on)], "runs_off": off, "runs_on": on}
    print(f"HF LlamaForCausalLM (examples/hf/train.py), CPU, {args.steps} steps, median of {args.repeats} "
          f"alternating pairs: sync off {1e3 * result['sync_off_step_seconds']:.1f} ms/step, sync on "
          f"{1e3 * result['sync_on_step_seconds']:.1f} ms/step, ratio {result['ratio']:.3f} (target <= {TARGET_RATIO})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
