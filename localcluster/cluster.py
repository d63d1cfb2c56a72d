"""Real local processes of a cluster: start, health-check, kill, restart, stop.

`diloco sim`, the integration tests and the benchmarks share this, so each starts
shards and learners exactly as a user would: `python -m diloco syncer ...`
and `python -m diloco learner ...` in their own processes.

With tls.mode mtls (the default) and no tls.dir of its own, the cluster issues its
certificates into the run's state folder first, as `diloco certs` would.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.services.process import DIE_WITH_PARENT_ENV
from diloco.services.contract.config import Config, RpcConfig, dump_config
from diloco.services.contract.rpc import open_channel
from diloco.services.cli.certs import issue_cluster_certs
from diloco.services.contract.tls import OPERATOR, Identity, certs_dir, load_identity
from diloco.localcluster.standby import go_line
from diloco.localcluster.wan import launcher

SYNCER_SERVICE = "diloco.v1.Syncer"


def free_ports(count: int) -> list[int]:
    """Ports the kernel reports free on 127.0.0.1 (all held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ExitedBeforeServing(RuntimeError):
    """A shard process that ended before it served: its error is in the message."""


def wait_serving(address: str, timeout: float, identity: Identity | None,
                 proc: Proc | None = None) -> None:
    """Blocks until the gRPC health service at `address` says the syncer is SERVING
    (asked over mutual TLS with `identity`, in plaintext with None). If `proc`, the process
    that should serve it, ends first: ExitedBeforeServing with the end of its log."""
    deadline = time.monotonic() + timeout
    with open_channel(address, RpcConfig(), identity) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.popen is not None and proc.returncode is not None:
                raise ExitedBeforeServing(f"{proc.name} exited with status {proc.returncode} before serving "
                                          f"(log {proc.log_path}):\n{proc.log_tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=SYNCER_SERVICE), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
            time.sleep(0.1)


@dataclass
class Proc:
    """One service process and the history of its lives."""
    name: str
    argv: list[str]
    log_path: pathlib.Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    started_at: float = 0.0  # time.time() of the last start
    warm_restarts: bool = False  # after a kill, prepare the next life as a standby (localcluster/standby.py)
    standby: subprocess.Popen | None = None
    warm_starts: int = 0

    def start(self) -> None:
        """Starts its next life: the standby's, if one is waiting, else a new process."""
        self.starts += 1
        self.started_at = time.time()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.time():.3f}: {' '.join(self.argv)}\n".encode())
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is None:
            try:
                standby.stdin.write(go_line(time.monotonic()))
                standby.stdin.close()
                self.popen = standby
                self.warm_starts += 1
                return
            except BrokenPipeError:  # it died meanwhile: start cold
                standby.wait()
        self.popen = self._spawn(self.argv)

    def _spawn(self, argv: list[str], stdin: int | None = None) -> subprocess.Popen:
        # Its own session (a Ctrl-C meant for the harness reaches it only through the harness),
        # but it dies with the harness, which may be SIGKILLed (services.process.die_with_parent).
        env = {**os.environ, **self.env, DIE_WITH_PARENT_ENV: str(os.getpid())}
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(argv, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def prepare_standby(self) -> None:
        """With warm restarts: a standby for the next life, importing while this one is down."""
        if self.warm_restarts and self.standby is None:
            self.standby = self._spawn([self.argv[0], "-m", "diloco.localcluster.standby", *self.argv[1:]],
                                       stdin=subprocess.PIPE)

    def discard_standby(self) -> None:
        standby = self.standby
        self.kill_standby()
        self.standby = None
        if standby is not None:
            standby.wait()

    def kill_standby(self) -> None:
        """SIGKILL to a waiting standby, without waiting for it."""
        if self.standby is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.standby.pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: no goodbye, no flush — what a machine failure looks like. With warm
        restarts, the next life's standby starts importing."""
        if self.running:
            self.send(signal.SIGKILL)
            self.popen.wait()
            self.kills += 1
        self.prepare_standby()

    def request_stop(self) -> None:
        """SIGTERM once: the process drains and exits by itself."""
        self.send(signal.SIGTERM)

    def send(self, signum: int) -> None:
        """Signals the process (its group) if it runs, without waiting for it."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):  # it ended after the check
                os.killpg(self.popen.pid, signum)

    def wait_or_kill(self, timeout: float) -> None:
        """Waits for the exit a request_stop asked for; SIGKILL after `timeout`. A standby
        waiting for a next life is ended too."""
        self.discard_standby()
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def terminate(self, timeout: float) -> None:
        self.request_stop()
        self.wait_or_kill(timeout)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines its last life wrote (an error's traceback, say)."""
        text = self.log_path.read_text(errors="replace")
        life = text.rsplit("\n=== start ", 1)[-1].split("\n", 1)[-1]  # after the start line
        return "\n".join([line for line in life.splitlines() if line.strip()][-lines:])


class LocalCluster:
    """Shards and learners of one config as local processes."""

    def __init__(self, cfg: Config, run_dir: pathlib.Path, learner_env: dict[str, str] | None = None,
                 learner_script: pathlib.Path | None = None, warm_restarts: bool = False):
        if cfg.run.listen_host is None:  # a local cluster is reached from this machine only
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"listen_host": "127.0.0.1"})})
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        self.config_path = run_dir / "cluster.yaml"
        self.config_path.write_text(dump_config(cfg))
        if cfg.tls.mode == "mtls" and cfg.tls.dir is None:
            issue_cluster_certs(cfg, certs_dir(cfg))
        # What the harness presents to the shards: health checks and Status.
        self.operator = load_identity(cfg, OPERATOR)
        cli = [sys.executable, "-m", "diloco"]
        self.shards = [
            Proc(f"shard-{i}", cli + ["syncer", "--config", str(self.config_path), "--shard-index", str(i)],
                 run_dir / "logs" / f"shard-{i}.log")
            for i in range(len(cfg.shards))]
        # The harness ends the run (stop_learners) once every learner has spent its budget;
        # until then a finished learner keeps following the global values. A learner script
        # (the user's own loop) is given the config and its id, and must stop on SIGTERM.
        learner = ([sys.executable, str(learner_script)] if learner_script else cli + ["learner"])
        argv = {l.id: (learner if cfg.link(l.id, l.region) is None else launcher(learner))
                + ["--config", str(self.config_path), "--learner-id", l.id]
                + ([] if learner_script else ["--region", l.region, "--catch-up-seconds", "86400"])
                for l in cfg.learners}
        # Islands of replica groups: each learner process is its island's group 0.
        from diloco.localcluster.islands import Islands  # it builds on Proc, defined here
        self.islands = Islands(cfg, run_dir, argv, warm_restarts) if cfg.island.replica_groups > 1 else None
        self.learners = [
            Proc(l.id, argv[l.id] + (self.islands.group_flags(l.id, 0) if self.islands else []),
                 run_dir / "logs" / f"{l.id}.log", env=dict(learner_env or {}), warm_restarts=warm_restarts)
            for l in cfg.learners]
        if self.islands:
            self.islands.adopt(self.learners)

    def start_shards(self, timeout: float = 60) -> None:
        for proc in self.shards:
            proc.start()
        for shard, proc in zip(self.cfg.shards, self.shards):
            wait_serving(shard.address, timeout, self.operator, proc)

    def restart_shard(self, index: int, timeout: float = 60) -> None:
        self.shards[index].start()
        wait_serving(self.cfg.shards[index].address, timeout, self.operator, self.shards[index])

    def start_learners(self) -> None:
        if self.islands:
            self.islands.start()
        for proc in self.learners:
            proc.start()

    def learner_report_path(self, learner_id: str) -> pathlib.Path:
        return pathlib.Path(self.cfg.run.state_dir) / f"learner-{learner_id}" / "report.json"

    def finish_learners(self) -> None:
        """SIGUSR1 to every learner: each ends the run here as if its budget were spent
        (delivers, leaves, keeps pulling the global model until stopped)."""
        for proc in self.learner_processes:
            proc.send(signal.SIGUSR1)

    def stop_learners(self, timeout: float = 60) -> None:
        """SIGTERM to every learner at once; they checkpoint, pull, report and leave."""
        for proc in self.learner_processes:
            proc.request_stop()
        for proc in self.learner_processes:
            proc.wait_or_kill(timeout)

    @property
    def learner_processes(self) -> list[Proc]:
        """Every process of every learner: an island's replica groups too, since any of them
        may lead it (Kubernetes, too, sends SIGTERM to every container of a pod)."""
        return self.islands.members if self.islands else self.learners

    def stop(self, timeout: float = 30) -> None:
        """Learners first (they leave cleanly), then shards (they flush state)."""
        self.stop_learners(timeout)
        if self.islands:
            self.islands.stop(timeout)
        for proc in self.shards:
            proc.terminate(timeout)

    def kill_now(self) -> None:
        """SIGKILL to every process, without waiting (a stop() under way reaps them): for a
        signal handler that interrupted that stop()."""
        for proc in self.learners + self.shards + (self.islands.processes if self.islands else []):
            proc.send(signal.SIGKILL)
            proc.kill_standby()
