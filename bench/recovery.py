"""Recovery against model size: how long a SIGKILLed learner takes to train again, and a
SIGKILLed syncer shard to serve again.

    python bench/recovery.py [--sizes 2x128 4x256 4x512] [--kills 3] [--json PATH]

For each model size (layers x width of the built-in GPT) one shard and two learners run as
real processes (bench/cluster.yaml, H=10, a checkpoint every 10 steps). Once both train and
the fragments have moved, learner 0 is SIGKILLed and started again at once, `--kills` times:
"back to training" is the wall time from the new process's start until the shard sees it
step past the checkpoint it restored (heartbeats every 0.1 s), while the other learner keeps
moving the fragments on. The restarted learner's own record splits that time into start-up
(interpreter, torch, model, data, checkpoint) and restore (join, then pull the updates missed
while it was down: catch-up). Then the shard is SIGKILLed and started again `--kills` times:
"serving again" is the wall time from its start until its gRPC health check says SERVING,
having restored its fragments, optimizer state and update history from disk. Medians.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from diloco.learner.trainer.checkpoint import load_checkpoint  # noqa: E402
from diloco.services.client import ShardClient  # noqa: E402
from diloco.localcluster.cluster import LocalCluster, wait_serving  # noqa: E402
from diloco.localcluster.processes import free_ports
from diloco.services.contract.config import Config, load_config, parse_config  # noqa: E402
from diloco.services.contract.tls import Identity  # noqa: E402

POLL_SECONDS = 0.05


def size_config(state_dir: pathlib.Path, layers: int, width: int) -> Config:
    data = load_config(ROOT / "bench" / "cluster.yaml").model_dump(mode="json")
    data["shards"] = [{"address": f"127.0.0.1:{free_ports(1)[0]}", "metrics_port": 0}]
    data["learners"] = [{"id": f"learner-{i}", "region": "bench", "metrics_port": 0} for i in range(2)]
    data["run"]["state_dir"] = str(state_dir)
    data["sync"].update(interval_steps=10, fragments=4)
    data["trainer"].update(max_steps=1_000_000, batch_size=2, eval_every=1_000_000, checkpoint_every=10,
                           heartbeat_seconds=0.1)
    data["model"].update(n_layer=layers, n_embd=width, n_head=4)
    return parse_config(data, source="recovery bench config")


class Watch:
    """The shard's view of one learner, polled over the Status RPC."""

    def __init__(self, cfg: Config, identity: Identity | None):
        self.client = ShardClient(cfg.shards[0].address, cfg.rpc, identity=identity)

    def learner(self, learner_id: str):
        status = self.client.status(timeout=5)
        return next((l for l in status.learners if l.learner_id == learner_id), None), status

    def wait(self, condition, timeout: float = 300.0):
        """Polls until condition(learner-0 status, shard status) holds; returns the learner's."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            learner, status = self.learner("learner-0")
            if learner is not None and condition(learner, status):
                return learner
            time.sleep(POLL_SECONDS)
        raise TimeoutError("the cluster did not reach the expected state")


def measure_size(layers: int, width: int, kills: int, work: pathlib.Path) -> dict:
    cfg = size_config(work / "state", layers, width)
    cluster = LocalCluster(cfg, work / "run")
    learner = cluster.learners[0]
    checkpoint = cluster.learner_report_path("learner-0").with_name("checkpoint.pt")
    back_to_training, serving_again = [], []
    try:
        cluster.start_shards()
        cluster.start_learners()
        watch = Watch(cfg, cluster.operator)
        watch.wait(lambda l, s: l.last_step >= 20 and min(f.version for f in s.fragments) >= 1)
        numel = sum(f.numel for f in watch.learner("learner-0")[1].fragments)
        for _ in range(kills):
            old = watch.learner("learner-0")[0].incarnation
            learner.kill()
            restored = load_checkpoint(checkpoint)["step"]
            started = time.monotonic()
            learner.start()
            # Trained again: a new incarnation past the step it restored, which its heartbeats
            # report while it rejoins.
            watch.wait(lambda l, s: l.incarnation != old and l.last_step > restored)
            back_to_training.append(time.monotonic() - started)
            watch.wait(lambda l, s: l.last_step >= 15)  # a checkpoint behind it before the next kill
        for _ in range(kills):
            cluster.shards[0].kill()
            started = time.monotonic()
            cluster.shards[0].start()
            wait_serving(cfg.shards[0].address, timeout=300, identity=cluster.operator)
            serving_again.append(time.monotonic() - started)
            watch.wait(lambda l, s: True)  # answers Status before the next kill
        state_bytes = sum(f.stat().st_size for f in (work / "state" / "shard-0").rglob("*") if f.is_file())
        watch.client.close()
    finally:
        cluster.stop()
    report = json.loads(cluster.learner_report_path("learner-0").read_text())
    restarts = report["incarnations"][1:]
    return {"layers": layers, "width": width, "model_parameters": numel, "kills": kills,
            "learner_back_to_training_seconds": statistics.median(back_to_training),
            "learner_startup_seconds": statistics.median(r["startup_seconds"] for r in restarts),
            "learner_restore_seconds": statistics.median(r["restore_seconds"] for r in restarts),
            "versions_caught_up": statistics.median(r["versions_behind_at_join"] for r in restarts),
            "shard_serving_again_seconds": statistics.median(serving_again),
            "shard_state_bytes": state_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["2x128", "4x256", "4x512"],
                        help="model sizes as LAYERSxWIDTH of the built-in GPT")
    parser.add_argument("--kills", type=int, default=3, help="kills of the learner, then of the shard, per size")
    parser.add_argument("--json", help="also write the figures here (bench/run_all.py reads them)")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        layers, width = (int(v) for v in size.split("x"))
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            rows.append(measure_size(layers, width, args.kills, pathlib.Path(tmp)))
    print(f"recovery: one shard, two learners, H=10, median of {args.kills} kills each")
    print(f"{'model':>8} {'params':>8} {'learner back':>13} {'start-up':>9} {'restore':>8} {'versions':>9} "
          f"{'shard serving':>14} {'shard state':>12}")
    for row in rows:
        print(f"{row['layers']}x{row['width']:<6} {row['model_parameters'] / 1e6:7.2f}M "
              f"{row['learner_back_to_training_seconds']:12.2f}s {row['learner_startup_seconds']:8.2f}s "
              f"{row['learner_restore_seconds']:7.2f}s {row['versions_caught_up']:9.0f} "
              f"{row['shard_serving_again_seconds']:13.2f}s {row['shard_state_bytes'] / 1e6:10.1f}MB")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"kills": args.kills, "sizes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
