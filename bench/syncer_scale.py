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
- RSS bytes per owned parameter: VmRSS at rest (the shard idle after its last round until it
  has given its freed memory back, as its memory_releases counter says; between rounds it
  keeps it) less VmRSS before the first
  join (the interpreter, torch, gRPC), over the parameters; and the peak (VmHWM) the same way;
- durable bytes per round per fragment: bytes the process wrote (/proc/<pid>/io wchar: files,
  and the small push replies) over the rounds, per round and fragment, against the encoded bytes
  a fragment receives per round. Enough rounds run to include the periodic full snapshot.
`--compare` (default: 58fd120, the last commit before the write-ahead log) runs the same
measurement with that commit's shard code, at --compare-params (its round close doubled the
fragment's memory, so 500M would not fit).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from bench.syncer_push import BLOCK, INT4, in_parallel, wait_serving  # noqa: E402
from diloco.localcluster.processes import free_ports  # noqa: E402
from diloco.services.client import ShardClient  # noqa: E402
from diloco.services.contract.codecs import get_codec  # noqa: E402
from diloco.services.contract.config import load_config, parse_config  # noqa: E402
from diloco.services.contract.payload import describe, iter_chunks  # noqa: E402
from diloco.syncer.core import ShardCore  # noqa: E402
from diloco.syncer.snapshot import SNAPSHOT_BYTES_PER_PARAM  # noqa: E402
from diloco.services.contract.wire import pb  # noqa: E402
from diloco.syncer.memory import IdleRelease  # noqa: E402

PACKAGES = ("services", "learner", "syncer", "localcluster", "integrations", "planner")
FRAGMENTS, PUSHERS = 4, 4
FP32 = get_codec("fp32")
BETWEEN_ROUNDS_SECONDS = 1.5  # in a run, a fragment's rounds are H steps apart
# Idle long enough for a shard without memory_releases (an earlier commit's) to rest after such pauses
REST_SECONDS = IdleRelease().factor * (BETWEEN_ROUNDS_SECONDS + 0.5) + 0.5


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


@contextlib.contextmanager
def running_shard(code: Path, state_dir: Path, learners: list[str], fragments: int, quorum: int, **syncer):
    """A `diloco syncer` process of `code` owning every fragment, int4, plaintext, with rounds
    that close only when `quorum` learners pushed, serving: yields its address, config, process
    and a list for the caller's clients; closes them and stops the process on the way out."""
    work = Path(tempfile.mkdtemp(prefix="bench-shard-"))
    (port,) = free_ports(1)
    config_path = work / "cluster.yaml"
    config_path.write_text(yaml.safe_dump({
        "run": {"state_dir": str(state_dir)},
        "shards": [{"address": f"127.0.0.1:{port}", "metrics_port": 0}],
        "learners": [{"id": learner, "region": "bench"} for learner in learners],
        "sync": {"fragments": fragments, "interval_steps": max(2, fragments), "overlap_steps": 1, "codec": "int4",
                 "codec_block_size": BLOCK},
        "syncer": {"quorum": quorum, "grace": {"mode": "fixed", "seconds": 3600.0}, "lease_seconds": 3600.0,
                   "max_update_norm": 1.0e9, **syncer},
        "rpc": {"deadline_seconds": 3600.0},
        "tls": {"mode": "plaintext"},
    }))
    cfg = load_config(config_path)
    address = cfg.shards[0].address
    process = subprocess.Popen([sys.executable, "-m", "diloco", "--log-level", "WARNING", "syncer",
                                "--config", str(config_path), "--shard-index", "0", "--listen", address],
                               cwd=work, env=dict(os.environ, PYTHONPATH=str(code)))
    clients: list[ShardClient] = []
    try:
        wait_serving(address, process)
        yield address, cfg, process, clients
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.wait(timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def at_rest(client: ShardClient, releases: float | None) -> None:
    """Returns once the idle shard has given its freed memory back since its memory_releases
    counter said `releases` (syncer/memory.py: after a pause twice the longest it saw between
    rounds, at most IdleRelease's max_seconds); None: a shard that does not count them rests
    REST_SECONDS."""
    if releases is None:
        time.sleep(REST_SECONDS)
        return
    deadline = time.monotonic() + IdleRelease().max_seconds + 10
    while client.status().counters.get("memory_releases", 0) <= releases:
        if time.monotonic() > deadline:
            raise SystemExit("the shard did not give its freed memory back while idle")
        time.sleep(0.5)


def measure(params: int, rounds: int, code: Path, state_dir: Path, label: str, counts_releases: bool = True) -> dict:
    learners = [f"pusher-{i}" for i in range(PUSHERS)]
    with running_shard(code, state_dir, learners, FRAGMENTS, PUSHERS) as (address, cfg, process, clients):
        baseline_rss = proc(process.pid, "status", "VmRSS")
        manifest = [(f"layers.{i}.weight", (params // 8,)) for i in range(8)]
        clients += [ShardClient(address, cfg.rpc, learner, 1, identity=None) for learner in learners]
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
            time.sleep(BETWEEN_ROUNDS_SECONDS)
            print(f"  round {version + 1}: {seconds[-1]:.2f} s, shard RSS between rounds "
                  f"{(proc(process.pid, 'status', 'VmRSS') - baseline_rss) / params:.1f} B per parameter, "
                  f"peak so far {(proc(process.pid, 'status', 'VmHWM') - baseline_rss) / params:.1f}", flush=True)
        written = proc(process.pid, "io", "wchar") - written_before
        at_rest(clients[0], status.counters.get("memory_releases", 0) if counts_releases else None)
        rss, peak = proc(process.pid, "status", "VmRSS"), proc(process.pid, "status", "VmHWM")
        return {"label": label, "params": params, "rounds": rounds, "round_seconds": statistics.median(seconds),
                "received_bytes_per_round_per_fragment": received_per_fragment,
                "durable_bytes_per_round_per_fragment": written / rounds / len(fragments),
                "rss_bytes_per_param": (rss - baseline_rss) / params, "peak_rss_bytes_per_param": (peak - baseline_rss) / params,
                "peak_rss_gib": peak / 2**30, "snapshots": status.counters.get("snapshots")}  # None: one every round


ANCHOR_PULLERS = 16


def measure_anchors(params: int, kept: int, spill: bool, code: Path, state_dir: Path) -> dict:
    """Shard memory with 16 learner identities each anchored on a value of its own: one fragment
    of `params` values, one pusher closing rounds; puller i takes a snapshot at version i, then,
    once every puller has one, all pull from their anchors (without syncer.kept_anchors bounding
    the values in memory, each would then hold an off-lineage value of its own; with
    syncer.spill_anchors the others are on the state disk). RSS and the anchors' files at rest
    per parameter, the pulls' answers, the bytes they took and the bytes written to disk."""
    pullers = [f"puller-{i}" for i in range(ANCHOR_PULLERS)]
    with running_shard(code, state_dir, ["pusher", *pullers], 1, 1, kept_anchors=kept,
                       spill_anchors=spill) as (address, cfg, process, clients):
        baseline_rss = proc(process.pid, "status", "VmRSS")
        manifest = [("w", (params,))]
        pusher = ShardClient(address, cfg.rpc, "pusher", 1, identity=None)
        clients += [pusher] + [ShardClient(address, cfg.rpc, learner, 1, identity=None) for learner in pullers]
        pusher.join("bench", manifest)
        pusher.push(0, torch.zeros(params), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        payload = INT4.encode(torch.randn(params, generator=torch.Generator().manual_seed(1)) * 1e-3, BLOCK)
        anchors = []
        for version, client in enumerate(clients[1:]):
            pulled = client.pull(0)  # a snapshot: on the lineage at `version`
            anchors.append((version, pulled.state_hash))
            del pulled
            reply = pusher.push(0, payload, numel=params, codec=INT4, block_size=BLOCK, base_version=version,
                                c_steps=2, c_tokens=2048, step_seconds=1.0)
            if reply.result != pb.PUSH_RESULT_ACCEPTED:
                raise RuntimeError(f"push not accepted: {reply}")
        before = pusher.status().counters
        started = time.perf_counter()
        pulled_bytes = [client.pull(0, version, anchor_hash=anchor_hash).payload_bytes
                        for client, (version, anchor_hash) in zip(clients[1:], anchors)]
        seconds = time.perf_counter() - started
        after = pusher.status().counters
        at_rest(pusher, after.get("memory_releases", 0))
        rss = proc(process.pid, "status", "VmRSS")
        answers = {key.removeprefix("pulls."): after[key] - before.get(key, 0) for key in after
                   if key.startswith("pulls.") and after[key] != before.get(key, 0)}
        on_disk = sum(path.stat().st_size for path in state_dir.glob("shard-0/anchors/*/*"))
        return {"params": params, "kept_anchors": kept, "spill_anchors": spill, "learners": ANCHOR_PULLERS,
                "rss_bytes_per_param": (rss - baseline_rss) / params, "answers": answers,
                "disk_bytes_per_param": on_disk / params, "spill_bytes_written": after.get("anchor_spill_bytes", 0),
                "pulled_bytes_per_learner": statistics.median(pulled_bytes), "pull_seconds": seconds,
                "int4_bytes": len(payload)}


def report_anchors(run: dict) -> None:
    print(f"anchors: {run['learners']} learners on anchors of their own, one fragment of {run['params'] / 1e6:.0f}M "
          f"values, syncer.kept_anchors={run['kept_anchors']}, spill_anchors={run['spill_anchors']}: shard RSS at "
          f"rest {run['rss_bytes_per_param']:.1f} B per parameter, anchors on disk {run['disk_bytes_per_param']:.1f} "
          f"({run['spill_bytes_written'] / 1e9:.1f} GB written); their pulls {run['answers']}, "
          f"{run['pulled_bytes_per_learner'] / 1e6:.1f} MB each (median; one int4 update "
          f"{run['int4_bytes'] / 1e6:.1f} MB), {run['pull_seconds']:.1f} s in all", flush=True)


def close_seconds_per_param(contributions: int, numel: int = 16_000_000) -> float:
    """Seconds per fragment parameter of one round close with this many contributions, timed in
    this process around the shard's own FragmentState.close (merge, outer step, int4 encode with
    error feedback, apply, state hash)."""
    learners = [f"l{i}" for i in range(contributions)] + ["observer"]  # the observer keeps the round open
    cfg = parse_config({"shards": [{"address": "127.0.0.1:1"}], "learners": [{"id": l, "region": "r"} for l in learners],
                        "sync": {"fragments": 1, "interval_steps": 2, "overlap_steps": 1, "codec": "int4",
                                 "codec_block_size": BLOCK},
                        "syncer": {"quorum": contributions, "grace": {"mode": "fixed", "seconds": 3600.0},
                                   "max_update_norm": 1.0e9, "lease_seconds": 3600.0}})
    core = ShardCore(cfg, 0)
    for learner in learners:
        core.join(learner, 1, "r", [("w", (numel,))])
    core.push(*push_parts("l0", torch.zeros(numel), FP32, pb.PUSH_KIND_SEED))
    for i in range(contributions):
        core.push(*push_parts(f"l{i}", torch.randn(numel) * 1e-3, INT4, pb.PUSH_KIND_OUTER_GRADIENT))
    state = core.fragments[0]
    closed = state.round.closing("all", frozenset(learners), frozenset(learners), time.monotonic(), time.time())
    started = time.perf_counter()
    state.close(closed)
    return (time.perf_counter() - started) / numel


def push_parts(learner: str, values: torch.Tensor, codec, kind: int):
    """A push's header and chunks, as the core takes them."""
    payload = codec.encode(values, BLOCK)
    header = pb.PushHeader(learner_id=learner, incarnation=1, fragment_id=0, kind=kind, c_steps=24,
                           c_tokens=24 * 1024, step_seconds=1.0, payload=describe(codec, values.numel(), payload, BLOCK))
    return header, iter_chunks(payload)


def disk_write_bytes_per_second(folder: Path, nbytes: int = 1 << 30) -> float:
    """Writing and fsyncing a file of nbytes in the state's folder, as a snapshot is written."""
    folder.mkdir(parents=True, exist_ok=True)
    data = os.urandom(1 << 24) * (nbytes >> 24)
    path = folder / "disk-bandwidth"
    started = time.perf_counter()
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return nbytes / seconds


@dataclass(frozen=True)
class Measured:
    """This machine's figures the capacity table scales from."""
    cores: int
    close_seconds_per_param: float  # one round close with PLAN["learners"] contributions, per fragment parameter
    rest_bytes_per_param: float  # RSS at rest, per owned parameter
    close_bytes_per_param: float  # the peak less the rest, per parameter of the closing fragment
    durable_vs_received: float  # durable bytes per round over the encoded bytes the round received
    disk_bytes_per_second: float


# The run the table is for: the paper's settings, int4 with 128-value blocks, shard machines of
# 16 cores and 128 GiB.
PLAN = {"fragments": 24, "learners": 8, "interval_steps": 100, "overlap_steps": 2, "step_seconds": 1.0,
        "kept_anchors": 0}
SHARD_CORES, SHARD_MEMORY = 16, 128 * 2**30
INT4_BYTES_PER_PARAM = INT4.encoded_size(BLOCK * 1024, BLOCK) / (BLOCK * 1024)


def capacity(measured: Measured, params: float) -> dict:
    """What a syncer needs for a model of `params` parameters under PLAN, scaled linearly from
    this machine's measurements (cores for the arithmetic, disk bandwidth for snapshots). A
    fragment whose close does not fit one shard's memory needs more fragments than PLAN's."""
    fragments = PLAN["fragments"]
    while True:
        fragment = params / fragments
        # the anchors' values in memory: kept_anchors, and the lineage's one version back while a learner holds it
        per_shard = lambda shards: ((measured.rest_bytes_per_param + 4 * (PLAN["kept_anchors"] + 1)) * params / shards
                                    + (measured.close_bytes_per_param + PLAN["learners"] * INT4_BYTES_PER_PARAM) * fragment)
        shards = next((s for s in range(1, fragments + 1) if per_shard(s) <= 0.8 * SHARD_MEMORY), None)
        if shards:
            break
        fragments *= 2
    period = PLAN["interval_steps"] * PLAN["step_seconds"]
    close_here = fragment * measured.close_seconds_per_param
    received = PLAN["learners"] * INT4_BYTES_PER_PARAM * fragment  # per round of one fragment
    return {"params": params, "fragments": fragments, "fragment_params": fragment, "close_seconds_here": close_here,
            "cores_for_window": measured.cores * close_here / (PLAN["overlap_steps"] * PLAN["step_seconds"]),
            "shards": shards, "shard_memory_gib": per_shard(shards) / 2**30,
            "memory_at_rest_gib": measured.rest_bytes_per_param * params / 2**30,
            "wan_in_mbytes_per_second": received * fragments / period / 1e6,
            "disk_mbytes_per_second": measured.durable_vs_received * received * fragments / period / 1e6,
            "snapshot_seconds": SNAPSHOT_BYTES_PER_PARAM * fragment / measured.disk_bytes_per_second,
            # the snapshot, its replacement while it is written, a log up to its size, the history;
            # and every learner's anchor value out of memory (syncer.spill_anchors)
            "disk_gib_per_shard": (3 * SNAPSHOT_BYTES_PER_PARAM + 4 + 4 * PLAN["learners"]) * params / shards / 2**30,
            "anchor_disk_gib_per_shard": 4 * PLAN["learners"] * params / shards / 2**30}


def print_capacity(measured: Measured) -> list[dict]:
    print(f"\ncapacity for H={PLAN['interval_steps']}, P={PLAN['fragments']}, M={PLAN['learners']}, "
          f"tau={PLAN['overlap_steps']}, {PLAN['step_seconds']:g} s steps, int4; shards of {SHARD_CORES} cores and "
          f"{SHARD_MEMORY / 2**30:.0f} GiB (80 % used), scaled from this machine: a close of M={PLAN['learners']} "
          f"takes {measured.close_seconds_per_param * 1e9:.1f} ns per fragment parameter on {measured.cores} cores, "
          f"disk {measured.disk_bytes_per_second / 1e6:.0f} MB/s")
    print("| model | fragments | per fragment | close here | cores to close in tau steps | shards | memory per shard | "
          "at rest, all shards | WAN in | disk writes | snapshot write | disk per shard |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [capacity(measured, params) for params in (1e9, 12e9, 70e9)]
    for row in rows:
        print(f"| {row['params'] / 1e9:.0f}B | {row['fragments']} | {row['fragment_params'] / 1e6:.0f}M | {row['close_seconds_here']:.1f} s | "
              f"{row['cores_for_window']:.0f} | {row['shards']} | {row['shard_memory_gib']:.0f} GiB | "
              f"{row['memory_at_rest_gib']:.0f} GiB | {row['wan_in_mbytes_per_second']:.0f} MB/s | "
              f"{row['disk_mbytes_per_second']:.0f} MB/s | {row['snapshot_seconds']:.0f} s | "
              f"{row['disk_gib_per_shard']:.0f} GiB |")
    return rows


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
    parser.add_argument("--anchors-params", type=int, default=100_000_000,
                        help="the fragment of the anchors measurement (0: none)")
    parser.add_argument("--anchors-kept", type=int, nargs="+", default=[0, 2 * ANCHOR_PULLERS],
                        help="syncer.kept_anchors values to measure it with (0: the default; 32: every learner's two "
                             "anchors in memory); the first also with syncer.spill_anchors false")
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
            runs.append(measure(args.compare_params, args.rounds, before, state_root / "before", f"before ({args.compare})",
                                counts_releases=False))
            runs.append(measure(args.compare_params, args.rounds, head, state_root / "now-small", "now"))
        runs.append(measure(args.params, args.rounds, head, state_root / "now", "now"))
        for run in runs:
            report(run)
        settings = [(kept, True) for kept in args.anchors_kept] + [(args.anchors_kept[0], False)]
        anchors = [measure_anchors(args.anchors_params, kept, spill, head, state_root / f"anchors-{kept}-{spill}")
                   for kept, spill in (settings if args.anchors_params else [])]
        for run in anchors:
            report_anchors(run)
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        print(f"this machine: {os.cpu_count()} cores, {memory / 2**30:.0f} GiB")
        now = runs[-1]
        measured = Measured(
            os.cpu_count(), statistics.median(close_seconds_per_param(PLAN["learners"]) for _ in range(3)),
            now["rss_bytes_per_param"], (now["peak_rss_bytes_per_param"] - now["rss_bytes_per_param"]) * FRAGMENTS,
            now["durable_bytes_per_round_per_fragment"] / now["received_bytes_per_round_per_fragment"],
            disk_write_bytes_per_second(state_root))
        rows = print_capacity(measured)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "anchors": anchors, "measured": measured.__dict__,
                                                   "plan": PLAN, "capacity": rows}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
