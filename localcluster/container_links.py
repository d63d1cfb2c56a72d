"""Kernel-shaped links for docker-compose.yml's learners: each learner container's link to the
shards shaped by tc from the Docker host, as `diloco sim --kernel-links` shapes local processes
(localcluster/kernel_links.py). The containers need no capability and no iproute2: the host's
`tc` runs in a container's network namespace through `nsenter`.

A learner container is one whose command is `learner ... --learner-id ID` for a learner of the
config; its link is the config's (its own, its region's, or rpc.wan_mbps). Its upload becomes
a tbf on every interface inside the container (everything it sends leaves through them; its
region's network holds nothing else) and its download a tbf on each interface's host end, the
veth Docker plugged into the network's bridge; latency a netem delay where the kernel has one.
A container started again gets a new namespace and new veths, so `--follow` shapes every
learner container as it starts, until stopped. Run as root on the Docker host:

    sudo .venv/bin/python -m diloco.localcluster.container_links --config deploy/compose/cluster.yaml --follow &
    docker compose up --build
"""
from __future__ import annotations

import argparse
import json
import itertools
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

from diloco.localcluster.kernel_links import check_available, sent_bytes, shape_device
from diloco.services.contract.config import Config, ConfigError, load_config

COMMAND = "python -m diloco.localcluster.container_links"


def _run(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout


def _learner_flags(argv: list[str]) -> argparse.Namespace:
    """--learner-id and --region of a container's command line (None where absent)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--learner-id")
    parser.add_argument("--region")
    return parser.parse_known_args(argv)[0]


def _interfaces(inside: list[str]) -> dict[str, int]:
    """Interface name -> the index of its veth peer on the host, for every veth `inside` sees."""
    out = _run(*inside, "ip", "-o", "link", "show")
    return {name: int(peer) for name, peer in re.findall(r"^\d+: ([^@:\s]+)@if(\d+):", out, re.MULTILINE)}


def _host_interfaces() -> dict[int, str]:
    """The host's interfaces by index."""
    return {int(index): name for index, name in
            re.findall(r"^(\d+): ([^@:\s]+)", _run("ip", "-o", "link", "show"), re.MULTILINE)}


@dataclass
class ShapedContainer:
    """One learner container's link as applied."""
    container: str
    learner_id: str
    up_mbps: float | None
    down_mbps: float | None
    latency_applied: bool
    devices: dict[str, str]  # interface inside -> its veth end on the host


def _inspect(container: str) -> dict:
    return json.loads(_run("docker", "inspect", container))[0]


def _devices(info: dict) -> tuple[list[str], dict[str, str]]:
    """What enters a running container's network namespace, and its interfaces -> their host ends."""
    inside = ["nsenter", f"--net=/proc/{info['State']['Pid']}/ns/net"]
    host = _host_interfaces()
    return inside, {device: host[peer] for device, peer in _interfaces(inside).items()}


def bytes_through(container: str) -> tuple[int, int]:
    """(up, down) bytes the kernel let through a shaped container's link since it was shaped."""
    inside, devices = _devices(_inspect(container))
    return (sum(sent_bytes(inside, device) for device in devices),
            sum(sent_bytes((), host_end) for host_end in devices.values()))


def shape_container(cfg: Config, container: str) -> ShapedContainer | None:
    """Shapes `container`'s link if it is a running learner of `cfg` with a link; None otherwise."""
    info = _inspect(container)
    argv = [*(info["Config"].get("Entrypoint") or []), *(info["Config"].get("Cmd") or [])]
    flags = _learner_flags(argv)
    learner = next((l for l in cfg.learners if l.id == flags.learner_id), None) if "learner" in argv else None
    if learner is None or not info["State"]["Running"]:
        return None
    link = cfg.link(learner.id, flags.region or learner.region)
    if link is None:
        return None
    inside, devices = _devices(info)
    latency_applied = True
    for device, host_end in devices.items():
        latency_applied &= shape_device(inside, device, link.up_mbps, link.latency_ms)
        latency_applied &= shape_device((), host_end, link.down_mbps, link.latency_ms)
    return ShapedContainer(info["Id"], learner.id, link.up_mbps, link.down_mbps, latency_applied, devices)


def describe(shaped: ShapedContainer) -> str:
    devices = ", ".join(f"{inside} (host end {host})" for inside, host in shaped.devices.items())
    latency = "" if shaped.latency_applied else "; latency not applied (this kernel has no netem)"
    return (f"{shaped.learner_id} (container {shaped.container[:12]}): up {shaped.up_mbps or 'uncapped'}, "
            f"down {shaped.down_mbps or 'uncapped'} Mbit/s on {devices}{latency}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the cluster config the learner containers run "
                        "(deploy/compose/cluster.yaml): its links")
    parser.add_argument("--project", help="only the containers of this compose project")
    parser.add_argument("--follow", action="store_true",
                        help="go on shaping each learner container as it starts, until stopped")


def _of_project(project: str | None) -> list[str]:
    """The docker filter for one compose project's containers (none: every container)."""
    return ["--filter", f"label=com.docker.compose.project={project}"] if project else []


def run(args: argparse.Namespace) -> int:
    try:
        check_available(COMMAND, ("ip", "tc", "nsenter", "docker"))
        cfg = load_config(args.config)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    events = (subprocess.Popen(["docker", "events", "--filter", "type=container", "--filter", "event=start",
                                *_of_project(args.project), "--format", "{{.ID}}"], stdout=subprocess.PIPE, text=True)
              if args.follow else None)  # listening before the running ones are shaped: no start is missed
    try:
        running = _run("docker", "ps", "--quiet", "--no-trunc", *_of_project(args.project)).split()
        started = (line.strip() for line in events.stdout) if events else iter(())
        for container in itertools.chain(running, started):
            try:
                shaped = shape_container(cfg, container)
            except subprocess.CalledProcessError as error:  # e.g. it stopped meanwhile
                print(f"{container[:12]}: not shaped: {error.stderr.strip()}", file=sys.stderr, flush=True)
                continue
            if shaped is not None:
                print(describe(shaped), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if events is not None:
            events.terminate()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
