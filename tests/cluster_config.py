"""A small, fast cluster config for tests that start real processes."""
from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
from typing import Iterator

from diloco.localcluster.cluster import LocalCluster
from diloco.localcluster.processes import free_ports
from diloco.cli import main
from diloco.services.contract.config import Config, parse_config


def tiny_cluster(state_dir: pathlib.Path, *, shards: int = 2, learners: int = 3,
                 steps: int = 200, **sections) -> Config:
    """Shards and learners on free loopback ports, a one-layer GPT on 1 MB of the corpus.

    Keyword arguments replace whole config sections or update them (dicts are merged).
    """
    ports = free_ports(shards)
    regions = ["us-east", "us-west", "us-central", "us-south"]
    data = {
        "run": {"name": "test", "seed": 7, "state_dir": str(state_dir)},
        "shards": [{"address": f"127.0.0.1:{port}", "metrics_port": 0} for port in ports],
        "learners": [{"id": f"{regions[i % 4]}-{i // 4}", "region": regions[i % 4], "metrics_port": 0}
                     for i in range(learners)],
        "sync": {"fragments": 4, "interval_steps": 20, "overlap_steps": 2, "codec": "int4"},
        "syncer": {"quorum": 1, "grace": {"mode": "fixed", "seconds": 0.3}, "max_staleness": 16,
                   "lease_seconds": 2.0},
        "trainer": {"batch_size": 8, "max_steps": steps, "eval_every": 50, "eval_batches": 4,
                    "checkpoint_every": 25, "heartbeat_seconds": 0.25,
                    "inner_optimizer": {"lr": 3.0e-3, "warmup_steps": 10}},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32},
        "data": {"corpus": "python-stdlib", "max_bytes": 1_000_000},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data, source="test config")


@contextlib.contextmanager
def running_shards(cfg: Config, run_dir: pathlib.Path) -> Iterator[LocalCluster]:
    """The config's shards as real processes for the block; its learners are the test's own."""
    cluster = LocalCluster(cfg, run_dir)
    try:
        cluster.start_shards()
        yield cluster
    finally:
        cluster.stop(timeout=10)


def export_both_ways(cfg: Config, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The config's first learner, a real `diloco learner --export` process, trains its budget
    against the config's shards; then `diloco export` pulls the shards' model. The two export
    folders: (by the learner, by the shards)."""
    by_learner, by_shards = folder / "by-learner", folder / "by-shards"
    learner = cfg.learners[0]
    with running_shards(cfg, folder / "run") as cluster:
        subprocess.run([sys.executable, "-m", "diloco", "learner", "--config", str(cluster.config_path),
                        "--learner-id", learner.id, "--region", learner.region, "--catch-up-seconds", "0.5",
                        "--export", str(by_learner)], check=True, capture_output=True, timeout=180)
        assert main(["export", "--config", str(cluster.config_path), "--out", str(by_shards)]) == 0
    return by_learner, by_shards
