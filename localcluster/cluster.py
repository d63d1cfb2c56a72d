"""Real local processes of a cluster: start, health-check, kill, restart, stop.

`diloco sim`, the integration tests and the benchmarks share this, so each starts
shards and learners exactly as a user would: `python -m diloco syncer ...`
and `python -m diloco learner ...` in their own processes.

With tls.mode mtls (the default) and no tls.dir of its own, the cluster issues its
certificates into the run's state folder first, as `diloco certs` would.
"""
from __future__ import annotations

import pathlib
import signal
import sys
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.services.contract.config import Config, RpcConfig, dump_config
from diloco.services.contract.rpc import open_channel
from diloco.services.authority import issue_cluster_certs
from diloco.services.contract.tls import OPERATOR, Identity, certs_dir, load_identity
from diloco.localcluster.islands import Islands
from diloco.localcluster.processes import Proc
from diloco.localcluster.wan import launcher

SYNCER_SERVICE = "diloco.v1.Syncer"


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


class LocalCluster:
    """Shards and learners of one config as local processes."""

    def __init__(self, cfg: Config, run_dir: pathlib.Path, learner_env: dict[str, str] | None = None,
                 learner_script: pathlib.Path | None = None, warm_restarts: bool = False,
                 learner_flags: dict[str, list[str]] | None = None,
                 learner_prefix: Callable[[str], list[str]] | None = None):
        """`learner_prefix`: what runs each learner's command in a network namespace whose link
        the kernel shapes (localcluster/kernel_links.py); None: learners with a link in the
        config pace it themselves (localcluster/wan.py)."""
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
        argv = {l.id: (learner_prefix(l.id) + learner if learner_prefix
                       else learner if cfg.link(l.id, l.region) is None else launcher(learner))
                + ["--config", str(self.config_path), "--learner-id", l.id]
                + ([] if learner_script else ["--region", l.region, "--catch-up-seconds", "86400"])
                + (learner_flags or {}).get(l.id, [])
                for l in cfg.learners}
        # Islands of replica groups: each learner process is its island's group 0.
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
        """Learners first (they leave cleanly), then shards (they flush state), all at once."""
        self.stop_learners(timeout)
        if self.islands:
            self.islands.stop(timeout)
        for proc in self.shards:
            proc.request_stop()
        for proc in self.shards:
            proc.wait_or_kill(timeout)

    def kill_now(self) -> None:
        """SIGKILL to every process, without waiting (a stop() under way reaps them): for a
        signal handler that interrupted that stop()."""
        for proc in self.learners + self.shards + (self.islands.processes if self.islands else []):
            proc.send(signal.SIGKILL)
            proc.kill_standby()
