"""The Helm chart (helm/diloco): it lints, renders, validates against the Kubernetes
schemas offline, and what it renders is a run that works: the shard addresses in the
cluster config are the syncer pods' names, learner ids are unique across the regions'
releases and known to the syncer, probes hit the gRPC health service on the shard's
port, shards may drain before they are killed, and bad values are refused with a
message that names the key.

helm comes from .venv/bin (scripts/install-helm.sh, run by `make test`), else PATH,
else scripts/install-helm.sh into a temporary folder; without it the tests fail.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from diloco.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "diloco"
EXAMPLES = CHART / "examples"
INSTALL_HELM = ROOT / "scripts" / "install-helm.sh"

# Rendered with these capabilities and validated against this version's schemas.
KUBE_VERSION = "1.32.0"
# Prometheus Operator CRDs: the Kubernetes schemas do not know them, so schema
# validation skips exactly these kinds (their shape is checked by hand below).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

NAMESPACE = "diloco"
REGIONS = ["us-east", "us-west", "us-central", "us-south"]
# The releases of docs/helm.md: release name -> example values files, in order.
RELEASES = {"diloco": ["values-cluster.yaml", "values-syncer.yaml"]} | {
    f"learners-{region}": ["values-cluster.yaml", f"values-{region}.yaml"] for region in REGIONS}
# Every optional part of the chart switched on, on top of the defaults.
EVERYTHING = ["tls.secretName=diloco-tls", "tls.learnerSecretPrefix=learner-tls-", "learners.persistence.enabled=true",
              "syncer.expose.enabled=true", "metrics.serviceMonitor.enabled=true",
              "metrics.prometheusRule.enabled=true", "grafana.dashboards.enabled=true",
              "learners.gpus=2", "learners.torchrun.nprocPerNode=2"]


# ---------------------------------------------------------------- helm and rendering

def _helm_version(path: str) -> str:
    try:
        out = subprocess.run([path, "version", "--template", "{{.Version}}"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> str:
    candidates = [ROOT / ".venv" / "bin" / "helm", shutil.which("helm")]
    for candidate in candidates:
        if candidate and _helm_version(str(candidate)).startswith("v3."):
            return str(candidate)
    dest = tmp_path_factory.mktemp("helm-bin")
    result = subprocess.run(["bash", str(INSTALL_HELM), str(dest)],
                            capture_output=True, text=True, timeout=300)
    path = dest / "helm"
    if result.returncode != 0 or not _helm_version(str(path)).startswith("v3."):
        pytest.fail("helm 3 is needed for the chart tests and could not be installed: not in "
                    ".venv/bin nor on PATH, and scripts/install-helm.sh failed:\n"
                    + result.stdout + result.stderr, pytrace=False)
    return str(path)


def _values_args(files=(), sets=(), set_json=()) -> list[str]:
    args = []
    for name in files:
        args += ["-f", str(EXAMPLES / name)]
    for item in sets:
        args += ["--set", item]
    for item in set_json:
        args += ["--set-json", item]
    return args


def helm_run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def template(helm: str, release: str, files=(), sets=(), set_json=(), namespace=NAMESPACE,
             chart=CHART) -> list[dict]:
    result = helm_run(helm, "template", release, str(chart), "--namespace", namespace,
                      "--kube-version", KUBE_VERSION, *_values_args(files, sets, set_json))
    assert result.returncode == 0, f"helm template {release} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def refused(helm: str, *, sets=(), set_json=(), files=()) -> str:
    """helm template's error output for values it must refuse."""
    result = helm_run(helm, "template", "diloco", str(CHART), "--namespace", NAMESPACE,
                      "--kube-version", KUBE_VERSION, *_values_args(files, sets, set_json))
    assert result.returncode != 0, f"values {sets or set_json} were accepted"
    return result.stderr


@pytest.fixture(scope="session")
def renders(helm) -> dict[str, list[dict]]:
    """Every release of the example run, the defaults, everything switched on, and a
    region whose learners run as an Indexed Job."""
    jobs = {name: dict(release=name, files=files) for name, files in RELEASES.items()}
    jobs["default"] = dict(release="diloco")
    jobs["everything"] = dict(release="diloco", sets=EVERYTHING)
    jobs["job"] = dict(release="learners-us-west", files=RELEASES["learners-us-west"],
                       sets=["learners.workload=Job"])
    jobs["groups"] = dict(release="diloco", sets=["config.island.replica_groups=2", "learners.gpus=2"])
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(template, helm, **kw) for name, kw in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs: list[dict]) -> Counter:
    return Counter(d["kind"] for d in docs)


def cluster_config(docs: list[dict]) -> dict:
    config_map = one(docs, "ConfigMap", "-config")
    return yaml.safe_load(config_map["data"]["cluster.yaml"])


def container(statefulset: dict) -> dict:
    (c,) = statefulset["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def run_entrypoint(workload: dict, pod_name: str, **controller_env: str) -> list[str]:
    """Runs the container's command with /bin/sh as the kubelet would, `diloco` and
    `torchrun` replaced by a printer, and returns the argv the real process would get."""
    c = container(workload)
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update(controller_env, POD_NAME=pod_name, PATH=os.environ["PATH"])
    argv = c["command"] + [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"] \
        + c["args"][1:]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=True)
    return [c["args"][0]] + json.loads(out.stdout)


# ---------------------------------------------------------------- lint and schemas

def test_lint_strict_for_defaults_and_every_example_release(helm):
    combos = [[]] + [_values_args(files) for files in RELEASES.values()] \
        + [_values_args(sets=EVERYTHING)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda args: helm_run(
            helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION, *args), combos))
    failures = [f"{args}:\n{r.stdout}{r.stderr}" for args, r in zip(combos, results) if r.returncode]
    assert not failures, "\n".join(failures)


def test_every_release_renders_what_it_is_for(renders):
    assert kinds(renders["default"]) == Counter(
        {"ConfigMap": 1, "ServiceAccount": 1, "Service": 2, "StatefulSet": 2, "PodDisruptionBudget": 1})
    syncer = kinds(renders["diloco"])
    assert syncer["StatefulSet"] == 1 and syncer["PodDisruptionBudget"] == 1
    assert syncer["Service"] == 1 + 4  # headless + one load balancer per shard
    assert syncer["PrometheusRule"] == 1 and syncer["ServiceMonitor"] == 1
    assert one(renders["diloco"], "StatefulSet")["metadata"]["name"] == "diloco-syncer"
    for region in REGIONS:
        docs = renders[f"learners-{region}"]
        assert kinds(docs)["StatefulSet"] == 1 and "PodDisruptionBudget" not in kinds(docs)
        assert one(docs, "StatefulSet")["metadata"]["name"] == f"learners-{region}-learner"
    assert {"ServiceMonitor", "PrometheusRule"} <= set(kinds(renders["everything"]))
    assert "ServiceMonitor" not in kinds(renders["default"])


def test_rendered_manifests_validate_against_kubernetes_schemas(renders):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: the project's install steps pin it "
                    "(pip install kubernetes-validate==1.37.0)", pytrace=False)
    skipped, errors = Counter(), []
    for name, docs in renders.items():
        for doc in docs:
            if doc["kind"] in CRD_KINDS:
                skipped[doc["kind"]] += 1
                continue
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name}: {doc['kind']}/{doc['metadata']['name']}: "
                              f"{'.'.join(map(str, exc.path))}: {exc.message}")
    assert not errors, "\n".join(errors)
    assert set(skipped) == CRD_KINDS  # only the CRD kinds went unvalidated


def test_crd_objects_have_the_shape_the_operator_expects(renders):
    docs = renders["everything"]
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["endpoints"]
    # The endpoint port is a named port of every Service the monitor selects.
    selected = [d for d in docs if d["kind"] == "Service"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] in ("syncer", "learner")
                and d["spec"].get("clusterIP") == "None"]
    assert len(selected) == 2
    for service in selected:
        assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    records = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert {r["alert"] for r in rules if "alert" in r} == {"DilocoLearnerOutliers", "DilocoCertificateExpiresSoon",
                                                            "DilocoRevokedLearnerCalling", "DilocoAnchorValuesMissed"}
    assert all(re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name) for name in records)
    # The project's recording rules, as the local cluster and docker-compose load them.
    project_rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "diloco-rules.yml").read_text())
    assert rule["spec"] == project_rules and "run:diloco_learner_goodput:ratio_rate5m" in records
    # The rules select learners by job, as in docker-compose and the local cluster.
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
            "targetLabel": "job", "replacement": "diloco-$1"} in endpoint["relabelings"]
    dashboards = one(docs, "ConfigMap", "-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(dashboards["data"]) == files and files
    for text in dashboards["data"].values():
        dashboard = json.loads(text)
        assert dashboard["title"] and dashboard["panels"]
        # The dashboard plots what the recording rules record.
        assert any(name in text for name in records)


# ---------------------------------------------------------------- the cluster config

def test_rendered_cluster_config_passes_the_projects_validation(renders, tmp_path):
    from diloco.services.contract.config import load_config, parse_config

    for name, docs in renders.items():
        text = one(docs, "ConfigMap", "-config")["data"]["cluster.yaml"]
        cfg = parse_config(yaml.safe_load(text), source=name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        assert load_config(path) == cfg  # what the processes themselves read
        assert cfg.run.state_dir == "/var/lib/diloco"


def test_rendered_runs_have_a_fragment_plan_for_their_model(renders):
    """P fragments need at least P tensors and S <= P: what learners and shards check
    when they start, checked here for the chart's default and example runs."""
    import torch
    from diloco.learner.trainer.model import build_model
    from diloco.learner.sync.synced_parameters import manifest
    from diloco.services.contract.config import parse_config
    from diloco.services.contract.fragments import plan_for_config

    for name in ("default", "diloco"):
        cfg = parse_config(cluster_config(renders[name]), source=name)
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            model = build_model(cfg.model, cfg.run.seed)
        plan = plan_for_config(cfg, manifest(model))
        assert len(plan.fragments) == cfg.sync.fragments


def test_schema_knows_exactly_the_keys_of_the_projects_config():
    """values.schema.json mirrors services/contract/config/, so helm refuses what the processes
    would refuse; this keeps the two from drifting apart."""
    from diloco.services.contract import config as c
    from diloco.services.contract.codecs import CODEC_NAMES

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]

    def keys(node):
        return set(node["properties"])

    def fields(model, *generated):
        return set(model.model_fields) - set(generated)

    s = schema["properties"]
    assert keys(schema) == fields(c.Config, "shards", "learners", "tls")  # tls: from the chart's tls.mode
    assert keys(s["run"]) == fields(c.RunConfig, "state_dir", "listen_host")  # pods listen on their own interfaces
    assert keys(s["sync"]) == fields(c.SyncConfig)
    assert keys(s["syncer"]) == fields(c.SyncerConfig)
    assert keys(s["syncer"]["properties"]["grace"]) == fields(c.GraceConfig)
    assert keys(s["syncer"]["properties"]["outer_optimizer"]) == fields(c.OuterOptimizerConfig)
    assert keys(s["trainer"]) == fields(c.TrainerConfig)
    assert keys(s["trainer"]["properties"]["inner_optimizer"]) == fields(c.InnerOptimizerConfig)
    assert keys(s["model"]["oneOf"][1]) == fields(c.GPTConfig)
    assert keys(s["data"]["oneOf"][1]) == fields(c.CorpusConfig)
    assert keys(s["rpc"]) == fields(c.RpcConfig)
    assert keys(s["links"]["additionalProperties"]) == fields(c.LinkConfig)
    assert keys(s["limits"]) == fields(c.LimitsConfig)
    assert keys(s["island"]) == fields(c.IslandConfig)
    assert s["sync"]["properties"]["codec"]["enum"] == list(CODEC_NAMES)


def test_every_release_of_a_run_renders_the_same_cluster_config(renders):
    configs = {name: cluster_config(renders[name]) for name in RELEASES}
    first = configs["diloco"]
    assert all(config == first for config in configs.values())
    assert first["sync"]["codec"] == "int4" and first["run"]["name"] == "llm-4-regions"


def test_shard_addresses_are_the_syncer_pods_dns_names(helm, renders):
    # Defaults (one release, in-cluster DNS) and a shard count the chart does not default to.
    cases = [(renders["default"], "diloco", NAMESPACE, 2),
             (template(helm, "run7", sets=["cluster.shards=5"], namespace="train"), "run7", "train", 5)]
    for docs, release, namespace, count in cases:
        statefulset = one(docs, "StatefulSet", "-syncer")
        headless = one(docs, "Service", "-syncer-headless")
        assert statefulset["spec"]["replicas"] == count
        assert statefulset["spec"]["serviceName"] == headless["metadata"]["name"]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"].items() <= \
            statefulset["spec"]["template"]["metadata"]["labels"].items()
        grpc_port = next(p["containerPort"] for p in container(statefulset)["ports"] if p["name"] == "grpc")
        name, service = statefulset["metadata"]["name"], headless["metadata"]["name"]
        assert name == f"{release}-syncer"
        expected = [f"{name}-{i}.{service}.{namespace}.svc.cluster.local:{grpc_port}" for i in range(count)]
        assert [s["address"] for s in cluster_config(docs)["shards"]] == expected


def test_learner_release_in_the_syncers_cluster_dials_the_syncer_release(helm):
    # us-central shares the syncer's Kubernetes cluster: without the override it derives
    # the shards' names from cluster.syncerRelease/syncerNamespace.
    no_override = ["cluster.syncerAddresses=[]"]
    syncer = template(helm, "diloco", files=RELEASES["diloco"], set_json=no_override,
                      sets=["syncer.expose.enabled=false"])
    learners = template(helm, "learners-us-central", files=RELEASES["learners-us-central"],
                        set_json=no_override)
    statefulset = one(syncer, "StatefulSet", "-syncer")
    service = statefulset["spec"]["serviceName"]
    expected = [f"{statefulset['metadata']['name']}-{i}.{service}.{NAMESPACE}.svc.cluster.local:50051"
                for i in range(statefulset["spec"]["replicas"])]
    assert [s["address"] for s in cluster_config(learners)["shards"]] == expected
    assert cluster_config(syncer) == cluster_config(learners)


def test_multi_cluster_addresses_have_one_load_balancer_per_shard(renders):
    docs = renders["diloco"]
    statefulset = one(docs, "StatefulSet", "-syncer")
    addresses = [s["address"] for s in cluster_config(docs)["shards"]]
    values = yaml.safe_load((EXAMPLES / "values-cluster.yaml").read_text())
    assert addresses == values["cluster"]["syncerAddresses"]
    assert len(addresses) == statefulset["spec"]["replicas"]
    for i, address in enumerate(addresses):
        host, port = address.rsplit(":", 1)
        service = one(docs, "Service", f"-syncer-{i}-external")
        assert service["spec"]["type"] == "LoadBalancer"
        assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == \
            f"{statefulset['metadata']['name']}-{i}"
        (svc_port,) = service["spec"]["ports"]
        assert svc_port["port"] == int(port) and svc_port["targetPort"] == "grpc"
        assert service["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"] == host


def test_shard_index_is_the_pod_ordinal(renders):
    statefulset = one(renders["diloco"], "StatefulSet", "-syncer")
    for i in (0, 3):
        argv = run_entrypoint(statefulset, f"diloco-syncer-{i}")
        assert argv[:2] == ["diloco", "syncer"]
        assert flag(argv, "--shard-index") == str(i)
        assert flag(argv, "--config") == "/etc/diloco/cluster.yaml"


# ---------------------------------------------------------------- learners

def test_learner_ids_are_unique_across_regions_and_listed_in_the_config(renders):
    config = cluster_config(renders["diloco"])
    listed = {l["id"]: l["region"] for l in config["learners"]}
    ids = []
    for region in REGIONS:
        statefulset = one(renders[f"learners-{region}"], "StatefulSet", "-learner")
        name = statefulset["metadata"]["name"]
        for ordinal in range(statefulset["spec"]["replicas"]):
            argv = run_entrypoint(statefulset, f"{name}-{ordinal}")
            learner_id = flag(argv, "--learner-id")
            assert flag(argv, "--region") == region
            assert listed.get(learner_id) == region, f"{learner_id} is not in the cluster config"
            ids.append(learner_id)
    assert len(ids) == len(set(ids)), f"duplicate learner ids: {ids}"
    assert set(ids) == set(listed)  # and every listed learner has a pod in some region
    for learner_id in ids:
        assert re.fullmatch(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?", learner_id)


def test_learners_as_an_indexed_job_take_the_completion_index_as_id(renders):
    job = one(renders["job"], "Job", "-learner")
    assert "StatefulSet" not in kinds(renders["job"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    listed = {l["id"] for l in cluster_config(renders["job"])["learners"]}
    for index in range(job["spec"]["completions"]):
        # Job pods are named <job>-<index>-<random>; the controller sets the index.
        argv = run_entrypoint(job, f"learners-us-west-learner-{index}-x7k2p",
                              JOB_COMPLETION_INDEX=str(index))
        assert flag(argv, "--learner-id") == f"us-west-{index}" and f"us-west-{index}" in listed


def test_an_island_of_replica_groups_is_a_container_per_group_beside_its_lighthouse(renders):
    pod = one(renders["groups"], "StatefulSet", "-learner")["spec"]["template"]["spec"]
    lighthouse, leader, group = pod["containers"]
    assert [c["name"] for c in pod["containers"]] == ["lighthouse", "learner", "group-1"]
    assert lighthouse["command"][:1] == ["torchft_lighthouse"] and "127.0.0.1:29510" in lighthouse["command"]
    assert flag(lighthouse["command"], "--heartbeat_timeout_ms") == "2000"
    for index, c in enumerate((leader, group)):
        assert flag(c["args"], "--replica-group") == str(index)
        assert flag(c["args"], "--lighthouse") == "http://127.0.0.1:29510"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # learners.gpus split over the groups
    assert "ports" in leader and "ports" not in group  # declared once; the leading group serves it
    assert cluster_config(renders["groups"])["island"]["replica_groups"] == 2


def test_learner_islands_get_torchrun_gpus_and_region_placement(renders):
    east = one(renders["learners-us-east"], "StatefulSet", "-learner")
    argv = run_entrypoint(east, "learners-us-east-learner-1")
    assert argv[:6] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=8", "-m", "diloco"]
    assert argv[6] == "learner" and flag(argv, "--learner-id") == "us-east-1"
    assert container(east)["resources"]["limits"]["nvidia.com/gpu"] == 8
    pod = east["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert east["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "200Gi"

    central = one(renders["learners-us-central"], "StatefulSet", "-learner")
    argv = run_entrypoint(central, "learners-us-central-learner-0")
    assert "--nproc-per-node=2" in argv  # CPU island: gloo
    assert "nvidia.com/gpu" not in container(central)["resources"].get("limits", {})

    south = one(renders["learners-us-south"], "StatefulSet", "-learner")
    argv = run_entrypoint(south, "learners-us-south-learner-0")
    assert argv[:2] == ["diloco", "learner"]  # one process: no torchrun
    assert container(south)["resources"]["limits"]["nvidia.com/gpu"] == 1


def mounted(docs: list[dict]) -> set[tuple[str, str]]:
    """(kind, name) of every Secret, ConfigMap and PersistentVolumeClaim a pod of the release
    mounts; a StatefulSet's volume claim templates make their own claims."""
    needed = set()
    for workload in (d for d in docs if d["kind"] in ("StatefulSet", "Job", "Deployment")):
        spec = workload["spec"]
        templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for volume in spec["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                needed.add(("Secret", volume["secret"]["secretName"]))
            for source in volume.get("projected", {}).get("sources", []):
                if "secret" in source:
                    needed.add(("Secret", source["secret"]["name"]))
            if "configMap" in volume:
                needed.add(("ConfigMap", volume["configMap"]["name"]))
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim and volume["name"] not in templates:
                needed.add(("PersistentVolumeClaim", claim))
    return needed


@pytest.mark.parametrize("release", [*RELEASES, "default"])
def test_every_secret_config_map_and_claim_a_pod_mounts_is_made_by_the_chart_or_diloco_certs(
        renders, release, tmp_path, capsys):
    """docs/helm.md's releases start: what the chart does not make, `diloco certs secrets`
    does from the release's own cluster config (nothing else is mounted)."""
    docs = renders[release]
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cluster_config(docs)))
    assert main(["certs", "--config", str(config), "--out", str(tmp_path / "certs")]) == 0
    assert main(["certs", "secrets", "--config", str(config), "--out", str(tmp_path / "certs")]) == 0
    made = {(d["kind"], d["metadata"]["name"]) for d in docs}
    made |= {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(capsys.readouterr().out)}
    needed = mounted(docs)
    assert needed and needed <= made, f"mounted but made by nothing: {sorted(needed - made)}"


def test_the_tls_secrets_are_mounted_where_the_processes_read_them(renders):
    for suffix in ("-syncer", "-learner"):
        mounts = {m["name"]: m for m in container(one(renders["everything"], "StatefulSet", suffix))["volumeMounts"]}
        assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/diloco/tls", "readOnly": True}


def test_mutual_tls_each_process_reads_its_own_certificate(helm, renders):
    """mTLS by default: the shards read the shards' Secret, each learner pod its own learner's
    Secret (one folder per learner id of its region); plaintext must be asked for."""
    docs = renders["everything"]
    syncer = one(docs, "StatefulSet", "-syncer")
    volumes = {v["name"]: v for v in syncer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "diloco-tls"
    assert flag(run_entrypoint(syncer, "diloco-syncer-1"), "--tls-dir") == "/etc/diloco/tls"
    learners = one(docs, "StatefulSet", "-learner")
    sources = {v["name"]: v for v in learners["spec"]["template"]["spec"]["volumes"]}["tls"]["projected"]["sources"]
    count = learners["spec"]["replicas"]
    assert [s["secret"]["name"] for s in sources] == [f"learner-tls-local-{i}" for i in range(count)]
    for i, source in enumerate(sources):
        assert sorted(item["path"] for item in source["secret"]["items"]) == \
            [f"local-{i}/{name}" for name in ("ca.crt", "tls.crt", "tls.key")]
        argv = run_entrypoint(learners, f"diloco-learner-{i}")
        assert (flag(argv, "--learner-id"), flag(argv, "--tls-dir")) == (f"local-{i}", f"/etc/diloco/tls/local-{i}")
    assert cluster_config(docs)["tls"] == {"mode": "mtls"}

    plain = template(helm, "diloco", sets=["tls.mode=plaintext"])
    assert cluster_config(plain)["tls"] == {"mode": "plaintext"}
    for suffix in ("-syncer", "-learner"):
        statefulset = one(plain, "StatefulSet", suffix)
        assert "tls" not in {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}
        assert "--tls-dir" not in run_entrypoint(statefulset, f"diloco{suffix}-0")


# ---------------------------------------------------------------- syncer pods

@pytest.mark.parametrize("case", ["default", "diloco", "custom-port"])
def test_probes_check_the_grpc_health_service_on_the_shard_port(helm, renders, case):
    docs = renders.get(case) or template(helm, "diloco", sets=["syncer.port=6001"])
    statefulset = one(docs, "StatefulSet", "-syncer")
    c = container(statefulset)
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    health_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "health")
    assert flag(c["args"], "--listen").endswith(f":{port}")
    address_port = {int(s["address"].rsplit(":", 1)[1]) for s in cluster_config(docs)["shards"]}
    if case != "diloco":  # the example dials load balancers; their port is checked elsewhere
        assert address_port == {port}
    # Probes cannot present a client certificate: they ask the shard's plaintext health port.
    assert {s["health_port"] for s in cluster_config(docs)["shards"]} == {health_port} and health_port != port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": health_port, "service": "diloco.v1.Syncer"}, probe
    headless = one(docs, "Service", "-syncer-headless")
    assert {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP",
            "appProtocol": "grpc"} in headless["spec"]["ports"]


def test_shards_may_drain_before_they_are_killed(renders):
    for name in ("default", "diloco"):
        statefulset = one(renders[name], "StatefulSet", "-syncer")
        drain = int(flag(container(statefulset)["args"], "--drain-seconds"))
        assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain > 0


def test_shard_state_is_one_persistent_volume_per_shard(renders):
    statefulset = one(renders["diloco"], "StatefulSet", "-syncer")
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(statefulset)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag(container(statefulset)["args"], "--state-dir")
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
    budget = one(renders["diloco"], "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= \
        statefulset["spec"]["template"]["metadata"]["labels"].items()


# ---------------------------------------------------------------- refused values

BAD_VALUES = [
    # (--set, or --set-json when it starts with "json:"), the message helm must print
    ("tls.secretName=", "tls.secretName: the shards need a Secret"),
    ("tls.learnerSecretPrefix=", "tls.learnerSecretPrefix: each learner needs a Secret"),
    ("tls.mode=none", "tls.mode must be one of the following"),
    ("syncer.healthPort=50051", "syncer.healthPort: 50051 is syncer.port"),
    ("cluster.shards=-1", "cluster.shards: Must be greater than or equal to 1"),
    ("cluster.shards=0", "cluster.shards: Must be greater than or equal to 1"),
    ("config.sync.codec=int3",
     'config.sync.codec: config.sync.codec must be one of the following: "fp32", "bf16", "int8", "int4", "fp4_e3m0"'),
    ("learners.region=US_East", "learners.region: Does not match pattern"),
    ('json:cluster.regions=[{"name": "us_east", "learners": 1}]', "cluster.regions.0.name: Does not match pattern"),
    ("config.sync.codecs=int4", "config.sync: Additional property codecs is not allowed"),
    ("syncer.shards=3", "syncer: Additional property shards is not allowed"),
    ("learners.region=eu-west", '"eu-west" is not one of cluster.regions'),
    ("syncer.drainSeconds=60", "syncer.terminationGracePeriodSeconds (60) must be greater than syncer.drainSeconds (60)"),
    ("cluster.shards=30", "cluster.shards (30) is more than config.sync.fragments (24)"),
    ('json:cluster.syncerAddresses=["a:1"]', "cluster.syncerAddresses has 1 entries but cluster.shards is 2"),
    ("learners.gpus=1,learners.torchrun.nprocPerNode=2", "nprocPerNode (2) is more than learners.gpus (1)"),
    ("config.island.replica_groups=2,learners.gpus=2,learners.torchrun.nprocPerNode=2",
     "each replica group is one process"),
    ("config.island.replica_groups=2,learners.gpus=3", "learners.gpus (3) does not split evenly"),
    ("syncer.enabled=false,learners.enabled=false", "this release would deploy nothing"),
    ("learners.workload=Job,learners.persistence.enabled=true",
     "learners.persistence.enabled needs learners.workload=StatefulSet"),
]


def test_bad_values_are_refused_with_a_message_naming_the_key(helm):
    def attempt(case):
        value, _ = case
        if value.startswith("json:"):
            return refused(helm, set_json=[value[5:]])
        return refused(helm, sets=[value])

    with ThreadPoolExecutor(max_workers=4) as pool:
        messages = list(pool.map(attempt, BAD_VALUES))
    for (value, expected), message in zip(BAD_VALUES, messages):
        assert expected in message, f"--set {value}: expected {expected!r} in:\n{message}"


def test_lint_refuses_what_the_schema_refuses(helm):
    result = helm_run(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION,
                      "--set", "cluster.shards=-1", "--set", "config.sync.codec=int3")
    assert result.returncode != 0
    assert "cluster.shards: Must be greater than or equal to 1" in result.stdout + result.stderr
    assert "config.sync.codec must be one of the following" in result.stdout + result.stderr


# ---------------------------------------------------------------- NOTES and install script

def test_notes_render_for_every_release(helm, tmp_path):
    # `helm template` does not render NOTES.txt (and `helm install --dry-run` wants a
    # cluster): render it as a ConfigMap of a copy of the chart.
    chart = tmp_path / "diloco"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "zz-notes.yaml").write_text(
        '{{- define "test.notes" -}}\n' + notes + '\n{{- end -}}\n'
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "test.notes" . | toJson }}}\n')
    cases = [("diloco", [], []), ("learners-us-west", RELEASES["learners-us-west"], ["learners.workload=Job"])]
    for release, files, sets in cases + [(r, f, []) for r, f in RELEASES.items()]:
        docs = template(helm, release, files=files, sets=sets, chart=chart)
        text = one(docs, "ConfigMap", "notes")["data"]["notes"]
        assert "syncer-0" in text and "shard 0:" in text, text
        if release.startswith("learners-"):
            region = release.removeprefix("learners-")
            assert f"ids {region}-0 .. {region}-1" in text, text


def test_install_script_leaves_a_pinned_helm_alone(helm, tmp_path):
    pinned = re.search(r'^HELM_VERSION="(v[0-9.]+)"', INSTALL_HELM.read_text(), re.M).group(1)
    if _helm_version(helm) != pinned:
        pytest.skip(f"the helm found is {_helm_version(helm)}, not the pinned {pinned}")
    dest = tmp_path / "bin"
    dest.mkdir()
    shutil.copy2(helm, dest / "helm")
    before = (dest / "helm").stat().st_mtime_ns
    # An empty PATH (no npm, no tar): an install attempt would fail, so success means
    # the script found the pinned helm and did nothing.
    env = {"PATH": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    result = subprocess.run([shutil.which("bash"), str(INSTALL_HELM), str(dest)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (dest / "helm").stat().st_mtime_ns == before


def test_make_image_builds_the_image_the_chart_runs_by_default():
    image = re.search(r"^IMAGE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert image == f"{values['image']['repository']}:{chart['appVersion']}"
