"""`diloco learner --config C --learner-id ID --region R`: one learner island.

It trains until its step or token budget is spent (or SIGTERM), syncing fragments
with the shards as it goes, then catches up with the run's final global values
and writes a report. Under torchrun the island is several processes: DDP inside
the island, rank 0 alone talks to the syncer and broadcasts every applied
fragment to the other ranks.

    trainer.step loop:  train_step -> sync.after_step (start due syncs, apply late ones)
                        (+ broadcast inside the island, eval, checkpoint)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Callable

import grpc
import torch
import torch.distributed as dist

from torch.nn.parallel import DistributedDataParallel

from diloco.learner.checkpoint import CheckpointWriter, load_checkpoint
from diloco.learner.sync import JoinRefused, StreamingSync
from diloco.learner.train import Trainer, manifest, named_parameters
from diloco.services.client import ShardClient
from diloco.services.config import Config, ConfigError, check_state_folder, load_config
from diloco.services.export import ExportedFragment, GlobalModel, write_export
from diloco.services.fragments import FragmentPlan, gather, plan_for_config, scatter
from diloco.services.metrics import LearnerMetrics, serve
from diloco.services.tls import Identity, learner_name, load_identity

log = logging.getLogger(__name__)

FAILED = 1  # exit status of a learner that could not do its job (a config error is 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster YAML file")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--state-dir", help="checkpoint and report folder "
                        "(default: <run.state_dir>/learner-<id>)")
    parser.add_argument("--tls-dir", help="folder with this learner's ca.crt, tls.crt and tls.key "
                        "(default: <tls.dir>/learner-<id> of the config)")
    parser.add_argument("--catch-up-seconds", type=float, default=3.0,
                        help="after training, pull until no fragment changed for this long "
                             "(or until SIGTERM), so the learner ends with the run's final values")
    parser.add_argument("--verify-island", action="store_true",
                        help="after every applied fragment, check that all ranks hold the same bits")
    parser.add_argument("--export", metavar="DIR",
                        help="at the end, write the run's global model as this learner holds it (after its "
                             "catch-up: the shards' final values) to DIR, as `diloco export` does")
    parser.add_argument("--no-sync", action="store_true",
                        help="train alone, never talking to the syncer (a baseline for benchmarks)")


class Island:
    """The processes of one learner: rank 0 syncs, every rank trains."""

    def __init__(self):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.verified = 0  # rank-equality checks passed (--verify-island)
        if self.world_size > 1:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share_start(self, trainer: Trainer, params: dict[str, torch.Tensor]) -> None:
        """Every rank starts from rank 0's (global) weights and its step count (only rank 0
        restores a checkpoint); DDP keeps the weights equal after."""
        if self.world_size > 1:
            for tensor in params.values():
                dist.broadcast(tensor.data, src=0)
            position = torch.tensor([trainer.step, trainer.tokens], dtype=torch.int64)
            dist.broadcast(position, src=0)
            trainer.step, trainer.tokens = (int(v) for v in position)

    def broadcast_applied(self, plan: FragmentPlan, applied: list[int],
                          params: dict[str, torch.Tensor]) -> list[int]:
        """Rank 0's applied fragment values reach every rank, so the island stays identical.
        Returns the applied fragment ids on every rank."""
        if self.world_size == 1:
            return applied
        flags = torch.zeros(len(plan.fragments), dtype=torch.uint8)
        flags[applied] = 1
        dist.broadcast(flags, src=0)
        for fragment in plan.fragments:
            if flags[fragment.id]:
                flat = gather(fragment, params) if self.leader else torch.empty(fragment.numel)
                dist.broadcast(flat, src=0)
                if not self.leader:
                    scatter(fragment, flat, params)
        return flags.nonzero().flatten().tolist()

    def verify_identical(self, params: dict[str, torch.Tensor]) -> None:
        """Checks that every rank holds the same bits (the --verify-island diagnostic)."""
        if self.world_size == 1:
            return
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params.values()))
        mine = torch.tensor(list(digest.digest()[:8]), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(mine, other) for other in every):
            raise RuntimeError(f"island ranks hold different parameters (rank {self.rank})")
        self.verified += 1

    def stopping(self, should_stop: Callable[[], bool]) -> bool:
        """Every rank of an island stops at the same step: rank 0 decides."""
        if self.world_size == 1:
            return should_stop()
        flag = torch.tensor([1 if self.leader and should_stop() else 0], dtype=torch.uint8)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def close(self) -> None:
        if self.world_size > 1:
            dist.destroy_process_group()

    def exit(self, code: int) -> None:
        """Ends a rank of an island without finalizing the interpreter (a single process returns).

        DDP's reducer keeps the gloo process group, and its worker threads, alive after
        destroy_process_group. A worker that drops the last collective's tensors while the
        interpreter finalizes must take the GIL, cannot, and the process aborts ("terminate
        called without an active exception", SIGABRT; about 1 run in 20 on 2 busy cores; the
        core dump shows ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject ->
        take_gil). Nothing of ours runs at exit: the report and checkpoint are on disk."""
        if self.world_size > 1:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def run(args: argparse.Namespace) -> int:
    # Start-up badput counts from the process's start: loading Python, torch and this code too.
    started = process_started()
    try:
        cfg = load_config(args.config)
        learner = cfg.learner(args.learner_id)
        if learner.region != args.region:
            raise ConfigError(f"--region {args.region}: learner {learner.id} is in region "
                              f"{learner.region} in {args.config}")
        identity = load_identity(cfg, learner_name(learner.id), args.tls_dir)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    state_dir = pathlib.Path(args.state_dir or pathlib.Path(cfg.run.state_dir) / f"learner-{learner.id}")
    try:
        check_state_folder(state_dir)  # a learner that cannot checkpoint must not train
    except OSError as error:
        log.error("learner %s: cannot write its state folder %s: %s", learner.id, state_dir, error.strerror)
        return FAILED
    island = Island()
    # Served before the slow part of start-up, so that time shows as startup badput, not down.
    metrics = LearnerMetrics() if island.leader and learner.metrics_port else None
    if metrics:
        try:
            serve(metrics.registry, learner.metrics_port)
        except OSError as error:
            log.error("learner %s: cannot serve metrics on port %d (learners[].metrics_port): %s",
                      learner.id, learner.metrics_port, error.strerror or error)
            island.close()
            return FAILED
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    trainer = Trainer.from_config(cfg, learner.id, rank=island.rank,
                                  cache_dir=pathlib.Path(cfg.run.state_dir) / "cache")
    params = named_parameters(trainer.model)
    plan = plan_for_config(cfg, manifest(trainer.model))
    checkpoint_path = state_dir / "checkpoint.pt"
    checkpoint = load_checkpoint(checkpoint_path) if island.leader else None
    checkpoints = CheckpointWriter(checkpoint_path)
    extra = checkpoint["extra"] if checkpoint else {}
    if checkpoint:
        trainer.restore(checkpoint)
    startup_seconds = time.monotonic() - started

    restore_started = time.monotonic()
    if metrics:
        metrics.model_loaded(plan.total_numel)
    sync = None
    if island.leader and not args.no_sync:
        if metrics:
            # Before joining: the shards still hold the previous incarnation's last step.
            metrics.steps_lost(max(0, last_step_seen_by_shards(cfg, learner.id, identity) - trainer.step),
                               mean_step_seconds(extra.get("report", {}).get("incarnations", [])))
        sync = StreamingSync(cfg, learner.id, learner.region, params, plan, observer=metrics, identity=identity)
        try:
            sync.start(extra.get("sync"), should_stop=stop.is_set, step=trainer.step,
                       tokens=trainer.tokens * island.world_size)
        except JoinRefused as refused:
            log.error("learner %s cannot join the run: %s", learner.id, refused)
            sync.close(leave=False)
            island.close()
            return FAILED
    island.share_start(trainer, params)
    if island.world_size > 1:
        trainer.forward_module = DistributedDataParallel(trainer.model)
    restore_seconds = time.monotonic() - restore_started
    if metrics:
        metrics.started(restore_seconds)
        if sync:
            metrics.watch_sync(sync.held_versions, lambda: sync.stats.blocked_seconds, lambda: {
                "refused": sync.stats.syncs_refused, "reanchored": sync.stats.reanchored,
                "hash_mismatch": sync.stats.hash_mismatches})

    report = Report(state_dir / "report.json", learner.id, learner.region, extra.get("report"))
    report.begin_incarnation(sync.incarnation if sync else 0, trainer.step, startup_seconds,
                             restore_seconds, sync.stats.versions_behind_at_join if sync else 0)
    if island.leader:  # so this incarnation's record survives a kill
        timed("checkpoint", lambda: save(trainer, sync, report, checkpoints), report, metrics)
    try:
        code = train(cfg, args, trainer, sync, island, plan, params, report, stop, checkpoints, metrics)
    except JoinRefused as refused:  # a shard came back with another model or other settings
        log.error("learner %s stops: %s", learner.id, refused)
        code = FAILED
    finally:
        checkpoints.wait()
        if sync is not None:
            sync.close(leave=True)
        island.close()
    island.exit(code)
    return code


def train(cfg: Config, args: argparse.Namespace, trainer: Trainer, sync: StreamingSync | None,
          island: Island, plan: FragmentPlan, params: dict[str, torch.Tensor], report: Report,
          stop: threading.Event, checkpoints: CheckpointWriter, metrics: LearnerMetrics | None) -> int:
    """Trains until the budget is spent or stopped; the exit status (FAILED: every sync refused)."""
    budget = cfg.trainer

    def budget_left() -> bool:
        """This learner's step and token budgets, and the run's token budget (on rank 0 only:
        ranks learn when to stop from island.stopping)."""
        tokens = trainer.tokens * island.world_size
        run_tokens_left = sync is None or not sync.schedule.run_over(sync.tokens)
        return trainer.step < budget.max_steps and (budget.max_tokens is None or tokens < budget.max_tokens) \
            and run_tokens_left

    def evaluate() -> None:
        report.evaluation(trainer.step, trainer.tokens * island.world_size, trainer.evaluate())

    if island.leader and not report.evaluations:
        timed("evaluation", evaluate, report, metrics)  # the starting point of the loss curve
    while not island.stopping(lambda: stop.is_set() or not budget_left()):
        step = trainer.step
        step_started = time.perf_counter()
        stats = trainer.train_step()
        tokens = stats.tokens * island.world_size
        applied = sync.after_step(step, tokens, stats.seconds) if sync else []
        applied = island.broadcast_applied(plan, applied, params)
        # compute: the step alone; loop: with starting and applying syncs (and any wait).
        report.step(stats.seconds, time.perf_counter() - step_started)
        if metrics:
            metrics.stepped(stats.seconds, tokens, trainer.step)
        if args.verify_island and applied:
            island.verify_identical(params)
        if island.leader and trainer.step % budget.eval_every == 0:
            timed("evaluation", evaluate, report, metrics)
        if island.leader and trainer.step % budget.checkpoint_every == 0:
            timed("checkpoint", lambda: save(trainer, sync, report, checkpoints), report, metrics)
            report.write("training", trainer, sync, island)  # what it keeps, should it die before the end
    if not island.leader:
        return 0
    finished = not budget_left()
    if sync and not finished:
        sync.flush()  # may wait for late results: still provisioned training time
    report.training_ended()
    if finished and metrics:
        metrics.training_finished()
    if sync:
        if finished:
            sync.deliver()  # the last contributions are in; their rounds need not wait for us
            sync.leave()
            report.write("catching_up", trainer, sync, island)
        # Hold the run's final global values: until it is quiet (or we are stopped).
        sync.catch_up(args.catch_up_seconds, should_stop=stop.is_set)
        if args.export:
            export_global_model(cfg, sync, pathlib.Path(args.export))
    evaluate()
    save(trainer, sync, report, checkpoints)
    checkpoints.wait()  # "done" means on disk
    report.write("done" if finished else "training", trainer, sync, island)
    if sync and sync.stats.syncs_refused and not sync.stats.syncs_applied:
        log.error("learner %s: the shards refused its syncs (%d of %d started) and applied none: "
                  "it trained alone; see the warnings above", report.learner_id, sync.stats.syncs_refused,
                  sync.stats.syncs_started)
        return FAILED
    log.info("learner %s %s at step %d", report.learner_id, "finished" if finished else "stopped",
             trainer.step)
    return 0


def export_global_model(cfg: Config, sync: StreamingSync, out: pathlib.Path) -> None:
    """The global values this learner holds, written as `diloco export` writes the shards'."""
    fragments = tuple(ExportedFragment(fid, sync.plan.fragments[fid].shard, version, digest, None)
                      for fid, (version, digest) in sorted(sync.fragment_hashes().items()))
    write_export(GlobalModel(cfg.run.name, sync.plan.digest, fragments, sync.global_state_dict()), out)
    log.info("wrote the global model at fragment versions %s to %s", [f.version for f in fragments], out)


def process_started() -> float:
    """When this process started, on time.monotonic's clock. /proc/self/stat's start time is in
    clock ticks since boot, the clock CLOCK_BOOTTIME reads. (psutil's create_time adds the boot
    time of /proc/stat, which is whole seconds: a start-up measured with it was up to 1 s long.)"""
    fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22, starttime; the split began at field 3
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - age


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


def timed(category: str, work: Callable[[], None], report: Report, metrics: LearnerMetrics | None) -> None:
    """Runs `work` (an evaluation or a checkpoint while training) and counts its time as that
    badput category."""
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    report.spent(category, seconds)
    if metrics:
        metrics.spent(category, seconds)


def save(trainer: Trainer, sync: StreamingSync | None, report: Report, checkpoints: CheckpointWriter) -> None:
    report.update(sync)
    extra = {"report": report.persistent()}
    if sync:
        extra["sync"] = sync.state_dict()
    checkpoints.write(trainer.checkpoint(extra))


class Report:
    """What this learner did, across its incarnations, as JSON for `diloco sim` and people.

    Each incarnation (process start) has a record; the records ride along in the
    checkpoint, so a restarted learner's report still shows the lives before it."""

    def __init__(self, path: pathlib.Path, learner_id: str, region: str, restored: dict | None):
        self.path = path
        self.learner_id = learner_id
        self.region = region
        saved = restored or {}
        self.evaluations: list[list[float]] = saved.get("evaluations", [])  # [unix time, step, tokens, loss]
        self.incarnations: list[dict] = saved.get("incarnations", [])
        self.current: dict = {}

    def persistent(self) -> dict:
        return {"evaluations": self.evaluations, "incarnations": self.incarnations}

    def begin_incarnation(self, incarnation: int, restored_step: int, startup: float, restore: float,
                          behind: int) -> None:
        self.current = {"incarnation": incarnation, "started": time.time(), "restored_step": restored_step,
                        "startup_seconds": startup, "restore_seconds": restore,
                        "versions_behind_at_join": behind, "steps": 0, "compute_seconds": 0.0,
                        "loop_seconds": 0.0, "evaluation_seconds": 0.0, "checkpoint_seconds": 0.0}
        self.incarnations.append(self.current)

    def spent(self, category: str, seconds: float) -> None:
        """Training-time work besides steps: category "evaluation" or "checkpoint"."""
        self.current[f"{category}_seconds"] += seconds

    def step(self, compute_seconds: float, loop_seconds: float) -> None:
        self.current["steps"] += 1
        self.current["compute_seconds"] += compute_seconds
        self.current["loop_seconds"] += loop_seconds

    def training_ended(self) -> None:
        """Training ended: its budget is spent, or it was stopped and its syncs are flushed.
        The learner's provisioned time ends here; catching up and the last evaluation follow."""
        self.current["training_ended_at"] = time.time()

    def evaluation(self, step: int, tokens: int, loss: float) -> None:
        self.evaluations.append([time.time(), step, tokens, loss])
        log.info("learner %s step %d: validation loss %.4f", self.learner_id, step, loss)

    def update(self, sync: StreamingSync | None) -> None:
        """Copies the sync counters of this incarnation into its record."""
        if sync:
            stats = sync.stats
            self.current.update(
                blocked_seconds=stats.blocked_seconds, bytes_up=stats.bytes_up, bytes_down=stats.bytes_down,
                transfer_seconds=stats.transfer_seconds, syncs_started=stats.syncs_started,
                syncs_applied=stats.syncs_applied, syncs_skipped=stats.syncs_skipped,
                syncs_late=stats.syncs_late, held_steps=stats.held_steps, refused_stale=stats.refused_stale,
                reanchored=stats.reanchored, syncs_refused=stats.syncs_refused,
                hash_mismatches=stats.hash_mismatches)

    def write(self, phase: str, trainer: Trainer, sync: StreamingSync | None, island: Island) -> None:
        """phase: "training", "catching_up" (budget spent) or "done"."""
        self.update(sync)
        body = {"learner_id": self.learner_id, "region": self.region, "phase": phase,
                "steps": trainer.step, "tokens": trainer.tokens * island.world_size, "world_size": island.world_size,
                "island_checks": island.verified,
                "evaluations": self.evaluations, "incarnations": self.incarnations}
        if sync:
            body["fragments"] = {str(fid): {"version": v, "state_hash": h}
                                 for fid, (v, h) in sync.fragment_hashes().items()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.path)
