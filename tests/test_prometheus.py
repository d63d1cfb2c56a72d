"""The Prometheus side of the project: recording rules and scrape configs that promtool accepts,
the copies the Helm chart ships, and a real Prometheus pointed at a running `diloco sim`
whose rules give a goodput between 0 and 1 and for which every PromQL expression of every
dashboard panel returns data."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from diloco.services.contract.config import dump_config, load_config
from diloco.services.metrics import file_sd_target_groups
from tests.cluster_config import tiny_cluster
from tests.prometheus_server import LOCAL_CONFIG, ROOT, Prometheus, binary, local_config

RULES = ROOT / "deploy" / "prometheus" / "diloco-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "diloco-overview.json"
CHART = ROOT / "helm" / "diloco"
COMPOSE_PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus.yml"
COMPOSE_CLUSTER = ROOT / "deploy" / "compose" / "cluster.yaml"
# Grafana's $__rate_interval for a 1 s scrape interval is 4 s; a little more smooths the bursts
# of outer steps and round closes.
RATE_INTERVAL = "10s"


# ---------------------------------------------------------------- the files

def test_promtool_accepts_the_rules_and_every_scrape_config():
    promtool = binary("promtool")
    for args in (["check", "rules", str(RULES)], ["check", "config", str(LOCAL_CONFIG)],
                 ["check", "config", str(COMPOSE_PROMETHEUS)]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_helm_chart_ships_the_projects_rules_and_dashboard():
    # Helm can read only files inside the chart, so it keeps copies; they must not drift.
    assert (CHART / "prometheus" / RULES.name).read_bytes() == RULES.read_bytes()
    assert (CHART / "dashboards" / DASHBOARD.name).read_bytes() == DASHBOARD.read_bytes()
    assert sorted(p.name for p in (CHART / "dashboards").glob("*.json")) == [DASHBOARD.name]


def test_every_scrape_config_attaches_the_target_labels_the_rules_group_by():
    cfg = load_config(COMPOSE_CLUSTER)
    jobs = {job["job_name"]: [group.get("labels", {}) for group in job["static_configs"]]
            for job in yaml.safe_load(COMPOSE_PROMETHEUS.read_text())["scrape_configs"]}
    assert {(l["run"], l["learner"], l["region"]) for l in jobs["diloco-learner"]} == \
        {(cfg.run.name, l.id, l.region) for l in cfg.learners}
    assert {(l["run"], l["shard"]) for l in jobs["diloco-syncer"]} == \
        {(cfg.run.name, str(i)) for i in range(len(cfg.shards))}
    # The local cluster's targets, and the relabelling that makes their job names.
    groups = file_sd_target_groups(cfg)
    assert {g["labels"]["component"] for g in groups} == {"syncer", "learner"}
    assert all(g["labels"]["run"] == cfg.run.name for g in groups)
    (job,) = yaml.safe_load(LOCAL_CONFIG.read_text())["scrape_configs"]
    assert job["relabel_configs"] == [{"source_labels": ["component"], "target_label": "job",
                                       "replacement": "diloco-$1"}]


def test_grafana_provisioning_points_at_compose_prometheus_and_dashboards():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(volume.split(":")[:2] for service in ("grafana", "prometheus")
                  for volume in compose["services"][service]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "diloco.yml").read_text())["providers"]
    assert provider["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    assert mounts["./deploy/prometheus"] == "/etc/prometheus/rules"


# ---------------------------------------------------------------- the dashboard's queries

def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    assert all(panel["type"] != "row" for panel in dashboard["panels"]), "rows would nest panels"
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def resolve_variables(dashboard: dict, prometheus: Prometheus) -> dict[str, str]:
    """What Grafana would substitute for each variable, from the variable's own query, run
    against Prometheus: every value of a multi-value variable, the first of a single one."""
    values = {"__rate_interval": RATE_INTERVAL}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "datasource":
            continue
        assert variable["type"] == "query", variable["name"]
        query = substitute(variable["query"]["query"], values)
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"${variable['name']}: not a label_values() query: {query}"
        selector, label = match.groups()
        found = sorted({series[label] for series in prometheus.api("series", **{"match[]": selector})
                        if label in series})
        if not found:
            return {}
        if variable.get("multi") or variable.get("includeAll"):
            values[variable["name"]] = variable.get("allValue") or "(" + "|".join(map(re.escape, found)) + ")"
        else:
            values[variable["name"]] = found[0]
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    for name in sorted(values, key=len, reverse=True):  # $region before $r...
        text = text.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    assert "$" not in text.replace("$1", ""), f"unresolved variable in {text}"
    return text


# ---------------------------------------------------------------- a real Prometheus on a sim

def stop_sim(sim: subprocess.Popen, run_dir: pathlib.Path) -> None:
    """SIGINT: the sim stops its cluster itself. If it does not, its processes (each started
    in a session of its own, all naming the run folder) are killed by pid."""
    if sim.poll() is None:
        sim.send_signal(signal.SIGINT)
        try:
            sim.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(run_dir).encode() in cmdline and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_real_prometheus_on_a_sim_records_goodput_and_answers_every_dashboard_query(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(dump_config(tiny_cluster(tmp_path / "unused", shards=2, learners=3)))
    run_dir, targets = tmp_path / "run", tmp_path / "targets.json"
    # 3 learners of the tiny model run ~40 steps/s each on 2 cores: the budget outlasts the test.
    sim = subprocess.Popen(
        [sys.executable, "-m", "diloco", "sim", "--config", str(base), "--learners", "3",
         "--shards", "2", "--steps", "5000", "--duration", "50", "--quiet", "--run-dir", str(run_dir),
         "--prometheus-targets", str(targets)],
        stdout=open(tmp_path / "sim.log", "wb"), stderr=subprocess.STDOUT)
    dashboard = json.loads(DASHBOARD.read_text())
    try:
        with Prometheus(local_config(targets), tmp_path / "prometheus") as prometheus:
            prometheus.wait_for(
                lambda: prometheus.value('count(up{job="diloco-learner"} == 1) + count(up{job="diloco-syncer"} == 1)') == 5,
                40, "the sim's 3 learners and 2 shards are not all scraped")
            goodput = prometheus.wait_for(lambda: prometheus.value("run:diloco_learner_goodput:ratio_rate5m"),
                                          20, "no cluster goodput recorded")
            assert 0 < goodput < 1
            assert prometheus.query("run:diloco_learner_goodput:ratio_rate5m")[0]["metric"]["run"] == "test"

            values = prometheus.wait_for(lambda: resolve_variables(dashboard, prometheus), 20,
                                         "a dashboard variable has no values")
            assert values["run"] == "test"
            queries = [(title, substitute(expr, values)) for title, expr in panel_queries(dashboard)]
            assert len(queries) >= 20
            deadline = time.monotonic() + 30
            for title, expr in queries:
                prometheus.wait_for(lambda: prometheus.query(expr), max(1.0, deadline - time.monotonic()),
                                    f"panel {title!r}: no data for {expr}")
            # What the ratio alerts compare with their threshold is a number of the run, not empty.
            for name, expr in ratio_alerts():
                prometheus.wait_for(lambda: prometheus.query(expr), max(1.0, deadline - time.monotonic()),
                                    f"alert {name}: no data for {expr}")
            # The badput breakdown and goodput add up to the provisioned time. rate() extrapolates
            # each series to the window's edges; on a series a few scrapes old that error is
            # several percent, so wait until every learner has 15 scrapes (of 1 s) behind it.
            prometheus.wait_for(
                lambda: (prometheus.value('min(count_over_time(diloco_learner_provisioned_seconds_total[5m]))')
                         or 0) >= 15,
                40, "the learners were not scraped 15 times")
            shares = prometheus.query('run_category:diloco_learner_badput:ratio_rate5m{run="test"}')
            assert {s["metric"]["category"] for s in shares} == \
                {"startup", "restore", "blocked", "lost", "evaluation", "checkpoint", "down", "overhead"}
            total = sum(float(s["value"][1]) for s in shares) + prometheus.value("run:diloco_learner_goodput:ratio_rate5m")
            assert total == pytest.approx(1.0, abs=0.05)
    finally:
        stop_sim(sim, run_dir)


def ratio_alerts() -> list[tuple[str, str]]:
    """The alerts that compare a ratio with a threshold (`A / B > x`): their `A / B`."""
    rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    return [(r["alert"], re.sub(r"\s*>\s*[0-9.]+\s*$", "", r["expr"].strip()))
            for r in rules if "alert" in r and " / " in r["expr"]]
