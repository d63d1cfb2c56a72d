"""How the shards and learners export to Prometheus: what both roles' metrics share (buckets,
registries, serving) and the local cluster's scrape targets. Each role's metrics live beside
it: learner/sync/metrics.py and syncer/metrics.py.

Names follow docs/monitoring.md: `diloco_` prefix, base units (`_seconds`, `_bytes`), counters
end in `_total`, and no step or tensor ids as labels. Which process a series comes from (run,
region, learner, shard) is not a label the process exports: the scraper attaches it as target
labels (`file_sd_target_groups` for the local cluster, deploy/compose/prometheus.yml, the Helm
chart's ServiceMonitor). `up` then carries the same labels, which is what lets the recording
rules (deploy/prometheus/diloco-rules.yml) count a dead learner's time as `down` by region:
a dead process cannot count it itself.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Callable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, start_http_server

from diloco.services.contract.config import Config
from diloco.services.files import atomic_write

# Counter reset times are not needed (rate() detects resets) and would double the series.
disable_created_metrics()

# Fragment transfers over a WAN: a few ms for a small fragment on a fast link, minutes for a
# large one on a congested 2 Gbit/s link or a pull waiting for a slow round.
WAN_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                        60.0, 120.0, 300.0, 600.0)
# One inner step: a millisecond for a toy model on CPU up to a minute for a large model.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)

def serve(registry: CollectorRegistry, port: int, host: str | None = None) -> WSGIServer | None:
    """Serves `registry` at http://<host>:<port>/metrics (None: every interface) from a daemon
    thread until the returned server is shut down; port 0: not at all (None)."""
    if not port:
        return None
    server, _ = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
    return server


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_start_time_seconds shows restarts
    return registry


class Collector:
    """A custom collector built from a function yielding metric families at scrape time."""

    def __init__(self, collect: Callable, registry: CollectorRegistry):
        self.collect = collect
        registry.register(self)


# ---- scrape targets -------------------------------------------------------------------

def file_sd_target_groups(cfg: Config, host: str = "127.0.0.1",
                          learner_hosts: Mapping[str, str] | None = None) -> list[dict]:
    """Prometheus file_sd target groups for every /metrics endpoint of `cfg`'s processes, with
    the target labels the recording rules and dashboards group by. `component` becomes the
    job (diloco-syncer, diloco-learner) in deploy/prometheus/local/prometheus.yml.
    `learner_hosts`: a learner's own address, where it is not `host` (a network namespace)."""
    groups = [{"targets": [f"{host}:{shard.metrics_port}"],
               "labels": {"component": "syncer", "run": cfg.run.name, "shard": str(index)}}
              for index, shard in enumerate(cfg.shards) if shard.metrics_port]
    groups += [{"targets": [f"{(learner_hosts or {}).get(learner.id, host)}:{learner.metrics_port}"],
                "labels": {"component": "learner", "run": cfg.run.name, "learner": learner.id,
                           "region": learner.region}}
               for learner in cfg.learners if learner.metrics_port]
    return groups


def write_file_sd(cfg: Config, path: str | os.PathLike, learner_hosts: Mapping[str, str] | None = None) -> None:
    """Writes the target groups atomically: Prometheus may read the file at any moment."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(file_sd_target_groups(cfg, learner_hosts=learner_hosts), indent=1).encode())
