"""The run of `diloco sim`: starts the local cluster, supervises it until every learner has spent
its budget (restarting what crashed, killing and restarting what chaos picks), lets the last
rounds settle, and evaluates the global model the run produced."""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import re
import sys
import time

from diloco.localcluster.chaos import Chaos
from diloco.localcluster.cluster import LocalCluster
from diloco.localcluster.processes import Proc
from diloco.localcluster.interrupt import ends_early
from diloco.localcluster.islands import recoveries
from diloco.localcluster.sim_observer import Observer
from diloco.localcluster.sim_summary import spared_islands, summarise
from diloco.learner.trainer.evaluate import evaluate_weights
from diloco.services.contract.config import Config
from diloco.services.export import MODEL_FILE, ExportError, fetch_global_model, write_export

log = logging.getLogger(__name__)


class StartupFailure(RuntimeError):
    """A learner that fails at start-up the same way every time: restarting it is no use."""


class StartupFailures:
    """Watches the learners that exit by themselves. One that exits before it ever trained
    (no report from that life: a report is written at each checkpoint) with the same error
    as its previous life, which also never trained, fails the same way at every start
    (a model factory that raises, say): StartupFailure with the error, rather than restart it
    forever with the error only in its log."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.errors: dict[str, str] = {}  # a learner's error at its last failed start-up

    def exited(self, proc: Proc) -> None:
        report_path = self.cluster.learner_report_path(proc.name)
        trained = report_path.exists() and report_path.stat().st_mtime >= proc.started_at
        tail = proc.log_tail()
        error = _without_timestamp(tail.splitlines()[-1]) if tail else ""
        if trained:
            self.errors.pop(proc.name, None)
        elif self.errors.get(proc.name) == error:
            raise StartupFailure(f"learner {proc.name} failed at start-up twice with the same error "
                                 f"(log {proc.log_path}):\n{tail}")
        else:
            self.errors[proc.name] = error


def _without_timestamp(line: str) -> str:
    """A log line without the time services.cli's log format puts first."""
    return re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", line)


def simulate(cfg: Config, cluster: LocalCluster, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    cluster.start_shards()
    started = time.time()
    cluster.start_learners()
    observer = Observer(cfg, cluster.operator)
    learner_chaos = Chaos("learner", len(cluster.learners), args.chaos_mtbf, args.restart_delay, rng, started)
    shard_chaos = Chaos("shard", len(cluster.shards), args.chaos_shards, args.restart_delay, rng, started)
    replica_chaos = Chaos("replica", len(cluster.islands.members) if cluster.islands else 0, args.chaos_replicas,
                          args.restart_delay, rng, started)
    startup_failures = StartupFailures(cluster)
    spared = frozenset(spared_islands(cfg, args))
    finished_at: dict[str, float] = {}
    timeline: list[dict] = []  # goodput over time
    total_steps = cfg.trainer.max_steps * len(cfg.learners)
    if cfg.trainer.max_run_tokens:  # the run ends at least this early
        total_steps = min(total_steps, -(-cfg.trainer.max_run_tokens // cfg.tokens_per_step()))
    progress = None if args.quiet else progress_bar(total_steps)
    outcome: dict = {}  # interrupted, if a stop signal ended the run early
    try:
        with ends_early(outcome):
            while len(finished_at) < len(cluster.learners):
                now = time.time()
                if args.duration and now - started > args.duration:
                    log.info("--duration %.0fs reached", args.duration)
                    break
                observer.poll()
                _supervise_learners(cluster, observer, learner_chaos, startup_failures, finished_at, now)
                _supervise_shards(cluster, observer, shard_chaos, now)
                if cluster.islands:
                    cluster.islands.supervise(replica_chaos, now, set(finished_at), spared)
                done = sum(observer.steps.values())
                timeline.append({"time": now - started, "steps": done})
                if progress:
                    progress.n = min(done, total_steps)
                    progress.set_postfix_str(f"killed {len(learner_chaos.events) // 2} "
                                             f"down {len(learner_chaos.down)}", refresh=False)
                    progress.refresh()
                time.sleep(0.5)
    finally:
        if progress:
            progress.close()
    wall = time.time() - started
    reports = _wind_down(cfg, cluster, observer, learner_chaos, shard_chaos, finished_at)
    report = summarise(cfg, args, reports, observer, learner_chaos, shard_chaos,
                       {name: at - started for name, at in finished_at.items()}, wall, timeline, started,
                       replica_chaos.events, [proc.name for proc in cluster.islands.members] if cluster.islands else [])
    # Lives started from a standby: the learners' and, in islands, the replica groups'.
    report["restarts"]["warm"] = sum(proc.warm_starts for proc in cluster.learner_processes)
    if cluster.islands:
        _add_islands(report, reports, cluster, replica_chaos)
    report.update(outcome)
    observer.close()
    report["final_eval_loss"] = evaluate_global_model(cluster)
    return report


def _supervise_learners(cluster: LocalCluster, observer: Observer, learner_chaos: Chaos,
                        startup_failures: StartupFailures, finished_at: dict[str, float], now: float) -> None:
    """One look at the learners: those that finished, those that crashed (restarted like chaos
    would), the kills chaos has due and the restarts after them."""
    for i, proc in enumerate(cluster.learners):
        if proc.name in finished_at or i in learner_chaos.down:
            continue
        report = _read_json(cluster.learner_report_path(proc.name))
        if report.get("phase") in ("catching_up", "done"):  # budget spent: now only following the run
            # Provisioned until the learner finished, not until this loop noticed.
            lives = report.get("incarnations") or [{}]
            finished_at[proc.name] = lives[-1].get("training_ended_at", now)
            learner_chaos.retire(i)
        elif proc.returncode is not None and not cluster.islands:  # crashed: restart like chaos would
            startup_failures.exited(proc)
            log.warning("learner %s exited with %s; restarting", proc.name, proc.returncode)
            learner_chaos.killed(i, now, observer.steps.get(proc.name, 0))
            proc.prepare_standby()
    for i in learner_chaos.due_kills(now):
        proc = cluster.learners[i]
        proc.kill()
        learner_chaos.killed(i, now, observer.steps.get(proc.name, 0))
        log.info("chaos: killed learner %s at step %d", proc.name, observer.steps.get(proc.name, 0))
    for downtime in learner_chaos.due_restarts(now):
        proc = cluster.learners[downtime.proc_index]
        proc.start()
        learner_chaos.restarted(downtime, time.time())


def _supervise_shards(cluster: LocalCluster, observer: Observer, shard_chaos: Chaos, now: float) -> None:
    """The shard kills chaos has due, and the restarts after them."""
    for i in shard_chaos.due_kills(now):
        observer.poll()
        observer.shard_restarting(i)
        cluster.shards[i].kill()
        shard_chaos.killed(i, now)
        log.info("chaos: killed shard %d", i)
    for downtime in shard_chaos.due_restarts(now):
        cluster.restart_shard(downtime.proc_index)
        shard_chaos.restarted(downtime, time.time())


def _wind_down(cfg: Config, cluster: LocalCluster, observer: Observer, learner_chaos: Chaos, shard_chaos: Chaos,
               finished_at: dict[str, float]) -> dict[str, dict]:
    """Ends the run: every shard up, the learners told to finish, the last rounds settled, the
    learners stopped. Returns their reports; `finished_at` gains the learners that had not finished."""
    for downtime in list(shard_chaos.down.values()):  # every shard serves the final pulls
        cluster.restart_shard(downtime.proc_index)
        shard_chaos.restarted(downtime, time.time())
    # A learner that has not finished (a --duration run) trains, or is down, until it is
    # told to finish, and then delivers its syncs in flight: its provisioned time ends when it
    # has (as it recorded), not at the wall time, or the steps it trains meanwhile would count
    # as goodput, and the waits as badput, outside any provisioned time.
    stopping = time.time()
    cluster.finish_learners()
    # Only once every learner has left and the last rounds have closed does each pull the
    # final values (SIGTERM ends its catch-up with one last pull) and write its report: a
    # learner stopped while a slower one still delivers would end a version behind.
    wait_until_settled(cfg, cluster, observer)
    learner_chaos.end(stopping)
    cluster.stop_learners()
    observer.poll(require_all=True)
    reports = {p.name: _read_json(cluster.learner_report_path(p.name)) for p in cluster.learners}
    for proc in cluster.learners:
        lives = reports[proc.name].get("incarnations") or [{}]
        finished_at.setdefault(proc.name, max(stopping, lives[-1].get("training_ended_at", stopping)))
    return reports


def _add_islands(report: dict, reports: dict[str, dict], cluster: LocalCluster, replica_chaos: Chaos) -> None:
    """The islands' part of the report: the replica groups' kills, and each island's recoveries."""
    report["chaos_events"] += replica_chaos.events
    report["islands"] = {learner_id: {**reports[learner_id].get("island", {}), "recoveries": recoveries(
        replica_chaos.events, reports[learner_id].get("island", {}).get("changes", []),
        [proc.name for proc in cluster.islands.members], learner_id, reports[learner_id].get("incarnations", []))}
        for learner_id in reports}


def wait_until_settled(cfg: Config, cluster: LocalCluster, observer: Observer) -> bool:
    """Waits until every running learner has finished training (its report says so) and no
    fragment of any shard changed (version, contributions pending) for the grace window and a
    second more; gives up, saying so, after the final delivery's time and a lease."""
    deadline = time.monotonic() + cfg.trainer.final_delivery_seconds + cfg.syncer.lease_seconds + 30.0
    quiet_for = cfg.syncer.grace.seconds + 1.0
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        observer.poll()
        finished = all(_read_json(cluster.learner_report_path(proc.name)).get("phase") in ("catching_up", "done")
                       for proc in cluster.learners if proc.running)
        fragments = tuple((f.fragment_id, f.version, f.pending_contributions)
                          for status in observer.last_status if status is not None for f in status.fragments)
        now = time.monotonic()
        if not finished or fragments != last:
            last, since = fragments, now
        elif now - since >= quiet_for:
            return True
        time.sleep(0.2)
    log.warning("the learners and shards did not settle in time: learners may end holding different versions")
    return False


def evaluate_global_model(cluster: LocalCluster) -> float | None:
    """The validation loss of what the run produced: the global model, exported from the shards
    to <run-dir>/export and evaluated as `diloco evaluate` does. None, with a warning, when there
    is no global model or evaluating it fails (the report is written either way)."""
    out = cluster.run_dir / "export"
    try:
        write_export(fetch_global_model(cluster.cfg, cluster.operator), out)
    except ExportError as error:
        log.warning("no global model to evaluate: %s", error)
        return None
    try:
        return evaluate_weights(cluster.cfg, out / MODEL_FILE)
    except Exception as error:  # whatever the model's own code raises: the run's report still matters more
        log.warning("evaluating the global model failed: %s: %s", type(error).__name__, error)
        return None


def progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, unit="step", desc="inner steps", dynamic_ncols=True, file=sys.stderr)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
