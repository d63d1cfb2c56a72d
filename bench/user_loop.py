"""The API's cost in a user's own loop: a plain PyTorch loop (a GPT of learner/trainer/model.py, torch
AdamW, batches of random bytes) with `DecoupledDiLoCo` syncing, against the same loop with
`DecoupledDiLoCo(enabled=False)`, both in this process, against real shard processes on loopback.

    python bench/user_loop.py [--pairs 3] [--sizes demo 25M] [--device cuda] [--json PATH]
    python bench/user_loop.py --step gpu-shaped --sizes 25M 85M --steps 96   # a GPU's step, on the CPU
    python bench/user_loop.py --device cuda --sizes 85M --tau 3 --set sync.wait_for_own_link=false
    python bench/user_loop.py --step gpu-shaped --keep-freed-memory   # as GLIBC_TUNABLES (docs/gpus.md) does

Sizes: the demo's model and sync settings (examples/local-4-regions.yaml: 446k parameters,
H=50, P=4, tau=3, int4), and GPTs of 25M, 85M and 350M parameters with H=16, so that short runs
hold several syncs of every fragment (350M: one shard per fragment). For each size, `--pairs`
pairs of runs alternate which one goes first (off-on, on-off, ...) so machine noise hits both
alike; each pair gets fresh shards. A run's figure is its mean loop seconds per step (the user's
step and `sync.step()`); the ratio is of the medians over the pairs. The loop runs on one torch
thread, as the examples do: the shard and the sync's threads get the other cores.

`--step model` (default) trains the GPT: forward, backward, AdamW (target: <= 1.01 on the CPU,
<= 1.05 with `--device cuda`). `--step gpu-shaped` is what a GPU step looks like to the host: a
20 ms wait that releases the interpreter and holds no core, then every parameter changed in
place, so that the host-side cost of a sync shows on a machine without a GPU (targets: 25M
<= 1.05, 85M <= 1.2).

Also per size: every `sync.step()` of the syncing runs (on a step where nothing was due, p50
and p90; all calls per step: the API's time on the training thread), the time blocked waiting
for results, the bytes a sync moved off and onto a GPU against its payload, the user's own step
with the sync on and off (what the sync's threads cost the loop through the interpreter lock
and the cores), and the CPU time per sync of the training thread, the sync's threads and the
shards. Exits 1 when a size misses its target.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.one_learner import one_learner_config  # noqa: E402
from diloco import DecoupledDiLoCo  # noqa: E402
from diloco.learner.trainer.model import build_model  # noqa: E402
from diloco.learner.sync.synced_parameters import manifest  # noqa: E402
from diloco.localcluster.cluster import LocalCluster  # noqa: E402
from diloco.localcluster.sim import apply_override  # noqa: E402
from diloco.services.contract.codecs import get_codec  # noqa: E402
from diloco.services.contract.fragments import plan_for_config  # noqa: E402
from diloco.services.contract.config import Config  # noqa: E402
from diloco.services.memory import keep_freed_memory  # noqa: E402

TARGET_RATIO = 1.01  # the model's own step on the CPU: the API's share of a CPU step
# A step that leaves the host's cores to the sync (issue 51): a GPU's, and the GPU-shaped step on
# this machine's 2 cores, where the learner's shard shares them.
GPU_TARGET_RATIO = 1.05
GPU_SHAPED_TARGET_RATIOS = {"25M": 1.05, "85M": 1.2}
DEMO_CONFIG = ROOT / "examples" / "local-4-regions.yaml"
DISTINCT_BATCHES = 8  # the loop cycles through these: data loading is not what is measured
GPU_SHAPED_STEP_SECONDS = 0.020


@dataclass(frozen=True)
class Size:
    """A model: steps per run, what its runs change in the demo's config (by section), and its
    shards (a syncer of that size is deployed as several: one fragment per shard)."""
    name: str
    steps: int
    config: dict[str, dict]
    shards: int = 1


SIZES = {size.name: size for size in (
    Size("demo", steps=100, config={}),
    Size("25M", steps=24, config={"model": {"n_layer": 8, "n_head": 8, "n_embd": 512, "seq_len": 64},
                                  "trainer": {"batch_size": 4}, "sync": {"interval_steps": 16}}),
    # A GPU's size (make gpu-check): too slow for the default CPU run.
    Size("85M", steps=64, config={"model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 256},
                                  "trainer": {"batch_size": 8}, "sync": {"interval_steps": 16}}),
    Size("350M", steps=64, shards=4, config={"model": {"n_layer": 28, "n_head": 16, "n_embd": 1024, "seq_len": 256},
                                             "trainer": {"batch_size": 8}, "sync": {"interval_steps": 16}}),
)}
DEFAULT_SIZES = ("demo", "25M")


def random_batches(cfg: Config, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(256, (DISTINCT_BATCHES, cfg.trainer.batch_size, cfg.model.seq_len + 1), generator=generator)
    return [(w[:, :-1].to(device), w[:, 1:].to(device)) for w in windows]


def user_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def gpu_shaped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """What a GPU step looks like to the host: a wait that holds no core and releases the
    interpreter (the kernels run elsewhere), then every parameter changed in place (a little of
    each: the changes must land in every fragment, not cost a pass over the model)."""
    time.sleep(GPU_SHAPED_STEP_SECONDS)
    with torch.no_grad():
        for param in model.parameters():
            param.view(-1)[:64].add_(1e-6)


STEPS = {"model": user_step, "gpu-shaped": gpu_shaped_step}


def fresh_model(cfg: Config, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(cfg.model, seed=cfg.run.seed).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def warm_up(cfg: Config, batches: list, device: torch.device) -> None:
    """A few steps outside any measured run: torch.optim's first step imports torch._dynamo
    (about a second), which would otherwise land in whichever run comes first."""
    model, optimizer = fresh_model(cfg, device)
    for x, y in batches[:3]:
        user_step(model, optimizer, x, y)


@dataclass
class Run:
    """One run of the user's loop."""
    seconds_per_step: float  # mean loop seconds per step
    step_calls: list[float]  # seconds of every `sync.step()` call
    idle_calls: list[float]  # of those on a step where nothing was due
    syncs: int  # started
    blocked_seconds: float  # waiting in sync.step() for results past tau
    device_to_host_bytes: int = 0  # what the syncs copied off the GPU
    host_to_device_bytes: int = 0  # and onto it
    user_step_seconds: float = 0.0  # mean seconds of the user's own step (outside sync.step())
    training_thread_cpu_seconds: float = 0.0  # CPU time of the loop's thread
    other_threads_cpu_seconds: float = 0.0  # of this process's other threads: the sync's
    shard_cpu_seconds: float = 0.0  # of the shard processes
    # A sync's own time, mean over the run's pushes: from its start until the shard answered the
    # push (with one learner the shard closes the round before answering), and until its result
    # was in, decoded and checked: what tau steps have to cover for the loop never to wait.
    push_seconds: float = 0.0
    round_trip_seconds: float = 0.0


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_run(cfg: Config, batches: list, enabled: bool, device: torch.device, shard_pids: list[int],
              step=user_step) -> Run:
    """The user's loop to the end of the config's step budget."""
    model, optimizer = fresh_model(cfg, device)
    run = Run(0.0, [], [], 0, 0.0)
    user_seconds = 0.0
    with DecoupledDiLoCo(model, cfg, cfg.learners[0].id, enabled=enabled, catch_up_seconds=0) as sync:
        started = time.perf_counter()
        cpu_started, thread_started = time.process_time(), time.thread_time()
        shards_started = sum(cpu_seconds(pid) for pid in shard_pids)
        stats = sync.sync.stats if sync.sync else None
        pushes_at_start, push_seconds_at_start, transfer_seconds_at_start = (
            (stats.pushes, stats.push_seconds, stats.transfer_seconds) if stats else (0, 0.0, 0.0))
        while not sync.should_stop:
            x, y = batches[len(run.step_calls) % len(batches)]
            stepped = time.perf_counter()
            step(model, optimizer, x, y)
            user_seconds += time.perf_counter() - stepped
            syncs_before = stats.syncs_started if stats else 0
            called = time.perf_counter()
            applied = sync.step(tokens=x.numel())
            run.step_calls.append(time.perf_counter() - called)
            if device.type == "cuda" and len(run.step_calls) % 10 == 0:
                torch.cuda.synchronize(device)  # a loop that reads its loss now and then: the GPU never runs far ahead
            if stats and not applied and stats.syncs_started == syncs_before:
                run.idle_calls.append(run.step_calls[-1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        run.seconds_per_step = (time.perf_counter() - started) / len(run.step_calls)
        run.user_step_seconds = user_seconds / len(run.step_calls)
        run.training_thread_cpu_seconds = time.thread_time() - thread_started
        run.other_threads_cpu_seconds = time.process_time() - cpu_started - run.training_thread_cpu_seconds
        run.shard_cpu_seconds = sum(cpu_seconds(pid) for pid in shard_pids) - shards_started
        if stats:  # the sync on: its counters (off, the run's defaults stand)
            run.syncs, run.blocked_seconds = stats.syncs_started, stats.blocked_seconds
            run.device_to_host_bytes, run.host_to_device_bytes = stats.device_to_host_bytes, stats.host_to_device_bytes
            pushes = max(1, stats.pushes - pushes_at_start)
            run.push_seconds = (stats.push_seconds - push_seconds_at_start) / pushes
            run.round_trip_seconds = (stats.transfer_seconds - transfer_seconds_at_start) / pushes
    return run


def measure(size: Size, pairs: int, device: torch.device, step_kind: str = "model", steps: int | None = None,
            overrides: list[str] = ()) -> dict:
    runs: dict[bool, list[Run]] = {False: [], True: []}  # by sync enabled
    sections = copy.deepcopy(size.config)
    for override in overrides:
        apply_override(sections, override)
    for pair in range(pairs):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = one_learner_config(DEMO_CONFIG, pathlib.Path(tmp) / "state", steps or size.steps, size.shards,
                                     **sections)
            batches = random_batches(cfg, device)
            if pair == 0:
                warm_up(cfg, batches, device)
            cluster = LocalCluster(cfg, pathlib.Path(tmp) / "run")
            try:
                cluster.start_shards()
                for enabled in ((False, True) if pair % 2 == 0 else (True, False)):
                    runs[enabled].append(timed_run(cfg, batches, enabled, device,
                                                   [proc.popen.pid for proc in cluster.shards], STEPS[step_kind]))
            finally:
                cluster.stop()
    off, on = [run.seconds_per_step for run in runs[False]], [run.seconds_per_step for run in runs[True]]
    off_median, on_median = statistics.median(off), statistics.median(on)
    idle_calls = [seconds for run in runs[True] for seconds in run.idle_calls]
    # Every `sync.step()` call (starting syncs and applying results too) on the training thread:
    # the API's own share of the step, apart from the sync's work on its threads and in the
    # shard, which competes with the loop for the machine's cores.
    step_calls = statistics.median(sum(run.step_calls) / len(run.step_calls) for run in runs[True])
    model = build_model(cfg.model, seed=0)
    plan = plan_for_config(cfg, manifest(model))
    codec = get_codec(cfg.sync.codec)
    encoded_per_sync = statistics.mean(codec.encoded_size(f.numel, cfg.sync.codec_block_size) for f in plan.fragments)
    return {"size": size.name, "device": str(device), "model_parameters": sum(p.numel() for p in model.parameters()),
            "layers": cfg.model.n_layer, "width": cfg.model.n_embd, "seq_len": cfg.model.seq_len,
            "batch_size": cfg.trainer.batch_size, "steps": cfg.trainer.max_steps, "step": step_kind,
            "target_ratio": target_ratio(size, device, step_kind), "H": cfg.sync.interval_steps,
            "P": cfg.sync.fragments, "tau": cfg.sync.overlap_steps, "codec": cfg.sync.codec, "overrides": list(overrides),
            "sync_off_step_seconds": off_median, "sync_on_step_seconds": on_median, "ratio": on_median / off_median,
            "pair_ratios": [b / a for a, b in zip(off, on)], "runs_off": off, "runs_on": on,
            "syncs_per_run": statistics.median(run.syncs for run in runs[True]),
            "blocked_seconds_per_step": statistics.median(run.blocked_seconds / len(run.step_calls) for run in runs[True]),
            "step_calls_seconds_per_step": step_calls, "step_calls_share": step_calls / off_median,
            "idle_step_call_seconds": {"p50": statistics.median(idle_calls),
                                       "p90": statistics.quantiles(idle_calls, n=10)[8], "calls": len(idle_calls)},
            "idle_step_call_share": statistics.median(idle_calls) / off_median,
            "shards": size.shards, "encoded_bytes_per_sync": encoded_per_sync,
            "device_to_host_bytes_per_sync": statistics.median(
                run.device_to_host_bytes / run.syncs for run in runs[True] if run.syncs),
            "host_to_device_bytes_per_sync": statistics.median(
                run.host_to_device_bytes / run.syncs for run in runs[True] if run.syncs),
            # The loop's own step with the sync on over off: what the sync's threads cost it
            # (the interpreter lock, the cores), apart from sync.step() itself.
            "user_step_seconds": {"off": statistics.median(run.user_step_seconds for run in runs[False]),
                                  "on": statistics.median(run.user_step_seconds for run in runs[True])},
            # CPU seconds per sync started: what a sync costs the machine, by where it runs.
            "cpu_seconds_per_sync": {
                where: statistics.median(getattr(on, attr) / on.syncs - getattr(off, attr) / on.syncs
                                         for off, on in zip(runs[False], runs[True]) if on.syncs)
                for where, attr in (("training_thread", "training_thread_cpu_seconds"),
                                    ("sync_threads", "other_threads_cpu_seconds"), ("shards", "shard_cpu_seconds"))},
            "seconds_between_syncs": on_median * cfg.sync.interval_steps / cfg.sync.fragments,
            "push_seconds": statistics.median(run.push_seconds for run in runs[True]),
            "round_trip_seconds": statistics.median(run.round_trip_seconds for run in runs[True]),
            "tau_steps_seconds": cfg.sync.overlap_steps * off_median}


def target_ratio(size: Size, device: torch.device, step_kind: str) -> float | None:
    """The ratio the issue that asked for this row set (None: none was set)."""
    if step_kind == "gpu-shaped":
        return GPU_SHAPED_TARGET_RATIOS.get(size.name)
    return GPU_TARGET_RATIO if device.type == "cuda" else TARGET_RATIO


def met(row: dict) -> bool:
    return row["target_ratio"] is None or row["ratio"] <= row["target_ratio"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(DEFAULT_SIZES))
    parser.add_argument("--device", default="cpu", help="where the model trains: cpu (default) or cuda")
    parser.add_argument("--step", choices=list(STEPS), default="model",
                        help="model: the GPT's forward, backward and AdamW; gpu-shaped: a 20 ms wait that holds no "
                             "core, then each parameter changed in place (a GPU step as the host sees it)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the size's)")
    parser.add_argument("--tau", type=int, help="sync.overlap_steps: the steps a result has to arrive in "
                                                "(default: the demo config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a config key for every size's runs, as diloco sim takes it, e.g. "
                             "sync.wait_for_own_link=false (repeatable)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="this process keeps freed memory (services/memory.py), as GLIBC_TUNABLES does for a "
                             "learner process (docs/gpus.md); both runs of a pair alike")
    parser.add_argument("--json", help="also write the figures here (bench/run_all.py reads them)")
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()  # before the first thread
    torch.set_num_threads(1)
    device = torch.device(args.device)
    load_before = os.getloadavg()[0]
    overrides = [*args.overrides, *([f"sync.overlap_steps={args.tau}"] if args.tau is not None else [])]
    rows = [measure(SIZES[name], args.pairs, device, args.step, args.steps, overrides) for name in args.sizes]
    load_after = os.getloadavg()[0]
    print(f"user loop on {device}, {args.step} step: sync on vs enabled=False, median of {args.pairs} alternating pairs, 1 torch thread"
          f"{', freed memory kept' if args.keep_freed_memory else ''}; "
          f"load average {load_before:.2f} at the start, {load_after:.2f} at the end")
    for r in rows:
        verdict = "no target" if r["target_ratio"] is None else "met" if met(r) else "MISSED"
        idle = r["idle_step_call_seconds"]
        print(f"{r['size']:>5}: {r['model_parameters'] / 1e6:.2f}M parameters, {r['steps']} steps a run "
              f"(H={r['H']} P={r['P']} tau={r['tau']}, {r['syncs_per_run']:.0f} syncs): "
              f"sync off {r['sync_off_step_seconds'] * 1e3:.1f} ms/step, on {r['sync_on_step_seconds'] * 1e3:.1f}; "
              f"ratio {r['ratio']:.3f} ({r['ratio'] - 1:+.1%} against the loop without sync; pairs "
              f"{min(r['pair_ratios']):.3f} to {max(r['pair_ratios']):.3f}), target <= {r['target_ratio']} {verdict}; "
              f"sync.step() with nothing due {idle['p50'] * 1e6:.0f} us p50, {idle['p90'] * 1e6:.0f} us p90 "
              f"({r['idle_step_call_share']:.3%} of the step); every sync.step() call "
              f"{r['step_calls_seconds_per_step'] * 1e3:.2f} ms per step ({r['step_calls_share']:.2%} of the step), "
              f"of which blocked waiting for results {r['blocked_seconds_per_step'] * 1e3:.2f} ms; per sync "
              f"{r['device_to_host_bytes_per_sync'] / 1e6:.2f} MB device to host (the payload: "
              f"{r['encoded_bytes_per_sync'] / 1e6:.2f} MB), {r['host_to_device_bytes_per_sync'] / 1e6:.2f} MB back; "
              f"the user's step {r['user_step_seconds']['off'] * 1e3:.2f} ms off, {r['user_step_seconds']['on'] * 1e3:.2f} "
              f"on; CPU ms per sync (a sync starts every {r['seconds_between_syncs'] * 1e3:.0f} ms): "
              + ", ".join(f"{where} {seconds * 1e3:.1f}" for where, seconds in r["cpu_seconds_per_sync"].items())
              + f"; a sync's round trip {r['round_trip_seconds'] * 1e3:.0f} ms (its push answered in "
              f"{r['push_seconds'] * 1e3:.0f}) against tau steps' {r['tau_steps_seconds'] * 1e3:.0f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "target_ratio": TARGET_RATIO, "step": args.step, "pairs": args.pairs, "torch_threads": 1,
            "keep_freed_memory": args.keep_freed_memory,
            "load_average": {"start": load_before, "end": load_after}, "sizes": rows}, indent=1))
    return 0 if all(met(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
