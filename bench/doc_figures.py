"""The benchmark figures the README and docs quote, written from bench/results.json between
markers, so that a figure in the docs is the one BENCHMARKS.md has, never a copy that drifts:

    <!-- bench:NAME -->...<!-- /bench -->

`python bench/doc_figures.py` rewrites every marked span (bench/run_all.py does after a run);
tests/test_docs_figures.py fails when one is not what the results say.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.report import capacity, summary_rows  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKED = re.compile(r"(<!-- bench:([a-z_]+) -->)(.*?)(<!-- /bench -->)", re.S)


def quality_vs_dp(results: dict) -> str:
    """The built-in GPT at M = 4, H <= 50, int4 against data parallel, and its bytes per token."""
    quality, bandwidth = results["quality"], results["bandwidth"]
    limit = quality["target_max_H"]

    def chosen(row: dict) -> bool:
        return (row["model"] == "gpt" and row["learners"] == 4 and row["H"] <= limit and row["codec"] == "int4"
                and not row.get("learner_script") and row.get("slow_learner", 1.0) == 1.0)

    losses = sorted(row["loss_vs_dp"] for row in quality["rows"] if chosen(row))
    ratios = sorted(row["dp_over_diloco"] for row in bandwidth["rows"] if chosen(row))
    H = sorted({row["H"] for row in quality["rows"] if chosen(row)})
    if losses[-1] < 0:
        against = f"{-losses[-1]:.1%} to {-losses[0]:.1%} better than data parallel"
    else:
        against = f"{losses[0]:+.1%} to {losses[-1]:+.1%} against data parallel"
    return (f"On the built-in GPT at {quality['steps']} steps per learner, M = 4, H = {H[0]} to {H[-1]}, the "
            f"global model ends {against} with {ratios[0]:.0f}x to {ratios[-1]:.0f}x fewer bytes per token.")


def quality_by_setting(results: dict) -> str:
    """Every quality run of the built-in models against data parallel, its own loop's, one
    learner alone and the bytes per token, as docs/demo.md tells them."""
    quality, bandwidth = results["quality"], results["bandwidth"]
    runs = [row for row in quality["rows"] if not row["learner_script"] and row["slow_learner"] == 1.0]
    groups: dict[tuple[str, int, str], list[str]] = {}
    for row in runs:
        seeds = f" ({len(row['seeds'])} seeds)" if len(row["seeds"]) > 1 else ""
        groups.setdefault((row["model"], row["learners"], row["codec"]), []).append(
            f"H = {row['H']} {row['loss_vs_dp']:+.1%}{seeds}")
    settings = "; ".join(f"{'Llama-style' if model == 'llama' else 'GPT'} M = {m}, {codec}: {', '.join(cells)}"
                         for (model, m, codec), cells in groups.items())
    own = quality["user_loop"][0]
    alone = min(-row["loss_vs_alone"] for row in runs)
    int4 = sorted((row["dp_over_diloco"], row["H"]) for row in bandwidth["rows"]
                  if row["model"] == "gpt" and row["learners"] == 4 and row["codec"] == "int4")
    return (f"at {quality['steps']} inner steps per learner, the global model against data parallel "
            f"(negative: better) is {settings}. A user's own loop around the API (`{own['script']}`) ends "
            f"{own['user_minus_built_in']:+.4f} from the built-in learner. Every run beats one learner alone on "
            f"its share of the tokens by {alone:.1%} or more; int4 at M = 4 moves {int4[0][0]:.0f}x "
            f"(H = {int4[0][1]}) to {int4[-1][0]:.0f}x (H = {int4[-1][1]}) fewer bytes per token than data "
            "parallel's all-reduce.")


def user_loop_quality(results: dict) -> str:
    """The user loop's headline rows (BENCHMARKS.md section 1b) against tuned data parallel."""
    parts = []
    for run in results["user_quality"]["runs"]:
        waiting = [r for r in run["rows"] if r["max_block_seconds"] is None]
        headline = max(waiting, key=lambda r: len(r["seeds"]))
        seeds = f", {len(headline['seeds'])} seeds" if len(headline["seeds"]) > 1 else ""
        parts.append(f"{headline['vs_dp']:+.1%} at {run['steps']} steps (H = {headline['H']}{seeds})")
    worst = max(r["vs_learners"] for run in results["user_quality"]["runs"] for r in run["rows"])
    return (f"In a user's own loop (a transformers Llama with torch AdamW, on another text, M = 4) the global "
            f"model ends {' and '.join(parts)} against the best-tuned data parallel, and at worst "
            f"{worst:+.1%} against the learners' own models.")


def sick_learner(results: dict) -> str:
    section = results["sick_learner"]
    return (f"the global model ends at most {section['worst_vs_clean']:.1%} worse than a run without it "
            f"(target {section['loss_target']:.0%})")


def paper_point(results: dict) -> str:
    """The seeds' point planned: each mode's rate, WAN use, time to train the same tokens, speed-up."""
    rows = results["plan"]["paper_point"]["rows"]
    tokens = max(row["tokens"] for row in rows)
    dp = next(row for row in rows if row["mode"] == "dp")
    lines = [f"| mode | tokens/s | WAN Gbit/s per link, mean / peak | hours to train {tokens:.3g} tokens | "
             "speed-up over dp |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        mean, peak = row["wan_gbps_mean_peak"] or (0.0, 0.0)
        lines.append(f"| {row['mode']} | {row['tokens_per_second']:.3g} | {mean:.2f} / {peak:.2f} | "
                     f"{tokens / row['tokens_per_second'] / 3600:.3g} | "
                     f"{row['tokens_per_second'] / dp['tokens_per_second']:.1f}x |")
    return "\n" + "\n".join(lines) + "\n"


def dp_calibration(results: dict) -> str:
    runs = {run["name"]: {row["figure"]: row for row in run["rows"]} for run in results["calibration"]["dp_rows"]}
    capped, mixed = runs["dp-20"], runs["dp-mixed-links"]
    diloco = next(run for run in results["calibration"]["rows"] if run["name"] == "mixed-links")
    goodput = next(row for row in diloco["rows"] if row["figure"] == "goodput")
    return (f"the step at 20 Mbit/s is {capped['step seconds']['predicted']:.2f} s planned against "
            f"{capped['step seconds']['measured']:.2f} s measured, {capped['blocked']['measured']:.0%} of it "
            f"blocked; with the mixed links of the table (us-south 2 Mbit/s up) "
            f"{mixed['step seconds']['predicted']:.1f} s against {mixed['step seconds']['measured']:.1f} s, "
            f"{mixed['blocked']['measured']:.0%} blocked, where a diloco run of the same links keeps "
            f"{goodput['measured']:.0%} goodput under kills")


def syncer_capacity(results: dict) -> str:
    """BENCHMARKS.md section 5's capacity table, for docs/helm.md's sizing."""
    return "\n" + "\n".join(capacity(results["transport"]["scale"])) + "\n"


def missed_targets(results: dict) -> str:
    """The sections whose target the last run missed, each with its target (BENCHMARKS.md's summary)."""
    missed = [f"{section.removeprefix('↳ ')} ({target})" for section, _, target, verdict in summary_rows(results)
              if "missed" in verdict]
    return "Targets missed in the last run: " + ("; ".join(missed) if missed else "none") + "."


FIGURES: dict[str, Callable[[dict], str]] = {
    "quality_vs_dp": quality_vs_dp, "quality_by_setting": quality_by_setting, "sick_learner": sick_learner, "paper_point": paper_point,
    "dp_calibration": dp_calibration, "missed_targets": missed_targets, "syncer_capacity": syncer_capacity,
    "user_loop_quality": user_loop_quality}


def marked(text: str) -> list[tuple[str, str]]:
    """(name, what the page holds) of every marked span of a page."""
    return [(match[2], match[3]) for match in MARKED.finditer(text)]


def rewritten(text: str, results: dict) -> str:
    """The page with every marked span as the results say (KeyError for an unknown name)."""
    return MARKED.sub(lambda match: match[1] + FIGURES[match[2]](results) + match[4], text)


def rewrite(results: dict, pages: list[pathlib.Path] = PAGES) -> list[pathlib.Path]:
    """Rewrites the pages whose figures changed; returns them."""
    changed = []
    for page in pages:
        text = page.read_text()
        new = rewritten(text, results)
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main() -> int:
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    changed = rewrite(results)
    print("rewrote " + (", ".join(str(p.relative_to(ROOT)) for p in changed) if changed else "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
