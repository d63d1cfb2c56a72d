"""`diloco plan`: goodput of a whole run at datacenter scale, simulated in virtual time.

Every key of planner/inputs.py is a flag (dashes for underscores) and a key of the YAML file
given with --config; a flag overrides the file. `links` (each region's link, as a cluster
config writes them) is one YAML mapping: --links '{us-east: {up_mbps: 2000, down_mbps: 5000}}'. `chips`, `learners` and `chips_per_learner`
take comma-separated lists (in YAML, lists): every combination is simulated in every mode,
and --plot draws goodput against chips, one line per mode and M.

    diloco plan --chips 1024,16384,131072 --learners 8,16 --plot goodput.png

--calibrate-from REPORT plans the run a `diloco sim` report describes (planner/calibrate.py) and
prints the prediction beside what the run measured.

    diloco plan --calibrate-from .diloco/sim/report.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import pathlib
import sys
import time

import yaml
from pydantic import TypeAdapter

from diloco.planner.calibrate import CalibrationError, calibrate
from diloco.planner.calibrate import table as calibration_table
from diloco.planner.inputs import FLAT_KEYS, WAN_KEYS, PlanError, PlanInputs, load_file, load_inputs
from diloco.planner.outcome import PlanResult
from diloco.planner.report import Speed, plot, speed_table, table, time_to_train, write_json
from diloco.planner.simulate import MODES, simulate
from diloco.planner.suggest import suggest
from diloco.planner.suggest import table as suggestion_table

SWEPT = ("chips", "learners", "chips_per_learner", "slices_per_learner")  # keys that take a list of values to sweep
# Keys whose flags (--fail, --links, --interval-steps ...) are not a list of values, or that
# only a file gives.
OWN_SYNTAX = ("failures", "links", "shard_outages", "sync", "syncer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Every input is described in docs/planning.md and planner/inputs.py; `null` unsets one "
                     "(--chip-mtbf-hours null: no random failures).")
    parser.add_argument("--config", help="YAML file of plan inputs (keys as the flags, with underscores)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--fail", action="append", default=[], metavar="LEARNER[/SLICE]@SECONDS",
                        help="inject a failure of this learner unit (or one slice of it) at this virtual time "
                             "(repeatable)")
    for field in dataclasses.fields(PlanInputs):
        if field.name in OWN_SYNTAX:
            continue
        listed = field.name in SWEPT or isinstance(field.default, tuple)
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            metavar="V1,V2,..." if listed else "VALUE",
                            help=f"default {_shown(field.default)}" + (" (a list)" if listed else ""))
    defaults = PlanInputs()
    for key, path in FLAT_KEYS.items():
        default = functools.reduce(getattr, path, defaults)
        parser.add_argument("--" + key.replace("_", "-"), dest=key, metavar="VALUE",
                            help=f"{'.'.join(path)} of the cluster config, default {default}")
    parser.add_argument("--links", metavar="YAML",
                        help="each region's link, as the cluster config's links: '{us-east: {up_mbps: 2000, "
                             "down_mbps: 5000, latency_ms: 30}, us-west: {...}}' (instead of --wan-gbps)")
    parser.add_argument("--calibrate-from", metavar="REPORT",
                        help="plan the run of this `diloco sim` report (its cluster, measured step and start-up "
                             "times, links, kills) and print the prediction beside what it measured; with --json")
    parser.add_argument("--suggest", action="store_true",
                        help="propose H, P, tau and codec for the plan's model, step time and links: every "
                             "learner's round trip within tau steps, ranked by the goodput planned (planner/suggest.py); "
                             "with --json, every candidate with its settings and figures")
    parser.add_argument("--json", metavar="PATH", help="write every result as JSON here ('-': stdout)")
    parser.add_argument("--plot", metavar="PNG", help="plot goodput against chips, one line per mode and M")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _shown(default: object) -> str:
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def plan_points(args: argparse.Namespace) -> list[PlanInputs]:
    """The inputs of every point of the sweep, from the file and the flags."""
    data = load_file(args.config) if args.config else {}
    # A flag's links replace the file's, whichever way either gives them.
    if args.links is not None:
        for key in WAN_KEYS:
            data.pop(key, None)
        data["links"] = yaml.safe_load(args.links)
    elif any(getattr(args, key) is not None for key in WAN_KEYS):
        data.pop("links", None)
    for field in dataclasses.fields(PlanInputs):
        text = getattr(args, field.name, None)
        if text is not None and field.name not in OWN_SYNTAX:
            values = [_scalar(v) for v in text.split(",")]
            listed = field.name in SWEPT or isinstance(field.default, tuple)
            data[field.name] = values if listed else values[0] if len(values) == 1 else text
    for key in FLAT_KEYS:
        if getattr(args, key) is not None:
            data[key] = _scalar(getattr(args, key))
    if args.fail:
        data["failures"] = [_failure(text) for text in args.fail]
    swept = {key: value if isinstance(value, list) else [value] for key, value in data.items()
             if key in SWEPT}
    points = []
    for combination in itertools.product(*swept.values()):
        point = {**data, **dict(zip(swept, combination))}
        where = ", ".join(f"{key}={value}" for key, value in zip(swept, combination))
        points.append(load_inputs(point, source=f"plan inputs ({where})" if where else "plan inputs"))
    return points


def _scalar(text: str) -> object:
    """A flag's value: a number where it reads as one (12e9 is an integer), else YAML."""
    try:
        number = float(text)
    except ValueError:
        return yaml.safe_load(text)
    return int(number) if number.is_integer() and "." not in text else number


def _failure(text: str) -> dict:
    unit, sep, seconds = text.partition("@")
    learner, slash, slice_ = unit.partition("/")
    try:
        return {"learner": int(learner), "at_seconds": float(seconds), **({"slice": int(slice_)} if slash else {})}
    except ValueError:
        raise PlanError(f"--fail {text!r}: expected LEARNER@SECONDS or LEARNER/SLICE@SECONDS, e.g. 3@3600") from None


class Progress:
    """A progress bar over virtual seconds (tqdm, as `diloco sim` uses), updated sparingly; it
    counts the events that report to it (every one of them does)."""

    def __init__(self, inputs: PlanInputs, mode: str, quiet: bool):
        from tqdm import tqdm
        total = inputs.duration_seconds if inputs.duration_seconds != float("inf") else None
        self.bar = None if quiet else tqdm(total=total, unit="s", unit_scale=True, file=sys.stderr,
                                           desc=f"{mode} M={inputs.num_learners} chips={inputs.chips:,}",
                                           dynamic_ncols=True, leave=False)
        self.step = (total or 3600.0) / 200
        self.events = 0

    def __call__(self, seconds: float) -> None:
        self.events += 1
        if self.bar is not None and seconds - self.bar.n >= self.step:
            self.bar.update(seconds - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    if args.calibrate_from:
        return run_calibration(pathlib.Path(args.calibrate_from), args.json)
    modes = args.modes.split(",")
    try:
        if unknown := [m for m in modes if m not in MODES]:
            raise PlanError(f"--modes: unknown mode {unknown[0]!r} (valid: {', '.join(MODES)})")
        points = plan_points(args)
    except (PlanError, OSError, yaml.YAMLError) as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    if args.suggest:
        return run_suggestions(points, args.json)
    results: list[PlanResult] = []
    speeds: list[Speed] = []
    for inputs, mode in itertools.product(points, modes):
        progress = Progress(inputs, mode, args.quiet)
        started = time.perf_counter()
        results.append(simulate(inputs, mode, progress))
        speeds.append(Speed(time.perf_counter() - started, progress.events))
        progress.close()
    print(table(results))
    print()
    print(time_to_train(results))
    print()
    print(speed_table(results, speeds))
    if args.json == "-":
        write_json(results, speeds, pathlib.Path("/dev/stdout"))
    elif args.json:
        write_json(results, speeds, pathlib.Path(args.json))
        print(f"json: {args.json}")
    if args.plot:
        plot(results, pathlib.Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def run_suggestions(points: list[PlanInputs], json_path: str | None) -> int:
    written = []
    for inputs in points:
        found = suggest(inputs)
        links = {inputs.region(i): inputs.link(i) for i in range(inputs.num_learners)}
        print(f"{inputs.model_parameters:.3g} parameters, {max(inputs.step_seconds):g} s steps, M={inputs.num_learners}, "
              f"links (Mbit/s up/down, ms): " + ", ".join(
                  f"{region} {link.up_mbps:g}/{link.down_mbps:g} {link.latency_ms:g}" for region, link in links.items()))
        written.append({"model_parameters": inputs.model_parameters, "step_seconds": max(inputs.step_seconds),
                        "learners": inputs.num_learners,
                        "links": {region: link.model_dump() for region, link in links.items()},
                        "suggestions": [s.as_json() for s in found]})
        if not found:
            print("no H, P, tau and codec fit these links: a fragment's round trip outlasts every H tried")
            continue
        print(suggestion_table(found, max(inputs.step_seconds)))
        print("suggested: sync: {" + ", ".join(f"{key}: {value:g}" if isinstance(value, float) else f"{key}: {value}"
                                               for key, value in found[0].settings().items()) + "}\n")
    if json_path:
        pathlib.Path("/dev/stdout" if json_path == "-" else json_path).write_text(json.dumps(written, indent=1))
    return 0


def run_calibration(report_path: pathlib.Path, json_path: str | None) -> int:
    try:
        inputs, result, rows = calibrate(report_path)
    except (CalibrationError, PlanError, OSError, ValueError) as error:
        print(f"invalid: --calibrate-from {report_path}: {error}", file=sys.stderr)
        return 2
    print(f"the run of {report_path} planned: {inputs.num_learners} learners, {len(inputs.failures)} learner kills, "
          f"{len(inputs.shard_outages)} shard kills, {inputs.duration_seconds:.0f} s")
    print(calibration_table(rows))
    if json_path:
        body = json.dumps({"inputs": TypeAdapter(PlanInputs).dump_python(inputs, mode="json"), "result": result.as_json(),
                           "rows": [row.as_json() for row in rows]}, indent=1)
        pathlib.Path("/dev/stdout" if json_path == "-" else json_path).write_text(body)
    return 0
