"""What the shards and learners export to Prometheus, and how it is served and scraped.

Names follow DESIGN.md §4: `diloco_` prefix, base units (`_seconds`, `_bytes`), counters end
in `_total`, and no step or tensor ids as labels. Which process a series comes from (run,
region, learner, shard) is not a label the process exports: the scraper attaches it as target
labels (`file_sd_target_groups` for the local cluster, deploy/compose/prometheus.yml, the Helm
chart's ServiceMonitor). `up` then carries the same labels, which is what lets the recording
rules (deploy/prometheus/diloco-rules.yml) count a dead learner's time as `down` by region:
a dead process cannot count it itself.

Goodput (DESIGN.md §5, defined in services/goodput.py) as a learner measures it, all in seconds:
  provisioned  ticks from the moment /metrics serves until the step/token budget is spent
  goodput      compute seconds of inner steps
  badput       startup (serving -> checkpoint loaded), restore (join + pull), blocked (waiting
               for a fragment past tau), lost (steps a restarted learner redoes, counted by the
               new process; stale-refused contributions), evaluation and checkpoint (the
               training loop's evaluations and checkpoint copies)
The rules add `down` (from `up`) and `overhead` (provisioned time in none of the above:
sync bookkeeping on the training thread, the loop itself).
"""
from __future__ import annotations

import json
import os
import pathlib
import threading
import time
from typing import Callable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               disable_created_metrics, start_http_server)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from diloco.services.codecs import get_codec
from diloco.services.config import Config
from diloco.services.goodput import MEASURED_BY_LEARNER, fragment_compute_seconds
from diloco.services.wire import pb

# Counter reset times are not needed (rate() detects resets) and would double the series.
disable_created_metrics()

# Fragment transfers over a WAN: a few ms for a small fragment on a fast link, minutes for a
# large one on a congested 2 Gbit/s link or a pull waiting for a slow round.
WAN_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                        60.0, 120.0, 300.0, 600.0)
# One inner step: a millisecond for a toy model on CPU up to a minute for a large model.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)

# The families of syncer/counters.py (`family.label` -> diloco_syncer_<family>_total{label}):
# label name, and the label values exported as 0 before they first happen, so that rates and
# dashboards have a series from the start. Refusal reasons are open-ended.
SYNCER_COUNTER_FAMILIES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "contributions": ("result", ("accepted", "stale_merged", "refused_stale", "refused", "restored")),
    "refusals": ("reason", ()),
    "rounds": ("reason", ("all", "quorum_grace")),
    "learners": ("event", ("joined", "rejoined", "left", "expired")),
    "seeds": (None, ()),
    "kept_compute_seconds": (None, ()),
    "journal_bytes": (None, ()),
    "snapshots": (None, ()),
    "replayed_rounds": (None, ()),
}
SYNCER_COUNTER_HELP = {
    "contributions": "Outer-gradient pushes by what the shard did with them.",
    "refusals": "Requests the shard refused, by reason.",
    "rounds": "Rounds closed, by why they closed (all live learners, or quorum then grace).",
    "learners": "Membership events.",
    "seeds": "Fragments seeded with a learner's initial values.",
    "kept_compute_seconds": "Learner compute embodied in merged contributions: "
                            "c_steps * step_seconds * fragment share.",
    "journal_bytes": "Bytes the shard wrote to its state folder (log records and snapshots).",
    "snapshots": "Full writes of a fragment's state (the log starts over after each).",
    "replayed_rounds": "Rounds closed again from the log when the shard restarted.",
}


def serve(registry: CollectorRegistry, port: int) -> WSGIServer | None:
    """Serves `registry` at http://0.0.0.0:<port>/metrics from a daemon thread until the
    returned server is shut down; port 0: not at all (None)."""
    if not port:
        return None
    server, _ = start_http_server(port, registry=registry)
    return server


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_start_time_seconds shows restarts
    return registry


class _Collector:
    """A custom collector built from a function yielding metric families at scrape time."""

    def __init__(self, collect: Callable, registry: CollectorRegistry):
        self.collect = collect
        registry.register(self)


class LearnerMetrics:
    """A learner's metrics. The training loop, the sync client (as its TransferObserver) and
    the process lifecycle call the methods; the registry is served by `serve`."""

    def __init__(self):
        self.registry = r = _registry()
        self._model_parameters = 0
        self._lock = threading.Lock()
        self._serving_since = time.monotonic()
        self._finished_at: float | None = None
        self._badput = dict.fromkeys(MEASURED_BY_LEARNER, 0.0)  # `down`, `overhead`: the rules
        self._blocked_seconds: Callable[[], float] = lambda: 0.0
        self._held_versions: Callable[[], Mapping[int, int]] = dict
        self._sync_faults: Callable[[], Mapping[str, int]] = dict
        self._shard_versions: dict[int, int] = {}
        self._lost_steps_unpriced = 0  # lost steps waiting for a measured step time
        _Collector(self._collect_seconds, r)

        self.goodput = Counter("diloco_learner_goodput_seconds",
                               "Compute seconds of inner steps (gross: steps later redone are in "
                               "badput category lost).", registry=r)
        self.inner_steps = Counter("diloco_learner_inner_steps", "Inner steps run by this process.",
                                   registry=r)
        self.tokens = Counter("diloco_learner_tokens", "Tokens trained on by this process (whole island).",
                              registry=r)
        self.step_seconds = Histogram("diloco_learner_step_seconds", "Compute time of one inner step.",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step = Gauge("diloco_learner_step", "Inner steps done, including those before a restore.",
                          registry=r)
        self.finished = Gauge("diloco_learner_finished",
                              "1 once the step/token budget is spent: the learner then only follows "
                              "the run and is no longer provisioned.", registry=r)
        self.sync_bytes = Counter("diloco_learner_sync_bytes",
                                  "Fragment payload bytes on the link to the syncer.",
                                  ["direction", "codec"], registry=r)
        self.pushes = Counter("diloco_learner_pushes", "Fragment pushes by the shard's answer.",
                              ["result"], registry=r)
        self.push_seconds = Histogram("diloco_learner_push_seconds",
                                      "Time to stream one fragment push and get the answer.",
                                      buckets=WAN_TRANSFER_BUCKETS, registry=r)
        self.pull_seconds = Histogram("diloco_learner_pull_seconds",
                                      "Time from asking for a fragment to holding it, including the "
                                      "wait for its round to close.",
                                      buckets=WAN_TRANSFER_BUCKETS, registry=r)
        Gauge("diloco_learner_staleness_versions",
              "Versions the fragments this learner holds are behind the shards (summed over "
              "fragments, as of the last heartbeats).", registry=r).set_function(self._staleness)
        self.model_parameters = Gauge("diloco_learner_model_parameters",
                                      "Parameters of the model (for the DP-equivalent bandwidth).", registry=r)

    # ---- lifecycle -------------------------------------------------------------------

    def model_loaded(self, parameters: int) -> None:
        self._model_parameters = parameters
        self.model_parameters.set(parameters)

    def started(self, restore_seconds: float) -> None:
        """Joined and restored: start-up is the time from serving /metrics until the restore
        began (before serving, the process is not up: the rules count that time as down)."""
        self._add_badput("startup", time.monotonic() - self._serving_since - restore_seconds)
        self._add_badput("restore", restore_seconds)

    def watch_sync(self, held_versions: Callable[[], Mapping[int, int]], blocked_seconds: Callable[[], float],
                   sync_faults: Callable[[], Mapping[str, int]]) -> None:
        """Reads the sync client's state at scrape time (after it started: its fragments are fixed).
        `sync_faults`: how often each kind of fault was met, by kind."""
        self._held_versions, self._blocked_seconds = held_versions, blocked_seconds
        self._sync_faults = sync_faults

    def steps_lost(self, steps: int, step_seconds: float | None) -> None:
        """Steps a previous incarnation ran that this one will run again. Without a known step
        time they are priced at this incarnation's first step."""
        if step_seconds is None:
            self._lost_steps_unpriced += steps
        else:
            self._add_badput("lost", steps * step_seconds)

    def stepped(self, compute_seconds: float, tokens: int, step: int) -> None:
        if self._lost_steps_unpriced:
            self.steps_lost(self._lost_steps_unpriced, compute_seconds)
            self._lost_steps_unpriced = 0
        self.goodput.inc(compute_seconds)
        self.inner_steps.inc()
        self.tokens.inc(tokens)
        self.step_seconds.observe(compute_seconds)
        self.step.set(step)

    def spent(self, category: str, seconds: float) -> None:
        """Training-time work besides steps: category "evaluation" or "checkpoint"."""
        self._add_badput(category, seconds)

    def training_finished(self) -> None:
        with self._lock:
            if self._finished_at is None:
                self._finished_at = time.monotonic()
        self.finished.set(1)

    # ---- services.client.TransferObserver ---------------------------------------------

    def pushed(self, header: pb.PushHeader, payload_bytes: int, seconds: float, result: int) -> None:
        self.sync_bytes.labels("up", get_codec(header.payload.codec).name).inc(payload_bytes)
        self.pushes.labels(pb.PushResult.Name(result).removeprefix("PUSH_RESULT_").lower()).inc()
        self.push_seconds.observe(seconds)
        if result == pb.PUSH_RESULT_REFUSED_STALE and self._model_parameters:
            # The learner re-anchors: the fragment's progress since its last sync is dropped.
            self._add_badput("lost", fragment_compute_seconds(header.c_steps, header.step_seconds,
                                                              header.payload.numel, self._model_parameters))

    def pulled(self, bytes_by_codec: Mapping[str, int], seconds: float) -> None:
        for codec, count in bytes_by_codec.items():
            self.sync_bytes.labels("down", codec).inc(count)
        self.pull_seconds.observe(seconds)

    def heartbeat_answered(self, versions: Mapping[int, int]) -> None:
        with self._lock:
            self._shard_versions.update(versions)

    # ---- scrape time -------------------------------------------------------------------

    def _add_badput(self, category: str, seconds: float) -> None:
        with self._lock:
            self._badput[category] += seconds

    def _staleness(self) -> float:
        held = self._held_versions()
        with self._lock:
            return sum(max(0, version - held[fid]) for fid, version in self._shard_versions.items()
                       if fid in held)

    def _collect_seconds(self):
        with self._lock:
            end = self._finished_at or time.monotonic()
            badput = dict(self._badput)
        yield CounterMetricFamily("diloco_learner_provisioned_seconds",
                                  "Wall seconds this process has served /metrics while its budget "
                                  "was not spent (time down is counted from `up` by the rules).",
                                  value=end - self._serving_since)
        badput["blocked"] += self._blocked_seconds()
        family = CounterMetricFamily("diloco_learner_badput_seconds",
                                     "Provisioned seconds that did not become kept progress, by "
                                     "category (down and overhead: see the recording rules).",
                                     labels=["category"])
        for category, seconds in badput.items():
            family.add_metric([category], seconds)
        yield family
        faults = CounterMetricFamily("diloco_learner_sync_faults",
                                     "Syncs that met a fault, by kind: refused (a push the shard refused), "
                                     "reanchored (a shard served a fragment below our version: its value "
                                     "taken), hash_mismatch (a pull's result was not the shard's value: "
                                     "pulled again whole).", labels=["kind"])
        for kind, count in self._sync_faults().items():
            faults.add_metric([kind], count)
        yield faults


class SyncerMetrics:
    """A shard's metrics: its decision counters and state read from `status()` at scrape time
    (a syncer.core.ShardStatus), plus what `round_closed` observes as rounds close."""

    def __init__(self, status: Callable[[], object]):
        self.registry = r = _registry()
        self._status = status
        self._lock = threading.Lock()
        self._outer_steps: dict[int, int] = {}
        self.round_duration = Histogram("diloco_syncer_round_duration_seconds",
                                        "From a round's first contribution to its close.", ["reason"],
                                        buckets=WAN_TRANSFER_BUCKETS, registry=r)
        for reason in SYNCER_COUNTER_FAMILIES["rounds"][1]:
            self.round_duration.labels(reason)
        _Collector(self._collect, r)

    def round_closed(self, fragment_id: int, closed_round) -> None:
        """Called by the core for every round it closes (a syncer.fragment_state.ClosedRound)."""
        with self._lock:
            self._outer_steps[fragment_id] = self._outer_steps.get(fragment_id, 0) + 1
        self.round_duration.labels(closed_round.close_reason).observe(closed_round.duration_seconds)

    def _collect(self):
        status = self._status()
        yield from counter_families(status.counters)
        live = GaugeMetricFamily("diloco_syncer_live_learners",
                                 "Learners whose lease this shard holds alive.")
        live.add_metric([], sum(1 for learner in status.learners if learner.alive))
        yield live
        steps = CounterMetricFamily("diloco_syncer_outer_steps", "Outer steps (closed rounds) by fragment.",
                                    labels=["fragment"])
        version = GaugeMetricFamily("diloco_syncer_fragment_version",
                                    "Version of the fragment's global value (outer steps since the seed).",
                                    labels=["fragment"])
        pending = GaugeMetricFamily("diloco_syncer_pending_contributions",
                                    "Contributions in the fragment's open round.", labels=["fragment"])
        with self._lock:
            outer_steps = dict(self._outer_steps)
        for fragment in status.fragments:
            label = [str(fragment.id)]
            steps.add_metric(label, outer_steps.get(fragment.id, 0))
            version.add_metric(label, fragment.version)
            pending.add_metric(label, fragment.pending_contributions)
        yield from (steps, version, pending)


def counter_families(counters: Mapping[str, float]):
    """The shard's counters (ShardCore.counters_snapshot) as Prometheus counters: the process
    counters of syncer/counters.py, `family.label` -> diloco_syncer_<family>_total{label}, and
    the durable totals `state.<name>` -> diloco_syncer_<name>_total (they survive restarts)."""
    values: dict[str, dict[str, float]] = {
        family: dict.fromkeys(known, 0.0) for family, (_, known) in SYNCER_COUNTER_FAMILIES.items()}
    for name, value in counters.items():
        family, _, label = name.partition(".")
        if family == "state":
            yield CounterMetricFamily(f"diloco_syncer_{label}", "Durable total of the shard's state "
                                      "(survives restarts).", value=value)
        else:
            values.setdefault(family, {})[label] = value
    for family, by_label in values.items():
        # A family this module does not know yet still gets exported, under a generic label.
        label_name = SYNCER_COUNTER_FAMILIES[family][0] if family in SYNCER_COUNTER_FAMILIES \
            else ("kind" if any(by_label) else None)
        metric = CounterMetricFamily(f"diloco_syncer_{family}", SYNCER_COUNTER_HELP.get(family, family),
                                     labels=[label_name] if label_name else None)
        if label_name:
            for label, value in sorted(by_label.items()):
                metric.add_metric([label], value)
        else:
            metric.add_metric([], by_label.get("", 0.0))
        yield metric


# ---- scrape targets -------------------------------------------------------------------

def file_sd_target_groups(cfg: Config, host: str = "127.0.0.1") -> list[dict]:
    """Prometheus file_sd target groups for every /metrics endpoint of `cfg`'s processes, with
    the target labels the recording rules and dashboards group by. `component` becomes the
    job (diloco-syncer, diloco-learner) in deploy/prometheus/local/prometheus.yml."""
    groups = [{"targets": [f"{host}:{shard.metrics_port}"],
               "labels": {"component": "syncer", "run": cfg.run.name, "shard": str(index)}}
              for index, shard in enumerate(cfg.shards) if shard.metrics_port]
    groups += [{"targets": [f"{host}:{learner.metrics_port}"],
                "labels": {"component": "learner", "run": cfg.run.name, "learner": learner.id,
                           "region": learner.region}}
               for learner in cfg.learners if learner.metrics_port]
    return groups


def write_file_sd(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the target groups atomically: Prometheus may read the file at any moment."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(file_sd_target_groups(cfg), indent=1))
    os.replace(tmp, path)
