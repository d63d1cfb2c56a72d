"""Overlap: inner-step time with fragment syncs in flight against the same loop with sync
switched off, measured in one run of this script.

    python bench/overlap.py [--steps 300] [--repeats 3] [--wan-mbps 0 100] [--json PATH]

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

from bench.one_learner import one_learner_config  # noqa: E402
from diloco.services.client import ShardClient  # noqa: E402
from diloco.localcluster.cluster import LocalCluster  # noqa: E402
from diloco.services.contract.codecs import get_codec  # noqa: E402


def bench_config(state_dir: pathlib.Path, steps: int, wan_mbps: float | None):
    """The demo's config, one learner; no evaluation or checkpoint inside the measured steps."""
    return one_learner_config(ROOT / "examples" / "local-4-regions.yaml", state_dir, steps,
                              trainer={"eval_every": 10_000, "checkpoint_every": 10_000}, rpc={"wan_mbps": wan_mbps})


def loop_step_seconds(cluster: LocalCluster, state_dir: pathlib.Path,
                      extra_args: list[str]) -> tuple[float, dict]:
    """Runs a fresh learner to the end of its budget; mean loop seconds per step, its record."""
    learner = cluster.cfg.learners[0]
    command = [sys.executable, "-m", "diloco", "learner", "--config", str(cluster.config_path),
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
    parser.add_argument("--json", help="also write the figures here (bench/run_all.py reads them)")
    args = parser.parse_args()
    cfg = bench_config(pathlib.Path("/tmp"), args.steps, None)
    rows = [measure_link(mbps, args.steps, args.repeats) for mbps in args.wan_mbps]
    print(f"overlap: H={cfg.sync.interval_steps} P={cfg.sync.fragments} tau={cfg.sync.overlap_steps} "
          f"codec={cfg.sync.codec}, {args.steps} steps, median of {args.repeats} alternating runs")
    print(f"{'link':>10} {'sync off ms/step':>17} {'sync on ms/step':>16} {'ratio':>7} "
          f"{'blocked ms/step':>16} {'bytes/step':>11} {'utilisation':>12}  target")
    for row in rows:
        link = f"{row['wan_mbps']:g} Mb/s" if row["wan_mbps"] else "loopback"
        verdict = "PASS" if row["ratio"] <= 1.05 else "FAIL"
        print(f"{link:>10} {row['sync_off_step_seconds'] * 1e3:17.2f} {row['sync_on_step_seconds'] * 1e3:16.2f} "
              f"{row['ratio']:7.3f} {row['blocked_step_seconds'] * 1e3:16.2f} {row['bytes_per_step']:11.0f} "
              f"{row['utilisation']:12.1%}  <= 1.05 {verdict}")
    # A fragment's sync (its compressed outer gradient up, one compressed update down) must
    # cross the link within tau steps of compute, or the learner blocks: the least bandwidth
    # that keeps the loop at full speed.
    fragment_numel = rows[0]["model_parameters"] // cfg.sync.fragments
    bytes_per_sync = 2 * get_codec(cfg.sync.codec).encoded_size(fragment_numel, cfg.sync.codec_block_size)
    step_seconds = statistics.median(r["sync_off_step_seconds"] for r in rows)
    needed_mbps = bytes_per_sync * 8 / (cfg.sync.overlap_steps * step_seconds) / 1e6
    print(f"a sync moves {bytes_per_sync / 1e3:.0f} kB; to cross within tau={cfg.sync.overlap_steps} steps of "
          f"{step_seconds * 1e3:.0f} ms the link needs about {needed_mbps:.1f} Mb/s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "H": cfg.sync.interval_steps, "P": cfg.sync.fragments, "tau": cfg.sync.overlap_steps,
            "codec": cfg.sync.codec, "model_parameters": rows[0]["model_parameters"], "steps": args.steps,
            "repeats": args.repeats, "bytes_per_sync": bytes_per_sync, "needed_mbps": needed_mbps,
            "links": rows}, indent=1))
    return 0


def measure_link(mbps: float, steps: int, repeats: int) -> dict:
    """Median loop seconds per step with sync off and on, over `repeats` alternating pairs of runs."""
    off, on, blocked, moved = [], [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = bench_config(pathlib.Path(tmp) / "state", steps, mbps or None)
            cluster = LocalCluster(cfg, pathlib.Path(tmp) / "run")
            try:
                cluster.start_shards()
                off.append(loop_step_seconds(cluster, pathlib.Path(tmp) / "off", ["--no-sync"])[0])
                seconds, life = loop_step_seconds(cluster, pathlib.Path(tmp) / "on", [])
                on.append(seconds)
                blocked.append(life["blocked_seconds"] / life["steps"])
                moved.append((life["bytes_up"] + life["bytes_down"]) / life["steps"])
                with ShardClient(cfg.shards[0].address, cfg.rpc, identity=cluster.operator) as client:
                    numel = sum(f.numel for f in client.status(timeout=10).fragments)
            finally:
                cluster.stop()
    ratio = statistics.median(on) / statistics.median(off)
    return {"wan_mbps": mbps, "sync_off_step_seconds": statistics.median(off),
            "sync_on_step_seconds": statistics.median(on), "ratio": ratio, "utilisation": 1 / ratio,
            "blocked_step_seconds": statistics.median(blocked), "bytes_per_step": statistics.median(moved),
            "model_parameters": numel}


if __name__ == "__main__":
    sys.exit(main())
