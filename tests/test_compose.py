"""docker-compose.yml: `docker-compose config` accepts it, it describes the cluster of
deploy/compose/cluster.yaml (the 4-region example with compose host names), and its
services' commands and environment really make a working run.

No docker engine is needed here (tests/test_compose_up.py builds the image and brings the file
up under one). The last test runs every syncer and learner service's exact
`command` as a local process, as the container would: the entrypoint `diloco` becomes
`python -m diloco`, each volume and tmpfs becomes a folder of its own, the mounted
cluster config is a copy whose compose host names (`syncer-0:50051`) point at loopback
ports and whose model and budgets are tiny, and the healthcheck runs against the shard.

docker-compose comes from Debian (scripts/install-debian-packages.sh, run by `make test`);
without it the validation test fails, it is not skipped.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time
import tomllib

import pytest
import yaml

import diloco.learner.trainer.main
import diloco.services.cli.certs
import diloco.syncer.main
from diloco.services.client import ShardClient
from diloco.localcluster.cluster import wait_serving
from diloco.localcluster.processes import Proc, free_ports
from diloco.services.contract.config import Config, dump_config, load_config, parse_config
from diloco.services.contract.tls import OPERATOR, load_identity

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
CLUSTER_CONFIG = ROOT / "deploy" / "compose" / "cluster.yaml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "compose" / "prometheus.yml"
EXAMPLE = ROOT / "examples" / "local-4-regions.yaml"
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "constraints.txt"
INSTALL = "scripts/install-debian-packages.sh"

WAN = "wan"
LEARNERS_TIMEOUT = 120  # seconds the learners of the live test may take to finish

# The live test's cluster: the compose config with a tiny model and budget, so 2 shards
# and 4 learners finish in well under a minute on 2 cores. Processes and flags are untouched.
FAST = {
    "sync": {"fragments": 2, "interval_steps": 10, "overlap_steps": 1},
    "trainer": {"batch_size": 4, "max_steps": 30, "eval_every": 10, "eval_batches": 2,
                "checkpoint_every": 10, "inner_optimizer": {"warmup_steps": 5}},
    "model": {"n_layer": 1, "n_embd": 32, "seq_len": 32},
    "data": {"max_bytes": 1_000_000},
}


# ---------------------------------------------------------------- reading the files

def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def parse_command(command: list[str]) -> argparse.Namespace:
    """The service's command as the subcommand's own parser reads it."""
    module = {"syncer": diloco.syncer.main, "learner": diloco.learner.trainer.main, "certs": diloco.services.cli.certs}[command[0]]
    parser = argparse.ArgumentParser(prog=f"diloco {command[0]}")
    module.add_arguments(parser)
    return parser.parse_args(command[1:])


def diloco_services(spec: dict, kind: str) -> dict[str, dict]:
    return {name: service for name, service in spec["services"].items()
            if service.get("command", [None])[0] == kind}


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, container path, writable) of every volume of a service."""
    result = []
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        result.append((source, target, mode != ["ro"]))
    return result


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def deep_merge(base: dict, changes: dict) -> dict:
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = deep_merge(base[key], value) if isinstance(value, dict) else value
    return merged


def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail(f"docker-compose is not on PATH: run {INSTALL} (Debian's docker-compose "
                    "validates docker-compose.yml without a docker engine)", pytrace=False)
    return path


# ---------------------------------------------------------------- the files themselves

def test_docker_compose_config_validates_the_file():
    exe = docker_compose()
    result = subprocess.run([exe, "-f", str(COMPOSE_FILE), "config", "--quiet"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_image_is_what_compose_and_this_test_assume():
    """The lines the compose file and the commands below rely on (test_compose_up.py builds it)."""
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert 'ENTRYPOINT ["diloco"]' in lines and "USER 10001:10001" in lines and "HOME=/tmp" in text
    # The image's torch is the pin every other install uses: pip installs under constraints.txt,
    # from the wheelhouse only.
    install = next(line for line in lines if "pip\" install" in line)
    assert "--no-index" in install and "-c constraints.txt" in text
    # Compose passes the Dockerfile's default base when BASE_IMAGE is unset.
    default = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG BASE_IMAGE="))
    assert compose()["x-diloco"]["build"]["args"]["BASE_IMAGE"] == f"${{BASE_IMAGE:-{default}}}"
    spec = compose()
    for name, service in {**diloco_services(spec, "syncer"), **diloco_services(spec, "learner")}.items():
        assert "entrypoint" not in service, f"{name}: the image's `diloco` must run the command"


def test_build_context_holds_every_package_folder_and_the_wheelhouse():
    # .dockerignore leaves everything out but what it names: a folder pyproject maps must be
    # named there, or `pip install .` in the image misses it.
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml", "constraints.txt", "wheelhouse"} <= allowed


def test_compose_cluster_config_is_the_example_with_compose_addresses():
    def topology(cfg: Config) -> dict:
        data = cfg.model_dump(mode="json")
        del data["run"]["state_dir"]
        for shard in data["shards"]:
            del shard["address"], shard["metrics_port"], shard["health_port"]
        del data["tls"]["dir"]
        for learner_cfg in data["learners"]:
            del learner_cfg["metrics_port"]
        del data["links"]
        return data

    compose_cfg = load_config(CLUSTER_CONFIG)
    assert topology(compose_cfg) == topology(load_config(EXAMPLE))
    # The containers share one host: every learner has a link for container_links to shape.
    assert all(compose_cfg.link(l.id, l.region) is not None for l in compose_cfg.learners)


def test_services_are_the_configs_processes_on_per_region_networks():
    spec, cfg = compose(), load_config(CLUSTER_CONFIG)
    syncers, learners = diloco_services(spec, "syncer"), diloco_services(spec, "learner")

    # One syncer service per shard, named as the shard's address says.
    by_index = {parse_command(s["command"]).shard_index: name for name, s in syncers.items()}
    assert sorted(by_index) == list(range(len(cfg.shards)))
    for index, name in by_index.items():
        host = cfg.shards[index].address.rsplit(":", 1)[0]
        assert name == host
        # The healthcheck asks the shard's plaintext health port for the Syncer service.
        code = syncers[name]["healthcheck"]["test"][-1]
        assert f"127.0.0.1:{cfg.shards[index].health_port}" in code and "diloco.v1.Syncer" in code

    # Every shard and learner reads its certificate from the volume the certs service writes,
    # and starts only once it has; only the certs service holds the CA's key.
    (certs_name, certs), = diloco_services(spec, "certs").items()
    certs_args = parse_command(certs["command"])
    assert certs_args.out == cfg.tls.dir and cfg.tls.mode == "mtls"
    (tls_volume,) = {src for src, target, writable in mounts(certs) if target == certs_args.out and writable}
    (ca_volume,) = {src for src, target, writable in mounts(certs) if target == certs_args.ca_dir and writable}
    assert tls_volume != ca_volume
    for name, service in {**syncers, **learners}.items():
        assert (tls_volume, cfg.tls.dir, False) in mounts(service), name
        assert ca_volume not in {src for src, _, _ in mounts(service)}, f"{name} mounts the CA's key"
    # Shards start once the certificates exist, learners once the shards are healthy (below).
    for name in syncers:
        assert spec["services"][name]["depends_on"] == {certs_name: {"condition": "service_completed_successfully"}}

    # One learner service per learner, with its id and region.
    region_of = {}
    for name, service in learners.items():
        args = parse_command(service["command"])
        assert cfg.learner(args.learner_id).region == args.region
        region_of[name] = args.region
    assert sorted(parse_command(s["command"]).learner_id for s in learners.values()) == \
        sorted(l.id for l in cfg.learners)

    # Regions are separate networks: a region's network holds only that region's learners
    # and reaches nothing outside it; whatever leaves a region goes over the WAN, where the
    # shards are.
    for name, service in spec["services"].items():
        region_networks = {n for n in service.get("networks", []) if n.startswith("region-")}
        assert region_networks == ({f"region-{region_of[name]}"} if name in learners else set()), name
    for name, service in learners.items():
        assert set(service["networks"]) == {f"region-{region_of[name]}", WAN}
        assert spec["networks"][f"region-{region_of[name]}"]["internal"] is True
        # It starts once every shard answers its healthcheck.
        assert service["depends_on"] == {s: {"condition": "service_healthy"} for s in syncers}
    for name in syncers:
        assert spec["services"][name]["networks"] == [WAN]

    # Every process reads the same config, read-only, and writes its state to a volume of
    # its own (the root filesystem is read-only).
    state_volumes = []
    for name, service in {**syncers, **learners}.items():
        assert service["read_only"] is True and service["user"] == "10001:10001"
        args = parse_command(service["command"])
        config_mounts = [(src, writable) for src, target, writable in mounts(service) if target == args.config]
        assert config_mounts == [("./" + str(CLUSTER_CONFIG.relative_to(ROOT)), False)], name
        state_dir = args.state_dir or cfg.run.state_dir
        writable = [(src, target) for src, target, w in mounts(service) if w and under(state_dir, target)]
        assert len(writable) == 1 and writable[0][0] in spec["volumes"], \
            f"{name}: its state {state_dir} is not on a named volume"
        state_volumes.append(writable[0][0])
    assert len(set(state_volumes)) == len(state_volumes), "two processes share a state volume"

    assert spec["services"]["grafana"]["profiles"] == ["monitoring"]


def test_prometheus_scrapes_every_process_by_compose_host_name():
    cfg, spec = load_config(CLUSTER_CONFIG), compose()
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {job["job_name"]: {t for group in job["static_configs"] for t in group["targets"]}
               for job in scrape["scrape_configs"]}
    names = {parse_command(s["command"]).learner_id: name
             for name, s in diloco_services(spec, "learner").items()}
    assert targets["diloco-syncer"] == {
        f"{shard.address.rsplit(':', 1)[0]}:{shard.metrics_port}" for shard in cfg.shards}
    assert targets["diloco-learner"] == {f"{names[l.id]}:{l.metrics_port}" for l in cfg.learners}
    prometheus = spec["services"]["prometheus"]
    assert WAN in prometheus["networks"]
    assert any(src == "./deploy/compose/prometheus.yml" for src, _, _ in mounts(prometheus))


# ---------------------------------------------------------------- the services, run

class ServiceProcess:
    """One compose service as a local process: its volumes and tmpfs are folders under
    `root`, and the mounted cluster config is `config` (with `run.state_dir` and `tls.dir`
    moved to wherever that service's volumes are)."""

    def __init__(self, name: str, service: dict, root: pathlib.Path, volumes: pathlib.Path,
                 config: Config):
        self.name = name
        self.args = parse_command(service["command"])
        root.mkdir(parents=True)
        self.mounts: list[tuple[str, pathlib.Path]] = []
        for source, target, _ in mounts(service):
            if source.startswith("."):  # a bind mount of a file of the repository
                assert target == self.args.config, f"{name}: unexpected bind mount {source}"
                host = root / "cluster.yaml"
            else:
                host = volumes / source
                host.mkdir(parents=True, exist_ok=True)
            self.mounts.append((target, host))
        for target in service.get("tmpfs", []):
            host = root / "tmpfs" / target.strip("/").replace("/", "_")
            host.mkdir(parents=True)
            self.mounts.append((target, host))
        state_dir = self.host_path(config.run.state_dir)
        run = config.run.model_copy(update={"state_dir": str(state_dir)})
        tls = config.tls.model_copy(update={"dir": str(self.host_path(config.tls.dir))})
        (root / "cluster.yaml").write_text(dump_config(config.model_copy(update={"run": run, "tls": tls})))
        argv = [sys.executable, "-m", "diloco"] + [self.map_arg(a) for a in service["command"]]
        # Paths in the environment (HOME) must be writable: on a volume or tmpfs.
        env = {key: str(self.host_path(value)) if str(value).startswith("/") else str(value)
               for key, value in service.get("environment", {}).items()}
        self.proc = Proc(name, argv, root / f"{name}.log", env=env)
        self.state_dir = state_dir

    def host_path(self, path: str) -> pathlib.Path:
        """Where a container path is on this machine; only mounted paths exist here."""
        matches = [(target, host) for target, host in self.mounts if under(path, target)]
        assert matches, f"{self.name}: {path} is on the read-only root filesystem"
        target, host = max(matches, key=lambda m: len(m[0]))
        return host / pathlib.Path(path).relative_to(target)

    def map_arg(self, arg: str) -> str:
        if arg.startswith("/") and any(under(arg, target) for target, _ in self.mounts):
            return str(self.host_path(arg))
        return arg

    def log_tail(self) -> str:
        return self.proc.log_path.read_text(errors="replace")[-3000:]


def healthcheck(service: dict, container_address: str, local_address: str) -> int:
    """Exit code of the service's healthcheck command, pointed at the local shard."""
    kind, program, *rest = service["healthcheck"]["test"]
    assert kind == "CMD" and program == "python"
    argv = [sys.executable] + [arg.replace(container_address, local_address) for arg in rest]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.mark.slow
def test_compose_commands_and_environment_run_a_working_cluster(tmp_path):
    spec = compose()
    base = load_config(CLUSTER_CONFIG)
    # Compose host names -> free loopback ports; every /metrics and health endpoint a port of its own.
    ports = iter(free_ports(len(base.shards) * 3 + len(base.learners)))
    local = {shard.address: f"127.0.0.1:{next(ports)}" for shard in base.shards}
    data = deep_merge(base.model_dump(mode="json"), FAST)
    data["shards"] = [{"address": local[s.address], "metrics_port": next(ports), "health_port": next(ports)}
                      for s in base.shards]
    data["learners"] = [{**l.model_dump(mode="json"), "metrics_port": next(ports)} for l in base.learners]
    config = parse_config(data, source="compose config for the local run")

    volumes = tmp_path / "volumes"
    (certs_name, certs_spec), = diloco_services(spec, "certs").items()
    certs = ServiceProcess(certs_name, certs_spec, tmp_path / certs_name, volumes, config)
    syncers = {name: ServiceProcess(name, s, tmp_path / name, volumes, config)
               for name, s in diloco_services(spec, "syncer").items()}
    learners = {name: ServiceProcess(name, s, tmp_path / name, volumes, config)
                for name, s in diloco_services(spec, "learner").items()}
    # Each shard's address here, and its health port as its own healthcheck sees it (the
    # container's loopback) and as it is here.
    shard_addresses = {}
    for name, process in syncers.items():
        index = process.args.shard_index
        shard_addresses[name] = (local[base.shards[index].address], f"127.0.0.1:{base.shards[index].health_port}",
                                 f"127.0.0.1:{config.shards[index].health_port}")
    first, (_, container_health, local_health) = next(iter(shard_addresses.items()))
    assert healthcheck(spec["services"][first], container_health, local_health) != 0, \
        "the healthcheck passes with no shard running"

    try:
        certs.proc.start()
        certs.proc.wait_or_kill(60)
        assert certs.proc.returncode == 0, certs.log_tail()
        operator = load_identity(config, OPERATOR, certs.host_path(f"{config.tls.dir}/{OPERATOR}"))
        for process in syncers.values():
            process.proc.start()
        for name, (local_address, container_health, local_health) in shard_addresses.items():
            try:
                wait_serving(local_address, 60, operator)
            except TimeoutError:
                pytest.fail(f"{name} never served:\n{syncers[name].log_tail()}")
            assert healthcheck(spec["services"][name], container_health, local_health) == 0, \
                f"{name}: the healthcheck fails against a serving shard"

        for process in learners.values():
            process.proc.start()
        deadline = time.monotonic() + LEARNERS_TIMEOUT
        while any(p.proc.running for p in learners.values()):
            if time.monotonic() > deadline:
                pytest.fail(f"learners still running after {LEARNERS_TIMEOUT}s: "
                            + ", ".join(n for n, p in learners.items() if p.proc.running))
            time.sleep(0.2)
        for name, process in learners.items():
            assert process.proc.returncode == 0, \
                f"{name} exited {process.proc.returncode}:\n{process.log_tail()}"

        shard_state = {}
        for local_address, _, _ in shard_addresses.values():
            with ShardClient(local_address, config.rpc, identity=operator) as client:
                for fragment in client.status(timeout=10).fragments:
                    shard_state[str(fragment.fragment_id)] = (fragment.version, fragment.state_hash)
        assert len(shard_state) == config.sync.fragments
        assert all(version > 0 for version, _ in shard_state.values()), shard_state
        for name, process in learners.items():
            report_path = process.state_dir / f"learner-{process.args.learner_id}" / "report.json"
            report = json.loads(report_path.read_text())
            assert report["phase"] == "done" and report["steps"] == config.trainer.max_steps, name
            held = {fid: (f["version"], f["state_hash"]) for fid, f in report["fragments"].items()}
            assert held == shard_state, f"{name} does not hold the shards' bits"
    finally:
        for process in [*learners.values(), *syncers.values()]:
            process.proc.kill()
