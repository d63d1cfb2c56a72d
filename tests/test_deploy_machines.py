"""docs/deploy-machines.md as written, on one machine: each shard and each region is a network
namespace on a bridge, each region's link to it shaped by the kernel (tbf, both directions;
netem delay where the kernel has it), every process started with the guide's own command in
a folder of its own holding only the config and its certificate. mTLS across namespaces, a
learner killed and started again with its command, the learners ending with the shards' exact
bits, and each region's shaped rate achieved by a bulk transfer over its link.

Needs root and iproute2 (ip, tc); skipped without them."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from diloco.localcluster.sim_summary import hashes_agree
from diloco.services.client import ShardClient
from diloco.services.contract.config import dump_config, parse_config
from diloco.services.contract.tls import read_identity
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until

# xdist_group: one test at a time adds namespaces and bridges to the host's network (make test runs two workers).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("host_network")]

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "deploy-machines.md"
SUBNET = "10.77.0"
SHARDS = [f"{SUBNET}.10", f"{SUBNET}.11"]
OPERATOR = f"{SUBNET}.2"  # the test process itself, in the root namespace
# region: (address, up Mbit/s, down Mbit/s, one-way delay ms where netem exists)
REGIONS = {"us-east": (f"{SUBNET}.100", 20, 40, 10), "us-west": (f"{SUBNET}.101", 10, 20, 30)}
RATE_TOLERANCE = 0.10
PROBE_BYTES = 2_500_000
TIMEOUT = 180


def guide_commands(role: str) -> list[str]:
    """The commands of the guide's code blocks for `role` (```sh ROLE)."""
    blocks = re.findall(rf"```sh {role}\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert blocks, f"{GUIDE.name} has no block for {role}"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=check)


class Namespaces:
    """A bridge in a namespace of its own, a namespace per shard and per region on it, and the
    root namespace on it as the operator's machine. Removed on close."""

    def __init__(self):
        self.prefix = f"dl{os.getpid() % 100000}"
        self.wan = f"{self.prefix}-wan"
        self.names: list[str] = []
        self.links: list[str] = []
        self._add(self.wan)
        sh("ip", "netns", "exec", self.wan, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", self.wan, "ip", "link", "set", "br0", "up")
        self._plug(None, f"{self.prefix}op", OPERATOR)
        for i, address in enumerate(SHARDS):
            self._plug(self.shard(i), f"{self.prefix}s{i}", address)
        for region, (address, up, down, delay) in REGIONS.items():
            ns = self.region(region)
            self._plug(ns, f"{self.prefix}{region[-4:]}", address)
            self._shape(ns, "eth0", up, delay)
            self._shape(self.wan, f"{self.prefix}{region[-4:]}b", down, delay)

    def shard(self, index: int) -> str:
        return f"{self.prefix}-shard{index}"

    def region(self, region: str) -> str:
        return f"{self.prefix}-{region}"

    def _add(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

    def _plug(self, ns: str | None, link: str, address: str) -> None:
        """A veth from namespace `ns` (None: root) to the bridge, `address` on its end."""
        sh("ip", "link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b")
        self.links.append(f"{link}a")
        sh("ip", "link", "set", f"{link}b", "netns", self.wan)
        sh("ip", "netns", "exec", self.wan, "ip", "link", "set", f"{link}b", "master", "br0", "up")
        inside = ["ip", "netns", "exec", ns] if ns else []
        device = "eth0" if ns else f"{link}a"
        if ns:
            self._add(ns)
            sh("ip", "link", "set", f"{link}a", "netns", ns)
            sh(*inside, "ip", "link", "set", f"{link}a", "name", "eth0")
        sh(*inside, "ip", "addr", "add", f"{address}/24", "dev", device)
        sh(*inside, "ip", "link", "set", device, "up")

    @staticmethod
    def _shape(ns: str, device: str, mbps: int, delay_ms: int) -> None:
        """The device's egress at `mbps` (tbf), delayed by `delay_ms` where the kernel has netem."""
        exec_ = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device]
        rate = ["tbf", "rate", f"{mbps}mbit", "burst", "32kbit", "latency", "400ms"]
        if sh(*exec_, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", check=False).returncode == 0:
            sh(*exec_, "parent", "1:1", "handle", "10:", *rate)
        else:
            sh(*exec_, "root", *rate)

    def sent_bytes(self, ns: str, device: str) -> int:
        """What the device's shaping let out, as the kernel counts it."""
        out = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", device).stdout
        return max(int(n) for n in re.findall(r"Sent (\d+) bytes", out))

    def close(self) -> None:
        for name in reversed(self.names):
            sh("ip", "netns", "del", name, check=False)
        for link in self.links:
            sh("ip", "link", "del", link, check=False)


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"dlprobe{os.getpid() % 100000}"
    made = sh("ip", "netns", "add", probe, check=False).returncode == 0
    sh("ip", "netns", "del", probe, check=False)
    return made


@pytest.fixture
def namespaces():
    if not can_make_namespaces():
        pytest.skip("needs root, ip and tc, and network namespaces")
    made = Namespaces()
    yield made
    made.close()


class Machine:
    """A folder standing for one machine: the config, its certificate folder, its state."""

    def __init__(self, root: pathlib.Path, name: str, ns: str | None, env: dict[str, str]):
        self.folder, self.ns, self.env = root / name, ns, env
        self.folder.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, command: str) -> subprocess.Popen:
        """The guide's command, in this machine's folder and namespace."""
        log = open(self.folder / "log.txt", "a")
        argv = (["ip", "netns", "exec", self.ns] if self.ns else []) + ["bash", "-c", command]
        proc = subprocess.Popen(argv, cwd=self.folder, env={**os.environ, **self.env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    def log(self) -> str:
        return (self.folder / "log.txt").read_text()[-3000:]


def probe_rate(namespaces: Namespaces, region: str, upload: bool) -> float:
    """Mbit/s a bulk TCP transfer between the region and shard 0's machine achieves."""
    port = 40000 + (os.getpid() % 1000)
    receive = ("import socket, time\ns = socket.create_server(('0.0.0.0', %d)); c, _ = s.accept()\n"
               "n, t = 0, None\nwhile (b := c.recv(1 << 16)):\n    t = t or time.monotonic(); n += len(b)\n"
               "print(n * 8 / (time.monotonic() - t) / 1e6)" % port)
    send = ("import socket, time\nfor _ in range(100):\n    try:\n        c = socket.create_connection(('%s', %d)); break\n"
            "    except OSError:\n        time.sleep(0.05)\nc.sendall(bytes(%d)); c.close()")
    sender_ns, receiver_ns = (namespaces.region(region), namespaces.shard(0))
    target = SHARDS[0]
    if not upload:
        sender_ns, receiver_ns, target = receiver_ns, sender_ns, REGIONS[region][0]
    receiver = subprocess.Popen(["ip", "netns", "exec", receiver_ns, sys.executable, "-c", receive],
                                stdout=subprocess.PIPE, text=True)
    sh("ip", "netns", "exec", sender_ns, sys.executable, "-c", send % (target, port, PROBE_BYTES))
    return float(receiver.communicate(timeout=60)[0])


def test_the_guides_commands_run_a_cluster_across_kernel_shaped_namespaces(namespaces, tmp_path):
    data = tiny_cluster(pathlib.Path("state"), steps=150, trainer={"checkpoint_every": 10, "eval_every": 1000},
                        ).model_dump(mode="json", exclude_unset=True)
    data["shards"] = [{"address": f"{address}:50051", "metrics_port": 0} for address in SHARDS]
    data["learners"] = [{"id": f"{region}-0", "region": region, "metrics_port": 0,
                         **({"slowdown": 4.0} if region == "us-west" else {})} for region in REGIONS]
    cfg = parse_config(data, source="the guide's run")
    bin_dir = str(pathlib.Path(sys.executable).parent)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ca = Machine(tmp_path, "ca", None, env)
    (ca.folder / "cluster.yaml").write_text(dump_config(cfg))
    for command in guide_commands("ca"):
        assert subprocess.run(["bash", "-c", command], cwd=ca.folder, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=120).returncode == 0, command
    # Each machine gets the config and its own folder, nothing else.
    shards = [Machine(tmp_path, f"shard-{i}", namespaces.shard(i), {**env, "SHARD": str(i)}) for i in range(2)]
    learners = {l.id: Machine(tmp_path, f"learner-{l.id}", namespaces.region(l.region), {**env, "LEARNER": l.id})
                for l in cfg.learners}
    desk = Machine(tmp_path, "operator", None, env)  # the operator's: the root namespace
    for machine in [*shards, *learners.values(), desk]:
        shutil.copy(ca.folder / "cluster.yaml", machine.folder)
        shutil.copytree(ca.folder / "certs" / machine.folder.name, machine.folder / machine.folder.name)
    operator = read_identity(desk.folder / "operator", "operator")

    def statuses():
        replies = []
        for shard in cfg.shards:
            with ShardClient(shard.address, cfg.rpc, identity=operator) as client:
                replies.append(client.status(timeout=5))
        return replies

    def learner(learner_id: str):
        return next((l for reply in statuses() for l in reply.learners if l.learner_id == learner_id), None)

    try:
        (shard_command,) = guide_commands("shard")
        for machine in shards:
            machine.start(shard_command)
        wait_until(lambda: _answers(statuses), TIMEOUT, "both shards to serve over mTLS")
        (learner_command,) = guide_commands("learner")
        for machine in learners.values():
            machine.start(learner_command)
        west = learners["us-west-0"]
        wait_until(lambda: (learner("us-west-0") or _nothing).last_step >= 40, TIMEOUT,
                   "us-west-0 to train 40 steps")
        first = learner("us-west-0").incarnation
        west.kill()
        west.start(learner_command)  # the same command: back from its checkpoint, the same learner
        wait_until(lambda: (learner("us-west-0") or _nothing).incarnation > first, TIMEOUT, "us-west-0 to rejoin")
        for machine in learners.values():
            proc = machine.procs[-1]
            wait_until(lambda: proc.poll() is not None, TIMEOUT, f"{machine.folder.name} to finish")
            assert proc.returncode == 0, machine.log()
        reports = {l.id: json.loads((learners[l.id].folder / "state" / f"learner-{l.id}" / "report.json").read_text())
                   for l in cfg.learners}
        assert hashes_agree(reports, statuses())
        assert len(reports["us-west-0"]["incarnations"]) == 2
        # Everything the learners pushed went through their region's shaped link.
        for l in cfg.learners:
            pushed = sum(life.get("bytes_up", 0) for life in reports[l.id]["incarnations"])
            assert namespaces.sent_bytes(namespaces.region(l.region), "eth0") >= pushed > 0
        for command in guide_commands("operator"):
            ran = subprocess.run(["bash", "-c", command], cwd=desk.folder, env={**os.environ, **env},
                                 capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0, ran.stdout + ran.stderr
        assert (desk.folder / "model" / "model.safetensors").exists()
    finally:
        for machine in [*learners.values(), *shards]:
            machine.kill()
    # The kernel shaped each region's link to its rate, each way.
    for region, (_, up, down, _) in REGIONS.items():
        for upload, rate in ((True, up), (False, down)):
            achieved = probe_rate(namespaces, region, upload)
            assert abs(achieved - rate) <= RATE_TOLERANCE * rate, (region, "up" if upload else "down", achieved, rate)


class _Nothing:
    last_step = incarnation = -1


_nothing = _Nothing()


def _answers(statuses) -> bool:
    try:
        return len(statuses()) == len(SHARDS)
    except Exception:  # grpc.RpcError while a shard starts
        return False


def test_the_guides_blocks_are_the_commands_of_each_role():
    assert guide_commands("ca") == ["diloco certs --config cluster.yaml --out certs"]
    assert guide_commands("shard") == ["diloco syncer --config cluster.yaml --shard-index $SHARD --tls-dir shard-$SHARD"]
    assert guide_commands("learner") == [
        "diloco learner --config cluster.yaml --learner-id $LEARNER --tls-dir learner-$LEARNER"]
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S)[1])
    assert [s["address"] for s in config["shards"]] and config["run"]["state_dir"] == "state"
