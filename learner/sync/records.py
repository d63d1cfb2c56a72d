"""What rank 0 of a learner records of itself: its report (learner/sync/report.py), written to
<state_dir>/report.json, and where learners[].metrics_port is set its Prometheus /metrics
(learner/sync/metrics.py). DecoupledDiLoCo (learner/sync/api.py) tells it what happens."""
from __future__ import annotations

import pathlib

import grpc

from diloco.learner.island.ranks import Island
from diloco.learner.sync.metrics import LearnerMetrics
from diloco.learner.sync.report import Report
from diloco.learner.sync.streaming import StreamingSync
from diloco.services.client import ShardClient
from diloco.services.contract.config import Config, LearnerConfig, check_state_folder
from diloco.services.contract.tls import Identity
from diloco.services.metrics import serve


class LearnerRecords:
    def __init__(self, cfg: Config, learner: LearnerConfig, state_dir: pathlib.Path, restored: dict | None,
                 total_numel: int):
        """Refuses (OSError naming it) a state folder it cannot write: a learner that cannot keep
        its report must not train."""
        try:
            check_state_folder(state_dir)
        except OSError as error:
            raise OSError(error.errno, f"learner {learner.id}: cannot write its state folder "
                          f"{state_dir}: {error.strerror}") from None
        self.cfg, self.learner, self.total_numel = cfg, learner, total_numel
        self.restored_lives = (restored or {}).get("incarnations", [])
        self.report = Report(state_dir / "report.json", learner.id, learner.region, restored, total_numel)
        self.metrics: LearnerMetrics | None = None
        self._server = None

    def serve_metrics(self) -> None:
        """Serves /metrics on learners[].metrics_port (0: none); OSError naming the key."""
        port = self.learner.metrics_port
        if not port:
            return
        self.metrics = LearnerMetrics()
        try:
            self._server = serve(self.metrics.registry, port, self.cfg.run.listen_host)
        except OSError as error:
            raise OSError(error.errno, f"learner {self.learner.id}: cannot serve metrics on port {port} "
                          f"(learners[].metrics_port): {error.strerror}") from None
        self.metrics.model_loaded(self.total_numel)

    def joining(self, steps: int, identity: Identity | None) -> None:
        """Before joining: the steps the previous incarnation trained past its checkpoint (the
        shards still hold its last reported step) are lost work."""
        if self.metrics:
            lost = max(0, last_step_seen_by_shards(self.cfg, self.learner.id, identity) - steps)
            self.metrics.steps_lost(lost, mean_step_seconds(self.restored_lives))

    def watch(self, sync: StreamingSync) -> None:
        if self.metrics:
            self.metrics.watch_sync(sync.held_versions, lambda: sync.stats.blocked_seconds, lambda: {
                "refused": sync.stats.syncs_refused, "reanchored": sync.stats.reanchored,
                "hash_mismatch": sync.stats.hash_mismatches, "healed": sync.stats.heals})

    def started(self, sync: StreamingSync | None, steps: int, startup_seconds: float, restore_seconds: float) -> None:
        if self.metrics:
            self.metrics.started(restore_seconds)
        self.report.begin_incarnation(sync.incarnation if sync else 0, steps, startup_seconds, restore_seconds,
                                      sync.stats.versions_behind_at_join if sync else 0)

    def stepped(self, compute_seconds: float, loop_seconds: float, tokens: int, steps: int) -> None:
        self.report.step(compute_seconds, loop_seconds)
        if self.metrics:
            self.metrics.stepped(compute_seconds, tokens, steps)

    def spent(self, category: str, seconds: float, report_key: str | None = None) -> None:
        """`seconds` of badput `category` (in the report under `report_key`, default the category)."""
        self.report.spent(report_key or category, seconds)
        if self.metrics:
            self.metrics.spent(category, seconds)

    def training_ended(self, budget_spent: bool) -> None:
        self.report.training_ended()
        if budget_spent and self.metrics:
            self.metrics.training_finished()

    def write(self, phase: str, steps: int, tokens: int, island: Island, sync: StreamingSync | None,
              background: bool = False) -> None:
        self.report.island = island.record()
        self.report.write(phase, steps, tokens, island.world_size, sync, background)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.report.close()  # the last write on disk


def last_step_seen_by_shards(cfg: Config, learner_id: str, identity: Identity | None) -> int:
    """The step this learner's previous incarnation last reported in a heartbeat, as far as any
    shard remembers it (0 when none does: first start, or the shards restarted too). It lags the
    step the process died at by up to one heartbeat interval, so work lost is a lower bound."""
    seen = 0
    for shard in cfg.shards:
        try:
            with ShardClient(shard.address, cfg.rpc, identity=identity) as client:
                status = client.status(timeout=2.0)
        except grpc.RpcError:
            continue
        seen = max([seen] + [l.last_step for l in status.learners if l.learner_id == learner_id])
    return seen


def mean_step_seconds(incarnations: list[dict]) -> float | None:
    """Mean compute seconds per step of the lives a checkpoint recorded (None: no step recorded)."""
    steps = sum(life.get("steps", 0) for life in incarnations)
    return sum(life.get("compute_seconds", 0.0) for life in incarnations) / steps if steps else None
