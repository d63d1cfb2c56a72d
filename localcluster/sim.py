"""`diloco sim`: a whole multi-region cluster as real local processes.

S syncer shards and M learners spread over named regions run on loopback, each
its own process started exactly as a user would start it. The run ends when
every learner has spent its budget (`--steps`) or after `--duration`; then every
process is stopped and a JSON report, a summary table and a plot are written.

`--mode dp` runs the data-parallel baseline: the M learners as one torch.distributed job,
gradients averaged every step, one optimizer trajectory, the same model, data, batch and inner
optimizer (localcluster/data_parallel.py). `--mode param-avg` is not data parallel: every learner
syncs its whole model after each of its own optimizer steps (H=1, one fragment, fp32, K=M, outer
SGD with lr 1), so the shards average the learners' parameters while each learner keeps its own
optimizer state.

Chaos (`--chaos-mtbf`, `--chaos-shards`) SIGKILLs processes at exponentially
distributed intervals and restarts each after `--restart-delay`. With `--replica-groups R` each
learner is an island of R replica groups (localcluster/islands.py), and `--chaos-replicas` kills
groups other than the one that syncs: the island trains on without the group until it rejoins. WAN emulation
(`--wan-mbps`, `--wan-latency-ms`, or the config's `links`) paces each learner's sync client
at its region's rate each way, n bytes in n / rate seconds, and makes each push and pull wait
the one-way latency out and back (localcluster/wan.py: WanLink); no root, no namespaces needed.

SIGTERM or Ctrl-C stops every process the run started (learners leave cleanly, shards drain);
another one meanwhile SIGKILLs them. On Linux they also die with the sim if it is SIGKILLed.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import grpc
import yaml

from diloco.services.client import ShardClient
from diloco.localcluster import data_parallel
from diloco.localcluster.chaos import Chaos
from diloco.localcluster.cluster import ExitedBeforeServing, LocalCluster
from diloco.localcluster.processes import Proc, free_ports
from diloco.localcluster.interrupt import Interrupted, StopSignals, ends_early
from diloco.localcluster.islands import leader_kills, recoveries
from diloco.localcluster.wan import apply_link_flags
from diloco.services.contract.config import (Config, ConfigError, ConfigLoader, LinkConfig, check_factories,
                                             load_config, parse_config)
from diloco.services.export import MODEL_FILE, ExportError, fetch_global_model, write_export
from diloco.services.contract.goodput import account, no_badput
from diloco.services.metrics import write_file_sd
from diloco.services.contract.tls import Identity

log = logging.getLogger(__name__)

DEFAULT_REGIONS = "us-east,us-west,us-central,us-south"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="examples/local-4-regions.yaml",
                        help="base cluster YAML (model, data, sync, syncer, trainer settings)")
    parser.add_argument("--learners", type=int, help="M learners (default: as in the config)")
    parser.add_argument("--shards", type=int, help="S syncer shards (default: as in the config)")
    parser.add_argument("--regions", default=None,
                        help=f"comma-separated region names the learners are spread over "
                             f"(default: the config's, else {DEFAULT_REGIONS})")
    parser.add_argument("--mode", choices=["diloco", "dp", "param-avg"], default="diloco",
                        help="dp: data parallel, one torch.distributed job; param-avg: the learners' "
                             "parameters averaged after every step (not data parallel)")
    parser.add_argument("--learner-script", type=pathlib.Path, metavar="SCRIPT",
                        help="run each learner as `python SCRIPT --config <run config> --learner-id <id>` "
                             "(your own loop around DecoupledDiLoCo; SIGTERM must end it) instead of "
                             "`diloco learner`; not with --mode dp")
    parser.add_argument("--steps", type=int, help="inner steps per learner (default: trainer.max_steps)")
    parser.add_argument("--duration", type=float, help="stop after this many seconds even if not done")
    parser.add_argument("--chaos-mtbf", type=float, help="mean seconds between SIGKILLs of each learner")
    parser.add_argument("--chaos-shards", type=float, help="mean seconds between SIGKILLs of each shard")
    parser.add_argument("--replica-groups", type=int, metavar="R",
                        help="replica groups per learner island (island.replica_groups): R processes under "
                             "torchft, one leads and syncs; losing a group costs the island a pause, not a restart")
    parser.add_argument("--chaos-replicas", type=float, metavar="MTBF",
                        help="mean seconds between SIGKILLs of each replica group (a leading one too: another "
                             "group takes the lead)")
    parser.add_argument("--chaos-islands", type=int, metavar="N",
                        help="with --chaos-replicas: only the first N learners' islands lose groups (default: "
                             "every island); the others' blocked time is what those losses cost learners that "
                             "lost nothing")
    parser.add_argument("--restart-delay", type=float, default=5.0, help="seconds a killed process stays down")
    parser.add_argument("--warm-restarts", action=argparse.BooleanOptionalAction, default=True,
                        help="a killed learner's next life is a standby that imported torch and the learner "
                             "while it was down, as a spare host booting during the repair (start-up in tenths "
                             "of a second); --no-warm-restarts starts a new process, as a restarted container "
                             "does (seconds here)")
    parser.add_argument("--wan-mbps", metavar="N|REGION=UP[/DOWN],...",
                        help="cap each learner's link to the syncer (Mbit/s): one number for every region "
                             "(each way), or per region, e.g. us-east=50,us-west=20/40 (up 20, down 40); "
                             "20,us-west=5: 20 for every region but us-west")
    parser.add_argument("--wan-latency-ms", metavar="N|REGION=MS,...",
                        help="one-way latency of each learner's link, for every region or per region "
                             "(us-east=20,us-west=70); each push and pull waits it out and back")
    parser.add_argument("--slow-learner", type=float, default=1.0, metavar="FACTOR",
                        help="the first learner's steps take FACTOR times as long (mixed hardware)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override one config key, e.g. --set sync.interval_steps=100 "
                             "--set sync.codec=bf16 (VALUE is read as YAML; repeatable)")
    parser.add_argument("--seed", type=int,
                        help="seed of the run and of the chaos schedule (default: the config's run.seed)")
    parser.add_argument("--run-dir", default=".diloco/sim", help="state, logs and generated config")
    parser.add_argument("--report", help="write the JSON report here (default: <run-dir>/report.json)")
    parser.add_argument("--plot", help="write a PNG of loss and goodput over time here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--prometheus-targets",
                        help="write every /metrics endpoint as Prometheus file_sd JSON here (default: "
                             "<run-dir>/prometheus-targets.json, which deploy/prometheus/local/"
                             "prometheus.yml reads)")


def build_config(base: Config, args: argparse.Namespace, run_dir: pathlib.Path) -> Config:
    """The run's config: the base config with the command line's topology and mode."""
    data = base.model_dump(mode="json")
    regions = (args.regions.split(",") if args.regions
               else sorted({l.region for l in base.learners}) or DEFAULT_REGIONS.split(","))
    num_learners = args.learners or len(base.learners)
    num_shards = args.shards or len(base.shards)
    ports = free_ports(2 * num_shards + num_learners)
    data["shards"] = [{"address": f"127.0.0.1:{ports[i]}", "metrics_port": ports[num_shards + i]}
                      for i in range(num_shards)]
    own_links = {learner["id"]: learner["link"] for learner in data["learners"]}  # kept for the same ids
    ids = [f"{regions[i % len(regions)]}-{i // len(regions)}" for i in range(num_learners)]
    data["learners"] = [{"id": learner_id, "region": regions[i % len(regions)],
                         "metrics_port": ports[2 * num_shards + i],
                         "slowdown": args.slow_learner if i == 0 else 1.0, "link": own_links.get(learner_id)}
                        for i, learner_id in enumerate(ids)]
    if args.seed is not None:
        data["run"]["seed"] = args.seed
    data["run"]["state_dir"] = str((run_dir / "state").resolve())
    for override in args.overrides:
        apply_override(data, override)
    args.seed = data["run"]["seed"]  # the chaos schedule's too
    if args.steps:
        data["trainer"]["max_steps"] = args.steps
    if args.replica_groups:
        data.setdefault("island", {})["replica_groups"] = args.replica_groups
    apply_link_flags(data, args.wan_mbps, args.wan_latency_ms, regions)
    if args.mode == "param-avg":
        # Every step synced by every learner, uncompressed, the global model the
        # plain mean of the learners' models (outer SGD with lr 1, no momentum).
        data["sync"].update(fragments=1, interval_steps=1, overlap_steps=0, mix_alpha=0.0, codec="fp32")
        data["syncer"].update(quorum=num_learners, wait_for_all=True, merge="mean", max_staleness=0,
                              outer_optimizer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
        data["syncer"]["grace"].update(mode="fixed", seconds=0.0)
        data["shards"] = data["shards"][:1]
    else:
        data["syncer"]["quorum"] = min(data["syncer"]["quorum"], num_learners)
    cfg = parse_config(data, source="sim config")
    if args.mode == "dp":  # one job claims every rank's tokens of a step
        data["syncer"]["max_tokens_per_step"] = num_learners * cfg.tokens_per_step()
        cfg = parse_config(data, source="sim config")
    return cfg


def spared_islands(cfg: Config, args: argparse.Namespace) -> list[str]:
    """The learners whose islands --chaos-islands keeps from losing groups (all but the first N)."""
    return [l.id for l in cfg.learners[args.chaos_islands or len(cfg.learners):]]


def check_flags(args: argparse.Namespace, cfg: Config) -> None:
    if args.chaos_islands is not None and not (args.chaos_replicas and 1 <= args.chaos_islands <= len(cfg.learners)):
        raise ConfigError(f"--chaos-islands {args.chaos_islands}: give it with --chaos-replicas, from 1 to the "
                          f"run's {len(cfg.learners)} learners")
    if cfg.island.replica_groups > 1 and args.chaos_mtbf:
        raise ConfigError("--chaos-mtbf: a learner of island.replica_groups > 1 fails only when every group does; "
                          "kill its groups with --chaos-replicas")
    if args.learner_script is None:
        return
    if cfg.island.replica_groups > 1:
        raise ConfigError("--learner-script: islands of replica groups (island.replica_groups > 1) run the "
                          "built-in learner")
    if args.mode == "dp":
        raise ConfigError("--learner-script: --mode dp runs the built-in learner under torchrun; run your "
                          "script under torchrun yourself for its data-parallel baseline")
    if not args.learner_script.is_file():
        raise ConfigError(f"--learner-script: no file {args.learner_script}")


def apply_override(data: dict, override: str) -> None:
    """Sets one `dotted.key=value` in the config's dict; parse_config judges the result."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. sync.codec=bf16")
    *sections, name = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise ConfigError(f"--set {override!r}: {section} is not a section")
    data[name] = yaml.load(value, Loader=ConfigLoader)


class Observer:
    """Polls the shards' Status: learners' steps for progress and goodput over time,
    counters accumulated across shard restarts (a restarted shard counts from zero)."""

    def __init__(self, cfg: Config, identity: Identity | None):
        self.clients = [ShardClient(s.address, cfg.rpc, identity=identity) for s in cfg.shards]
        self.steps: dict[str, int] = {}
        self.counters_before_restart: Counter[str] = Counter()
        self.last_counters: list[Counter[str]] = [Counter() for _ in self.clients]
        self.last_status: list = [None for _ in self.clients]

    def poll(self, require_all: bool = False) -> None:
        """One Status call per shard; a shard that is down keeps its last answer, unless
        `require_all`, when it is retried (for up to a minute) until it answers."""
        for i, client in enumerate(self.clients):
            status = _status_of(client, retry_seconds=60 if require_all else 0)
            if status is None:
                if require_all:
                    raise RuntimeError(f"shard {i} did not answer Status for a minute")
                continue
            self.last_status[i] = status
            self.last_counters[i] = Counter(status.counters)
            for learner in status.learners:
                self.steps[learner.learner_id] = max(self.steps.get(learner.learner_id, 0), learner.last_step)

    def shard_restarting(self, index: int) -> None:
        self.counters_before_restart.update(self.last_counters[index])
        self.last_counters[index] = Counter()

    def counters(self) -> Counter[str]:
        return sum(self.last_counters, Counter(self.counters_before_restart))

    def close(self) -> None:
        for client in self.clients:
            client.close()


def run(args: argparse.Namespace) -> int:
    try:
        base = load_config(args.config)
        run_dir = pathlib.Path(args.run_dir)
        cfg = build_config(base, args, run_dir)
        check_factories(cfg)
        check_flags(args, cfg)
    except ConfigError as error:  # the previous run's folder is left as it was
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    shutil.rmtree(run_dir, ignore_errors=True)  # a run starts from nothing
    if args.mode == "dp":
        processes = data_parallel.DataParallelJob(cfg, run_dir)
        progress = None if args.quiet else _progress_bar(cfg.trainer.max_steps * len(cfg.learners))
        run_processes = lambda: data_parallel.simulate(processes, args, progress)  # noqa: E731
    else:
        processes = LocalCluster(cfg, run_dir, learner_script=args.learner_script,
                                 warm_restarts=args.warm_restarts)
        write_file_sd(cfg, args.prometheus_targets or run_dir / "prometheus-targets.json")
        run_processes = lambda: simulate(cfg, processes, args)  # noqa: E731
    stop_signals = StopSignals(processes)
    try:
        report = run_processes()
    except (StartupFailure, ExitedBeforeServing, data_parallel.JobFailed) as failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    except Interrupted as interrupted:  # before the run started, or a second signal: no report
        print(f"interrupted ({interrupted.name}): "
              + ("every process killed" if interrupted.processes_killed else "while starting the run"),
              file=sys.stderr)
        return 128 + interrupted.signum
    finally:
        stop_signals.cleaning_up = True
        processes.stop()
    report_path = pathlib.Path(args.report or run_dir / "report.json")
    report_path.write_text(json.dumps(report, indent=2))
    print_summary(report, report_path)
    if args.plot:
        plot(report, pathlib.Path(args.plot))
        print(f"plot: {args.plot}")
    if report.get("interrupted"):
        return 128 + signal.Signals[report["interrupted"]]
    return 0


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
    progress = None if args.quiet else _progress_bar(total_steps)
    outcome: dict = {}  # interrupted, if a stop signal ended the run early
    try:
        with ends_early(outcome):
            while len(finished_at) < len(cluster.learners):
                now = time.time()
                if args.duration and now - started > args.duration:
                    log.info("--duration %.0fs reached", args.duration)
                    break
                observer.poll()
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
                for i in shard_chaos.due_kills(now):
                    observer.poll()
                    observer.shard_restarting(i)
                    cluster.shards[i].kill()
                    shard_chaos.killed(i, now)
                    log.info("chaos: killed shard %d", i)
                for downtime in shard_chaos.due_restarts(now):
                    cluster.restart_shard(downtime.proc_index)
                    shard_chaos.restarted(downtime, time.time())
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
    report = summarise(cfg, args, reports, observer, learner_chaos, shard_chaos,
                       {name: at - started for name, at in finished_at.items()}, wall, timeline, started,
                       replica_chaos.events, [proc.name for proc in cluster.islands.members] if cluster.islands else [])
    # Lives started from a standby: the learners' and, in islands, the replica groups'.
    report["restarts"]["warm"] = sum(proc.warm_starts for proc in cluster.learner_processes)
    if cluster.islands:
        report["chaos_events"] += replica_chaos.events
        report["islands"] = {learner_id: {**reports[learner_id].get("island", {}), "recoveries": recoveries(
            replica_chaos.events, reports[learner_id].get("island", {}).get("changes", []),
            [proc.name for proc in cluster.islands.members], learner_id, reports[learner_id].get("incarnations", []))}
            for learner_id in reports}
    report.update(outcome)
    observer.close()
    report["final_eval_loss"] = evaluate_global_model(cluster)
    return report


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
    to <run-dir>/export and evaluated by `diloco evaluate` (the model is learner code, which
    services/ does not import). None, with a warning, when there is no global model."""
    out = cluster.run_dir / "export"
    try:
        write_export(fetch_global_model(cluster.cfg, cluster.operator), out)
    except ExportError as error:
        log.warning("no global model to evaluate: %s", error)
        return None
    result = subprocess.run([sys.executable, "-m", "diloco", "evaluate", "--config", str(cluster.config_path),
                             "--weights", str(out / MODEL_FILE), "--json"], capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("evaluating the global model failed: %s", result.stderr.strip()[-2000:])
        return None
    return json.loads(result.stdout)["eval_loss"]


def _status_of(client: ShardClient, retry_seconds: float):
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            return client.status(timeout=2)
        except grpc.RpcError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


def _progress_bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, unit="step", desc="inner steps", dynamic_ncols=True, file=sys.stderr)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def killed_lives(events: list[dict], index: int, run_started: float, lives: list[dict],
                 step_seconds: float) -> tuple[float, float]:
    """What learner `index`'s kills cost besides its down time: (seconds of lives killed before
    they recorded anything, all start-up; seconds lost: each killed life's time after its last
    record, which the kill destroyed, plus the recorded steps past the checkpoint the next life
    restored). `lives`: its report's incarnations."""
    starts = [run_started] + [e["time"] for e in events if e["event"] == "restart" and e["index"] == index]
    starting = lost = 0.0
    for kill in (e for e in events if e["event"] == "kill" and e["index"] == index):
        began = max((start for start in starts if start <= kill["time"]), default=run_started)
        life = next((life for life in lives if began <= life["started"] <= kill["time"]), None)
        if life is None:
            starting += kill["time"] - began  # it never got to train
            continue
        lost += max(0.0, kill["time"] - life["recorded_at"])
        successor = next((later for later in lives if later["started"] > kill["time"]), None)
        if successor is not None:
            recorded_step = life["restored_step"] + life["steps"]
            lost += max(0, recorded_step - successor["restored_step"]) * step_seconds
    return starting, lost


def summarise(cfg: Config, args: argparse.Namespace, reports: dict[str, dict], observer: Observer,
              learner_chaos: Chaos, shard_chaos: Chaos, provisioned: dict[str, float], wall: float,
              timeline: list[dict], run_started: float, replica_events: list[dict] = (),
              group_names: list[str] = ()) -> dict:
    """The run's figures. Goodput (services/contract/goodput.py) = kept training compute / provisioned
    learner time: a learner is provisioned from the start of the run until its budget is
    spent, and its kept compute is its final step count times its mean step time. The badput:
    start-up (a life killed before it recorded anything: all of it), restore, waits, down
    time, lost (what a kill destroyed: a life's time after its last record, and steps past the
    checkpoint its successor restored), evaluations and checkpoint copies; `other` is the rest of
    the provisioned time: the loop's own bookkeeping, starting and applying syncs. An island's
    leading group killed (`replica_events` of the groups `group_names`) is a kill of its learner
    whose next life began when another group took the lead: down until then."""
    statuses = [s for s in observer.last_status if s is not None]
    model_numel = sum(f.numel for s in statuses for f in s.fragments)
    badput = no_badput()
    useful = provisioned_total = 0.0
    links, per_learner = {}, {}
    totals = {"tokens": 0, "inner_steps": 0, "bytes_up": 0, "bytes_down": 0}
    for index, learner in enumerate(cfg.learners):
        report = reports.get(learner.id, {})
        lives = report.get("incarnations", [])

        def total(key: str) -> float:
            return sum(life.get(key, 0) for life in lives)

        steps_run = total("steps")
        step_seconds = total("compute_seconds") / steps_run if steps_run else 0.0
        kept_steps = report.get("steps", 0)
        useful += kept_steps * step_seconds
        provisioned_total += provisioned[learner.id]
        badput["startup"] += total("startup_seconds")
        badput["restore"] += total("restore_seconds") + total("regroup_seconds")  # an island's pauses too
        badput["blocked"] += total("blocked_seconds")
        badput["down"] += learner_chaos.down_seconds[index]
        badput["evaluation"] += total("evaluation_seconds")
        badput["checkpoint"] += total("checkpoint_seconds")
        island_kills, leaderless = leader_kills(replica_events, group_names, learner.id, index, lives)
        badput["down"] += leaderless
        starting, lost = killed_lives(learner_chaos.events + island_kills, index, run_started, lives, step_seconds)
        badput["startup"] += starting
        badput["lost"] += lost
        moved = total("bytes_up") + total("bytes_down")
        totals["tokens"] += report.get("tokens", 0)
        totals["inner_steps"] += kept_steps
        totals["bytes_up"] += total("bytes_up")
        totals["bytes_down"] += total("bytes_down")
        # The link as configured (None: uncapped) beside what its pushes and pulls achieved.
        link = cfg.link(learner.id, learner.region) or LinkConfig()
        links[learner.id] = {"region": learner.region, **link.model_dump(), "bytes": moved,
                             "bytes_per_second": moved / total("transfer_seconds") if total("transfer_seconds") else 0.0}
        per_learner[learner.id] = {"region": learner.region, "steps": kept_steps, "step_seconds": step_seconds,
                                   "steps_run": steps_run, "restarts": max(0, len(lives) - 1),
                                   "push_seconds": total("push_seconds") / total("pushes") if total("pushes") else None,
                                   "blocked_seconds": total("blocked_seconds"),
                                   "phase": report.get("phase"), "evaluations": report.get("evaluations", []),
                                   # each life that recorded: its process start and its join and pull
                                   "startup_seconds": [life.get("startup_seconds", 0.0) for life in lives],
                                   "restore_seconds": [life.get("restore_seconds", 0.0) for life in lives]}
    counters = observer.counters()
    # Refused contributions: too stale, or refused for any other reason once the header said
    # outer gradient (refusals.* also counts lost seeding races, heartbeats, bad joins).
    refused = counters.get("contributions.refused_stale", 0) + counters.get("contributions.refused", 0)
    goodput = account(provisioned_total, useful, badput)
    # The run's first evaluation is of the seeded, untrained model; a learner that joins
    # later starts from an already trained global model.
    first_evaluations = [r["evaluations"][0] for r in reports.values() if r.get("evaluations")]
    last_losses = [r["evaluations"][-1][3] for r in reports.values() if r.get("evaluations")]
    return {
        "mode": args.mode,
        "seed": args.seed,
        "learners": len(cfg.learners),
        "shards": len(cfg.shards),
        "regions": sorted({l.region for l in cfg.learners}),
        "wall_seconds": wall,
        "started_at": run_started,  # unix time, as chaos_events give theirs
        "tokens": totals["tokens"],
        "inner_steps": totals["inner_steps"],
        "outer_steps": sum(f.version for s in statuses for f in s.fragments),
        "contributions": {"accepted": int(counters.get("contributions.accepted", 0)),
                          "stale_merged": int(counters.get("contributions.stale_merged", 0)),
                          "refused": int(refused)},
        "goodput": goodput.share,
        "badput_seconds": dict(goodput.badput_seconds),
        "useful_seconds": useful,
        "provisioned_seconds": provisioned_total,
        "initial_eval_loss": min(first_evaluations)[3] if first_evaluations else None,
        "final_eval_loss": None,  # the global model's: simulate evaluates it once the learners are done
        "final_eval_loss_learners": sum(last_losses) / len(last_losses) if last_losses else None,
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        # What --mode dp moves for the same steps: a ring all-reduce of the fp32 gradients,
        # sent and received by every learner at every step.
        "dp_equivalent_bytes": totals["inner_steps"] * 2 * data_parallel.allreduce_bytes(len(cfg.learners),
                                                                                          model_numel),
        "model_parameters": model_numel,
        "restarts": {"learners": sum(1 for e in learner_chaos.events if e["event"] == "restart"),
                     "shards": sum(1 for e in shard_chaos.events if e["event"] == "restart")},
        "chaos_events": learner_chaos.events + shard_chaos.events,
        "state_hashes_agree": hashes_agree(reports, statuses),
        "down_at_end": sorted(name for name, r in reports.items() if r.get("phase") != "done"),
        "anchor_offset": anchor_offset(statuses),
        "links": links,
        "per_learner": per_learner,
        "timeline": timeline,
        "config": {"model": cfg.model_name(), "H": cfg.sync.interval_steps, "P": cfg.sync.fragments, "tau": cfg.sync.overlap_steps,
                   "codec": cfg.sync.codec, "K": cfg.syncer.quorum, "wan_mbps": cfg.rpc.wan_mbps,
                   "chaos_mtbf": args.chaos_mtbf, "restart_delay": args.restart_delay,
                   "warm_restarts": args.warm_restarts, "replica_groups": cfg.island.replica_groups,
                   "chaos_replicas": args.chaos_replicas, "chaos_islands": args.chaos_islands,
                   "spared_islands": spared_islands(cfg, args),
                   "slow_learner": args.slow_learner, "max_block_seconds": cfg.sync.max_block_seconds,
                   "learner_script": str(args.learner_script) if args.learner_script else None},
        "cluster_config": cfg.model_dump(mode="json"),  # as the processes ran it (diloco plan --calibrate-from)
    }


def hashes_agree(reports: dict[str, dict], statuses: list) -> bool:
    """Every learner that finished (its report says "done": it pulled the final values) holds
    exactly the bits the shards last served it (docs/protocol.md, "The downlink"): the anchor a
    shard recorded for it, or the shard's value where it has no record of that learner. One
    down when the run ended holds nothing: its report is one it wrote while training."""
    value = {str(f.fragment_id): (f.version, f.state_hash) for s in statuses for f in s.fragments}
    served = {(a.learner_id, str(f.fragment_id)): (a.version, a.state_hash)
              for s in statuses for f in s.fragments for a in f.served}
    held = {learner_id: r["fragments"] for learner_id, r in reports.items()
            if r.get("phase") == "done" and r.get("fragments")}
    return bool(held) and bool(value) and all(
        {fid: (f["version"], f["state_hash"]) for fid, f in fragments.items()}
        == {fid: served.get((learner_id, fid), exact) for fid, exact in value.items()}
        for learner_id, fragments in held.items())


def anchor_offset(statuses: list) -> float:
    """The largest distance of a learner's anchor from the shards' value when it was served,
    as a fraction of the delta that made it (0: every learner holds the shards' bits)."""
    return max((a.offset for s in statuses for f in s.fragments for a in f.served), default=0.0)


def print_summary(report: dict, report_path: pathlib.Path) -> None:
    badput = report["badput_seconds"]
    moved = report["bytes_up"] + report["bytes_down"]
    rows = [
        ("mode", f"{report['mode']}  ({report['learners']} learners in {len(report['regions'])} regions, "
                 f"{report['shards']} shards)"),
        ("wall time", f"{report['wall_seconds']:.1f} s"
                      + (f"  (interrupted by {report['interrupted']}: what ran until then)"
                         if report.get("interrupted") else "")),
        ("inner / outer steps", f"{report['inner_steps']} / {report['outer_steps']}"),
        ("validation loss", _losses(report)),
        ("goodput", f"{report['goodput']:.1%}"),
        ("badput", ", ".join(f"{k} {v:.1f}s" for k, v in badput.items())),
        ("contributions", ", ".join(f"{k} {v}" for k, v in report["contributions"].items())),
        ("bytes on the wire", f"{moved / 1e6:.2f} MB (data parallel: "
                              f"{report['dp_equivalent_bytes'] / 1e6:.1f} MB, "
                              f"{report['dp_equivalent_bytes'] / moved if moved else float('inf'):.0f}x more)"),
        ("restarts", f"learners {report['restarts']['learners']}, shards {report['restarts']['shards']}"
                     + (f"; {warm} lives from a warm standby" if (warm := report["restarts"].get("warm")) else "")),
        ("state hashes agree", str(report["state_hashes_agree"]).lower() + (
            "" if report["state_hashes_agree"] is None else
            f" (each learner holds the bits the shards served it; anchors at most {report['anchor_offset']:.2f} "
            "of their last pull from the shards' values)")
         + (f"; {', '.join(report['down_at_end'])} down at the end: not compared" if report.get("down_at_end") else "")),
        *((f"link {learner_id}", _link(link)) for learner_id, link in report["links"].items()),
        *((f"island {learner_id}", _island(island)) for learner_id, island in report.get("islands", {}).items()),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"\nreport: {report_path}")


def _link(link: dict) -> str:
    """A learner's link as configured, and the rate its pushes and pulls achieved (their bytes
    over their time on the wire, waits for a round's result included)."""
    def rate(mbps: float | None) -> str:
        return "uncapped" if mbps is None else f"{mbps:g}"

    return (f"{link['region']}: up {rate(link['up_mbps'])} / down {rate(link['down_mbps'])} Mbit/s, "
            f"latency {link['latency_ms']:g} ms; measured {link['bytes_per_second'] / 1e6:.3f} MB/s "
            f"({link['bytes_per_second'] * 8 / 1e6:.2f} Mbit/s) over {link['bytes'] / 1e6:.2f} MB")


def _island(island: dict) -> str:
    """An island of replica groups: its groups, the steps dropped, each loss's pause and rejoin."""
    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} s"

    losses = "; ".join(f"{r['group']} killed: trained again after {seconds(r['trained_again_seconds'])}, "
                       f"back {seconds(r['rejoined_seconds_after_restart'])} after its restart"
                       for r in island["recoveries"])
    return (f"{island.get('replica_groups', '?')} replica groups, {island.get('dropped_steps', 0)} steps dropped"
            + (f"; {losses}" if losses else ""))


def _losses(report: dict) -> str:
    """initial -> the global model's final loss, and the learners' own final losses beside it."""
    def loss(key: str) -> str:
        return "n/a" if report[key] is None else f"{report[key]:.3f}"

    return (f"{loss('initial_eval_loss')} -> {loss('final_eval_loss')} (global model; "
            f"learners' local models {loss('final_eval_loss_learners')})")


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, goodput_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    start = min((e[0] for l in report["per_learner"].values() for e in l["evaluations"][:1]), default=0)
    for learner_id, learner in sorted(report["per_learner"].items()):
        evaluations = learner["evaluations"]
        loss_ax.plot([e[0] - start for e in evaluations], [e[3] for e in evaluations],
                     marker=".", label=f"{learner_id} ({learner['region']})")
    for event in report["chaos_events"]:
        if event["event"] == "kill" and event["kind"] == "learner":
            loss_ax.axvline(event["time"] - start, color="red", alpha=0.15)
    loss_ax.set(xlabel="wall time (s)", ylabel="validation loss",
                title=f"{report['mode']}: validation loss per learner (red: kills)")
    loss_ax.legend(fontsize="small")
    # Goodput over time: kept steps so far times the mean step time, over learner-seconds.
    step_seconds = [l["step_seconds"] for l in report["per_learner"].values() if l["step_seconds"]]
    mean_step = sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
    points = [(t["time"], t["steps"] * mean_step / (report["learners"] * t["time"]))
              for t in report["timeline"] if t["time"] > 1.0]
    goodput_ax.plot([p[0] for p in points], [p[1] for p in points])
    goodput_ax.set(xlabel="wall time (s)", ylabel="goodput", ylim=(0, 1.05),
                   title=f"goodput over time (final {report['goodput']:.1%})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
