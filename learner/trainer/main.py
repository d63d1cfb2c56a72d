"""`diloco learner --config C --learner-id ID --region R`: one learner island, the built-in
GPT and inner loop (learner/trainer/train.py) as one user of DecoupledDiLoCo (learner/sync/api.py).

It trains until its step or token budget is spent (or SIGTERM), syncing fragments with the
shards as it goes, then catches up with the run's final global values and writes a report.
Under torchrun the island is several processes: DDP inside the island, rank 0 alone talks
to the syncer and broadcasts every applied fragment to the other ranks. Each process trains on
trainer.device (learner/trainer/device.py: under torchrun, GPU LOCAL_RANK), and the island's process
group is NCCL on GPUs, gloo on the CPU.

`--data-parallel` under torchrun with one process per learner of the config is the data-parallel
baseline (`diloco sim --mode dp`): rank r trains on learner r's data exactly as that learner
would, DDP averages the gradients of every step, one optimizer trajectory, no syncer.

    loop:  trainer.train_step -> sync.step (start due syncs, apply results)
           (+ evaluation and checkpoint, timed as badput)
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.learner.sync.api import DecoupledDiLoCo
from diloco.learner.trainer.checkpoint import CheckpointError, CheckpointWriter, load_checkpoint
from diloco.learner.trainer.device import DeviceUnavailable, local_rank, resolve_device
from diloco.learner.island.ranks import IslandBroken, LeadTaken
from diloco.learner.island.leader_lease import LeaderLease
from diloco.learner.sync.report import LIFE_STARTED_ENV
from diloco.learner.sync.healing import LearnerDiverged
from diloco.learner.sync.streaming import JoinRefused
from diloco.learner.trainer.poison import Poison
from diloco.learner.trainer.wan_allreduce import PacedAllReduce
from diloco.services.client import emulated_link
from diloco.learner.trainer.train import Trainer
from diloco.services.contract.config import ConfigError, load_config
from diloco.services.memory import keep_freed_memory

log = logging.getLogger(__name__)

FAILED = 1  # exit status of a learner that could not do its job (a config error is 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster YAML file")
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--region", help="checked against the learner's region in the config (default: that region)")
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
    parser.add_argument("--start-fresh", action="store_true",
                        help="start from step 0 when the state folder's checkpoints cannot be read (the default "
                             "refuses: it would train the learner's whole budget again)")
    parser.add_argument("--no-sync", action="store_true",
                        help="train alone, never talking to the syncer (a baseline for benchmarks)")
    parser.add_argument("--replica-group", type=int, default=0, metavar="G",
                        help="with island.replica_groups > 1: which replica group of the island this process is "
                             "(0 leads at the start: it syncs with the shards and the others heal from it; "
                             "when the leader dies, another group takes the lead)")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), metavar="URL",
                        help="with island.replica_groups > 1: the island's torchft lighthouse, e.g. "
                             "http://127.0.0.1:29510 (default: $TORCHFT_LIGHTHOUSE)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="under torchrun with one process per learner of the config: data parallel "
                             "training, rank r on learner r's data, gradients averaged every step, no syncer")
    parser.add_argument("--eval-global", action="store_true",
                        help="each evaluation also evaluates the global model this learner holds (the report's "
                             "global_evaluations): the global model against the learner's own over the run")
    parser.add_argument("--poison", type=poison_flag, metavar="STEP:KIND",
                        help="fault injection (tests, `diloco sim --chaos-poison`): after inner step STEP the "
                             "model goes bad, KIND scale (x1000), nan or bitflip (learner/trainer/poison.py); in "
                             "every life of the learner that reaches STEP")


def poison_flag(text: str) -> Poison:
    try:
        return Poison.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        learner = cfg.learner(args.learner_id)
        if args.region is not None and learner.region != args.region:
            raise ConfigError(f"--region {args.region}: learner {learner.id} is in region "
                              f"{learner.region} in {args.config}")
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(cfg.trainer.device, local_rank())
    except DeviceUnavailable as error:  # the config is valid; this machine lacks the device
        log.error("learner %s: %s", learner.id, error)
        return FAILED
    keep_freed_memory()  # before any thread: every sync allocates its fragment-sized buffers again
    state_dir = pathlib.Path(args.state_dir or pathlib.Path(cfg.run.state_dir) / f"learner-{learner.id}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.data_parallel and world_size != len(cfg.learners):
        print(f"invalid: --data-parallel runs one process per learner of {args.config} ({len(cfg.learners)}), "
              f"this job has {world_size} (torchrun --nproc-per-node)", file=sys.stderr)
        return 2
    problem = replica_group_problem(cfg, args, world_size)
    if problem:
        print(f"invalid: {problem}", file=sys.stderr)
        return 2
    if world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's collectives run on the current GPU
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world_size > 1 else args.replica_group
    cache_dir = pathlib.Path(cfg.run.state_dir) / "cache"
    try:
        if args.data_parallel:  # learner r's data and sampling stream
            trainer = Trainer.from_config(cfg, cfg.learners[rank].id, cache_dir=cache_dir, device=device)
        else:
            trainer = Trainer.from_config(cfg, learner.id, rank=rank, cache_dir=cache_dir, device=device)
    except ConfigError as error:  # data.files that match nothing on this machine
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    checkpoints = CheckpointWriter(state_dir / "checkpoint.pt")
    island = join_replica_groups(cfg, args, trainer, device, state_dir) if cfg.island.replica_groups > 1 else None
    try:
        code = FAILED
        # Every rank: the model, the optimizer and its own data (a replica group: the leader's own).
        checkpoint = restore_checkpoint(args, trainer, checkpoints, rank) if island is None or island.leader else None
        code = learn(args, cfg, learner.id, trainer, island, checkpoints, checkpoint, state_dir, world_size)
        while code is None:  # this replica group took the lead of its island: it goes on as the learner
            os.environ[LIFE_STARTED_ENV] = str(time.monotonic())  # this life of the learner starts now
            checkpoint = restore_checkpoint(args, trainer, checkpoints, rank=None)
            code = learn(args, cfg, learner.id, trainer, island, checkpoints, checkpoint, state_dir, world_size)
    except CheckpointError as error:
        log.error("learner %s: %s", learner.id, error)
    finally:
        checkpoints.wait()
        if island:
            island.close()
        if world_size > 1:
            dist.destroy_process_group()
    if world_size > 1 or island:
        exit_rank(code)
    return code


def restore_checkpoint(args: argparse.Namespace, trainer: Trainer, checkpoints: CheckpointWriter,
                       rank: int | None) -> dict | None:
    """The learner's last checkpoint, restored into the trainer (None: there is none yet).
    `rank` None: this process keeps its own data position (a replica group taking the lead)."""
    checkpoint = load_checkpoint(checkpoints.path, start_fresh=args.start_fresh)
    if checkpoint:
        trainer.restore(checkpoint, rank)
    return checkpoint


def learn(args: argparse.Namespace, cfg, learner_id: str, trainer: Trainer, island, checkpoints: CheckpointWriter,
          checkpoint: dict | None, state_dir: pathlib.Path, world_size: int) -> int | None:
    """This process's part in the learner until the end: the exit status, or None when this
    replica group took the lead of its island on the way (it goes on as the learner)."""
    leads = island is None or island.leader
    sync = DecoupledDiLoCo(trainer.synced_module, cfg, learner_id, state_dir=state_dir, tls_dir=args.tls_dir,
                           catch_up_seconds=args.catch_up_seconds, enabled=not (args.no_sync or args.data_parallel),
                           # SIGTERM ends a replica group other than the leader at once: it holds nothing
                           # the island lacks, and may be waiting for a leader that has left.
                           stop_signals=(signal.SIGTERM, signal.SIGINT) if leads else (), island=island,
                           optimizer=trainer.optimizer)
    if island:
        island.keep_state(lambda: island_state(trainer, sync), lambda state: load_island_state(state, trainer, sync))
    if checkpoint and "diloco" in checkpoint["extra"]:
        sync.load_state_dict(checkpoint["extra"]["diloco"])
    try:
        with sync:
            trainer.step, trainer.tokens = sync.steps, sync.tokens // world_size  # rank 0's, on every rank
            if world_size > 1:
                trainer.forward_module = DistributedDataParallel(trainer.model)
            if args.data_parallel:
                pace_allreduce(cfg, trainer)
            return train(args, trainer, sync, checkpoints)
    except LeadTaken as taken:
        log.warning("learner %s: %s", learner_id, taken)
        return None
    except ConfigError as error:  # this learner's certificates
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # its state folder or its metrics port (DecoupledDiLoCo names which)
        log.error("%s", error.strerror if error.filename is None else error)
        return FAILED
    except JoinRefused as refused:  # not in the run, another model or other settings
        log.error("learner %s stops: %s", learner_id, refused)
        return FAILED
    except LearnerDiverged as diverged:  # healing did not help: stop rather than train on it
        log.error("learner %s stops, diverged: %s", learner_id, diverged)
        return FAILED
    except IslandBroken as broken:  # a replica group that cannot go on: restarted, it rejoins
        log.error("learner %s: %s", learner_id, broken)
        return FAILED


def train(args: argparse.Namespace, trainer: Trainer, sync: DecoupledDiLoCo, checkpoints: CheckpointWriter) -> int:
    """Trains until a budget is spent or stopped; the exit status (FAILED: every sync refused)."""
    report, budget = sync.report, sync.cfg.trainer

    def evaluate() -> None:
        held = sync.global_state_dict() if args.eval_global and sync.sync else None
        report.evaluation(trainer.step, sync.tokens, trainer.evaluate(),
                          None if held is None else trainer.evaluate(held))

    def save(ranks: list[dict] | None = None) -> None:
        """Every rank calls it at the same step: rank 0 writes what each rank alone holds."""
        ranks = ranks or sync.island.gather(trainer.rank_state())
        if sync.island.leader:
            checkpoints.write(trainer.checkpoint({"diloco": sync.state_dict()}, ranks))

    with sync.timed("checkpoint"):  # so this incarnation's record survives a kill
        save()
    if sync.island.leader:
        if not report.evaluations:
            with sync.timed("evaluation"):  # the starting point of the loss curve
                evaluate()
    stood_still = 0.0  # the island reconfiguring: a step dropped, a regroup
    while not sync.should_stop:
        stats = trainer.train_step()
        stood_still += stats.regroup_seconds + (0.0 if stats.committed else stats.seconds)
        if stats.regrouped:  # the island stood still while the others trained on
            sync.rephase(stood_still)
            stood_still = 0.0
        if not stats.committed:  # a replica group died during it: no step, the survivors go on
            continue
        applied = sync.step(stats.tokens, stats.seconds - stats.wan_seconds)
        if report and trainer.wan_allreduce:
            report.waited_for_wan(stats.wan_seconds, stats.wan_overlap_seconds)
        if args.poison and trainer.step == args.poison.step:
            log.warning("learner %s: poisoned after step %d (--poison %s)", sync.learner.id,
                        trainer.step, args.poison.kind)
            args.poison.apply(trainer.model.parameters(), seed=trainer.step)
        if args.verify_island and applied:
            sync.island.verify_identical(sync.params)
            if report:
                report.island_checks += 1
        if sync.island.leader and trainer.step % budget.eval_every == 0:
            with sync.timed("evaluation"):
                evaluate()
        if trainer.step % budget.checkpoint_every == 0:
            with sync.timed("checkpoint"):
                save()
                sync.write_report()  # what it keeps, should it die before the end
    if args.verify_island or sync.cfg.island.replica_groups > 1:  # replica groups always check at the end
        sync.island.verify_identical(sync.params)
    ranks = sync.island.gather(trainer.rank_state())  # before rank 0 catches up: the others stop here
    if not sync.island.leader:
        return 0
    sync.finish()
    if args.export and sync.sync:
        sync.export(args.export)
        log.info("wrote the global model as this learner holds it to %s", args.export)
    evaluate()
    save(ranks)
    checkpoints.wait()  # "done" means on disk
    stats = sync.sync.stats if sync.sync else None
    if stats and stats.syncs_refused and not stats.syncs_applied:
        log.error("learner %s: the shards refused its syncs (%d of %d started) and applied none: "
                  "it trained alone; see the warnings above", report.learner_id, stats.syncs_refused,
                  stats.syncs_started)
        return FAILED
    log.info("learner %s %s at step %d", report.learner_id, "finished" if sync.budget_spent else "stopped",
             trainer.step)
    return 0


def pace_allreduce(cfg, trainer: Trainer) -> None:
    """Data parallel whose harness emulates the WAN (`diloco sim --mode dp --wan-mbps`): the
    gradient all-reduce waits for a ring over the links of the regions its ranks are in (rank r
    is learner r of the config; a region's link is its first learner's)."""
    first = {l.region: l for l in reversed(cfg.learners)}
    ring = [link for l in first.values() if (link := emulated_link(cfg, l.id, l.region)) is not None]
    if len(first) < 2 or not ring:
        return
    trainer.wan_allreduce = PacedAllReduce(ring, len(first))
    trainer.forward_module.register_comm_hook(None, trainer.wan_allreduce.hook)


def replica_group_problem(cfg, args: argparse.Namespace, world_size: int) -> str | None:
    """What is wrong with this process as a replica group of its island (None: nothing)."""
    groups = cfg.island.replica_groups
    if groups == 1:
        return None if args.replica_group == 0 else \
            f"--replica-group {args.replica_group}: island.replica_groups is 1 in {args.config}"
    if not 0 <= args.replica_group < groups:
        return f"--replica-group {args.replica_group}: island.replica_groups is {groups} (groups 0 to {groups - 1})"
    if world_size > 1 or args.data_parallel:
        return (f"island.replica_groups {groups}: each replica group is one process, not a torchrun job "
                f"(this one has WORLD_SIZE {world_size}) nor --data-parallel")
    if not args.lighthouse:
        return f"island.replica_groups {groups}: give the island's lighthouse (--lighthouse or $TORCHFT_LIGHTHOUSE)"
    return None


def join_replica_groups(cfg, args: argparse.Namespace, trainer: Trainer, device: torch.device,
                        state_dir: pathlib.Path):
    """This process as replica group --replica-group of the island; the trainer averages its
    gradients with the other groups' (torchft is imported only here). The groups share the
    learner's state folder: its checkpoint, and the lease of the island's lead."""
    # torchft logs every step's quorum and commit at INFO (Python and Rust): its warnings are enough.
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from diloco.learner.island.replica_groups import ReplicaGroups
    # The finish signal (SIGUSR1) may reach every group of an island (diloco sim signals them
    # all, since any of them may lead): a group that does not lead, or not yet, ignores it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    groups = ReplicaGroups(args.replica_group, cfg.island, args.lighthouse, device,
                           LeaderLease(state_dir / "leader.lock"))
    trainer.replicas = groups
    return groups


def island_state(trainer: Trainer, sync: DecoupledDiLoCo) -> dict:
    """What a group joining the island receives: the model, the inner optimizer, the counters."""
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "counters": [trainer.step, trainer.tokens, sync.steps, sync.tokens]}


def load_island_state(state: dict, trainer: Trainer, sync: DecoupledDiLoCo) -> None:
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step, trainer.tokens, sync.steps, sync.tokens = state["counters"]


def exit_rank(code: int) -> None:
    """Ends a rank of an island without finalizing the interpreter.

    DDP's reducer keeps the gloo process group, and its worker threads, alive after
    destroy_process_group. A worker that drops the last collective's tensors while the
    interpreter finalizes must take the GIL, cannot, and the process aborts ("terminate
    called without an active exception", SIGABRT; about 1 run in 20 on 2 busy cores; the
    core dump shows ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> decref_pyobject ->
    take_gil). Nothing of ours runs at exit: the report and checkpoint are on disk."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
