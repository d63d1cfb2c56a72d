"""A learner's Prometheus metrics (names and serving: services/metrics.py).

Goodput (docs/monitoring.md; the categories are services/contract/goodput.py's) as a learner measures it, all in seconds:
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

import threading
import time
from typing import Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from diloco.services.contract.codecs import get_codec
from diloco.services.contract.goodput import MEASURED_BY_LEARNER, fragment_compute_seconds
from diloco.services.contract.wire import pb
from diloco.services.metrics import STEP_BUCKETS, WAN_TRANSFER_BUCKETS, Collector, new_registry


class LearnerMetrics:
    """A learner's metrics. The training loop, the sync client (as its TransferObserver) and
    the process lifecycle call the methods; the registry is served by `serve`."""

    def __init__(self):
        self.registry = r = new_registry()
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
        Collector(self._collect_seconds, r)

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
        """Training-time work besides steps: category "evaluation", "checkpoint" or "restore"
        (an island regrouping)."""
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
                                     "pulled again whole), healed (the learner was sick and took the "
                                     "global model back).", labels=["kind"])
        for kind, count in self._sync_faults().items():
            faults.add_metric([kind], count)
        yield faults
