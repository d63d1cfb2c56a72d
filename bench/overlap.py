"""Overlap: inner-step time with fragment syncs in flight against the same loop with sync
switched off, measured in one run of this script.

    python bench/overlap.py [--steps 300] [--repeats 3] [--wan-mbps 0 100]

One shard and one learner process (so every round closes as soon as the learner's
contribution arrives) train the demo model; the same learner is also run with
`--no-sync`. Runs alternate (sync off, sync on, ...) so machine noise hits both alike;
the table gives medians of the per-step loop time (the step plus starting and applying
syncs, including any wait for a late result). Target: ratio <= 1.05, i.e. >= 95 %
compute utilisation, on a link fast enough for a fragment to arrive within tau steps.
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

from services.cluster import LocalCluster, free_ports  # noqa: E402
from services.config import load_config, parse_config  # noqa: E402


def bench_config(state_dir: pathlib.Path, steps: int, wan_mbps: float | None):
    data = load_config(ROOT / "examples" / "local-4-regions.yaml").model_dump(mode="json")
    learner = data["learners"][0]
    data["learners"] = [{**learner, "metrics_port": 0}]
    data["shards"] = [{"address": f"127.0.0.1:{free_ports(1)[0]}", "metrics_port": 0}]
    data["run"]["state_dir"] = str(state_dir)
    data["syncer"]["quorum"] = 1
    data["trainer"].update(max_steps=steps, eval_every=10_000, checkpoint_every=10_000)
    data["rpc"]["wan_mbps"] = wan_mbps
    return parse_config(data, source="bench config")


def loop_step_seconds(cluster: LocalCluster, state_dir: pathlib.Path,
                      extra_args: list[str]) -> tuple[float, dict]:
    """Runs a fresh learner to the end of its budget; mean loop seconds per step, its record."""
    learner = cluster.cfg.learners[0]
    command = [sys.executable, "-m", "services.cli", "learner", "--config", str(cluster.config_path),
               "--learner-id", learner.id, "--region", learner.region, "--catch-up-seconds", "0",
               "--state-dir", str(state_dir), *extra_args]
    subprocess.run(command, check=True, capture_output=True, timeout=1800)
    report = json.loads((state_dir / "report.json").read_text())
    life = report["incarnations"][-1]
    return life["loop_seconds"] / life["steps"], life


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wan-mbps", type=float, nargs="+", default=[0.0],
                        help="link caps to measure (0: loopback, uncapped)")
    args = parser.parse_args()
    rows = []
    for mbps in args.wan_mbps:
        off, on, blocked, moved = [], [], [], []
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = bench_config(pathlib.Path(tmp) / "state", args.steps, mbps or None)
                cluster = LocalCluster(cfg, pathlib.Path(tmp) / "run")
                try:
                    cluster.start_shards()
                    off.append(loop_step_seconds(cluster, pathlib.Path(tmp) / "off", ["--no-sync"])[0])
                    seconds, life = loop_step_seconds(cluster, pathlib.Path(tmp) / "on", [])
                    on.append(seconds)
                    blocked.append(life["blocked_seconds"] / life["steps"])
                    moved.append((life["bytes_up"] + life["bytes_down"]) / life["steps"])
                finally:
                    cluster.stop()
        ratio = statistics.median(on) / statistics.median(off)
        rows.append((mbps, statistics.median(off), statistics.median(on), ratio,
                     statistics.median(blocked), statistics.median(moved)))
    cfg = bench_config(pathlib.Path("/tmp"), args.steps, None)
    print(f"overlap: H={cfg.sync.interval_steps} P={cfg.sync.fragments} tau={cfg.sync.overlap_steps} "
          f"codec={cfg.sync.codec}, {args.steps} steps, median of {args.repeats} alternating runs")
    print(f"{'link':>10} {'sync off ms/step':>17} {'sync on ms/step':>16} {'ratio':>7} "
          f"{'blocked ms/step':>16} {'bytes/step':>11} {'utilisation':>12}  target")
    for mbps, off_s, on_s, ratio, blocked_s, bytes_step in rows:
        link = f"{mbps:g} Mb/s" if mbps else "loopback"
        verdict = "PASS" if ratio <= 1.05 else "FAIL"
        print(f"{link:>10} {off_s * 1e3:17.2f} {on_s * 1e3:16.2f} {ratio:7.3f} {blocked_s * 1e3:16.2f} "
              f"{bytes_step:11.0f} {1 / ratio:12.1%}  <= 1.05 {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
