"""What `diloco sim` reports: the run's figures (goodput and its badput, bytes, contributions,
whether the learners hold the shards' bits) as the JSON report, the printed summary table and
the plot."""
from __future__ import annotations

import argparse
import pathlib

from diloco.localcluster import data_parallel
from diloco.localcluster.chaos import Chaos
from diloco.localcluster.islands import leader_kills
from diloco.localcluster.sim_observer import Observer
from diloco.services.contract.config import Config, LinkConfig
from diloco.services.contract.goodput import account, no_badput
from diloco.syncer.pull import PULL_ANSWERS


def spared_islands(cfg: Config, args: argparse.Namespace) -> list[str]:
    """The learners whose islands --chaos-islands keeps from losing groups (all but the first N)."""
    return [l.id for l in cfg.learners[args.chaos_islands or len(cfg.learners):]]


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
    useful, provisioned_total, badput, totals, links, per_learner = _learner_figures(
        cfg, reports, learner_chaos, provisioned, run_started, replica_events, group_names)
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
        # Why the shards' rounds closed (docs/monitoring.md, diloco_syncer_rounds_total).
        "rounds": {name.removeprefix("rounds."): int(n) for name, n in sorted(counters.items())
                   if name.startswith("rounds.")},
        # What the shards answered pulls with (the downlink's encoding work is delta_encoded),
        # and the payload bytes of each kind of answer.
        "pulls": {answer: int(counters.get(f"pulls.{answer}", 0)) for answer in PULL_ANSWERS},
        "pull_bytes": {answer: int(counters.get(f"pull_bytes.{answer}", 0)) for answer in PULL_ANSWERS},
        # Of those, the updates or snapshots that went where the anchor's value had been dropped
        # (syncer.spill_anchors off, or a write the disk refused), so one delta would have done.
        "anchor_values_missed": int(counters.get("anchor_values_missed", 0)),
        # Anchors' values the shards wrote to their state folders as they left memory, and read
        # back for a pull (syncer.spill_anchors).
        "anchor_spill": {"values_written": int(counters.get("anchor_values_spilled", 0)),
                         "bytes_written": int(counters.get("anchor_spill_bytes", 0)),
                         "values_read": int(counters.get("anchor_values_loaded", 0))},
        "goodput": goodput.share,
        "badput_seconds": dict(goodput.badput_seconds),
        "useful_seconds": useful,
        "provisioned_seconds": provisioned_total,
        "initial_eval_loss": min(first_evaluations)[3] if first_evaluations else None,
        "final_eval_loss": None,  # the global model's: simulate evaluates it once the learners are done
        "final_eval_loss_learners": sum(last_losses) / len(last_losses) if last_losses else None,
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        # Of bytes_down: the snapshots each learner took at the end to hold the shards' exact
        # final values (once per run, not per sync).
        "bytes_down_exact_end": totals["exact_end_bytes"],
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
        # Learners the shards refused pushes of as outliers, or that healed: by id.
        "sick_learners": {learner_id: {"outliers_refused": int(counters.get(f"outliers.{learner_id}", 0)),
                                       "heals": figures["heals"], "phase": figures["phase"]}
                          for learner_id, figures in per_learner.items()
                          if figures["heals"] or counters.get(f"outliers.{learner_id}", 0)},
        "global_vs_local": global_vs_local(per_learner),
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


def _learner_figures(cfg: Config, reports: dict[str, dict], learner_chaos: Chaos, provisioned: dict[str, float],
                     run_started: float, replica_events: list[dict], group_names: list[str]) -> tuple:
    """summarise's figures of each learner, and their sums: (useful seconds, provisioned seconds,
    badput seconds by cause, totals of tokens, steps and bytes, links, per-learner figures)."""
    badput = no_badput()
    useful = provisioned_total = 0.0
    links, per_learner = {}, {}
    totals = {"tokens": 0, "inner_steps": 0, "bytes_up": 0, "bytes_down": 0, "exact_end_bytes": 0}
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
        totals["exact_end_bytes"] += total("exact_end_bytes")
        # The link as configured (None: uncapped) beside what its pushes and pulls achieved.
        link = cfg.link(learner.id, learner.region) or LinkConfig()
        links[learner.id] = {"region": learner.region, **link.model_dump(), "bytes": moved,
                             "bytes_per_second": moved / total("transfer_seconds") if total("transfer_seconds") else 0.0}
        per_learner[learner.id] = {"region": learner.region, "steps": kept_steps, "step_seconds": step_seconds,
                                   "provisioned_seconds": provisioned[learner.id],
                                   "steps_run": steps_run, "restarts": max(0, len(lives) - 1),
                                   "push_seconds": total("push_seconds") / total("pushes") if total("pushes") else None,
                                   "blocked_seconds": total("blocked_seconds"),
                                   "phase": report.get("phase"), "evaluations": report.get("evaluations", []),
                                   "heals": int(total("heals")),
                                   "global_evaluations": report.get("global_evaluations", []),
                                   # each life that recorded: its process start and its join and pull
                                   "startup_seconds": [life.get("startup_seconds", 0.0) for life in lives],
                                   "restore_seconds": [life.get("restore_seconds", 0.0) for life in lives]}
    return useful, provisioned_total, badput, totals, links, per_learner


def global_vs_local(per_learner: dict[str, dict]) -> list[list[float]]:
    """[step, the learners' own models' mean loss, the mean loss of the global models they held]
    at each step where learners evaluated both (`--eval-global`), before they finished."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for learner in per_learner.values():
        own, held = {}, {}
        for evaluations, by in ((learner["evaluations"], own), (learner["global_evaluations"], held)):
            for _, step, _, loss in evaluations:
                by.setdefault(step, loss)  # a step's first: its last step's is evaluated again once it holds the global model
        for step in own.keys() & held.keys():
            by_step.setdefault(step, []).append((own[step], held[step]))
    return [[step, sum(o for o, _ in pairs) / len(pairs), sum(g for _, g in pairs) / len(pairs)]
            for step, pairs in sorted(by_step.items())]


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
        *((("pulls answered", ", ".join(_pulls(report, answer, count) for answer, count in report["pulls"].items()
                                        if count)
            + (f" ({missed} from an anchor whose value the shards had dropped: syncer.kept_anchors)"
               if (missed := report.get("anchor_values_missed")) else "")),)
          if any(report.get("pulls", {}).values()) else ()),
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
        *((("global vs own", _global_vs_local(report["global_vs_local"])),) if report.get("global_vs_local") else ()),
        *((f"sick {learner_id}", f"{sick['outliers_refused']} pushes refused as outliers, healed {sick['heals']}x"
           + ("" if sick["phase"] == "done" else f", ended {sick['phase']}"))
          for learner_id, sick in report.get("sick_learners", {}).items()),
        *((f"link {learner_id}", _link(link)) for learner_id, link in report["links"].items()),
        *((f"island {learner_id}", _island(island)) for learner_id, island in report.get("islands", {}).items()),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"\nreport: {report_path}")


def _global_vs_local(curve: list[list[float]]) -> str:
    """The global model's loss against the learners' own, at their last step and on average."""
    last = curve[-1]
    gaps = [held / own - 1 for _, own, held in curve[1:]] or [0.0]
    return (f"step {last[0]:.0f}: global {last[2]:.3f}, learners' own {last[1]:.3f} ({last[2] / last[1] - 1:+.1%}); "
            f"mean gap over {len(gaps)} evaluations {sum(gaps) / len(gaps):+.1%}")


def _pulls(report: dict, answer: str, count: int) -> str:
    """One kind of pull answer: how many, and their megabytes where the report has them."""
    megabytes = report.get("pull_bytes", {}).get(answer, 0) / 1e6
    return f"{answer} {count}" + (f" ({megabytes:.1f} MB)" if megabytes else "")


def _link(link: dict) -> str:
    """A learner's link as configured, and the rate its pushes and pulls achieved (their bytes
    over their time on the wire, waits for a round's result included; a dp rank's all-reduce:
    its bytes only)."""
    def rate(mbps: float | None) -> str:
        return "uncapped" if mbps is None else f"{mbps:g}"

    configured = (f"{link['region']}: up {rate(link['up_mbps'])} / down {rate(link['down_mbps'])} Mbit/s, "
                  f"latency {link['latency_ms']:g} ms")
    if "bytes_per_second" not in link:
        return f"{configured}; {link['bytes'] / 1e6:.2f} MB"
    kernel = (f"; the kernel let through {link['kernel_bytes_up'] / 1e6:.2f} MB up, "
              f"{link['kernel_bytes_down'] / 1e6:.2f} MB down" if "kernel_bytes_up" in link else "")
    return (f"{configured}; measured {link['bytes_per_second'] / 1e6:.3f} MB/s "
            f"({link['bytes_per_second'] * 8 / 1e6:.2f} Mbit/s) over {link['bytes'] / 1e6:.2f} MB{kernel}")


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
