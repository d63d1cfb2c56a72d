"""One syncer shard at model scale: seconds per round, memory per owned parameter and durable
bytes per round, for this checkout's shard and for an earlier commit's, in the same command.

    python bench/syncer_scale.py                      # 500M parameters now; 64M now and before
    python bench/syncer_scale.py --params 64000000 --compare-params 0   # a quick run, no comparison

A real `diloco syncer` process owns every fragment (P = 4); M = 4 synthetic pushers stream
int4 outer gradients of every fragment each round (precomputed random payloads, no model), and
a round closes when the last of them arrives (every live learner contributed). The shard keeps
its state on disk as it would in a run (--state-dir, default a temporary folder).

Figures, from the shard process itself:
- seconds per round: from the first push to the last fragment's new version (median);
- RSS bytes per owned parameter: VmRSS at rest (the shard idle for a moment after a round, as
  between a run's rounds) less VmRSS before the first join (the interpreter, torch, gRPC), over
  the parameters; and the peak (VmHWM) the same way;
- durable bytes per round per fragment: bytes the process wrote (/proc/<pid>/io wchar: files,
  and the small push replies) over the rounds, per round and fragment, against the encoded bytes
  a fragment receives per round. Enough rounds run to include the periodic full snapshot.
`--compare` (default: 58fd120, the last commit before the write-ahead log) runs the same
measurement with that commit's shard code, at --compare-params (its round close doubled the
fragment's memory, so 500M would not fit).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from bench.syncer_push import BLOCK, INT4, in_parallel, wait_serving  # noqa: E402
from diloco.localcluster.cluster import free_ports  # noqa: E402
from diloco.services.client import ShardClient  # noqa: E402
from diloco.services.config import load_config  # noqa: E402
from diloco.services.wire import pb  # noqa: E402
from diloco.syncer.service import IDLE_RELEASE_SECONDS  # noqa: E402

PACKAGES = ("services", "learner", "syncer", "localcluster", "integrations", "planner")
FRAGMENTS, PUSHERS = 4, 4
SNAPSHOT_BYTES_PER_PARAM = 16


def shard_code(commit: str | None, work: Path) -> Path:
    """A folder whose `diloco` package is this checkout's code, or `commit`'s (from git), laid
    out as pyproject.toml's package-dir maps it."""
    source = ROOT
    if commit:
        source = work / f"src-{commit}"
        source.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = work / f"code-{commit or 'head'}" / "diloco"
    package.mkdir(parents=True)
    shutil.copy(source / "diloco" / "__init__.py", package / "__init__.py")
    for name in PACKAGES:
        if (source / name).exists():
            (package / name).symlink_to(source / name)
    return package.parent


def proc(pid: int, name: str, field: str) -> int:
    """A number from /proc/<pid>/<name> ("status": kB, returned in bytes)."""
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            number, *unit = value.split()
            return int(number) * (1024 if unit == ["kB"] else 1)
    raise KeyError(field)


def measure(params: int, rounds: int, code: Path, state_dir: Path, label: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    learners = [f"pusher-{i}" for i in range(PUSHERS)]
    (port,) = free_ports(1)
    config_path = work / "cluster.yaml"
    config_path.write_text(yaml.safe_dump({
        "run": {"state_dir": str(state_dir)},
        "shards": [{"address": f"127.0.0.1:{port}", "metrics_port": 0}],
        "learners": [{"id": learner, "region": "bench"} for learner in learners],
        "sync": {"fragments": FRAGMENTS, "interval_steps": FRAGMENTS, "overlap_steps": 1, "codec": "int4",
                 "codec_block_size": BLOCK},
        "syncer": {"quorum": PUSHERS, "grace": {"mode": "fixed", "seconds": 3600.0}, "lease_seconds": 3600.0,
                   "max_update_norm": 1.0e9},
        "rpc": {"deadline_seconds": 3600.0},
        "tls": {"mode": "plaintext"},
    }))
    cfg = load_config(config_path)
    address = cfg.shards[0].address
    env = dict(os.environ, PYTHONPATH=str(code))
    process = subprocess.Popen([sys.executable, "-m", "diloco.services.cli", "--log-level", "WARNING", "syncer",
                                "--config", str(config_path), "--shard-index", "0", "--listen", address],
                               cwd=work, env=env)
    clients = []
    try:
        wait_serving(address, process)
        baseline_rss = proc(process.pid, "status", "VmRSS")
        manifest = [(f"layers.{i}.weight", (params // 8,)) for i in range(8)]
        clients = [ShardClient(address, cfg.rpc, learner, 1, identity=None) for learner in learners]
        fragments = [(f.fragment_id, f.numel) for f in clients[0].join("bench", manifest).fragments]
        for client in clients[1:]:
            client.join("bench", manifest)
        for fragment, n in fragments:
            clients[0].push(fragment, torch.zeros(n), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        payloads = [{fragment: INT4.encode(torch.randn(n, generator=torch.Generator().manual_seed(100 * i + fragment))
                                           * 1e-3, BLOCK) for fragment, n in fragments} for i in range(PUSHERS)]
        received_per_fragment = sum(len(p[fragments[0][0]]) for p in payloads)

        def push_all(i: int, base_version: int) -> None:
            for fragment, n in fragments:
                reply = clients[i].push(fragment, payloads[i][fragment], numel=n, codec=INT4, block_size=BLOCK,
                                        base_version=base_version, c_steps=24, c_tokens=24 * 1024, step_seconds=1.0)
                if reply.result != pb.PUSH_RESULT_ACCEPTED:
                    raise RuntimeError(f"push not accepted: {reply}")

        print(f"  seeded: shard RSS {(proc(process.pid, 'status', 'VmRSS') - baseline_rss) / params:.1f} B per "
              f"parameter, peak so far {(proc(process.pid, 'status', 'VmHWM') - baseline_rss) / params:.1f}")
        written_before = proc(process.pid, "io", "wchar")
        seconds = []
        print(f"{label}: {params / 1e6:.0f}M parameters in {len(fragments)} fragments, M={PUSHERS}, int4: "
              f"{received_per_fragment / 1e6:.1f} MB received per fragment per round", flush=True)
        for version in range(rounds):
            seconds.append(in_parallel([lambda i=i: push_all(i, version) for i in range(PUSHERS)]))
            status = clients[0].status()
            assert all(f.version == version + 1 for f in status.fragments), status.fragments
            time.sleep(IDLE_RELEASE_SECONDS + 0.5)  # at rest: in a run, a fragment's rounds are H steps apart
            print(f"  round {version + 1}: {seconds[-1]:.2f} s, shard RSS at rest "
                  f"{(proc(process.pid, 'status', 'VmRSS') - baseline_rss) / params:.1f} B per parameter, "
                  f"peak so far {(proc(process.pid, 'status', 'VmHWM') - baseline_rss) / params:.1f}", flush=True)
        written = proc(process.pid, "io", "wchar") - written_before
        rss, peak = proc(process.pid, "status", "VmRSS"), proc(process.pid, "status", "VmHWM")
        return {"label": label, "params": params, "rounds": rounds, "round_seconds": statistics.median(seconds),
                "received_bytes_per_round_per_fragment": received_per_fragment,
                "durable_bytes_per_round_per_fragment": written / rounds / len(fragments),
                "rss_bytes_per_param": (rss - baseline_rss) / params, "peak_rss_bytes_per_param": (peak - baseline_rss) / params,
                "peak_rss_gib": peak / 2**30, "snapshots": status.counters.get("snapshots")}  # None: one every round
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.wait(timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def report(run: dict) -> None:
    received, durable = run["received_bytes_per_round_per_fragment"], run["durable_bytes_per_round_per_fragment"]
    print(f"{run['label']}, {run['params'] / 1e6:.0f}M parameters, {run['rounds']} rounds:")
    print(f"  seconds per round            {run['round_seconds']:8.2f}")
    print(f"  RSS per owned parameter      {run['rss_bytes_per_param']:8.1f} B at rest, "
          f"{run['peak_rss_bytes_per_param']:.1f} B at the peak ({run['peak_rss_gib']:.1f} GiB in all)")
    print(f"  durable bytes per round and fragment {durable / 1e6:8.1f} MB = {durable / received:.2f} x the "
          f"{received / 1e6:.1f} MB it received "
          f"({'a full snapshot every round' if run['snapshots'] is None else str(run['snapshots']) + ' full snapshots'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=500_000_000)
    parser.add_argument("--rounds", type=int, default=9, help="enough that the log reaches a full snapshot")
    parser.add_argument("--compare", default="58fd120", help="an earlier commit whose shard to measure too")
    parser.add_argument("--compare-params", type=int, default=64_000_000, help="0: no comparison")
    parser.add_argument("--state-dir", help="where the shard keeps its state (default: a temporary folder)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-code-"))
    state_root = Path(args.state_dir) if args.state_dir else work / "state"
    try:
        head = shard_code(None, work)
        runs = []
        if args.compare_params:
            before = shard_code(args.compare, work)
            runs.append(measure(args.compare_params, args.rounds, before, state_root / "before", f"before ({args.compare})"))
            runs.append(measure(args.compare_params, args.rounds, head, state_root / "now-small", "now"))
        runs.append(measure(args.params, args.rounds, head, state_root / "now", "now"))
        for run in runs:
            report(run)
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        print(f"this machine: {os.cpu_count()} cores, {memory / 2**30:.0f} GiB")
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
