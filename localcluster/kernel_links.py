"""`diloco sim --kernel-links`: each learner of the local cluster in a network namespace of its
own, its link to the shards shaped by the kernel instead of paced by the learner
(localcluster/wan.py). The shards stay in this namespace and listen on a bridge that every
learner's namespace is plugged into by a veth pair; a learner's configured link (Config.link:
its own, its region's, or rpc.wan_mbps) becomes a tbf qdisc on each end of its veth, its upload
on the learner's end and its download on the bridge's, and its latency a netem delay each way
where the kernel has netem. Real TCP then carries the sync traffic: windows, queues and the
competing flows of one learner's pushes and pulls. Needs root and iproute2 (ip, tc).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence

from diloco.services.contract.config import Config, ConfigError, LinkConfig

BRIDGE_ADDRESS = "10.78.0.1"
PREFIX_LENGTH = 16


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=check)


def check_available(what: str, tools: Sequence[str] = ("ip", "tc")) -> None:
    """ConfigError naming what `what` (a flag or command) lacks: root, or one of `tools`."""
    if os.geteuid() != 0:
        raise ConfigError(f"{what}: network namespaces and tc need root")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        raise ConfigError(f"{what}: {' and '.join(missing)} not found")


def shape_device(inside: Sequence[str], device: str, mbps: float | None, latency_ms: float) -> bool:
    """What leaves `device` (in the namespace `inside` enters) limited to `mbps` by a tbf and
    delayed by `latency_ms` by a netem where the kernel has one; replaces what shaped it
    before. False when a latency was asked for and the kernel has no netem."""
    _run(*inside, "tc", "qdisc", "del", "dev", device, "root", check=False)
    add = [*inside, "tc", "qdisc", "add", "dev", device]
    # A bucket of 10 ms at the rate (at least 4 KB) lets the kernel's 64 KB segments through
    # whole on fast links instead of cutting each into packets on the cores the run trains on.
    burst_kbit = max(32, round(mbps * 10)) if mbps else 0
    rate = ["tbf", "rate", f"{mbps}mbit", "burst", f"{burst_kbit}kbit", "latency", "400ms"] if mbps else []
    latency_applied = True
    if latency_ms:
        if _run(*add, "root", "handle", "1:", "netem", "delay", f"{latency_ms}ms", check=False).returncode == 0:
            if rate:
                _run(*add, "parent", "1:1", "handle", "10:", *rate)
            return True
        latency_applied = False  # this kernel has no netem
    if rate:
        _run(*add, "root", *rate)
    return latency_applied


def sent_bytes(inside: Sequence[str], device: str) -> int:
    """Bytes the qdiscs of `device` let through since they were made."""
    out = _run(*inside, "tc", "-s", "qdisc", "show", "dev", device).stdout
    return max((int(n) for n in re.findall(r"Sent (\d+) bytes", out)), default=0)


class KernelLinks:
    """The namespaces and shaped links of one run; `close()` removes them."""

    def __init__(self, cfg: Config):
        check_available("--kernel-links")
        tag = f"dls{os.getpid() % 100000}"
        self.bridge = f"{tag}br"
        self.namespaces: dict[str, str] = {}  # learner id -> its namespace
        self.addresses: dict[str, str] = {}  # learner id -> its address on the bridge
        self._bridge_ends: dict[str, str] = {}  # learner id -> the veth end on the bridge
        self.latency_applied = True
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{BRIDGE_ADDRESS}/{PREFIX_LENGTH}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, learner in enumerate(cfg.learners):
                self._plug(f"{tag}-{i}", f"{tag}{i}", learner.id, f"10.78.{1 + i // 250}.{2 + i % 250}",
                           cfg.link(learner.id, learner.region) or LinkConfig())
        except (subprocess.CalledProcessError, OSError) as error:
            self.close()
            detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else error
            raise ConfigError(f"--kernel-links: cannot make the namespaces and links: {detail}") from None
        self.cfg = self._config(cfg)

    def _plug(self, ns: str, veth: str, learner_id: str, address: str, link: LinkConfig) -> None:
        _run("ip", "netns", "add", ns)
        self.namespaces[learner_id] = ns
        inside = ("ip", "netns", "exec", ns)
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b")
        self._bridge_ends[learner_id] = f"{veth}b"
        _run("ip", "link", "set", f"{veth}a", "netns", ns)
        _run(*inside, "ip", "link", "set", f"{veth}a", "name", "eth0")
        _run(*inside, "ip", "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run("ip", "link", "set", f"{veth}b", "master", self.bridge, "up")
        self.addresses[learner_id] = address
        # Its pushes leave through its end, its pulls through the bridge's.
        up = shape_device(inside, "eth0", link.up_mbps, link.latency_ms)
        down = shape_device((), f"{veth}b", link.down_mbps, link.latency_ms)
        self.latency_applied &= up and down

    @staticmethod
    def _config(cfg: Config) -> Config:
        """The run's config with the shards on the bridge and every server on every interface
        (the shards on the bridge, each learner's /metrics in its namespace). The links stay
        in it, as what was asked for; learners started in a namespace do not pace them."""
        shards = [shard.model_copy(update={"address": f"{BRIDGE_ADDRESS}:{shard.address.rsplit(':', 1)[1]}"})
                  for shard in cfg.shards]
        return cfg.model_copy(update={"shards": shards,
                                      "run": cfg.run.model_copy(update={"listen_host": "0.0.0.0"})})

    def prefix(self, learner_id: str) -> list[str]:
        """What runs a learner's command inside its namespace."""
        return ["ip", "netns", "exec", self.namespaces[learner_id]]

    def bytes_through(self, learner_id: str) -> tuple[int, int]:
        """(up, down) bytes the kernel let through the learner's link since it was made."""
        return (sent_bytes(self.prefix(learner_id), "eth0"), sent_bytes((), self._bridge_ends[learner_id]))

    def close(self) -> None:
        for ns in self.namespaces.values():
            _run("ip", "netns", "del", ns, check=False)
        for end in self._bridge_ends.values():
            _run("ip", "link", "del", end, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
