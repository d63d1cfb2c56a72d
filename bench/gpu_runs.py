"""Adds a GPU run of the user-loop benchmark to bench/results.json (`gpu_user_loop`), from which
BENCHMARKS.md's section 7 renders it. CI machines have no GPU, so bench/run_all.py cannot make
these figures: a session lent a GPU runs the benchmark there and records what it printed.

    python bench/user_loop.py --device cuda --sizes 25M 85M 350M --tau 8 --json ul.json   # on the GPU
    python bench/gpu_runs.py --device "NVIDIA H200" --cpu-cores 16 --torch 2.11.0+cu130 --commit 9f018fc \
        --command "python bench/user_loop.py --device cuda --sizes 25M 85M 350M --tau 8" ul.json
    python bench/report.py

Also takes `make gpu-check ARGS="--json F"`'s file (its user-loop check). Runs are kept in the
order added; --replace drops the earlier ones first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results.json"


def user_loop_figures(path: pathlib.Path) -> dict:
    """bench/user_loop.py's JSON, also inside a gpu-check file."""
    data = json.loads(path.read_text())
    for check in data.get("checks", []):
        if check["name"] == "user loop":
            return check["figures"]
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=pathlib.Path, help="a bench/user_loop.py --json or gpu-check --json file")
    parser.add_argument("--command", required=True, help="the command that wrote it")
    parser.add_argument("--device", required=True, help="the GPU, as nvidia-smi names it")
    parser.add_argument("--cpu-cores", type=int, required=True, help="the GPU machine's cores (the shards ran there too)")
    parser.add_argument("--torch", required=True, help="torch.__version__ there")
    parser.add_argument("--commit", required=True, help="the commit whose code ran")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--replace", action="store_true", help="drop the GPU runs recorded before")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text())
    runs = [] if args.replace else results.get("gpu_user_loop", [])
    runs.append({"device": args.device, "cpu_cores": args.cpu_cores, "torch": args.torch, "commit": args.commit,
                 "date": args.date, "command": args.command, "sizes": user_loop_figures(args.file)["sizes"]})
    results["gpu_user_loop"] = runs
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"{RESULTS}: {len(runs)} GPU run(s) of the user loop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
