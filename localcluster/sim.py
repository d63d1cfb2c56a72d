"""`diloco sim`: a whole multi-region cluster as real local processes.

S syncer shards and M learners spread over named regions run on loopback, each
its own process started exactly as a user would start it. The run ends when
every learner has spent its budget (`--steps`) or after `--duration`; then every
process is stopped and a JSON report, a summary table and a plot are written. This module
is the command line and the run's config; sim_run.py runs the cluster, sim_observer.py polls
the shards while it runs, sim_summary.py makes the report.

`--mode dp` runs the data-parallel baseline: the M learners as one torch.distributed job,
gradients averaged every step, one optimizer trajectory, the same model, data, batch and inner
optimizer (localcluster/data_parallel.py). `--mode param-avg` is not data parallel: every learner
syncs its whole model after each of its own optimizer steps (H=1, one fragment, fp32, K=M, outer
SGD with lr 1), so the shards average the learners' parameters while each learner keeps its own
optimizer state.

Chaos (`--chaos-mtbf`, `--chaos-shards`) SIGKILLs processes at exponentially
distributed intervals and restarts each after `--restart-delay`. With `--replica-groups R` each
learner is an island of R replica groups (localcluster/islands.py), and `--chaos-replicas` kills
groups other than the one that syncs: the island trains on without the group until it rejoins.
`--chaos-poison LEARNER:STEP:KIND` makes one learner's model go bad (scaled x1000, NaN, flipped
bits): the shards refuse its pushes, it heals or stops (docs/reliability.md). WAN emulation
(`--wan-mbps`, `--wan-latency-ms`, or the config's `links`) paces each learner's sync client
at its region's rate each way, n bytes in n / rate seconds, and makes each push and pull wait
the one-way latency out and back (localcluster/wan.py: WanLink); no root, no namespaces needed.
`--kernel-links` instead puts each learner in a network namespace whose link the kernel shapes
(tc; localcluster/kernel_links.py), which needs root.

SIGTERM or Ctrl-C stops every process the run started (learners leave cleanly, shards drain);
another one meanwhile SIGKILLs them. On Linux they also die with the sim if it is SIGKILLed.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import signal
import sys

import yaml

from diloco.learner.trainer.poison import Poison
from diloco.localcluster import data_parallel
from diloco.localcluster.cluster import ExitedBeforeServing, LocalCluster
from diloco.localcluster.processes import free_ports
from diloco.localcluster.interrupt import Interrupted, StopSignals
from diloco.localcluster.sim_run import StartupFailure, progress_bar, simulate
from diloco.localcluster.sim_summary import plot, print_summary
from diloco.localcluster.wan import apply_link_flags
from diloco.services.contract.config import (Config, ConfigError, ConfigLoader, check_factories, load_config,
                                             parse_config)
from diloco.localcluster.kernel_links import KernelLinks
from diloco.services.metrics import write_file_sd

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
    # Flags in seconds say so; the shorter spellings stay as aliases.
    parser.add_argument("--duration-seconds", "--duration", type=float, dest="duration", metavar="SECONDS",
                        help="stop after this many seconds even if not done")
    parser.add_argument("--chaos-mtbf-seconds", "--chaos-mtbf", type=float, dest="chaos_mtbf", metavar="SECONDS",
                        help="mean seconds between SIGKILLs of each learner")
    parser.add_argument("--chaos-shards-mtbf-seconds", "--chaos-shards", type=float, dest="chaos_shards",
                        metavar="SECONDS", help="mean seconds between SIGKILLs of each shard")
    parser.add_argument("--replica-groups", type=int, metavar="R",
                        help="replica groups per learner island (island.replica_groups): R processes under "
                             "torchft, one leads and syncs; losing a group costs the island a pause, not a restart")
    parser.add_argument("--chaos-replicas-mtbf-seconds", "--chaos-replicas", type=float, dest="chaos_replicas",
                        metavar="SECONDS",
                        help="mean seconds between SIGKILLs of each replica group (a leading one too: another "
                             "group takes the lead)")
    parser.add_argument("--chaos-islands", type=int, metavar="N",
                        help="with --chaos-replicas: only the first N learners' islands lose groups (default: "
                             "every island); the others' blocked time is what those losses cost learners that "
                             "lost nothing")
    parser.add_argument("--eval-global", action="store_true",
                        help="each learner's evaluations also evaluate the global model it holds: the summary "
                             "sets the global model against the learners' own over the run (built-in learner)")
    parser.add_argument("--chaos-poison", action="append", default=[], metavar="LEARNER:STEP:KIND",
                        help="after inner step STEP the learner's model goes bad: KIND scale (x1000), nan or "
                             "bitflip (learner/trainer/poison.py); the run refuses its pushes, it heals or "
                             "stops (docs/reliability.md); repeatable")
    parser.add_argument("--restart-delay-seconds", "--restart-delay", type=float, default=5.0, dest="restart_delay",
                        metavar="SECONDS", help="seconds a killed process stays down")
    parser.add_argument("--warm-restarts", action=argparse.BooleanOptionalAction, default=True,
                        help="a killed learner's next life is a standby that imported torch and the learner "
                             "while it was down, as a spare host booting during the repair (start-up in tenths "
                             "of a second); --no-warm-restarts starts a new process, as a restarted container "
                             "does (seconds here)")
    parser.add_argument("--kernel-links", action="store_true",
                        help="each learner in a network namespace, its link shaped by the kernel (tc tbf; netem "
                             "delay where the kernel has it) instead of paced by the learner; needs root")
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
    parser.add_argument("--report", "--json", dest="report",
                        help="write the JSON report here (default: <run-dir>/report.json)")
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


def check_flags(args: argparse.Namespace, cfg: Config) -> None:
    if args.chaos_islands is not None and not (args.chaos_replicas and 1 <= args.chaos_islands <= len(cfg.learners)):
        raise ConfigError(f"--chaos-islands {args.chaos_islands}: give it with --chaos-replicas, from 1 to the "
                          f"run's {len(cfg.learners)} learners")
    if cfg.island.replica_groups > 1 and args.chaos_mtbf:
        raise ConfigError("--chaos-mtbf: a learner of island.replica_groups > 1 fails only when every group does; "
                          "kill its groups with --chaos-replicas")
    poison_flags(args.chaos_poison, cfg)
    if args.kernel_links and (args.mode == "dp" or cfg.island.replica_groups > 1):
        raise ConfigError("--kernel-links: learners of one process each in --mode diloco or param-avg (not "
                          "--mode dp, not replica groups)")
    for flag, given in (("--chaos-poison", args.chaos_poison), ("--eval-global", args.eval_global)):
        if given and (args.learner_script or args.mode != "diloco"):
            raise ConfigError(f"{flag}: a flag of the built-in learner of --mode diloco (not of a --learner-script, "
                              "not --mode dp or param-avg)")
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


def poison_flags(poisons: list[str], cfg: Config) -> dict[str, list[str]]:
    """The `diloco learner --poison STEP:KIND` flags of --chaos-poison LEARNER:STEP:KIND, by
    learner id; ConfigError naming what is wrong."""
    if poisons and cfg.island.replica_groups > 1:
        raise ConfigError("--chaos-poison: the built-in learner of one process; not with replica groups")
    flags: dict[str, list[str]] = {}
    for poison in poisons:
        learner_id, _, step_kind = poison.partition(":")
        if learner_id not in {l.id for l in cfg.learners}:
            raise ConfigError(f"--chaos-poison {poison}: no learner {learner_id!r} in the run "
                              f"({', '.join(l.id for l in cfg.learners)})")
        try:
            Poison.parse(step_kind)
        except ValueError as error:
            raise ConfigError(f"--chaos-poison {poison}: {error}") from None
        flags.setdefault(learner_id, []).extend(["--poison", step_kind])
    return flags


def learner_flags(args: argparse.Namespace, cfg: Config) -> dict[str, list[str]]:
    """Flags of `diloco learner` by learner id: --poison of --chaos-poison, --eval-global."""
    flags = poison_flags(args.chaos_poison, cfg)
    if args.eval_global:
        for learner in cfg.learners:
            flags.setdefault(learner.id, []).append("--eval-global")
    return flags


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
    try:
        links = KernelLinks(cfg) if args.kernel_links else None
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    try:
        return run_cluster(cfg if links is None else links.cfg, args, run_dir, links)
    finally:
        if links is not None:
            links.close()


def run_cluster(cfg: Config, args: argparse.Namespace, run_dir: pathlib.Path, links: KernelLinks | None) -> int:
    """The run of the config, its report written and summarised; the exit status."""
    if args.mode == "dp":
        processes = data_parallel.DataParallelJob(cfg, run_dir)
        progress = None if args.quiet else progress_bar(cfg.trainer.max_steps * len(cfg.learners))
        run_processes = lambda: data_parallel.simulate(processes, args, progress)  # noqa: E731
    else:
        processes = LocalCluster(cfg, run_dir, learner_script=args.learner_script,
                                 warm_restarts=args.warm_restarts, learner_flags=learner_flags(args, cfg),
                                 learner_prefix=links.prefix if links else None)
        write_file_sd(cfg, args.prometheus_targets or run_dir / "prometheus-targets.json",
                      learner_hosts=links.addresses if links else None)
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
    if links is not None:
        report["kernel_links"] = {"latency_applied": links.latency_applied}
        for learner_id, link in report["links"].items():
            link["kernel_bytes_up"], link["kernel_bytes_down"] = links.bytes_through(learner_id)
    report_path = pathlib.Path(args.report or run_dir / "report.json")
    report_path.write_text(json.dumps(report, indent=2))
    print_summary(report, report_path)
    if args.plot:
        plot(report, pathlib.Path(args.plot))
        print(f"plot: {args.plot}")
    if report.get("interrupted"):
        return 128 + signal.Signals[report["interrupted"]]
    return 0
