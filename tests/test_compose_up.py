"""`docker-compose up` for real: the image built from the Dockerfile on bases made from Debian's
archive (scripts/make-base-images.sh, kept in the image store between runs) and the wheelhouse
(scripts/fill-wheelhouse.sh), then docker-compose.yml's 2 shards, 4 learners on their region
networks and Prometheus, in containers, over mutual TLS.

The run: every learner trains and syncs, its container's link shaped by the kernel from the
host (`python -m diloco.localcluster.container_links --follow`, where the test runs as root);
`diloco status` answers on the host with the operator's certificate; Prometheus records goodput; one learner's container is stopped and started again
and rejoins; every learner ends holding the shards' bits; after `down` the shards come back
from their volumes with the same state. The cluster config is deploy/compose/cluster.yaml with
a tiny model and budget (an override file mounts it in place of the shipped one); services,
commands, networks and volumes are the compose file's.

Needs a Docker daemon: it uses the one that answers, else starts Debian's dockerd as root
(tests/docker_engine.py); elsewhere it is skipped and says why. It removes every container,
network, volume and image it made, but not the base images and the Dockerfile's stages that
change only with the pins (KEPT_STAGES). The first run on a machine makes the base images
(minutes) and installs the dependencies; later runs install the package and run the cluster.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from diloco.localcluster import container_links
from diloco.services.client import ShardClient
from diloco.services.contract.config import dump_config, load_config, parse_config
from diloco.services.contract.tls import OPERATOR, load_identity
from tests.cluster_watch import held_fragments, wait_until
from tests.docker_engine import docker, docker_daemon
from tests.prometheus_server import PrometheusApi
from tests.test_compose import CLUSTER_CONFIG, COMPOSE_FILE, ROOT, compose, deep_merge, diloco_services, \
    parse_command
from tests.test_compose import FAST as LOCAL_RUN

# xdist_group: one test at a time shapes links with tc on the host's network (make test runs two workers).
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.xdist_group("host_network")]

BASE_IMAGE = "diloco-base:bookworm"
PROMETHEUS_IMAGE = "diloco-prometheus:bookworm"
# The Dockerfile's stages whose layers change only with the pins, kept between runs as these tags.
KEPT_STAGES = {"dependencies": "diloco-dependencies:bookworm", "runtime": "diloco-runtime:bookworm"}
MOUNTED_CONFIG = "/etc/diloco/cluster.yaml"
RESTARTED = "learner-us-west-0"
# Seconds each stage may take on 2 busy cores. Making the base images is the first run's alone.
BASES_TIMEOUT, WHEELS_TIMEOUT, BUILD_TIMEOUT, RUN_TIMEOUT = 480, 180, 480, 240

# test_compose.py's tiny run, with enough steps that a learner can be stopped and started mid-run
# and the links read while every learner trains.
FAST = deep_merge(LOCAL_RUN, {"trainer": {"max_steps": 1000, "eval_every": 500}})
# The host's tc shapes the containers' links where the test may enter their namespaces.
SHAPES_LINKS = os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc", "nsenter"))


class Stages:
    """Prints how long each stage took since the test began (pytest shows it on failure; -s always)."""

    def __init__(self):
        self.start = self.last = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        print(f"{now - self.start:6.1f}s  {what} took {now - self.last:.1f}s", flush=True)
        self.last = now


def run_script(script: str, timeout: float, *args: str) -> None:
    result = subprocess.run([str(ROOT / "scripts" / script), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stderr[-3000:]}"


def image_ids() -> set[str]:
    return set(docker("images", "--all", "--quiet", "--no-trunc").stdout.split())


def remove_images(ids: set[str]) -> None:
    """Newest first, as each must outlive its children: one `docker rmi` a round."""
    for _ in range(3):
        remaining = sorted(ids & image_ids())
        if not remaining:
            return
        created = docker("image", "inspect", "-f", "{{.Created}}", *remaining).stdout.split()
        newest_first = [image for _, image in sorted(zip(created, remaining), reverse=True)]
        docker("rmi", "--force", *newest_first, check=False)


def build_kept_stages() -> set[str]:
    """The Dockerfile's stages that change only with the pins (KEPT_STAGES), kept in the image
    store as the base images are, so that each run's build takes them from the store's cache;
    ones made for other pins are removed. Returns the ids of their layers, which the test
    leaves in place."""
    layers: set[str] = set()
    older: set[str] = set()
    for target, tag in KEPT_STAGES.items():
        older.add(docker("image", "inspect", "-f", "{{.Id}}", tag, check=False).stdout.strip())
        docker("build", "--quiet", "--target", target, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--tag", tag,
               str(ROOT), timeout=BUILD_TIMEOUT)
        image = docker("image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()
        while image:
            layers.add(image)
            image = docker("image", "inspect", "-f", "{{.Parent}}", image).stdout.strip()
    for image in older - layers - {""}:
        docker("rmi", image, check=False)
    return layers


def finished_at(state: dict) -> datetime.datetime:
    """A container's State.FinishedAt (RFC 3339 in nanoseconds; Python reads microseconds)."""
    return datetime.datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", state["FinishedAt"]))


class Compose:
    """docker-compose.yml plus the test's override, as a project of its own with its own image
    tag, and host ports Docker picks, so it touches nothing a user's `docker-compose up` made."""

    def __init__(self, folder: pathlib.Path):
        tag = f"{os.getpid()}-{int(time.time())}"
        self.project = f"dilocotest{tag.replace('-', '')}"
        self.image = f"diloco-compose-test:{tag}"
        self.cfg = self.write_config(folder)
        self.override = folder / "override.yml"
        spec = compose()
        mounted = {name: {"volumes": [f"{folder / 'cluster.yaml'}:{MOUNTED_CONFIG}:ro"]}
                   for kind in ("certs", "syncer", "learner") for name in diloco_services(spec, kind)}
        self.override.write_text(yaml.safe_dump({"version": spec["version"], "services": mounted}))
        # Empty: each published port is one Docker finds free (`address` asks which).
        ports = {"SYNCER_0_PORT": "", "SYNCER_1_PORT": "", "PROMETHEUS_PORT": ""}
        self.env = {**os.environ, **ports, "DILOCO_IMAGE": self.image, "BASE_IMAGE": BASE_IMAGE,
                    "PROMETHEUS_IMAGE": PROMETHEUS_IMAGE}
        self.learners = {name: parse_command(s["command"]).learner_id
                         for name, s in diloco_services(spec, "learner").items()}
        self.operator_dir = folder / OPERATOR
        self.addresses: list[str] = []  # the shards' published gRPC ports: find_shards()
        self.containers: dict[str, str] = {}  # service -> container id, until the next up or down

    @staticmethod
    def write_config(folder: pathlib.Path):
        data = deep_merge(load_config(CLUSTER_CONFIG).model_dump(mode="json"), FAST)
        cfg = parse_config(data, source="the compose test's cluster config")
        (folder / "cluster.yaml").write_text(dump_config(cfg))
        return cfg

    def __call__(self, *args: str, timeout: float = 180) -> str:
        if args[0] in ("up", "down"):
            self.containers.clear()
        argv = ["docker-compose", "--project-name", self.project, "-f", str(COMPOSE_FILE),
                "-f", str(self.override), *args]
        result = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"docker-compose {' '.join(args)} exited {result.returncode}:\n" \
                                       f"{result.stdout[-2000:]}{result.stderr[-3000:]}"
        return result.stdout

    def container(self, service: str) -> str:
        if service not in self.containers:
            (self.containers[service],) = self("ps", "--quiet", service).split()
        return self.containers[service]

    def state(self, service: str) -> dict:
        """The container's State as `docker inspect` gives it (Status, ExitCode, Health)."""
        return json.loads(docker("inspect", "-f", "{{json .State}}", self.container(service)).stdout)

    def copy_out(self, service: str, path: str, dest: pathlib.Path) -> pathlib.Path:
        docker("cp", f"{self.container(service)}:{path}", str(dest))
        return dest

    def logs(self) -> str:
        result = subprocess.run(["docker-compose", "--project-name", self.project, "-f", str(COMPOSE_FILE),
                                 "-f", str(self.override), "logs", "--no-color", "--tail", "30"],
                                cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        return result.stdout[-6000:]

    # ---- the shards, from the host --------------------------------------------------------

    def address(self, service: str, port: int) -> str:
        """host:port on this machine of a container port the compose file publishes."""
        return self("port", service, str(port)).strip()

    def find_shards(self) -> None:
        """Where the shards' gRPC ports are published, after each `up` that starts them."""
        self.addresses = [self.address(f"syncer-{i}", int(shard.address.rsplit(":", 1)[1]))
                          for i, shard in enumerate(self.cfg.shards)]

    def statuses(self) -> list:
        identity = load_identity(self.cfg, OPERATOR, self.operator_dir)
        replies = []
        for address in self.addresses:
            with ShardClient(address, self.cfg.rpc, identity=identity) as client:
                replies.append(client.status(timeout=5))
        return replies

    def shard_fragments(self) -> dict[str, tuple[int, str]]:
        return {str(f.fragment_id): (f.version, f.state_hash) for reply in self.statuses() for f in reply.fragments}

    def learners_seen(self) -> dict[str, tuple[int, bool, int]]:
        """learner id -> (incarnation, alive on every shard, last step), as the shards see them."""
        seen: dict[str, list] = {}
        replies = self.statuses()
        for reply in replies:
            for learner in reply.learners:
                incarnation, alive, step = seen.setdefault(learner.learner_id, [learner.incarnation, 0, 0])
                seen[learner.learner_id] = [max(incarnation, learner.incarnation), alive + learner.alive,
                                            max(step, learner.last_step)]
        return {lid: (inc, alive == len(replies), step) for lid, (inc, alive, step) in seen.items()}


class LinkShaper:
    """`container_links --follow` for the project, started before it is up; its lines in a file."""

    def __init__(self, project: Compose, folder: pathlib.Path):
        self.log = folder / "container_links.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "diloco.localcluster.container_links", "--config",
                                          str(folder / "cluster.yaml"), "--project", project.project, "--follow"],
                                         stdout=out, stderr=subprocess.STDOUT)

    def shaped(self, learner_id: str, container: str) -> list[str]:
        """The lines that say the container's link was shaped, one per start."""
        prefix = f"{learner_id} (container {container[:12]})"
        return [l for l in self.log.read_text().splitlines() if l.startswith(prefix)]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def sync_bytes(project: Compose, service: str) -> tuple[float, float]:
    """(up, down) payload bytes the learner's /metrics counts, read inside its container."""
    read = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
    text = docker("exec", project.container(service), "python", "-c", read).stdout
    total = {"up": 0.0, "down": 0.0}
    for direction, value in re.findall(r'^diloco_learner_sync_bytes_total\{[^}]*direction="(\w+)"[^}]*\} (\S+)$',
                                       text, re.MULTILINE):
        total[direction] += float(value)
    return total["up"], total["down"]


def test_docker_compose_up_trains_and_a_restarted_learner_rejoins(tmp_path):
    stages = Stages()
    with docker_daemon():
        stages.done("a Docker daemon")
        run_script("make-base-images.sh", BASES_TIMEOUT)
        stages.done("the base images")
        run_script("fill-wheelhouse.sh", WHEELS_TIMEOUT, sys.executable)
        stages.done("the wheelhouse")
        project = Compose(tmp_path)
        before, kept = image_ids(), set()
        try:
            kept = build_kept_stages()
            stages.done("the stages kept between runs")
            run_cluster(project, tmp_path, stages)
        except AssertionError as error:
            raise AssertionError(f"{error}\n--- docker-compose logs ---\n{project.logs()}") from None
        finally:
            subprocess.run(["docker-compose", "--project-name", project.project, "-f", str(COMPOSE_FILE),
                            "-f", str(project.override), "down", "--volumes", "--remove-orphans", "--timeout", "10"],
                           cwd=ROOT, env=project.env, capture_output=True, timeout=180)
            stages.done("down --volumes")
            remove_images(image_ids() - before - kept)
            stages.done("removing the images")


def run_cluster(project: Compose, folder: pathlib.Path, stages: Stages) -> None:
    project("build", "--force-rm", "certs", timeout=BUILD_TIMEOUT)
    stages.done(f"the image ({int(docker('image', 'inspect', '-f', '{{.Size}}', project.image).stdout) / 1e6:.0f} MB)")
    shaper = LinkShaper(project, folder) if SHAPES_LINKS else None
    try:
        train_and_rejoin(project, folder, stages, shaper)
    finally:
        if shaper is not None:
            shaper.stop()


def train_and_rejoin(project: Compose, folder: pathlib.Path, stages: Stages, shaper: LinkShaper | None) -> None:
    cfg, learners = project.cfg, project.learners
    shard_services = [f"syncer-{i}" for i in range(len(cfg.shards))]
    # Shards start once the certificates exist, learners once the shards are healthy.
    project("up", "--detach", "--no-build", timeout=RUN_TIMEOUT)
    project.copy_out(shard_services[0], f"{cfg.tls.dir}/{OPERATOR}", project.operator_dir)
    project.find_shards()
    stages.done("up")

    def answering(condition):
        try:
            return condition()
        except grpc.RpcError:
            return False

    def trained_and_synced() -> bool:
        seen = project.learners_seen()
        fragments = project.shard_fragments()
        return (sorted(seen) == sorted(learners.values())
                and all(alive and step >= cfg.sync.interval_steps for _, alive, step in seen.values())
                and len(fragments) == cfg.sync.fragments and all(v > 0 for v, _ in fragments.values()))

    wait_until(lambda: answering(trained_and_synced), RUN_TIMEOUT, "every learner to train and sync", poll=1.0)
    stages.done("training and syncing")

    if shaper is None:
        print("links not shaped by the kernel: the test is not root, or ip, tc or nsenter is missing")
    else:
        # Each learner's container shaped at its region's rates, and everything its sync sent
        # and received went through the shaped interfaces (the kernel's count read after its own).
        for service, learner_id in learners.items():
            link = cfg.link(learner_id, next(l.region for l in cfg.learners if l.id == learner_id))
            lines = shaper.shaped(learner_id, project.container(service))
            assert len(lines) == 1 and f"up {link.up_mbps}, down {link.down_mbps} Mbit/s" in lines[0], \
                f"{service}'s link not shaped:\n{shaper.log.read_text()}"
            up, down = sync_bytes(project, service)
            kernel_up, kernel_down = container_links.bytes_through(project.container(service))
            assert 0 < up <= kernel_up and 0 < down <= kernel_down, (service, up, kernel_up, down, kernel_down)
        stages.done("the links shaped by the kernel")

    # Stopped (SIGTERM: it checkpoints and leaves) and started again, a learner rejoins as a
    # new incarnation and resumes; the rest goes on meanwhile.
    learner_id = learners[RESTARTED]
    incarnation, _, step = project.learners_seen()[learner_id]
    assert step < cfg.trainer.max_steps, f"{learner_id} finished before it was stopped: raise FAST's max_steps"
    project("stop", RESTARTED, timeout=60)
    assert project.state(RESTARTED)["ExitCode"] == 0, f"{RESTARTED} failed on SIGTERM"
    project("start", RESTARTED, timeout=60)

    # A rejoin is a new incarnation on the shards; it may finish its budget and leave soon after.
    def rejoined() -> bool:
        return project.learners_seen()[learner_id][0] != incarnation

    wait_until(lambda: answering(rejoined), RUN_TIMEOUT, f"{learner_id} to rejoin", poll=0.5)
    if shaper is not None:  # started again, its container has a new namespace, shaped as it started
        wait_until(lambda: len(shaper.shaped(learner_id, project.container(RESTARTED))) == 2, 30,
                   f"{RESTARTED}'s container to be shaped again", poll=0.5)
    stages.done("its rejoin")

    # The operator's view from the host, through the ports the compose file publishes.
    status = subprocess.run([sys.executable, "-m", "diloco", "status", "--syncer",
                             ",".join(project.addresses), "--tls-dir", str(project.operator_dir)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert all(learner_id in status.stdout for learner_id in learners.values()), status.stdout

    # Prometheus has scraped every shard and learner over `wan`, and the recording rules give goodput.
    prometheus = PrometheusApi(f"http://{project.address('prometheus', 9090)}")
    processes = len(cfg.shards) + len(cfg.learners)
    wait_until(lambda: prometheus.value('count(max_over_time(up{job=~"diloco-.*"}[5m]) == 1)') == processes,
               60, f"Prometheus to scrape all {processes} shards and learners", poll=1.0)
    goodput = wait_until(lambda: prometheus.value("run:diloco_learner_goodput:ratio_rate5m"), 60,
                         "Prometheus to record goodput", poll=1.0)
    assert 0 < goodput <= 1
    # Healthy: the shards since learners started (compose waited for it), the learner once it
    # serves /metrics again (or has spent its budget and exited).
    wait_until(lambda: all(project.state(s)["Health"]["Status"] == "healthy" for s in shard_services)
               and (project.state(RESTARTED)["Health"]["Status"] == "healthy"
                    or project.state(RESTARTED)["Status"] == "exited"),
               60, f"the shards and {RESTARTED} to be healthy", poll=1.0)
    stages.done(f"status and goodput ({goodput:.2f})")

    wait_until(lambda: all(project.state(s)["Status"] == "exited" for s in learners), RUN_TIMEOUT,
               "every learner to spend its budget and exit", poll=1.0)
    stages.done("the learners' budgets")
    # A learner leaves once no fragment changed for its catch-up's 3 s, so one that finished
    # while the restarted learner still trained may hold older versions: where its version is
    # the shards', its bits are theirs. The last to finish holds every fragment as they do.
    shard_state = project.shard_fragments()
    held, finished = {}, {}
    for service, learner_id in learners.items():
        state = project.state(service)
        assert state["ExitCode"] == 0, f"{service} failed"
        finished[service] = finished_at(state)
        report_path = project.copy_out(service, f"{cfg.run.state_dir}/learner-{learner_id}/report.json",
                                       folder / f"{learner_id}.json")
        report = json.loads(report_path.read_text())
        assert report["phase"] == "done" and report["steps"] == cfg.trainer.max_steps, service
        held[service] = held_fragments(report)
        for fid, (version, state_hash) in held[service].items():
            assert version <= shard_state[fid][0], f"{service} holds fragment {fid} at a version the shards lack"
            if version == shard_state[fid][0]:
                assert state_hash == shard_state[fid][1], f"{service}: fragment {fid} v{version} differs"
    last = max(finished, key=finished.get)
    assert held[last] == shard_state, f"{last}, the last learner to finish, does not hold the shards' bits"

    # State lives in volumes: after `down`, the shards come back holding what they held.
    project("down", "--timeout", "30", timeout=RUN_TIMEOUT)
    project("up", "--detach", "--no-build", "--no-deps", *shard_services, timeout=RUN_TIMEOUT)
    project.find_shards()
    restored = wait_until(lambda: answering(project.shard_fragments), 60, "the shards to restore", poll=1.0)
    assert restored == shard_state
    stages.done("down and the shards' restore")
