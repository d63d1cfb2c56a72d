"""BENCHMARKS.md and the plots under bench/plots/ from the figures of bench/run_all.py.

    python bench/report.py [bench/results.json] [--out .]    # render again without running

Nothing here measures: every number comes from results.json, which the runner wrote from
the commands it ran. bench/history.md (earlier sessions' measurements, written by hand) is
linked from the last section.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.split_downlink import anchors_setting  # noqa: E402

UTILISATION_TARGET = 0.95
PLAN_SPEED_TARGET_SECONDS = 300  # one day of 2.4M chips at M = 16, every mode (issue 34)
HISTORY = pathlib.Path(__file__).resolve().parent / "history.md"


def pct(value: float, signed: bool = False) -> str:
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def code(command: str) -> str:
    return f"`{command}`"


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows), ""]


def config_name(row: dict) -> str:
    name = f"{row.get('model', 'gpt')} M={row['learners']} H={row['H']} {row['codec']}"
    if row.get("learner_script"):
        name += f", user loop ({row['learner_script']})"
    if row.get("slow_learner", 1.0) != 1.0:
        name += f", one learner {row['slow_learner']:g}x slower (measured {row['slow_learner_step_ratio']:.2f}x)"
    return name


def save(fig, ax, out: pathlib.Path, name: str, **axes) -> str:
    """Labels the axes, writes bench/plots/<name>.png below `out`; the Markdown that shows it."""
    ax.set(**axes)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    path = out / "bench" / "plots" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"![{name}](bench/plots/{name}.png)"


# ---- the sections --------------------------------------------------------------------------

def quality(section: dict, out: pathlib.Path) -> list[str]:
    rows = section["rows"]
    first = rows[0]["diloco"]
    targets = " and ".join(f"{pct(t)} for M={m}" for m, t in section["targets"].items())
    alone = section["alone"]
    lines = [f"Final validation loss of the global model (what the run produced: exported from the shards "
             f"and evaluated; start {first['initial_eval_loss']:.3f}) against data parallel at the same model, "
             f"data, seed and tokens ({section['steps']} inner steps per learner, {first['tokens']:,} tokens for "
             f"M={rows[0]['learners']}: H=100 syncs each fragment {section['steps'] // 100} times). dp is "
             f"`diloco sim --mode dp` with the same flags: the M learners as one torch.distributed job (DDP over "
             f"gloo), rank r on learner r's data and batch, gradients averaged every step, one AdamW trajectory. "
             f"Target: the global model within {targets} of dp's loss for H <= {section['target_max_H']}, and at least "
             f"{pct(section['alone_margin'])} better than one learner alone on one learner's share of the tokens "
             f"(`{alone['command']}`: {alone['final_eval_loss']:.4f}). Rows with several seeds show the median and "
             f"the range; the others seed 1, beside dp of the same seed. The slow-learner run has the run's token "
             f"budget instead (`trainer.max_run_tokens`): every learner trains until the run's tokens reach it, and "
             f"its dp run trains the tokens it ended with.", ""]
    lines += table(
        ["configuration", "seeds", "diloco loss", "dp loss", "diloco vs dp", "target", "vs one learner alone",
         "diloco learners' loss", "tokens diloco / dp", "command (diloco, seed 1)"],
        [[config_name(r), ", ".join(map(str, r["seeds"])), _median_range(r["diloco_losses"]),
          _median_range(r["dp_losses"]), pct(r["loss_vs_dp"], signed=True),
          "n/a (H > 50)" if r["target"] is None else f"<= {pct(r['target'])}: " + verdict(r["within_target"]),
          pct(r["loss_vs_alone"], signed=True) + ("" if r["better_than_alone"] else " (**missed**)"),
          _loss(r["diloco"].get("final_eval_loss_learners")),
          f"{r['diloco']['tokens']:,} / {r['dp']['tokens']:,}", code(r["diloco"]["command"])]
         for r in rows])
    lines += ["dp commands: " + ", ".join(sorted({code(r["dp"]["command"]) for r in rows})), ""]
    lines += [f"Monotone in H (a smaller H never worse than a larger one by more than the seed spread, "
              f"{section['seed_spread']:.4f}, the largest range of a row run with several seeds): "
              + "; ".join(f"{m['model']} M={m['learners']} {m['codec']} H={m['H'][0]} vs {m['H'][1]}: "
                          f"{m['smaller_minus_larger']:+.4f} " + verdict(m["within_spread"])
                          for m in section["monotone"]), ""]
    if section.get("user_loop"):
        lines += ["The user-loop path (`DecoupledDiLoCo` around a plain loop with torch.optim.AdamW, `diloco sim "
                  "--learner-script`) against the built-in learner at the same settings and seeds (agree: the "
                  "medians differ by at most the seed spread): "
                  + "; ".join(f"{u['model']} M={u['learners']} H={u['H']} {u['codec']} ({u['script']}): "
                              f"{u['user_minus_built_in']:+.4f} " + verdict(u["within_spread"])
                              for u in section["user_loop"]), ""]
    fig, ax = plt.subplots(figsize=(10, 4))
    names = [config_name(r).split(",")[0] + (" slow" if r["slow_learner"] != 1.0 else "")
             + (" own loop" if r.get("learner_script") else "") for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [statistics.median(r["diloco_losses"]) for r in rows], 0.4, label="diloco")
    ax.bar([i + 0.2 for i in x], [statistics.median(r["dp_losses"]) for r in rows], 0.4, label="data parallel")
    low = min(min(r["diloco_losses"] + r["dp_losses"]) for r in rows)
    ax.set_xticks(list(x), names, rotation=20, fontsize="small")
    bars = save(fig, ax, out, "quality", ylabel="final validation loss", ylim=(low * 0.9, None),
                title="quality at equal tokens")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    shown = [r for r in rows if r["slow_learner"] == 1.0 and not r.get("learner_script") and r["model"] == rows[0]["model"]
             and r["learners"] == rows[0]["learners"] and r["codec"] == rows[0]["codec"]]
    tokens, losses = zip(*shown[0]["curves"]["dp"])
    ax.plot(tokens, losses, color="black", label="data parallel")
    for r in shown:
        tokens, losses = zip(*r["curves"]["diloco"])
        ax.plot(tokens, losses, label=f"diloco H={r['H']} (learners' own models)")
    curves = save(fig, ax, out, "quality_curves", xlabel="tokens trained (the whole run)", ylabel="validation loss",
                  ylim=(low * 0.95, low * 1.5), title=f"{config_name(shown[0]).rsplit(' H=', 1)[0]}: loss against tokens")
    return lines + [bars, "", curves, ""]


def _median_range(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.median(values):.4f} ({min(values):.4f} to {max(values):.4f})"


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def bandwidth(section: dict, out: pathlib.Path) -> list[str]:
    rows = section["rows"]
    models = list(rows[0]["diloco"]["at_1s_step"])
    lines = [f"Bytes on the wire (up and down, join pulls included) per token trained, from the quality runs, and "
             f"the ratio dp / diloco (anchor: Streaming DiLoCo {section['anchor_dp_over_diloco']}x fewer bits than dp). "
             f"The Gbit/s a learner would need at a 1 s step for {' and '.join(models)} parameters with the same H, P, "
             f"tau and codec come from the measured bytes per parameter per sync: on average over H steps, and to move "
             f"one fragment within tau steps (dp: every step, the same). The downlink is larger than the uplink: "
             f"a learner pulls every round's update since its anchor, and with learners out of lockstep a "
             f"sync period holds about one (partial) round per learner; the join snapshots count too.", ""]
    header = ["configuration", "B/token diloco", "B/token dp", "dp / diloco", "vs 400x anchor", "B/param/sync up + down"]
    for model in models:
        header += [f"{model} Gbit/s avg (dp)", f"{model} Gbit/s within tau"]
    body = []
    for r in rows:
        cells = [config_name(r), f"{r['diloco']['bytes_per_token']:.1f}", f"{r['dp']['bytes_per_token']:.0f}",
                 f"{r['dp_over_diloco']:.0f}x", verdict(r["dp_over_diloco"] >= section["anchor_dp_over_diloco"]),
                 f"{r['diloco']['up_bytes_per_parameter_per_sync']:.2f} + "
                 f"{r['diloco']['bytes_per_parameter_per_sync'] - r['diloco']['up_bytes_per_parameter_per_sync']:.2f}"]
        for model in models:
            ours, theirs = r["diloco"]["at_1s_step"][model], r["dp"]["at_1s_step"][model]
            cells += [f"{ours['average_gbps']:.1f} ({theirs['average_gbps']:.0f})", f"{ours['within_tau_gbps']:.1f}"]
        body.append(cells)
    lines += table(header, body)
    lines += ["Commands: the quality runs of the same configuration (section 1).", ""]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([config_name(r) for r in rows], [r["diloco"]["bytes_per_token"] for r in rows], label="diloco")
    ax.bar(["dp"], [rows[0]["dp"]["bytes_per_token"]], color="tab:orange", label="data parallel")
    ax.tick_params(axis="x", labelrotation=20, labelsize="small")
    return lines + [save(fig, ax, out, "bandwidth", yscale="log", ylabel="bytes on the wire per token",
                         title="bandwidth per token"), ""]


def goodput(section: dict, out: pathlib.Path) -> list[str]:
    rows = section["rows"]
    anchor = section["anchor"]
    lines = [f"The demo's cluster and model ({code(section['config'])}), M={section['learners']} learners, "
             f"{section['seconds']:g} s per run; every learner is SIGKILLed at "
             f"exponentially distributed intervals and restarted {section['restart_delay']:g} s later, so that it is "
             f"down for the target share of the time. In dp (one torch.distributed job) a killed rank stops the "
             f"job, which starts again {section['restart_delay']:g} s later, every rank from the last checkpoint: "
             f"every rank is down meanwhile, and the steps since that checkpoint are lost. A killed diloco "
             f"learner restarts as a new process (as the dp job does), and its shards stop counting it when its "
             f"connection closes. "
             f"Goodput = kept training compute / provisioned learner time; badput shares are of provisioned time; "
             f"up-efficiency = goodput / share of time up; global model loss: the validation loss of the model the run "
             f"produced (the runs are as long, not as many steps). "
             f"Anchor: Decoupled DiLoCo {pct(anchor['diloco'])} vs data parallel {pct(anchor['dp'])} at a high failure rate.", ""]
    body = []
    for r in rows:
        for mode in ("diloco", "dp"):
            m = r[mode]
            badput = ", ".join(f"{k} {pct(v)}" for k, v in m["badput_share"].items() if v >= 0.005)
            loss = m.get("final_eval_loss")
            body.append([pct(r["target_down_share"]), mode, pct(m["down_share"]), f"**{pct(m['goodput'])}**",
                         f"{m['goodput'] / (1 - m['down_share']):.2f}" if m["down_share"] < 1 else "-",
                         f"{loss:.3f}" if loss is not None else "-", m["restarts"], badput, code(m["command"])])
    lines += table(["target down", "mode", "measured down", "goodput", "up-efficiency", "global model loss",
                    "restarts", "badput", "command"], body)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, color in (("diloco", "tab:blue"), ("dp", "tab:orange")):
        ax.plot([r[mode]["down_share"] * 100 for r in rows], [r[mode]["goodput"] * 100 for r in rows],
                marker="o", color=color, label=f"{mode} (measured)")
        ax.axhline(anchor[mode] * 100, color=color, linestyle=":", label=f"{mode} paper anchor")
    return lines + [save(fig, ax, out, "goodput", xlabel="learner time down (%)", ylabel="goodput (%)",
                         ylim=(0, 100), title="goodput under failures"), ""]


def overlap(section: dict, out: pathlib.Path) -> list[str]:
    links = section["links"]
    lines = [f"One shard, one learner (demo model, {section['model_parameters']:,} parameters, H={section['H']}, "
             f"P={section['P']}, tau={section['tau']}, {section['codec']}), {section['steps']} steps; loop time per "
             f"step with syncs in flight against the same learner with sync off, median of {section['repeats']} "
             f"alternating runs. Target: utilisation (off / on) >= {pct(UTILISATION_TARGET)}.", ""]
    lines += table(["link", "sync off ms/step", "sync on ms/step", "utilisation", ">= 95 %", "blocked ms/step", "command"],
                   [[f"{l['wan_mbps']:g} Mb/s" if l["wan_mbps"] else "loopback (uncapped)",
                     f"{l['sync_off_step_seconds'] * 1e3:.1f}", f"{l['sync_on_step_seconds'] * 1e3:.1f}",
                     pct(l["utilisation"]), verdict(l["utilisation"] >= UTILISATION_TARGET),
                     f"{l['blocked_step_seconds'] * 1e3:.1f}", code(section["command"])] for l in links])
    capped = sorted((l for l in links if l["wan_mbps"]), key=lambda l: l["wan_mbps"])
    below = [l["wan_mbps"] for l in capped if l["utilisation"] < UTILISATION_TARGET]
    above = [l["wan_mbps"] for l in capped if l["utilisation"] >= UTILISATION_TARGET]
    where = (f"Utilisation falls below {pct(UTILISATION_TARGET)} between {max(below):g} and {min(above):g} Mb/s"
             if below and above and max(below) < min(above) else
             f"Measured links below {pct(UTILISATION_TARGET)}: {', '.join(f'{b:g}' for b in below) or 'none'} Mb/s")
    lines += [f"{where}. A sync moves {section['bytes_per_sync'] / 1e3:.0f} kB (one fragment up and one update down); "
              f"to cross within tau steps of compute the link needs about {section['needed_mbps']:.1f} Mb/s.", ""]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([l["wan_mbps"] for l in capped], [l["utilisation"] * 100 for l in capped], marker="o", label="measured")
    ax.axhline(UTILISATION_TARGET * 100, color="red", linestyle=":", label="95 %")
    ax.axvline(section["needed_mbps"], color="grey", linestyle="--", label="estimated need")
    return lines + [save(fig, ax, out, "overlap", xscale="log", xlabel="link Mb/s (each way)",
                         ylabel="compute utilisation (%)", title="overlap"), ""]


def transport(section: dict, out: pathlib.Path) -> list[str]:
    runs = section["runs"]
    lines = [f"M={section['pushers']} pushers, {section['params'] / 1e6:.0f}M fp32 parameters in {section['fragments']} "
             f"fragments, {section['codec']}, median of {section['rounds']} iterations; raw = the same bytes over plain "
             f"gRPC streams, with the same concurrency, to a server that only counts them; push all at once = every "
             f"pusher's every fragment streamed together (a learner pushes from a thread per fragment); one at a time = "
             f"each pusher's fragments one after another, each push waiting for its log record's fdatasync; every pushed "
             f"byte crosses gRPC and is made durable, so no push path beats min(raw, disk), the disk's rate being the "
             f"state folder's for push-sized appends, each fdatasynced (measured in the same run); pull as "
             f"served = received and checksummed (raw's work), decoded = also decoded and applied by the client; a "
             f"round = every fragment's round closed by its last push (merge, outer step, encode, log, apply, install); "
             f"in-process = the same round's arithmetic (decode, RDA merge, Nesterov, int4 with error feedback, apply) "
             f"in one process with torch. Targets: push all at once >= {section['target_push_vs_raw']} x raw, pull as "
             f"served >= {section['target_pull_vs_raw']} x raw, a round >= {section['target_round_vs_in_process']} x "
             f"in-process.", ""]
    inproc = section["in_process_params_per_second"]
    rows = [(run, "disk") for run in runs] + ([(section["memory_run"], "/dev/shm")] if section.get("memory_run") else [])
    lines += table(["shards (state)", "push all at once MB/s (raw)", "vs raw", "disk MB/s", "vs min(raw, disk)",
                    "push one at a time MB/s (raw)", "vs raw", "pull as served MB/s (raw)", "vs raw",
                    "pull decoded vs raw", "round M params/s (in-process)", "vs in-process", "targets", "command"],
                   [[f"{r['shards']} ({state})",
                     f"{r['push_mbytes_per_second']:.0f} ({r['raw_push_mbytes_per_second']:.0f})",
                     f"{r['push_vs_raw']:.2f}", f"{r['log_mbytes_per_second']:.0f}", f"{r['push_vs_bound']:.2f}",
                     f"{r['push_sequential_mbytes_per_second']:.0f} ({r['raw_push_sequential_mbytes_per_second']:.0f})",
                     f"{r['push_sequential_vs_raw']:.2f}",
                     f"{r['pull_served_mbytes_per_second']:.0f} ({r['raw_pull_mbytes_per_second']:.0f})",
                     f"{r['pull_vs_raw']:.2f}", f"{r['pull_decoded_vs_raw']:.2f}",
                     f"{r['params_per_second'] / 1e6:.0f} ({inproc / 1e6:.0f})", f"{r['params_per_second'] / inproc:.2f}x",
                     verdict(transport_targets_met(section, r)), code(section["command"])] for r, state in rows])
    lines += [f"The in-process arithmetic ran at {section['in_process_of_memory_bandwidth']:.2f} of what this machine's "
              f"memory bandwidth allows ({section['memory_bytes_per_second'] / 1e9:.1f} GB/s measured by a large torch "
              f"copy, {section['round_bytes_per_parameter']:.1f} bytes a round must touch per parameter): the int4 "
              f"encode and decode are compute-bound, not memory-bound.", ""]
    if "cpu" in runs[0]:
        lines += ["CPU per MB pushed all at once (user and system time): " + "; ".join(
            f"{r['shards']} shard(s) ({state}): the push path {r['cpu']['push']['server_ms_per_mb']:.2f} ms, the raw "
            f"server {r['cpu']['raw']['server_ms_per_mb']:.2f} ms, their pushers {r['cpu']['push']['pushers_ms_per_mb']:.2f} "
            f"and {r['cpu']['raw']['pushers_ms_per_mb']:.2f} ms, the {section['cores']} cores "
            f"{r['cpu']['push']['cores_busy']:.0%} and {r['cpu']['raw']['cores_busy']:.0%} busy" for r, state in rows)
            + ". Pushers and servers share the cores, so the ratio to raw follows the CPU each MB costs; the push "
            "path's extra is mostly the durable write (the kernel's copy into the page cache and its writeback).", ""]
    if "shared_pulls" in runs[0]:
        lines += ["Shared pulls (issue 53: one encode per (anchor, value) pair): " + "; ".join(
            f"{r['shards']} shard(s): {r['shared_pulls']['learners']} learners holding the same value pull a "
            f"fragment of {r['shared_pulls']['fragment_params'] / 1e6:.1f}M values two rounds later, together: "
            f"{r['shared_pulls']['encodes']} encode, {r['shared_pulls']['reuses']} reused (the shard's "
            f"`pulls.delta_encoded` and `pulls.delta_reused` counters), {r['shared_pulls']['seconds']:.2f} s in all"
            for r in runs) + ".", ""]
    if len(runs) > 1:
        lines += [f"Scaling: {runs[-1]['shards']} shards give {runs[-1]['params_per_second'] / runs[0]['params_per_second']:.2f}x "
                  f"the round throughput of {runs[0]['shards']} (shards and pushers share the machine's cores).", ""]
    if "scale" in section:
        lines += scale(section["scale"])
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['shards']} shard(s)" for r in runs] + ["in-process"]
    ax.bar(labels, [r["params_per_second"] / 1e6 for r in runs] + [inproc / 1e6], color=["tab:blue"] * len(runs) + ["grey"])
    return lines + [save(fig, ax, out, "transport", ylabel="M fp32 parameters merged per second",
                         title="syncer round throughput"), ""]


def transport_targets_met(section: dict, run: dict) -> bool:
    return (run["push_vs_raw"] >= section["target_push_vs_raw"] and run["pull_vs_raw"] >= section["target_pull_vs_raw"]
            and run["params_per_second"] / section["in_process_params_per_second"] >= section["target_round_vs_in_process"])


ANCHORS_TARGET = 24.0  # B per owned parameter at M = 16 (issue 53)


def scale(section: dict) -> list[str]:
    """bench/syncer_scale.py: one shard at model scale, now and before, and the capacity table."""
    lines = ["One shard process owning every fragment (P = 4), M = 4 synthetic pushers of int4 outer gradients, rounds "
             "closed by the last push; RSS at rest is measured once the shard, idle after its last round, has given "
             "its freed memory back; durable bytes are what the process wrote (its log, snapshots and push replies).", ""]
    lines += table(["shard code", "parameters", "s per round", "RSS B/param at rest", "peak RSS B/param",
                    "durable MB per round per fragment", "vs received", "command"],
                   [[r["label"], f"{r['params'] / 1e6:.0f}M", f"{r['round_seconds']:.2f}", f"{r['rss_bytes_per_param']:.1f}",
                     f"{r['peak_rss_bytes_per_param']:.1f} ({r['peak_rss_gib']:.1f} GiB)",
                     f"{r['durable_bytes_per_round_per_fragment'] / 1e6:.1f}",
                     f"{r['durable_bytes_per_round_per_fragment'] / r['received_bytes_per_round_per_fragment']:.2f}x",
                     code(section["command"])] for r in section["runs"]])
    if section.get("anchors"):
        lines += ["", f"Anchors (issue 53): one fragment of {section['anchors'][0]['params'] / 1e6:.0f}M values, "
                  f"{section['anchors'][0]['learners']} learner identities; learner i takes a snapshot at version i "
                  "(one pusher closes a round after each), then all pull from their anchors at once, each leaving "
                  "with an off-lineage value of its own. The shard keeps syncer.kept_anchors of those values in memory "
                  "(4 B/param each); with syncer.spill_anchors the others go to its state folder and are read back "
                  "for their learner's next pull, without it a learner whose value was dropped pulls the exact "
                  "updates since, or a snapshot. On disk: the anchors' files once the pulls are done; written: "
                  "during the run. Target: <= 24 B/param at rest at M = 16, with every learner's next pull one delta "
                  "(the default settings).", ""]
        lines += table(["syncer.kept_anchors", "syncer.spill_anchors", "RSS B/param at rest", "target",
                        "anchors on disk B/param", "GB written", "the 16 pulls' answers",
                        "MB pulled per learner (median)", "one int4 update MB", "the 16 pulls s"],
                       [[r["kept_anchors"], str(r.get("spill_anchors", False)).lower(),
                         f"{r['rss_bytes_per_param']:.1f}",
                         verdict(r["rss_bytes_per_param"] <= ANCHORS_TARGET) if is_default_anchors(r) else "-",
                         f"{r.get('disk_bytes_per_param', 0):.1f}", f"{r.get('spill_bytes_written', 0) / 1e9:.1f}",
                         ", ".join(f"{k} {v}" for k, v in sorted(r["answers"].items())),
                         f"{r['pulled_bytes_per_learner'] / 1e6:.1f}", f"{r['int4_bytes'] / 1e6:.1f}",
                         f"{r['pull_seconds']:.1f}"]
                        for r in section["anchors"]])
    return lines + capacity(section)


def is_default_anchors(run: dict) -> bool:
    """The anchors run with the shard's default settings (kept_anchors 0, spill_anchors true)."""
    return run["kept_anchors"] == 0 and run.get("spill_anchors", False)


def capacity(section: dict) -> list[str]:
    """bench/syncer_scale.py's capacity table for 1B, 12B and 70B, scaled from its run."""
    plan, measured = section["plan"], section["measured"]
    lines = [f"Capacity for H = {plan['interval_steps']}, P = {plan['fragments']}, M = {plan['learners']}, "
              f"tau = {plan['overlap_steps']}, {plan['step_seconds']:g} s inner steps, int4, on shard machines of 16 cores and "
              f"128 GiB (80 % used), scaled linearly from this run: a round close of M = {plan['learners']} took "
              f"{measured['close_seconds_per_param'] * 1e9:.1f} ns per fragment parameter on {measured['cores']} cores, "
              f"{measured['rest_bytes_per_param']:.1f} B/param at rest"
              + (f" plus 4 B/param for the lineage's value one version back and each anchor value a fragment keeps "
                 f"in memory (syncer.kept_anchors = {plan['kept_anchors']})" if "kept_anchors" in plan else "")
              + f", and {measured['close_bytes_per_param']:.1f} B per "
              f"parameter of the closing fragment, disk {measured['disk_bytes_per_second'] / 1e6:.0f} MB/s. "
              "Where one fragment's close does not fit a shard, P doubles. Disk per shard: the state (a snapshot, "
              "its replacement while written, a full log, the history)"
              + (", plus the anchors' values out of memory with every learner out of phase (M x 4 B per owned "
                 "parameter; none while every learner contributes to every round)"
                 if "anchor_disk_gib_per_shard" in section["capacity"][0] else "") + ".", ""]
    return lines + table(["model", "P", "per fragment", "close on this machine", "cores to close within tau steps", "shards",
                    "memory per shard", "at rest, all shards", "WAN in", "disk writes", "snapshot write", "disk per shard"],
                   [[f"{r['params'] / 1e9:.0f}B", r["fragments"], f"{r['fragment_params'] / 1e6:.0f}M",
                     f"{r['close_seconds_here']:.1f} s", f"{r['cores_for_window']:.0f}", r["shards"],
                     f"{r['shard_memory_gib']:.0f} GiB", f"{r['memory_at_rest_gib']:.0f} GiB",
                     f"{r['wan_in_mbytes_per_second']:.0f} MB/s", f"{r['disk_mbytes_per_second']:.0f} MB/s",
                     f"{r['snapshot_seconds']:.0f} s", f"{r['disk_gib_per_shard']:.0f} GiB"] for r in section["capacity"]])


def recovery(section: dict, out: pathlib.Path) -> list[str]:
    sizes = section["sizes"]
    lines = [f"One shard, two learners; learner 0 SIGKILLed and started again at once, then the shard; median of "
             f"{section['kills']} kills. Back to training: from the new process's start until the shard sees it step; "
             f"start-up and restore (join + pulling the missed updates) are the learner's own records.", ""]
    lines += table(["model", "parameters", "learner back to training s", "start-up s", "restore + catch-up s",
                    "versions caught up", "shard serving again s", "shard state MB", "command"],
                   [[f"{s['layers']}x{s['width']}", f"{s['model_parameters'] / 1e6:.2f}M",
                     f"{s['learner_back_to_training_seconds']:.2f}", f"{s['learner_startup_seconds']:.2f}",
                     f"{s['learner_restore_seconds']:.2f}", f"{s['versions_caught_up']:.0f}",
                     f"{s['shard_serving_again_seconds']:.2f}", f"{s['shard_state_bytes'] / 1e6:.1f}",
                     code(section["command"])] for s in sizes])
    fig, ax = plt.subplots(figsize=(6, 4))
    params = [s["model_parameters"] / 1e6 for s in sizes]
    ax.plot(params, [s["learner_back_to_training_seconds"] for s in sizes], marker="o", label="learner back to training")
    ax.plot(params, [s["learner_restore_seconds"] for s in sizes], marker="o", label="learner restore + catch-up")
    ax.plot(params, [s["shard_serving_again_seconds"] for s in sizes], marker="o", label="shard serving again")
    return lines + [save(fig, ax, out, "recovery", xscale="log", xlabel="model parameters (M)", ylabel="seconds",
                         title="recovery after SIGKILL"), ""]


def pair_range(section: dict) -> str:
    """The spread of a loop-time ratio: the lowest and highest of its pairs' on / off."""
    return f"{min(section['pair_ratios']):.3f}-{max(section['pair_ratios']):.3f}"


def user_loop(section: dict, out: pathlib.Path) -> list[str]:
    sizes = section["sizes"]
    load = section["load_average"]
    lines = [f"A plain PyTorch loop in one process (a GPT of `learner/trainer/model.py`, torch AdamW, random bytes, "
             f"{section['torch_threads']} torch thread) with `DecoupledDiLoCo` syncing against one shard process, "
             f"against the same loop with `DecoupledDiLoCo(enabled=False)`; mean loop time per step (the user's step "
             f"and `sync.step()`), median of {section['pairs']} pairs of runs that alternate which goes first, "
             f"a fresh shard per pair. Ratio: sync on / sync off, so how far the loop is from the one without sync "
             f"(pairs: the lowest and highest pair's ratio). Target: ratio <= {section['target_ratio']}. "
             f"`sync.step()` with nothing due: every call of the syncing runs on a step where no sync started and "
             f"no result was applied; its share is of the sync-off step. All `sync.step()` calls: what the API takes on "
             f"the training thread per step (gathering fragments, applying results); the rest of the ratio is the "
             f"sync's work on its own thread and in the shard, competing with the loop for the machine's cores. The "
             f"shard shares those cores here, which it would not across regions. Load average {load['start']:.1f} at the start, "
             f"{load['end']:.1f} at the end (other processes share the machine).", ""]
    lines += table(["model", "parameters", "steps a run (syncs)", "H, P, tau", "sync off ms/step", "sync on ms/step",
                    "ratio (pairs)", "target", "idle `sync.step()` p50 / p90 us", "of the step",
                    "all `sync.step()` ms/step (of the step)", "command"],
                   [[s["size"] + f" ({s['layers']}x{s['width']}, batch {s['batch_size']}x{s['seq_len']})",
                     f"{s['model_parameters'] / 1e6:.2f}M", f"{s['steps']} ({s['syncs_per_run']:.0f})",
                     f"{s['H']}, {s['P']}, {s['tau']} ({s['codec']})", f"{s['sync_off_step_seconds'] * 1e3:.1f}",
                     f"{s['sync_on_step_seconds'] * 1e3:.1f}", f"{s['ratio']:.3f} ({pair_range(s)})",
                     verdict(s["ratio"] <= section["target_ratio"]),
                     f"{s['idle_step_call_seconds']['p50'] * 1e6:.0f} / {s['idle_step_call_seconds']['p90'] * 1e6:.0f}",
                     f"{s['idle_step_call_share']:.2%}",
                     f"{s['step_calls_seconds_per_step'] * 1e3:.2f} ({s['step_calls_share']:.1%})",
                     code(section["command"])] for s in sizes])
    noisy = [s for s in sizes if max(s["pair_ratios"]) > section["target_ratio"]]
    if noisy:
        lines += ["Pairs above the target: " + ", ".join(f"{s['size']} up to {max(s['pair_ratios']):.3f}" for s in noisy)
                  + f". On this machine one pair's ratio moves by more than the target's margin: a verdict holds "
                  f"as a median of {section['pairs']} pairs, not for every pair.", ""]
    if "gpu_shaped" in section:
        lines += gpu_shaped(section["gpu_shaped"], section.get("gpu_shaped_kept"))
    return lines


def gpu_shaped(section: dict, kept: dict | None = None) -> list[str]:
    """The same loop with a GPU's step as the host sees it (issue 51); `kept`: the same runs
    with the learner process keeping its freed memory."""
    runs = [(section, "glibc's default")] + ([(kept, "kept")] if kept else [])
    lines = ["### A GPU-shaped step on this machine", "",
             "The same loop and shard, the step replaced by what a GPU step looks like to the host: a 20 ms wait "
             "that releases the interpreter and holds no core, then every parameter changed in place "
             "(`--step gpu-shaped`). Blocked: the time `sync.step()` waited for results past tau, per step. The "
             "user's step: its own time with the sync on and off (what the sync's threads cost it through the "
             "interpreter lock and the cores). CPU ms per sync: the CPU time a sync costs the training thread, "
             "the sync's threads and the shard, against the time between two syncs' starts (P syncs every H "
             "steps); learner and shard share this machine's 2 cores. Freed memory: the learner process as "
             "glibc leaves it, or keeping what it frees (`--keep-freed-memory`, what GLIBC_TUNABLES does for a "
             "learner process: docs/gpus.md; the shard and the built-in learner always do).", ""]
    lines += table([*LOOP_COLUMNS, "freed memory", "user's step off / on ms",
                    "CPU ms per sync: training thread / sync threads / shard", "a sync starts every",
                    "a sync's round trip ms (push) / tau steps' ms", "command"],
                   [[*loop_cells(s), memory,
                     f"{s['user_step_seconds']['off'] * 1e3:.2f} / {s['user_step_seconds']['on'] * 1e3:.2f}",
                     " / ".join(f"{s['cpu_seconds_per_sync'][k] * 1e3:.0f}"
                                for k in ("training_thread", "sync_threads", "shards")),
                     f"{s['seconds_between_syncs'] * 1e3:.0f} ms", round_trip(s), code(run["command"])]
                    for run, memory in runs for s in run["sizes"]])
    return lines


LOOP_COLUMNS = ["model", "steps a run (syncs)", "H, P, tau", "sync off ms/step", "sync on ms/step",
                "ratio (pairs: lowest-highest)", "target", "blocked ms/step"]


def loop_cells(size: dict) -> list[str]:
    """A user-loop row's LOOP_COLUMNS, for a GPU-shaped step's table and a GPU's."""
    return [f"{size['size']} ({size['model_parameters'] / 1e6:.1f}M)", f"{size['steps']} ({size['syncs_per_run']:.0f})",
            f"{size['H']}, {size['P']}, {size['tau']} ({size['codec']})", f"{size['sync_off_step_seconds'] * 1e3:.1f}",
            f"{size['sync_on_step_seconds'] * 1e3:.1f}",
            f"{size['ratio']:.3f} ({len(size['runs_on'])}: {pair_range(size)})",
            "-" if size["target_ratio"] is None else f"<= {size['target_ratio']} "
            + verdict(size["ratio"] <= size["target_ratio"]),
            f"{size['blocked_seconds_per_step'] * 1e3:.1f}"]


def round_trip(size: dict) -> str:
    """A user-loop row's mean round trip of a sync (its push's answer) against tau steps' time;
    '-' for rows measured before the benchmark reported it."""
    if "round_trip_seconds" not in size:
        return "-"
    return (f"{size['round_trip_seconds'] * 1e3:.0f} ({size['push_seconds'] * 1e3:.0f}) / "
            f"{size['tau_steps_seconds'] * 1e3:.0f}")


def gpu_user_loop(runs: list[dict], out: pathlib.Path) -> list[str]:
    """The user loop on a GPU (issue 51), recorded by bench/gpu_runs.py: CI has no GPU."""
    lines = ["The loop of section 7 with the model on a GPU (`--device cuda`), its shards on the same machine: "
             "recorded where a session was lent a GPU (`bench/gpu_runs.py`), so each row names its machine, "
             "commit and command. Blocked: `sync.step()` waiting for results past tau, per step; `sync.step()`: "
             "all of its calls per step on the training thread, blocked included. A result is due tau steps after "
             "its sync starts; its round trip (from its start until the result is in, decoded and checked; in "
             "brackets until the shard answered its push, which with one learner includes the round's close) "
             "is what tau steps of the loop without sync have to cover (docs/gpus.md).", ""]
    lines += table(["GPU (machine's cores), commit", *LOOP_COLUMNS, "`sync.step()` ms/step",
                    "a sync's round trip ms (push) / tau steps' ms", "MB per sync off the GPU (payload) / onto it",
                    "command"],
                   [[f"{run['device']} ({run['cpu_cores']}), {run['commit']}", *loop_cells(s),
                     f"{s['step_calls_seconds_per_step'] * 1e3:.1f}",
                     round_trip(s),
                     f"{s['device_to_host_bytes_per_sync'] / 1e6:.2f} ({s['encoded_bytes_per_sync'] / 1e6:.2f}) / "
                     f"{s['host_to_device_bytes_per_sync'] / 1e6:.2f}", code(run["command"])]
                    for run in runs for s in run["sizes"] if s["size"] != "demo"])
    return lines


def hf(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"`examples/hf/train.py`, a tiny `LlamaForCausalLM` (random init, bytes as tokens) in its user's own "
             f"loop with torch AdamW, one thread, against one shard; sync on ({section['P']} fragments, "
             f"H={section['H']}, tau={section['tau']}, {section['codec']}) against `--no-sync` "
             f"(`DecoupledDiLoCo(enabled=False)`), {section['repeats']} alternating pairs of {section['steps']}-step "
             f"runs, medians of the mean loop seconds per step (pairs: the lowest and highest pair's ratio).", ""]
    lines += table(["sync off ms/step", "sync on ms/step", "ratio (pairs)", "target", "command"],
                   [[f"{section['sync_off_step_seconds'] * 1e3:.1f}", f"{section['sync_on_step_seconds'] * 1e3:.1f}",
                     f"{section['ratio']:.3f} ({pair_range(section)})", f"<= {section['target_ratio']}: "
                     + verdict(section["ratio"] <= section["target_ratio"]), code(section["command"])]])
    return lines


def plan(section: dict, out: pathlib.Path) -> list[str]:
    first = section["models"][0]["rows"]
    slices = max(r["learners"] for r in first)
    lines = [f"`diloco plan` ([docs/planning.md](docs/planning.md)): the whole run in virtual time, Decoupled DiLoCo's "
             f"decisions made by the real `ShardCore` and `LearnerSchedule`. The example's settings "
             f"({code(section['config'])}: H = P = 24, tau = 2, K = 1, int4, a 12B model, 1 s steps, a syncer "
             f"closing rounds at 1e9 parameters per second; dp checkpoints every 10 minutes and reloads in 1, elastic "
             f"reconfigures in 30 s) with the links and run length of the commands below. Failure models: the "
             f"example's (chip MTBF 50,000 hours, as Llama 3's fleet; repairs lognormal, median 5 minutes) and a "
             f"milder one (chip MTBF 200,000 hours, the same repairs). dp and elastic run in {slices} slices (the "
             f"JSON has every M). Goodput = kept compute / provisioned chip time; the paper's figures are at 1.2M "
             f"chips, its failure model not public. In this model the fleet's size changes only how often a unit "
             f"fails (chips per unit / MTBF; the step time, batch and links per learner stay), so the milder model "
             f"at 4N chips repeats the example's figures at N.", ""]
    chips = sorted({r["chips"] for r in first})
    paper = section["paper"]
    for model in section["models"]:
        by_key = {(r["mode"], r["learners"], r["chips"]): r for r in model["rows"]}
        learners = sorted({r["learners"] for r in model["rows"]})
        labels = [("dp", slices, f"data parallel ({slices} slices)"),
                  ("elastic", slices, f"elastic data parallel ({slices} slices)"),
                  *(("diloco", m, f"Decoupled DiLoCo M={m}") for m in learners)]
        body = [[label, *(f"**{pct(by_key[mode, m, c]['goodput'])}**" for c in chips),
                 pct(paper[key]) if (key := plan_label(by_key[mode, m, chips[0]])) in paper else "-"]
                for mode, m, label in labels]
        body.append([f"failures in the run (M={slices})", *(by_key["dp", slices, c]["failures"] for c in chips), ""])
        lines += [f"**{model['name']} failure model**: {code(model['command'])}", ""]
        lines += table(["goodput", *(f"{c:,} chips" for c in chips), "paper (1.2M chips)"], body)
    speed, (run, *_) = section["speed"], section["speed"]["rows"]
    lines += [f"The planner's own speed: {run['hours']:g} simulated hours of {run['chips']:,} chips at "
              f"M={run['learners']}, every mode, in {plan_speed_seconds(section):.0f} s of wall time ({plan_speed_verdict(section)}), "
              f"at the example's failure model and links: {code(speed['command'])}.", ""]
    lines += table(["mode", "M", "chips", "goodput", "wall s", "events", "events/s"],
                   [[r["mode"], r["learners"], f"{r['chips']:,}", pct(r["goodput"]), f"{r['speed']['wall_seconds']:.1f}",
                     f"{r['speed']['events']:,}", f"{r['speed']['events_per_second']:,.0f}"] for r in speed["rows"]])
    if "paper_point" in section:
        lines += paper_point(section["paper_point"])
    return lines


def paper_point(point: dict) -> list[str]:
    """The seeds' point: every mode on the same chips and links, and how much faster than dp."""
    rows = point["rows"]
    dp = next(r for r in rows if r["mode"] == "dp")
    lines = [f"The seeds' headline point, a 12B model on four regions' links of 2, 5, 2 and 5 Gbit/s with 1 s steps, no "
             f"failures, H = 48, tau = 4: data parallel all-reduces its bf16 gradients each step in a ring across the "
             f"regions over the slowest link, overlapped with the backward pass (planner/allreduce.py). The seeds "
             f"report Decoupled DiLoCo {point['paper_speedup']}x faster than conventional synchronisation: "
             f"{code(point['command'])}", ""]
    lines += table(["mode", "tokens/s", "WAN Gbit/s per link, mean / peak", "goodput", "speed-up over dp"],
                   [[r["mode"], f"{r['tokens_per_second']:.3g}",
                     "/".join(f"{g:.2f}" for g in r["wan_gbps_mean_peak"]) if r["wan_gbps_mean_peak"] else "-",
                     pct(r["goodput"]), f"{r['tokens_per_second'] / dp['tokens_per_second']:.1f}x"] for r in rows])
    return lines


def plan_label(row: dict) -> str:
    """dp, elastic, or diloco M=<learners>: the keys of the paper's figures."""
    return f"diloco M={row['learners']}" if row["mode"] == "diloco" else row["mode"]


def plan_speed_seconds(section: dict) -> float:
    return sum(r["speed"]["wall_seconds"] for r in section["speed"]["rows"])


def plan_speed_verdict(section: dict) -> str:
    """Against the target where the run is the target's size (a quick profile's is not)."""
    run = section["speed"]["rows"][0]
    if run["chips"] < 2.4e6 or run["learners"] < 16 or run["hours"] < 24:
        return "-"
    return f"target: under {PLAN_SPEED_TARGET_SECONDS // 60} minutes, " + verdict(plan_speed_seconds(section) < PLAN_SPEED_TARGET_SECONDS)


CALIBRATION_SHOWN = ("goodput", "blocked", "lost", "restore", "startup", "down", "MB up", "MB down", "outer steps")


def calibration(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"`diloco plan --calibrate-from REPORT` ([docs/planning.md](docs/planning.md#calibrated-against-the-local-cluster)) "
             f"configures the planner as a `diloco sim` run was and sets its prediction beside what the run measured. "
             f"Each run: the demo's cluster ({code(section['config'])}: 4 learners, 2 shards, H = 50, P = 4, tau = 3, "
             f"K = 4, int4, a checkpoint every 10 steps, an evaluation every 50), {section['seconds']:g} s, "
             f"processes SIGKILLed at the given mean interval and restarted {section['restart_delay']:g} s later, one "
             f"seed. From the run the planner takes each learner's measured step time and mean start-up time, what "
             f"one evaluation, one checkpoint copy and one step's bookkeeping take, the links and the kill "
             f"schedule; it predicts the rest (evaluation and checkpoint shares it then matches within a point). Each cell: planned / measured (shares of provisioned learner time; "
             f"bytes in MB). Load: the machine's 1-minute load average at the end of the run (2 cores, shared).", ""]
    body = []
    for run in section["rows"]:
        by_figure = {row["figure"]: row for row in run["rows"]}
        cells = []
        for figure in CALIBRATION_SHOWN:
            row = by_figure[figure]
            if row["unit"] == "share":
                cells.append(f"{row['predicted']:.1%} / {row['measured']:.1%}")
            elif row["unit"] == "MB":
                cells.append(f"{row['predicted']:.1f} / {row['measured']:.1f}")
            else:
                cells.append(f"{row['predicted']:.0f} / {row['measured']:.0f}")
        body.append([run["name"], f"{run['learner_kills']} / {run['shard_kills']}", f"{run['load_1min']:.1f}", *cells,
                     code(run["command"])])
    lines += table(["run", "kills: learners / shards", "load", *CALIBRATION_SHOWN, "sim command"], body)
    lines += ["Largest difference, planned less measured, over the runs: " + ", ".join(
        _calibration_spread(figure, [row for run in section["rows"] for row in run["rows"] if row["figure"] == figure])
        for figure in CALIBRATION_SHOWN) + ".", ""]
    if "dp_rows" in section:
        lines += calibration_dp(section["dp_rows"])
    return lines


def calibration_dp(runs: list[dict]) -> list[str]:
    lines = ["Data parallel over the same links: the demo's 4 learners as one DDP job (`diloco sim --mode dp`), "
             "without kills; each bucket of fp32 gradients waits for a ring across the 4 regions over the "
             "slowest link, as the planner's dp pays for it (learner/trainer/wan_allreduce.py, "
             "planner/allreduce.py). From the run the planner takes a step's compute time and how long "
             "DDP's buckets overlapped the backward pass (as a share of it); it predicts the step with its "
             "all-reduce, the share of the training time blocked on the links, and the steps in that time. "
             "Each cell: planned / measured.", ""]
    body = []
    for run in runs:
        by_figure = {row["figure"]: row for row in run["rows"]}
        step, blocked, steps = by_figure["step seconds"], by_figure["blocked"], by_figure["steps"]
        body.append([run["name"], f"{run['load_1min']:.1f}", f"{run['compute_seconds']:.3f}",
                     f"{run['backward_share']:.2f}", f"{step['predicted']:.3f} / {step['measured']:.3f}",
                     f"{blocked['predicted']:.1%} / {blocked['measured']:.1%}",
                     f"{steps['predicted']:.0f} / {steps['measured']:.0f}", code(run["command"])])
    return lines + table(["run", "load", "compute s per step", "overlap share", "step s", "blocked", "steps",
                          "sim command"], body)


def _calibration_spread(figure: str, rows: list[dict]) -> str:
    """Points for a share (the largest in size, signed), the range of planned / measured otherwise."""
    differences = [row["difference"] for row in rows]
    if rows[0]["unit"] == "share":
        return f"{figure} {max(differences, key=abs) * 100:+.1f} points"
    return f"{figure} x{min(differences):.2f} to x{max(differences):.2f}"


ISLAND_TRAINS_AGAIN_SECONDS = 5.0  # issue 35: "the learner keeps training within a few seconds"
# issue 35: "the other learners see no blocked time", beyond the run without failures (within its noise)
ISLAND_OTHERS_BLOCKED_SECONDS = 0.5


def island(section: dict, out: pathlib.Path) -> list[str]:
    base, chaos = section["without_failures"], section["groups_killed"]
    spared = chaos.get("spared_learners", [])  # older results: every island lost groups
    killed = "every group of the first learner's island, the leading one too," if spared else \
        "every group, the leading ones too,"
    cost = (f" {', '.join(spared)} lost no group: its blocked seconds against the run without failures are what the "
            "kills cost the other learners." if spared else "")
    lines = ["Learner islands of replica groups under torchft (`island.replica_groups`, docs/reliability.md "
             f"\"Losing a replica group\"): {killed} SIGKILLed at exponential intervals and restarted 3 s later, "
             f"against the same run without kills.{cost} Trained again: from a kill to the island's first "
             "step without the group (a leader's kill: to the first step of the group that took the lead, from the "
             "learner's checkpoint); back: from the killed group's restart to its first step in the island. "
             f"{code(section['command'])} runs both.", ""]
    leader = [s for s in chaos["trained_again_after_leader_kill_seconds"] if s is not None]
    lines += table(["run", "kills (leaders')", "trained again s, median / max", "after a leader's kill s, median",
                    "back after restart s, median", "blocked s per learner", "tokens", "goodput (largest badput)",
                    "global loss",
                    "hashes agree", "command"],
                   [[name, f"{run['kills']} ({run['leader_kills']})",
                     "-" if run["trained_again_seconds_median"] is None else
                     f"{run['trained_again_seconds_median']:.2f} / {run['trained_again_seconds_max']:.2f}",
                     f"{statistics.median(leader):.2f}" if leader and run is chaos else "-",
                     "-" if run["rejoined_seconds_median"] is None else f"{run['rejoined_seconds_median']:.1f}",
                     ", ".join(f"{name} {seconds:.2f}" for name, seconds in run["blocked_seconds"].items()),
                     f"{run['tokens'] / 1e6:.3f}M", f"{pct(run['goodput'])} ({_largest_badput(run)})",
                     _loss(run["final_eval_loss"]),
                     "yes" if run["state_hashes_agree"] else "**no**", code(run["command"])]
                    for name, run in (("without failures", base), ("groups killed", chaos))])
    return lines


def _largest_badput(run: dict) -> str:
    """The three largest badput categories of a run, in seconds (older results have none)."""
    badput = sorted(run.get("badput_seconds", {}).items(), key=lambda item: -item[1])[:3]
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in badput) or "-"


def summary(results: dict) -> list[str]:
    return table(["section", "headline (this run)", "target or anchor", "verdict"], summary_rows(results))


def summary_rows(results: dict) -> list[list[str]]:
    """One headline row per section that ran, with its target or anchor and whether it was met."""
    rows = []
    if "quality" in results:
        section = results["quality"]
        q = [r for r in section["rows"] if r["target"] is not None]
        met = sum(r["within_target"] for r in q)
        worst = max(section["rows"], key=lambda r: r["loss_vs_dp"])
        alone = sum(r["better_than_alone"] for r in section["rows"])
        monotone = sum(m["within_spread"] for m in section["monotone"])
        rows.append(["1. quality", f"global model vs data parallel {pct(min(r['loss_vs_dp'] for r in section['rows']), True)} "
                     f"to {pct(worst['loss_vs_dp'], True)} (worst: {config_name(worst)}); better than one learner alone "
                     f"in {alone} of {len(section['rows'])}; monotone in H in {monotone} of {len(section['monotone'])}"
                     + "".join(f"; user loop vs built-in {u['user_minus_built_in']:+.4f} ({verdict(u['within_spread'])})"
                               for u in section.get("user_loop", [])),
                     "within " + ", ".join(f"{pct(t)} (M={m})" for m, t in section["targets"].items())
                     + f" of dp for H <= {section['target_max_H']}",
                     f"{met} of {len(q)} met" if met < len(q) else "met"])
    if "user_quality" in results:
        u = results["user_quality"]["runs"]
        rows.append(["↳ 1. user loop", "; ".join(
            f"{run['steps']} steps: H=" + ", ".join(f"{r['H']} {pct(r['vs_dp'], True)}" for r in run["rows"]
                                                   if r["max_block_seconds"] is None)
            + f" vs tuned dp, global vs learners' own {pct(max(r['vs_learners'] for r in run['rows']), True)} at worst"
            for run in u), "global <= learners' own; every H within " + ", ".join(
                f"{pct(run['dp_target'])} at {run['steps']} steps" for run in u) + " of dp; monotone in H (issue 52)",
                     verdict(all(all(run["met"].values()) for run in u))])
    if "bandwidth" in results:
        b = results["bandwidth"]
        best = max(b["rows"], key=lambda r: r["dp_over_diloco"])
        rows.append(["2. bandwidth", f"dp / diloco bytes per token {min(r['dp_over_diloco'] for r in b['rows']):.0f}x "
                     f"to {best['dp_over_diloco']:.0f}x (best: {config_name(best)}; 12B at a 1 s step: "
                     f"{best['diloco']['at_1s_step']['12B']['average_gbps']:.1f} vs "
                     f"{best['dp']['at_1s_step']['12B']['average_gbps']:.0f} Gbit/s)",
                     f"{b['anchor_dp_over_diloco']}x (Streaming DiLoCo)",
                     verdict(best["dp_over_diloco"] >= b["anchor_dp_over_diloco"])])
    if "goodput" in results:
        g = results["goodput"]
        high = g["rows"][-1]
        rows.append(["3. goodput", f"at {pct(high['target_down_share'])} down: diloco {pct(high['diloco']['goodput'])} "
                     f"vs dp {pct(high['dp']['goodput'])}",
                     f"{pct(g['anchor']['diloco'])} vs {pct(g['anchor']['dp'])} (paper)",
                     verdict(high["diloco"]["goodput"] >= g["anchor"]["diloco"])])
    if "overlap" in results:
        links = results["overlap"]["links"]
        rows.append(["4. overlap", ", ".join(f"{pct(l['utilisation'])} at {l['wan_mbps']:g} Mb/s" if l["wan_mbps"]
                                             else f"{pct(l['utilisation'])} on loopback" for l in links),
                     f">= {pct(UTILISATION_TARGET)} on a link above the need "
                     f"({results['overlap']['needed_mbps']:.0f} Mb/s)",
                     verdict(all(l["utilisation"] >= UTILISATION_TARGET for l in links
                                 if not l["wan_mbps"] or l["wan_mbps"] >= results["overlap"]["needed_mbps"]))])
    if "transport" in results:
        t = results["transport"]
        one = t["runs"][0]
        summary = (f"push {one['push_vs_raw']:.2f}x raw gRPC ({one['push_vs_bound']:.2f}x what the disk allows), "
                   f"pull {one['pull_vs_raw']:.2f}x; a round "
                   f"{one['params_per_second'] / t['in_process_params_per_second']:.2f}x in-process arithmetic"
                   + (f"; {t['runs'][-1]['shards']} shards {t['runs'][-1]['params_per_second'] / one['params_per_second']:.2f}x one"
                      if len(t["runs"]) > 1 else ""))
        if "shared_pulls" in one:
            summary += (f"; {one['shared_pulls']['learners']} learners pulling one (anchor, value) pair: "
                        f"{one['shared_pulls']['encodes']} encode")
        if "scale" in t:
            biggest = max(t["scale"]["runs"], key=lambda r: r["params"])
            summary += (f"; one shard of {biggest['params'] / 1e6:.0f}M parameters: {biggest['round_seconds']:.1f} s a "
                        f"round, {biggest['rss_bytes_per_param']:.1f} B/param at rest, durable writes "
                        f"{biggest['durable_bytes_per_round_per_fragment'] / biggest['received_bytes_per_round_per_fragment']:.1f}x "
                        f"what a round received")
            default = next((r for r in t["scale"].get("anchors", []) if is_default_anchors(r)), None)
            if default:
                summary += (f"; {default['learners']} learners on anchors of their own: "
                            f"{default['rss_bytes_per_param']:.1f} B/param at rest, "
                            f"{default['disk_bytes_per_param']:.1f} B/param of anchors on disk, their pulls "
                            + ", ".join(f"{k} {v}" for k, v in sorted(default["answers"].items())))
        rows.append(["5. transport", summary,
                     f"push >= {t['target_push_vs_raw']}x raw, pull >= {t['target_pull_vs_raw']}x, round >= "
                     f"{t['target_round_vs_in_process']}x in-process", verdict(transport_targets_met(t, one))])
    if "recovery" in results:
        sizes = results["recovery"]["sizes"]
        rows.append(["6. recovery", f"learner back to training in {sizes[0]['learner_back_to_training_seconds']:.1f} s "
                     f"({sizes[0]['model_parameters'] / 1e6:.1f}M) to {sizes[-1]['learner_back_to_training_seconds']:.1f} s "
                     f"({sizes[-1]['model_parameters'] / 1e6:.1f}M); shard serving again in "
                     f"{sizes[0]['shard_serving_again_seconds']:.1f} to {sizes[-1]['shard_serving_again_seconds']:.1f} s",
                     "torchft's documented pain: 948 s", "-"])
    if "user_loop" in results:
        u = results["user_loop"]
        met = sum(s["ratio"] <= u["target_ratio"] for s in u["sizes"])
        rows.append(["7. user loop", "; ".join(
            f"{s['model_parameters'] / 1e6:.2f}M: sync on / off {s['ratio']:.3f} (pairs {pair_range(s)}), idle "
            f"`sync.step()` {s['idle_step_call_seconds']['p50'] * 1e6:.0f} us ({s['idle_step_call_share']:.2%} "
            f"of a step; all calls {s['step_calls_share']:.1%})" for s in u["sizes"]),
                     f"<= {u['target_ratio']} (issue 17)", ("met" if met == len(u["sizes"]) else
                     f"**{met} of {len(u['sizes'])} met**") + (" (in the median; some pairs above)" if any(
                         max(s["pair_ratios"]) > u["target_ratio"] for s in u["sizes"]) else "")])
        if "gpu_shaped" in u:
            shaped = u["gpu_shaped"]["sizes"]
            kept = {s["size"]: s for s in u.get("gpu_shaped_kept", {}).get("sizes", [])}
            rows.append(["↳ 7. GPU-shaped step", "; ".join(
                f"{s['model_parameters'] / 1e6:.0f}M: sync on / off {s['ratio']:.2f}, blocked "
                f"{s['blocked_seconds_per_step'] * 1e3:.0f} ms/step"
                + (f" ({kept[s['size']]['ratio']:.2f} and {kept[s['size']]['blocked_seconds_per_step'] * 1e3:.0f} "
                   "keeping freed memory)" if s["size"] in kept else "") for s in shaped),
                         ", ".join(f"{s['size']} <= {s['target_ratio']}" for s in shaped) + " (issue 51)",
                         verdict(all(s["ratio"] <= s["target_ratio"] for s in shaped))])
    if "gpu_user_loop" in results:
        last = results["gpu_user_loop"][-1]
        rows.append([f"↳ 7b. on a GPU ({last['device']}, {last['commit']})", "; ".join(
            f"{s['model_parameters'] / 1e6:.0f}M tau={s['tau']}: sync on / off {s['ratio']:.2f}, blocked "
            f"{s['blocked_seconds_per_step'] * 1e3:.1f} ms/step" for s in last["sizes"]),
                     f"<= {last['sizes'][0]['target_ratio']}, 0 ms blocked (issue 51)",
                     verdict(all(s["ratio"] <= s["target_ratio"] and s["blocked_seconds_per_step"] == 0
                                 for s in last["sizes"]))])
    if "hf" in results:
        h = results["hf"]
        rows.append(["8. HF Llama", f"sync on / off {h['ratio']:.3f} (pairs {pair_range(h)}), "
                     f"{h['sync_on_step_seconds'] * 1e3:.1f} vs {h['sync_off_step_seconds'] * 1e3:.1f} ms/step",
                     f"<= {h['target_ratio']}", verdict(h["ratio"] <= h["target_ratio"])])
    if "plan" in results:
        p = results["plan"]
        example = p["models"][0]["rows"]
        chips = min({r["chips"] for r in example}, key=lambda c: abs(c - 1.2e6))  # the paper's scale, or the nearest
        slices = max(r["learners"] for r in example)
        shown = sorted((r for r in example if r["chips"] == chips and (r["mode"] == "diloco" or r["learners"] == slices)),
                       key=lambda r: (r["mode"] == "diloco", r["mode"] == "elastic", r["learners"]))
        run = p["speed"]["rows"][0]
        rows.append(["9. plan", f"at {chips:,} chips, example failures: "
                     + ", ".join(f"{plan_label(r)} {pct(r['goodput'])}" for r in shown)
                     + f"; {run['hours']:g} hours of {run['chips']:,} chips (M={run['learners']}) in every mode "
                     f"simulated in {plan_speed_seconds(p):.0f} s",
                     "paper at 1.2M chips: " + ", ".join(f"{k} {pct(v)}" for k, v in p["paper"].items())
                     + f"; a day of 2.4M chips in under {PLAN_SPEED_TARGET_SECONDS // 60} minutes",
                     plan_speed_verdict(p)])
    if "suggest" in results:
        g = results["suggest"]
        best = g["suggestions"][0]
        rows.append(["↳ 9b. suggested settings", "at the seeds' point: " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in best["sync"].items())
                     + f": goodput {pct(best['goodput'])}, {pct(best['staleness_zero_share'])} of merges at staleness 0",
                     f">= {pct(g['targets']['goodput'])} goodput, >= {pct(g['targets']['staleness_zero_share'])} of merges "
                     "at staleness 0 (issue 53)", verdict(g["met"])])
    if "calibration" in results:
        c = results["calibration"]
        goodput = [next(row for row in run["rows"] if row["figure"] == "goodput") for run in c["rows"]]
        dp = [(run["name"], next(row for row in run["rows"] if row["figure"] == "step seconds"))
              for run in c.get("dp_rows", [])]
        rows.append(["10. calibration", "planned / measured goodput: " + ", ".join(
            f"{run['name']} {g['predicted']:.1%} / {g['measured']:.1%}" for run, g in zip(c["rows"], goodput))
            + ("; data parallel's step over capped links, planned / measured: " + ", ".join(
                f"{name} {step['predicted']:.2f} / {step['measured']:.2f} s" for name, step in dp) if dp else ""),
                     "the planner predicts what diloco sim measures", "-"])
    if "island" in results:
        chaos = results["island"]["groups_killed"]
        base = results["island"]["without_failures"]
        again = chaos["trained_again_seconds_median"]
        spared = chaos.get("spared_learners", [])
        extra = max((chaos["blocked_seconds"][name] - base["blocked_seconds"][name] for name in spared), default=0.0)
        rows.append(["11. islands", f"{chaos['kills']} groups killed ({chaos['leader_kills']} leading): trained again "
                     f"after {again:.2f} s (median), {chaos['takeovers']} takeovers of a lead, no learner restart: "
                     f"{chaos['learner_restarts'] == 0}; hashes agree: {chaos['state_hashes_agree']}"
                     + "".join(f"; {name}, which lost no group, blocked {chaos['blocked_seconds'][name]:.2f} s "
                               f"({base['blocked_seconds'][name]:.2f} s without failures)" for name in spared),
                     f"trains on within {ISLAND_TRAINS_AGAIN_SECONDS:g} s of a kill; the other learners block no more "
                     f"than without failures (+{ISLAND_OTHERS_BLOCKED_SECONDS:g} s); hashes agree (issue 35)",
                     verdict(again <= ISLAND_TRAINS_AGAIN_SECONDS and extra <= ISLAND_OTHERS_BLOCKED_SECONDS
                             and chaos["state_hashes_agree"])])
    if "sick_learner" in results:
        s = results["sick_learner"]
        rows.append(["12. sick learner", f"one of 4 learners poisoned (x1000, NaN, bit flips): global model at most "
                     f"{pct(s['worst_vs_clean'], signed=True)} against the run without poison (clean runs' spread "
                     f"{pct(s['clean_spread'])}); {_healthy_goodput_lost(s)}; healed after at most "
                     f"{max(r['steps_to_heal'] or 0 for r in s['runs'] if r['poison'] in POISONS)} steps",
                     f"within {pct(s['loss_target'])}; healthy goodput within 2 points (median over seeds); healed "
                     "within one sync period, "
                     f"H = {s['interval_steps']} steps (issue 55)", verdict(s["met"])])
    if "kernel_links" in results:
        k = results["kernel_links"]
        medians = ((f" (median {100 * k['median_goodput_difference']:+.1f})", f" (median {100 * k['median_blocked_difference']:+.1f})")
                   if "median_blocked_difference" in k else ("", ""))
        rows.append(["13. kernel links", "goodput, kernel-shaped less paced: " + ", ".join(
            f"{100 * d:+.1f}" for d in k["goodput_kernel_minus_paced"]) + f" points{medians[0]}; blocked share " + ", ".join(
            f"{100 * d:+.1f}" for d in k["blocked_kernel_minus_paced"]) + f" points{medians[1]}",
                     f"within {100 * k['goodput_points']:.0f} points (median over seeds), or the difference explained "
                     "(issue 56)",
                     verdict(k["met"])])
    if "own_link" in results:
        o = results["own_link"]
        rows.append(["14. own link", "global loss median (seeds " + ", ".join(map(str, o["seeds"])) + "): "
                     + "; ".join(f"{kind} {loss:.4f} ({pct(o['median_blocked_share'][kind])} blocked)"
                                 for kind, loss in o["median_loss"].items()),
                     f"{o['target_kind']}: within the uniform runs' spread in "
                     f"quality and <= {pct(o['blocked_target'])} blocked (issue 53)", verdict(o["met"])])
    if "split_downlink" in results:
        s = results["split_downlink"]
        by_setting: dict[str, list[dict]] = {}
        for run in s["runs"]:
            by_setting.setdefault(anchors_setting(run), []).append(run)
        rows.append(["15. split rounds' downlink", "downlink / uplink median, by the shards' anchors: " + "; ".join(
            f"{setting} {statistics.median(r['ratio'] for r in runs):.2f} "
            f"({statistics.median(r['ratio_without_end'] for r in runs):.2f} without the exact final values)"
            for setting, runs in by_setting.items()), f"<= {s['target']} at the default (issue 53)", verdict(s["met"])])
    return rows


POISONS = ("scale", "nan", "bitflip")


def user_quality(section: dict, out: pathlib.Path) -> list[str]:
    first = section["runs"][0]
    lines = [f"A user's own loop ({code('bench/plain_loop.py')}: torch AdamW, lr {first['lr']:g} constant after 50 "
             "warm-up steps, clip 1, weight decay 0.1, `DecoupledDiLoCo` around it) training a transformers "
             "`LlamaForCausalLM` (2 layers, width 128, bytes as tokens) on a text other than section 1's: the "
             f"pinned transformers package's own sources ({code(first['config'])}: {first['learners']} learners, "
             "batch 8 x 128 each, P = 4, tau = 3, int4, K = M, outer lr 0.7 with Nesterov momentum `auto`, "
             "RDA; a learner's last contributions averaged plainly, docs/protocol.md). Global: the model the "
             "run produced (`diloco export`), final validation loss; learners' own: their models just before "
             "they left. Data parallel: the same model, data, tokens and optimizer as one torch.distributed "
             "job (gradients averaged every step, one AdamW), its lr tuned over the multipliers shown; the "
             "best is the baseline. Rows with several seeds show the median and the range. "
             "Targets (issue 52): the global model at most the learners' own; within "
             + ", ".join(f"{pct(r['dp_target'])} at {r['steps']} steps" for r in section["runs"])
             + " of the best data parallel; at least 5 % better than one learner alone.", ""]
    for run in section["runs"]:
        dp = run["dp"]
        lines += [f"**{run['steps']} steps per learner** ({code(run['command'])}): data parallel by lr "
                  + ", ".join(f"x{float(m):g}: {loss:.4f}" for m, loss in run["dp_by_lr"].items())
                  + f"; baseline x{run['dp_best_multiplier']:g}, seeds {', '.join(map(str, dp['seeds']))}: "
                  f"{_median_range([r['final_eval_loss'] for r in run['runs'] if r['kind'] == 'dp' and r['lr_multiplier'] == run['dp_best_multiplier']])} "
                  f"({code(dp['command'])}); one learner alone {run['alone']['loss']:.4f} ({code(run['alone']['command'])}).", ""]
        lines += table(["H", "waits for late results", "seeds", "global", "learners' own", "global vs own",
                        "vs data parallel", "target", "vs one learner alone", "command (seed 1)"],
                       [[str(r["H"]), "no (`max_block_seconds=0`)" if r["max_block_seconds"] == 0 else "up to 2 s",
                         ", ".join(map(str, r["seeds"])), f"{r['loss']:.4f}" + (f" ({r['low']:.4f} to {r['high']:.4f})"
                                                                               if len(r["seeds"]) > 1 else ""),
                         _loss(r["learners"]), pct(r["vs_learners"], True) if r["vs_learners"] is not None else "-",
                         pct(r["vs_dp"], True), f"<= {pct(run['dp_target'])}: {verdict(r['vs_dp'] <= run['dp_target'])}",
                         pct(r["vs_alone"], True), code(r["command"])] for r in run["rows"]])
        headline = next(r for r in run["rows"] if r["max_block_seconds"] is None and len(r["seeds"]) == max(
            len(x["seeds"]) for x in run["rows"]))
        if headline["curve"]:
            lines += ["", f"The global model against the learners' own over the run (H = {headline['H']}, seed "
                      f"{headline['seeds'][0]}: at each evaluation, the mean over the learners of their own model and "
                      "of the global model they held):", ""]
            curve = headline["curve"]
            every = max(1, len(curve) // 10)  # about ten rows, the last one always
            lines += table(["step", "learners' own", "global held", "global vs own"],
                           [[str(int(step)), f"{own:.4f}", f"{held:.4f}", pct(held / own - 1, True)]
                            for i, (step, own, held) in enumerate(curve) if i % every == 0 or i == len(curve) - 1])
        if run.get("ablations"):
            default = next(r for r in run["runs"] if r["kind"] == "diloco" and r["H"] == headline["H"]
                           and r["max_block_seconds"] is None and r["seed"] == headline["seeds"][0])
            lines += ["", f"One setting changed at a time (H = {headline['H']}, seed {default['seed']}, `--ablations`):", ""]
            lines += table(["setting", "global", "learners' own", "vs data parallel", "command"],
                           [["default", f"{default['final_eval_loss']:.4f}", _loss(default["final_eval_loss_learners"]),
                             pct(default["final_eval_loss"] / run["dp"]["loss"] - 1, True), code(default["command"])]]
                           + [[a["setting"], f"{a['loss']:.4f}", _loss(a["learners"]), pct(a["vs_dp"], True),
                               code(a["command"])] for a in run["ablations"]])
        if len({r["H"] for r in run["rows"]}) > 1:
            lines += ["", f"Monotone in H within the seed spread ({run['spread']:.4f}): {verdict(run['monotone'])}"
                      + (f"; not waiting against waiting: {run['no_wait_vs_wait']:+.4f} "
                         f"({verdict(run['met']['no_wait'])})" if run["no_wait_vs_wait"] is not None else "") + "."]
        lines += [""]
    return lines


def _healthy_goodput_lost(section: dict) -> str:
    """What the healthy learners' goodput lost to the poison, as the verdict reads it."""
    worst = f"{100 * section['worst_healthy_goodput_lost']:.1f}"
    if "median_healthy_goodput_lost" not in section:  # a run from before the median
        return f"the healthy learners' goodput at most {worst} points lower"
    medians = ", ".join(f"{kind} {100 * lost:+.1f}" for kind, lost in section["median_healthy_goodput_lost"].items())
    return (f"the healthy learners' goodput lower by (points, median over seeds) {medians}; single runs at most "
            f"{worst}, clean runs' spread {100 * section['clean_healthy_goodput_spread']:.1f}")


def sick_learner(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"The demo's cluster (4 learners, H = {section['interval_steps']}, P = {section['fragments']}, int4), "
             f"{section['steps']} steps per learner; {section['sick']} poisoned after step {section['poisoned_at']} "
             "(a quarter of its run): its weights x1000 (`scale`), one value NaN (`nan`), or the top exponent bit of "
             "16 values flipped (`bitflip`). Shards refuse a push above `syncer.outlier_norm_factor` (10) times "
             "the norm of the fragment's global value; a learner with NaN in its model, or whose pushes are refused "
             "twice in a row, takes the global model back (docs/reliability.md, \"A diverged learner\"). "
             "`scale, rule off` is the same poison with the outlier rule off. Global loss: the run's global model "
             "at the end; against the run without poison of the same seed. Healed: steps from the poison to the "
             f"learner's heal. {code(section['command'])} runs them all.", ""]
    lines += table(["seed", "poison", "global loss", "vs no poison", "sick learner: refused as outliers / heals / "
                    "healed after steps", "healthy learners: blocked s (vs no poison)", "healthy learners: goodput "
                    "(vs no poison)", "run's goodput", "command"],
                   [[str(r["seed"]), r["poison"], _loss(r["final_eval_loss"]),
                     "-" if r["poison"] == "none" else pct(r["vs_clean"], signed=True),
                     "-" if r["poison"] == "none" else
                     f"{r['outliers_refused']} / {r['heals']} / {r['steps_to_heal'] if r['steps_to_heal'] is not None else '-'}",
                     f"{r['healthy_blocked_seconds']:.1f} ({r['blocked_vs_clean_seconds']:+.1f})",
                     f"{pct(r['healthy_goodput'])} ({100 * r['healthy_goodput_vs_clean']:+.1f})" if "healthy_goodput" in r
                     else "-", pct(r["goodput"]),
                     code(r["command"])] for r in section["runs"]])
    return lines


def kernel_links(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"The demo's cluster (4 learners, 2 shards, H = 50, P = 4, int4), {section['steps']} steps per learner, "
             f"on mixed links each way per region ({section['links']} Mbit/s), once paced by the learners "
             "themselves (localcluster/wan.py) and once shaped by the kernel: each learner in a network namespace "
             "on a bridge the shards listen on, a tbf qdisc each way on its veth (`--kernel-links`, "
             "localcluster/kernel_links.py); this machine's kernel has no netem, so no latency either way. "
             "Achieved: each learner's sync bytes over their time on the wire (waits for a round's result "
             "included), the slowest learner's. Kernel bytes: what the qdiscs let through, up / down, summed over "
             f"the learners (TLS, HTTP/2 and heartbeats included). {code(section['command'])} runs them all.", ""]
    body = []
    for r in section["runs"]:
        links = r["learner_links"].values()
        kernel = (f"{sum(l['kernel_bytes_up'] for l in links) / 1e6:.1f} / {sum(l['kernel_bytes_down'] for l in links) / 1e6:.1f}"
                  if r["shaping"] == "kernel" else "-")
        body.append([str(r["seed"]), r["shaping"],
                     pct(r["goodput"]), pct(r["blocked_share"]), f"{r['blocked_seconds']:.1f}", _loss(r["final_eval_loss"]),
                     f"{min(l['bytes_per_second'] for l in links) * 8 / 1e6:.2f}", kernel,
                     str(r["state_hashes_agree"]).lower(), code(r["command"])])
    return lines + table(["seed", "links", "goodput", "blocked share", "learners blocked s", "global loss",
                          "slowest learner's achieved Mbit/s", "kernel MB up / down", "hashes agree", "command"], body)


def own_link(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"The demo's cluster (4 learners, 2 shards, H = 50, P = 4, tau = 3, K = 4, int4), {section['steps']} steps "
             "per learner: on uncapped links (uniform fast), and on mixed links each way per region "
             f"({section['links']} Mbit/s, paced by the learners) once with every learner waiting for its results "
             "(mixed, waits) and once with `sync.wait_for_own_link: false` (mixed, own link late: a learner whose own "
             "push and pull outlast tau steps trains on and merges its results late, the progress made meanwhile "
             "kept; in effect its own tau); and with every wait for a result capped at one of the learner's steps "
             "(`sync.max_block_steps: 1`, wait <= 1 step; the default waits up to 2 s). Global loss: the run's global "
             "model at the end. Blocked share: of the "
             f"learners' provisioned time. {code(section['command'])} runs them all.", ""]
    body = [[str(r["seed"]), r["kind"], _loss(r["final_eval_loss"]), pct(r["goodput"]), pct(r["blocked_share"]),
             ", ".join(f"{lid} {l['blocked_seconds']:.1f}" for lid, l in sorted(r["learners"].items())), code(r["command"])]
            for r in section["runs"]]
    return lines + table(["seed", "links", "global loss", "goodput", "blocked share", "blocked s per learner", "command"],
                         body)


def suggest(section: dict, out: pathlib.Path) -> list[str]:
    links = ", ".join(f"{region} {link['up_mbps'] / 1e3:g}/{link['down_mbps'] / 1e3:g} Gbit/s {link['latency_ms']:g} ms"
                      for region, link in section["links"].items())
    lines = [f"The settings `diloco plan --suggest` proposes for a {section['model_parameters'] / 1e9:g}B model, "
             f"{section['step_seconds']:g} s steps and M = {section['learners']} learners on the seeds' links ({links}): "
             "every learner's round trip for one fragment (push up its link, result down it, a round trip of latency "
             "each way) within tau steps with a quarter to spare, each candidate planned failure-free and ranked by "
             "goodput, then merges at staleness 0 ([docs/planning.md](docs/planning.md)). "
             f"{code(section['command'])}.", ""]
    body = [[str(s["sync"]["interval_steps"]), str(s["sync"]["fragments"]), str(s["sync"]["overlap_steps"]),
             s["sync"]["codec"], f"{s['sync']['max_block_steps']:g}", f"{s['round_trip_seconds']:.2f}", pct(s["goodput"]),
             pct(s["staleness_zero_share"]),
             "/".join(f"{v:.2f}" for v in s["wan_gbps_mean_peak"]) if s["wan_gbps_mean_peak"] else "-"]
            for s in section["suggestions"]]
    return lines + table(["H", "P", "tau", "codec", "max_block_steps", "slowest round trip s", "goodput",
                          "merges at staleness 0", "WAN Gbit/s mean/peak"], body)


def split_downlink(section: dict, out: pathlib.Path) -> list[str]:
    lines = [f"The demo's cluster (4 learners, 2 shards, P = 4, int4) with H = 25, quorum 2 and learner 2 slowed, so "
             f"rounds close without it: {section['steps']} steps per learner, with the shards' default anchors (no "
             "value in memory beyond the lineage's, the others in the state folder: `syncer.kept_anchors: 0`, "
             "`syncer.spill_anchors: true`) and, without the folder, one value kept per fragment (the default before "
             "it) or one per learner: 4 B per owned parameter each. Bytes on the "
             "learners' links; without the exact final values: less the snapshots each learner takes once at the end "
             "to hold the shards' exact bits (at most one fp32 model per learner, whatever the run's length). Pulls: "
             f"what the shards answered with (docs/monitoring.md, `diloco_syncer_pulls_total`); from a dropped value: "
             "those that came from an anchor whose value the shard had dropped, and so got the updates since or a "
             "snapshot instead of one delta (`diloco_syncer_anchor_values_missed_total`); on disk: the anchors' values "
             "the shards wrote to their state folders and read back (`diloco_syncer_anchor_spill_bytes_total`). "
             f"{code(section['command'])} runs them all.", ""]
    body = [[str(r["seed"]), anchors_setting(r), f"{r['bytes_up'] / 1e6:.1f}", f"{r['bytes_down'] / 1e6:.1f}",
             f"{r['end_bytes'] / 1e6:.1f}", f"{r['ratio']:.2f}", f"{r['ratio_without_end']:.2f}",
             ", ".join(f"{answer} {n}" for answer, n in r["pulls"].items() if n), str(r.get("anchor_values_missed", "-")),
             spill_cell(r.get("anchor_spill")), _loss(r["final_eval_loss"]), code(r["command"])]
            for r in section["runs"]]
    return lines + table(["seed", "anchors", "MB up", "MB down", "of which exact final values", "down / up",
                          "without the final values", "pulls", "from a dropped value",
                          "on disk: values written / read (MB written)", "global loss", "command"], body)


def spill_cell(spill: dict | None) -> str:
    if not spill or not spill["values_written"]:
        return "-"
    return f"{spill['values_written']} / {spill['values_read']} ({spill['bytes_written'] / 1e6:.1f})"


TITLES = {"quality": "1. Quality at equal tokens",
          "user_quality": "1b. The run's product in a user's loop (transformers Llama, another text)", "bandwidth": "2. Bandwidth", "goodput": "3. Goodput under failures",
          "overlap": "4. Overlap", "transport": "5. Transport and syncer", "recovery": "6. Recovery",
          "user_loop": "7. The API in a user's loop",
          "gpu_user_loop": "7b. The API in a user's loop on a GPU (recorded by hand)", "hf": "8. Hugging Face Llama on the API (CPU)",
          "plan": "9. Planning at datacenter scale (`diloco plan`)",
          "suggest": "9b. An operating point from the links (`diloco plan --suggest`)",
          "calibration": "10. The planner against the local cluster (`diloco plan --calibrate-from`)",
          "island": "11. Elastic islands: losing replica groups (local)",
          "sick_learner": "12. A diverged learner (`diloco sim --chaos-poison`)",
          "kernel_links": "13. Kernel-shaped links against paced ones (`diloco sim --kernel-links`)",
          "own_link": "14. Mixed links against uniform fast links",
          "split_downlink": "15. Split rounds' downlink"}
RENDERERS = {"quality": quality, "user_quality": user_quality, "bandwidth": bandwidth, "goodput": goodput, "overlap": overlap,
             "transport": transport, "recovery": recovery, "user_loop": user_loop, "gpu_user_loop": gpu_user_loop, "hf": hf, "plan": plan,
             "suggest": suggest, "calibration": calibration, "island": island, "sick_learner": sick_learner,
             "kernel_links": kernel_links, "own_link": own_link, "split_downlink": split_downlink}


def later_run(run: dict) -> str:
    """A sentence on sections measured by a later `--merge` run than the rest."""
    m = run["machine"]
    names = ", ".join(f'"{TITLES[name]}"' for name in run["sections"])
    return (f"From a later run that replaced only its own sections, `{run['runner']['command']}` ({run['profile']} "
            f"profile, {run['runner']['wall_seconds'] / 60:.1f} minutes on {m['date']}: {m['cpu']}, {m['cores']} "
            f"cores, torch {m['torch']}, commit {m['commit']}): {names}.")


def render(results: dict, out: pathlib.Path) -> None:
    m, runner = results["machine"], results["runner"]
    lines = ["# Benchmarks", "",
             f"Generated by `{runner['command']}` ({results['profile']} profile) in "
             f"{runner['wall_seconds'] / 60:.1f} minutes on {m['date']}: {m['cpu']}, {m['cores']} cores, "
             f"{m['ram_gib']} GiB RAM, torch {m['torch']}, Python {m['python']}, commit {m['commit']}. "
             "Every figure below comes from that run unless said next (also in "
             "[bench/results.json](bench/results.json)); each row names "
             "the command that produced it (the runner only adds where output goes: `--quiet --run-dir --report`, "
             "`--json`). Regenerate with `make benchmarks`, or one section with `python bench/run_all.py --sections "
             "NAME --merge`. The models are small so that the whole run fits in about two hours "
             "on 2 cores: the method, not the scale, is compared. Other processes may share the machine.", ""]
    lines += [later_run(run) + "\n" for run in results.get("later_runs", [])]
    lines += ["## Summary", "", *summary(results)]
    for name in RENDERERS:
        if name in results:
            lines += [f"## {TITLES[name]}", "", *RENDERERS[name](results[name], out)]
    lines += ["## History and notes", "",
              f"Earlier sessions' measurements, what changed between them and why, with the machine and commit "
              f"each was measured on: [bench/history.md](bench/history.md) ({len(HISTORY.read_text().splitlines())} "
              "lines, written by hand).", ""]
    (out / "BENCHMARKS.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="bench/results.json")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    render(json.loads(pathlib.Path(args.results).read_text()), pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
