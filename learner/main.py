"""`diloco learner --config C --learner-id ID --region R`: one learner island, the built-in
GPT and inner loop (learner/train.py) as one user of DecoupledDiLoCo (learner/api.py).

It trains until its step or token budget is spent (or SIGTERM), syncing fragments with the
shards as it goes, then catches up with the run's final global values and writes a report.
Under torchrun the island is several processes: DDP inside the island, rank 0 alone talks
to the syncer and broadcasts every applied fragment to the other ranks. Each process trains on
trainer.device (learner/device.py: under torchrun, GPU LOCAL_RANK), and the island's process
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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.learner.api import DecoupledDiLoCo
from diloco.learner.checkpoint import CheckpointError, CheckpointWriter, load_checkpoint
from diloco.learner.device import DeviceUnavailable, local_rank, resolve_device
from diloco.learner.sync import JoinRefused
from diloco.learner.train import Trainer
from diloco.services.contract.config import ConfigError, load_config

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
    parser.add_argument("--start-fresh", action="store_true",
                        help="start from step 0 when the state folder's checkpoints cannot be read (the default "
                             "refuses: it would train the learner's whole budget again)")
    parser.add_argument("--no-sync", action="store_true",
                        help="train alone, never talking to the syncer (a baseline for benchmarks)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="under torchrun with one process per learner of the config: data parallel "
                             "training, rank r on learner r's data, gradients averaged every step, no syncer")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        learner = cfg.learner(args.learner_id)
        if learner.region != args.region:
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
    state_dir = pathlib.Path(args.state_dir or pathlib.Path(cfg.run.state_dir) / f"learner-{learner.id}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.data_parallel and world_size != len(cfg.learners):
        print(f"invalid: --data-parallel runs one process per learner of {args.config} ({len(cfg.learners)}), "
              f"this job has {world_size} (torchrun --nproc-per-node)", file=sys.stderr)
        return 2
    if world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's collectives run on the current GPU
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    cache_dir = pathlib.Path(cfg.run.state_dir) / "cache"
    if args.data_parallel:  # learner r's data and sampling stream
        trainer = Trainer.from_config(cfg, cfg.learners[rank].id, cache_dir=cache_dir, device=device)
    else:
        trainer = Trainer.from_config(cfg, learner.id, rank=rank, cache_dir=cache_dir, device=device)
    checkpoints = CheckpointWriter(state_dir / "checkpoint.pt")
    try:  # every rank: the model, the optimizer and its own data
        checkpoint = load_checkpoint(checkpoints.path, start_fresh=args.start_fresh)
    except CheckpointError as error:
        log.error("learner %s: %s", learner.id, error)
        return FAILED
    if checkpoint:
        trainer.restore(checkpoint, rank)
    sync = DecoupledDiLoCo(trainer.synced_module, cfg, learner.id, state_dir=state_dir, tls_dir=args.tls_dir,
                           catch_up_seconds=args.catch_up_seconds, enabled=not (args.no_sync or args.data_parallel),
                           stop_signals=(signal.SIGTERM, signal.SIGINT))
    if checkpoint and "diloco" in checkpoint["extra"]:
        sync.load_state_dict(checkpoint["extra"]["diloco"])
    try:
        with sync:
            trainer.step, trainer.tokens = sync.steps, sync.tokens // world_size  # rank 0's, on every rank
            if world_size > 1:
                trainer.forward_module = DistributedDataParallel(trainer.model)
            code = train(args, trainer, sync, checkpoints)
    except ConfigError as error:  # this learner's certificates
        print(f"invalid: {error}", file=sys.stderr)
        code = 2
    except OSError as error:  # its state folder or its metrics port (DecoupledDiLoCo names which)
        log.error("%s", error.strerror if error.filename is None else error)
        code = FAILED
    except JoinRefused as refused:  # not in the run, another model or other settings
        log.error("learner %s stops: %s", learner.id, refused)
        code = FAILED
    finally:
        checkpoints.wait()
        if world_size > 1:
            dist.destroy_process_group()
    if world_size > 1:
        exit_rank(code)
    return code


def train(args: argparse.Namespace, trainer: Trainer, sync: DecoupledDiLoCo, checkpoints: CheckpointWriter) -> int:
    """Trains until a budget is spent or stopped; the exit status (FAILED: every sync refused)."""
    report, budget = sync.report, sync.cfg.trainer

    def evaluate() -> None:
        report.evaluation(trainer.step, sync.tokens, trainer.evaluate())

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
    while not sync.should_stop:
        stats = trainer.train_step()
        applied = sync.step(stats.tokens, stats.seconds)
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
