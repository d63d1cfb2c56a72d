"""A syncer shard's Prometheus metrics (names and serving: services/metrics.py)."""
from __future__ import annotations

import threading
from typing import Callable, Mapping

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from diloco.services.metrics import WAN_TRANSFER_BUCKETS, Collector, new_registry
from diloco.syncer.certificates import ShardCertificates
from diloco.syncer.pull import PULL_ANSWERS

# The families of syncer/counters.py (`family.label` -> diloco_syncer_<family>_total{label}):
# label name, and the label values exported as 0 before they first happen, so that rates and
# dashboards have a series from the start. Refusal reasons are open-ended.
SYNCER_COUNTER_FAMILIES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "contributions": ("result", ("accepted", "stale_merged", "refused_stale", "refused", "restored")),
    "refusals": ("reason", ()),
    "rounds": ("reason", ("all", "others_waiting", "quorum_grace", "all_left")),
    "learners": ("event", ("joined", "rejoined", "left", "expired")),
    "outliers": ("learner", ()),
    "revoked": ("learner", ()),
    "seeds": (None, ()),
    "kept_compute_seconds": (None, ()),
    "journal_bytes": (None, ()),
    "snapshots": (None, ()),
    "replayed_rounds": (None, ()),
    "pulls": ("answer", PULL_ANSWERS),
    "pull_bytes": ("answer", PULL_ANSWERS),
    "anchor_values_missed": (None, ()),
    "anchor_values_spilled": (None, ()),
    "anchor_spill_bytes": (None, ()),
    "anchor_values_loaded": (None, ()),
    "memory_releases": (None, ()),
}
SYNCER_COUNTER_HELP = {
    "contributions": "Outer-gradient pushes by what the shard did with them.",
    "refusals": "Requests the shard refused, by reason.",
    "rounds": "Rounds closed, by why they closed (all live learners, quorum then grace, or every "
              "contributor left the run).",
    "learners": "Membership events.",
    "outliers": "Outer-gradient pushes refused as outliers (syncer.outlier_norm_factor), by learner.",
    "revoked": "Calls refused because the learner's certificate is revoked (diloco certs revoke).",
    "seeds": "Fragments seeded with a learner's initial values.",
    "kept_compute_seconds": "Learner compute embodied in merged contributions: "
                            "c_steps * step_seconds * fragment share.",
    "journal_bytes": "Bytes the shard wrote to its state folder (log records and snapshots).",
    "snapshots": "Full writes of a fragment's state (the log starts over after each).",
    "replayed_rounds": "Rounds closed again from the log when the shard restarted.",
    "pulls": "Pulls answered, by what they got: nothing new, the lineage's shared update, a delta "
             "encoded for them or reused from another pull of the same anchor and value, the updates "
             "since their version, a snapshot.",
    "pull_bytes": "Payload bytes of the pulls' answers, by answer (as diloco_syncer_pulls_total): where "
                  "the downlink goes.",
    "anchor_values_missed": "Pulls from an anchor whose value the shard had dropped (syncer.spill_anchors off): "
                            "answered with the updates since or a snapshot where one delta would have done.",
    "anchor_values_spilled": "Anchors' values written to the state folder as they left memory "
                             "(syncer.kept_anchors, syncer.spill_anchors).",
    "anchor_spill_bytes": "Bytes of those values written to the state folder.",
    "anchor_values_loaded": "Anchors' values read back from the state folder for a pull's delta.",
    "memory_releases": "Times the shard, idle for longer than between its rounds, gave the memory of its last "
                       "rounds back to the system.",
}



class SyncerMetrics:
    """A shard's metrics: its decision counters and state read from `status()` at scrape time
    (a syncer.views.ShardStatus), its certificates (syncer.certificates.ShardCertificates,
    under mTLS), plus what `round_closed` observes as rounds close."""

    def __init__(self, status: Callable[[], object], certificates: ShardCertificates | None = None):
        self.registry = r = new_registry()
        self._status = status
        self._certificates = certificates
        self._lock = threading.Lock()
        self._outer_steps: dict[int, int] = {}
        self.round_duration = Histogram("diloco_syncer_round_duration_seconds",
                                        "From a round's first contribution to its close.", ["reason"],
                                        buckets=WAN_TRANSFER_BUCKETS, registry=r)
        for reason in SYNCER_COUNTER_FAMILIES["rounds"][1]:
            self.round_duration.labels(reason)
        Collector(self._collect, r)

    def round_closed(self, fragment_id: int, closed_round) -> None:
        """Called by the core for every round it closes (a syncer.snapshot.ClosedRound)."""
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
        if self._certificates is not None:
            yield from certificate_families(self._certificates)


def certificate_families(certificates: ShardCertificates):
    expiry = GaugeMetricFamily("diloco_certificate_expiry_timestamp_seconds",
                               "When a certificate expires (unix seconds): the CAs the shard trusts, its own, "
                               "and the last one each caller presented.", labels=["name", "serial"])
    for view in certificates.views():
        expiry.add_metric([view.name, f"{view.serial:x}"], view.expires.timestamp())
    yield expiry
    yield GaugeMetricFamily("diloco_syncer_revoked_certificates",
                            "Serials in the shard's revocation list.", value=len(certificates.revocations))


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
