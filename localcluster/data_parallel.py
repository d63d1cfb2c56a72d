"""`diloco sim --mode dp`: the data-parallel baseline, run as data parallel runs.

The config's M learners become one torch.distributed job of M processes (torchrun on one
machine; gloo on the CPU, NCCL on GPUs): rank r trains on learner r's data with the model,
batch and inner optimizer learner r has in a diloco run, DistributedDataParallel averages the
gradients of every step, and every rank takes the same optimizer step from the same state
(`diloco learner --data-parallel`). The same tokens as a diloco run of the same config.

Failures are data parallel's: chaos SIGKILLs one rank, torchrun stops the others, and after
--restart-delay the whole job starts again, every rank from the last checkpoint. Bytes on the
wire are a ring all-reduce's of the fp32 gradients: each rank sends and receives
2 (M - 1) / M x 4 B per parameter per step.

Links capped as for a diloco run (--wan-mbps, --wan-latency-ms, the config's `links`) cap the
all-reduce: each rank's gradients wait for a ring across the regions over its region's link
(learner/trainer/wan_allreduce.py), and that wait is the job's badput "blocked". `diloco plan
--calibrate-from` sets the planner's data parallel beside such a run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import sys
import time

from diloco.localcluster.processes import Proc
from diloco.localcluster.chaos import Chaos
from diloco.localcluster.interrupt import ends_early
from diloco.services.contract.config import Config, LinkConfig, dump_config
from diloco.services.contract.goodput import account, no_badput

POLL_SECONDS = 0.5


class JobFailed(RuntimeError):
    """The job ended by itself before its budget was spent: its error is in the message."""


def allreduce_bytes(ranks: int, parameters: int) -> float:
    """What one rank sends (and receives) in a ring all-reduce of fp32 gradients, per step."""
    return 2 * (ranks - 1) / ranks * 4 * parameters


class DataParallelJob:
    """The torchrun process of the job and its ranks."""

    def __init__(self, cfg: Config, run_dir: pathlib.Path):
        self.cfg = cfg
        self.ranks = len(cfg.learners)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.config_path = run_dir / "cluster.yaml"
        self.config_path.write_text(dump_config(cfg))
        leader = cfg.learners[0]
        self.report_path = pathlib.Path(cfg.run.state_dir) / f"learner-{leader.id}" / "report.json"
        # Capped links: every rank starts behind its emulated link, which its all-reduce waits for.
        capped = any(cfg.link(l.id, l.region) for l in cfg.learners)
        self.proc = Proc("data-parallel", [
            sys.executable, "-m", "diloco.localcluster.torchrun", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(self.ranks), "--max-restarts", "0", "--monitor-interval", "0.1",
            *(["-m", "diloco.localcluster.wan"] if capped else []),
            "-m", "diloco", "learner", "--config", str(self.config_path), "--learner-id", leader.id,
            "--region", leader.region, "--data-parallel"], run_dir / "logs" / "data-parallel.log",
            env={"OMP_NUM_THREADS": str(cfg.trainer.threads)})

    def rank_pids(self) -> dict[int, int]:
        """The pid of every rank running now (torchrun's children, by their RANK)."""
        pids = {}
        if not self.proc.running:
            return pids
        task_dir = pathlib.Path(f"/proc/{self.proc.popen.pid}/task")
        try:
            children = [int(pid) for task in task_dir.iterdir() for pid in (task / "children").read_text().split()]
        except OSError:  # it exited meanwhile
            return pids
        for pid in children:
            try:
                environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                pids[rank] = pid
        return pids

    def fail(self, rank: int) -> None:
        """SIGKILL to one rank, as a machine failure, and waits while torchrun stops the others
        and exits. A job whose ranks have not started yet is killed whole."""
        if not self._kill(self.rank_pids().get(rank)):  # not started yet, or it ended meanwhile
            self.kill_now()
        self.proc.wait_or_kill(timeout=60)

    @staticmethod
    def _kill(pid: int | None) -> bool:
        """SIGKILL to `pid`; whether there was such a process."""
        try:
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                return True
        except ProcessLookupError:
            pass
        return False

    def report(self) -> dict:
        try:
            return json.loads(self.report_path.read_text())
        except (OSError, ValueError):
            return {}

    def kill_now(self) -> None:
        """SIGKILL to every rank and to torchrun, without waiting."""
        for pid in self.rank_pids().values():
            self._kill(pid)
        self.proc.send(signal.SIGKILL)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM: torchrun passes it to every rank; they stop at the same step and report."""
        self.proc.terminate(timeout)


def simulate(job: DataParallelJob, args: argparse.Namespace, progress) -> dict:
    """Runs the job to the end of its budget (or --duration) under chaos; the run's report in
    the form `diloco sim` writes for a diloco run."""
    cfg, ranks = job.cfg, job.ranks
    rng = random.Random(args.seed)
    started = time.time()
    job.proc.start()
    # Every rank fails at the rate a learner does; any failure stops the whole job.
    chaos = Chaos("learner", ranks, args.chaos_mtbf, args.restart_delay, rng, started)
    lost_seconds, timeline, launches = 0.0, [], [job.proc.started_at]
    outcome: dict = {}  # interrupted, if a stop signal ended the run early
    try:
        with ends_early(outcome):
            while True:
                now = time.time()
                report = job.report()
                if args.duration and now - started > args.duration:
                    break
                if not chaos.down and job.proc.returncode is not None:
                    if job.proc.returncode == 0 and report.get("phase") == "done":
                        break
                    raise JobFailed(f"the data-parallel job exited with {job.proc.returncode} by itself "
                                    f"(log {job.proc.log_path}):\n{job.proc.log_tail()}")
                for rank in [] if chaos.down else chaos.due_kills(now)[:1]:  # the first failure stops the job
                    job.fail(rank)
                    # Trained since this life's last checkpoint (its report is written with it): lost.
                    written = job.report_path.stat().st_mtime if job.report_path.exists() else 0.0
                    if report.get("phase") == "training" and written >= launches[-1]:
                        lost_seconds += now - written
                    chaos.killed(rank, now, report.get("steps", 0))
                for downtime in chaos.due_restarts(now):
                    job.proc.start()
                    launches.append(job.proc.started_at)
                    chaos.restarted(downtime, time.time())
                    chaos.redraw_all(time.time())
                steps = report.get("steps", 0) * ranks
                timeline.append({"time": now - started, "steps": steps})
                if progress:
                    progress.n = steps
                    progress.set_postfix_str(f"job restarts {len(chaos.events) // 2}", refresh=False)
                    progress.refresh()
                time.sleep(POLL_SECONDS)
    finally:
        if progress:
            progress.close()
    stopping = time.time()
    chaos.end(stopping)
    job.stop()
    report = job.report()
    return summarise(cfg, args, report, chaos, lost_seconds, started, stopping, launches, timeline) | outcome


def summarise(cfg: Config, args: argparse.Namespace, report: dict, chaos: Chaos, lost_seconds: float,
              started: float, stopping: float, launches: list[float], timeline: list[dict]) -> dict:
    """The job's figures. Every rank is provisioned from the start of the run until training
    ended, and every badput of the job (its start-up from torchrun's launch, evaluations on
    rank 0, time lost and down after a failure) is every rank's."""
    ranks = len(cfg.learners)
    lives = report.get("incarnations", [])

    def total(key: str) -> float:
        return sum(life.get(key, 0) for life in lives)

    def startup(life: dict) -> float:  # from the launch that made this life to its restore
        launched = max((at for at in launches if at <= life["started"]), default=life["started"])
        return life["started"] - launched - life.get("restore_seconds", 0.0)

    steps_run = total("steps")
    step_seconds = total("compute_seconds") / steps_run if steps_run else 0.0  # the WAN's wait not in it
    kept_steps = report.get("steps", 0)
    parameters = report.get("parameters", 0)
    ended = lives[-1].get("training_ended_at", stopping) if report.get("phase") == "done" else stopping
    wall = ended - started
    badput = no_badput()
    for category in ("restore", "evaluation", "checkpoint"):
        badput[category] = ranks * total(f"{category}_seconds")
    badput["startup"] = ranks * sum(startup(life) for life in lives)
    badput["down"] = ranks * sum(chaos.down_seconds)
    badput["lost"] = ranks * lost_seconds
    badput["blocked"] = ranks * total("wan_seconds")  # the all-reduce waiting for the links
    goodput = account(ranks * wall, ranks * kept_steps * step_seconds, badput)
    evaluations = report.get("evaluations", [])
    # The job's model is evaluated by rank 0 after its last step; a job stopped while down never was.
    final = evaluations[-1] if evaluations and evaluations[-1][1] == kept_steps else None
    per_rank_bytes = steps_run * allreduce_bytes(ranks, parameters)
    leader = cfg.learners[0]
    return {
        "mode": "dp",
        "seed": args.seed,
        "learners": ranks,
        "shards": 0,
        "regions": sorted({l.region for l in cfg.learners}),
        "started_at": started,
        "wall_seconds": wall,
        "tokens": report.get("tokens", 0),
        "inner_steps": ranks * kept_steps,
        "outer_steps": 0,
        "contributions": {"accepted": 0, "stale_merged": 0, "refused": 0},
        "goodput": goodput.share,
        "badput_seconds": dict(goodput.badput_seconds),
        "useful_seconds": ranks * kept_steps * step_seconds,
        "provisioned_seconds": ranks * wall,
        "initial_eval_loss": evaluations[0][3] if evaluations else None,
        "final_eval_loss": final[3] if final else None,  # one model, the same on every rank
        "final_eval_loss_learners": final[3] if final else None,
        "bytes_up": ranks * per_rank_bytes,
        "bytes_down": ranks * per_rank_bytes,
        "bytes_down_exact_end": 0,  # no shards' values to take at the end
        "dp_equivalent_bytes": 2 * ranks * per_rank_bytes,
        "model_parameters": parameters,
        "restarts": {"learners": sum(1 for e in chaos.events if e["event"] == "restart"), "shards": 0},
        "chaos_events": chaos.events,
        "state_hashes_agree": None,  # no shards: one model, the same on every rank by construction
        "anchor_offset": None,
        "links": {l.id: {"region": l.region, **(cfg.link(l.id, l.region) or LinkConfig()).model_dump(),
                         "bytes": 2 * per_rank_bytes} for l in cfg.learners},
        "per_learner": {leader.id: {"region": leader.region, "steps": kept_steps, "step_seconds": step_seconds,
                                    "steps_run": steps_run, "wan_seconds": total("wan_seconds"),
                                    "wan_overlap_seconds": total("wan_overlap_seconds"),
                                    "restarts": max(0, len(lives) - 1), "phase": report.get("phase"),
                                    "evaluations": evaluations, "ranks": ranks}},
        "timeline": timeline,
        "cluster_config": cfg.model_dump(mode="json"),
        "config": {"model": cfg.model_name(), "H": 1, "P": 1,
                   "tau": 0, "codec": "fp32", "K": ranks, "wan_mbps": cfg.rpc.wan_mbps, "chaos_mtbf": args.chaos_mtbf,
                   "restart_delay": args.restart_delay, "slow_learner": args.slow_learner},
    }
