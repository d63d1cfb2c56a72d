"""/metrics of real shard and learner processes (localcluster.cluster.LocalCluster): every metric
issue 6 asks for, with its type and labels, named by Prometheus conventions; and a SIGKILLed
learner seen by a real Prometheus as `down` badput while the shards' live learners drop."""
from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diloco.localcluster.cluster import LocalCluster
from diloco.localcluster.processes import free_ports
from diloco.services.contract.config import Config, parse_config
from diloco.services.metrics import WAN_TRANSFER_BUCKETS, write_file_sd
from diloco.syncer.pull import PULL_ANSWERS
from tests.cluster_config import tiny_cluster
from tests.prometheus_server import Prometheus, local_config

pytestmark = pytest.mark.slow

# Issue 6: family (as the parser names it: counters without _total) -> type, label names.
LEARNER_METRICS = {
    "diloco_learner_provisioned_seconds": ("counter", set()),
    "diloco_learner_goodput_seconds": ("counter", set()),
    "diloco_learner_badput_seconds": ("counter", {"category"}),
    "diloco_learner_inner_steps": ("counter", set()),
    "diloco_learner_tokens": ("counter", set()),
    "diloco_learner_step_seconds": ("histogram", set()),
    "diloco_learner_sync_bytes": ("counter", {"direction", "codec"}),
    "diloco_learner_push_seconds": ("histogram", set()),
    "diloco_learner_pull_seconds": ("histogram", set()),
    "diloco_learner_staleness_versions": ("gauge", set()),
    "diloco_learner_sync_faults": ("counter", {"kind"}),
}
SYNCER_METRICS = {
    "diloco_syncer_outer_steps": ("counter", {"fragment"}),
    "diloco_syncer_contributions": ("counter", {"result"}),
    "diloco_syncer_refusals": ("counter", {"reason"}),
    "diloco_syncer_live_learners": ("gauge", set()),
    "diloco_syncer_rounds": ("counter", {"reason"}),
    "diloco_syncer_round_duration_seconds": ("histogram", {"reason"}),
    "diloco_syncer_fragment_version": ("gauge", {"fragment"}),
    "diloco_syncer_kept_compute_seconds": ("counter", set()),
    "diloco_syncer_pulls": ("counter", {"answer"}),
}
# Identity is a target label (attached by the scraper), and ids of steps or tensors never a label.
FORBIDDEN_LABELS = {"step", "tensor", "learner", "region", "shard", "run", "instance", "job"}


def with_metrics_ports(cfg: Config) -> Config:
    data = cfg.model_dump(mode="json")
    ports = iter(free_ports(len(cfg.shards) + len(cfg.learners)))
    for process in data["shards"] + data["learners"]:
        process["metrics_port"] = next(ports)
    return parse_config(data, source="metrics test config")


def scrape(port: int) -> dict:
    """family name -> parsed family, of the diloco_ families at 127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("diloco_")}


def sample_value(family, **labels) -> float:
    """A counter's or gauge's value; a histogram's observation count."""
    suffix = {"counter": "_total", "histogram": "_count"}.get(family.type, "")
    (value,) = [s.value for s in family.samples if s.name == family.name + suffix and s.labels == labels]
    return value


def scrape_when(port: int, ready, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            families = scrape(port)
            if ready(families):
                return families
        except (OSError, KeyError):  # not serving yet, or that metric not there yet
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"127.0.0.1:{port}/metrics not ready after {timeout:.0f}s", pytrace=False)
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("metrics")
    cfg = with_metrics_ports(tiny_cluster(folder / "state", shards=2, learners=3, steps=100_000))
    local = LocalCluster(cfg, folder / "run")
    try:
        local.start_shards()
        local.start_learners()
        for learner in cfg.learners:  # trained, and pulled an outer step's update
            scrape_when(learner.metrics_port, lambda families: any(
                s.labels == {"direction": "down", "codec": cfg.sync.codec}
                for s in families["diloco_learner_sync_bytes"].samples))
        yield cfg, local, folder
    finally:
        local.stop(timeout=20)


def check_families(families: dict, expected: dict, where: str) -> None:
    for name, (kind, labels) in expected.items():
        assert name in families, f"{where}: {name} is not exported"
        family = families[name]
        assert family.type == kind, f"{where}: {name} is a {family.type}, not a {kind}"
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, f"{where}: {sample}"
    for name, family in families.items():
        for sample in family.samples:
            assert not FORBIDDEN_LABELS & set(sample.labels), f"{where}: {sample}"
            if family.type == "counter":
                assert sample.name == name + "_total", f"{where}: counter sample {sample.name}"
        if "seconds" in name or "bytes" in name:  # base units, named as the last word
            assert name.endswith(("_seconds", "_bytes")), name


def test_learners_export_goodput_badput_steps_bytes_latency_and_staleness(cluster):
    cfg, _, _ = cluster
    for learner in cfg.learners:
        families = scrape(learner.metrics_port)
        check_families(families, LEARNER_METRICS, learner.id)
        badput = families["diloco_learner_badput_seconds"]
        assert {s.labels["category"] for s in badput.samples} == {"startup", "restore", "blocked", "lost",
                                                                   "evaluation", "checkpoint"}
        assert sample_value(badput, category="startup") > 0
        # Every start evaluates the model it begins from and checkpoints at once.
        assert sample_value(badput, category="evaluation") > 0 and sample_value(badput, category="checkpoint") > 0
        assert sample_value(families["diloco_learner_goodput_seconds"]) > 0
        assert sample_value(families["diloco_learner_provisioned_seconds"]) > \
            sample_value(families["diloco_learner_goodput_seconds"])
        assert sample_value(families["diloco_learner_inner_steps"]) > 0
        assert sample_value(families["diloco_learner_tokens"]) > 0
        faults = families["diloco_learner_sync_faults"]  # none in a healthy run, each kind shown
        assert {(s.labels["kind"], s.value) for s in faults.samples} == \
            {("refused", 0), ("reanchored", 0), ("hash_mismatch", 0), ("healed", 0)}
        links = {(s.labels["direction"], s.labels["codec"]) for s in families["diloco_learner_sync_bytes"].samples}
        assert {("up", cfg.sync.codec), ("down", cfg.sync.codec)} <= links
        for name in ("diloco_learner_push_seconds", "diloco_learner_pull_seconds"):
            bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
            assert bounds[:-1] == list(WAN_TRANSFER_BUCKETS) and bounds[-1] == float("inf")
            assert WAN_TRANSFER_BUCKETS[0] <= 0.01 and WAN_TRANSFER_BUCKETS[-1] >= 300  # ms to minutes


def test_shards_export_outer_steps_contributions_rounds_and_kept_compute(cluster):
    cfg, _, _ = cluster
    owned = []
    for index, shard in enumerate(cfg.shards):
        families = scrape(shard.metrics_port)
        check_families(families, SYNCER_METRICS, f"shard {index}")
        results = {s.labels["result"] for s in families["diloco_syncer_contributions"].samples}
        assert {"accepted", "stale_merged", "refused_stale"} <= results
        assert sample_value(families["diloco_syncer_contributions"], result="accepted") > 0
        assert {s.labels["reason"] for s in families["diloco_syncer_rounds"].samples} >= {"all", "quorum_grace"}
        assert sample_value(families["diloco_syncer_live_learners"]) == len(cfg.learners)
        assert sample_value(families["diloco_syncer_kept_compute_seconds"]) > 0
        pulls = {s.labels["answer"]: s.value for s in families["diloco_syncer_pulls"].samples}
        assert set(pulls) == set(PULL_ANSWERS) and sum(pulls.values()) > 0  # every answer exported, pulls counted
        # A fresh shard: every version is an outer step of this process. The run goes on, and a
        # scrape may fall between a round's install and its count: scrape again (bounded).
        for _ in range(20):
            steps = {s.labels["fragment"]: s.value for s in families["diloco_syncer_outer_steps"].samples}
            versions = {s.labels["fragment"]: s.value for s in families["diloco_syncer_fragment_version"].samples}
            if steps == versions:
                break
            families = scrape(shard.metrics_port)
        assert steps.keys() == versions.keys() and sum(steps.values()) > 0
        assert steps == versions
        owned += steps
    assert sorted(owned, key=int) == [str(f) for f in range(cfg.sync.fragments)]


def test_a_killed_learner_is_down_badput_and_drops_from_live_learners(cluster):
    cfg, local, folder = cluster
    victim = cfg.learners[0]
    targets = folder / "targets.json"
    write_file_sd(cfg, targets)
    with Prometheus(local_config(targets), folder / "prometheus") as prometheus:
        prometheus.wait_for(lambda: prometheus.value('sum(up{job="diloco-learner"}) + sum(up{job="diloco-syncer"})')
                            == len(cfg.learners) + len(cfg.shards), 20, "not every process is scraped")
        down = f'instance:diloco_learner_down:bool{{learner="{victim.id}"}}'
        assert prometheus.wait_for(lambda: prometheus.query(down), 10, "no down rule")[0]["value"][1] == "0"
        assert prometheus.value('min(diloco_syncer_live_learners)') == len(cfg.learners)

        local.learners[0].kill()
        prometheus.wait_for(lambda: prometheus.value(down) == 1, 10, f"{victim.id} never counted down")
        down_badput = (f'run_region_category:diloco_learner_badput_seconds:rate5m'
                       f'{{category="down", region="{victim.region}"}}')
        prometheus.wait_for(lambda: (prometheus.value(down_badput) or 0) > 0, 10, "no down badput")
        # Its connection closed (or, at the latest, its lease of 2 s expires) on every shard.
        prometheus.wait_for(lambda: prometheus.value('max(diloco_syncer_live_learners)') == len(cfg.learners) - 1,
                            15, "the shards still count the killed learner as live")
        for region in {l.region for l in cfg.learners[1:]} - {victim.region}:
            assert (prometheus.value(f'run_region_category:diloco_learner_badput_seconds:rate5m'
                                     f'{{category="down", region="{region}"}}') or 0) == 0
        goodput = prometheus.wait_for(lambda: prometheus.value("run:diloco_learner_goodput:ratio_rate5m"), 15,
                                      "no goodput recorded")
        assert 0 < goodput < 1
