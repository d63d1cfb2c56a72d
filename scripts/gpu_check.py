"""`make gpu-check`: do the GPU paths work on this machine's GPUs? Minutes, one command.

    python scripts/gpu_check.py [--json PATH] [--steps 60]

On the GPUs torch sees, in turn:
  1. tests     the CUDA tests (pytest -m cuda);
  2. memory    the built-in learner's GPT (about 85M parameters) trains on GPU 0 with the sync on,
               against one shard on loopback: the device memory a sync step, a checkpoint, an
               export and a restore take beyond what was allocated before them (their peak),
               per parameter of the model and against one fragment; seconds to copy a fragment
               to the host;
  3. learners  two learners on the GPU under bf16 with 2 micro-batches per step against one
               shard (diloco sim): they train and end holding the shard's bits;
  4. island    a torchrun island of every GPU on NCCL, its ranks checked identical after every
               applied fragment (needs 2 GPUs: NCCL takes one per rank);
  5. user loop bench/user_loop.py on the GPU: seconds per step with the sync on over off.
Prints a line per check and the figures; exits 1 if one failed. Where torch sees no GPU it says
so in one line and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench.one_learner import one_learner_config  # noqa: E402
from diloco import DecoupledDiLoCo  # noqa: E402
from diloco.learner.sync.host_copy import copy_to_host  # noqa: E402
from diloco.learner.trainer.train import Trainer  # noqa: E402
from diloco.localcluster.cluster import LocalCluster  # noqa: E402
from diloco.services.contract.codecs import get_codec, workspace_bytes  # noqa: E402

DEMO = ROOT / "examples" / "local-4-regions.yaml"
MEMORY_MODEL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "seq_len": 256}
MEMORY_SYNC = {"fragments": 4, "interval_steps": 8, "overlap_steps": 1}
# What an allocation may round up to (the caching allocator's blocks): below this is no copy.
ALLOCATOR_SLACK_BYTES = 2 << 20


@dataclass
class Check:
    name: str
    passed: bool | None  # None: skipped
    summary: str
    figures: dict = field(default_factory=dict)


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)


def tail(result: subprocess.CompletedProcess, lines: int = 15) -> str:
    return "\n".join((result.stdout + result.stderr).strip().splitlines()[-lines:])


def cuda_tests() -> Check:
    result = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                  "tests/test_devices.py", "tests/test_codecs.py", "tests/test_outer_gradient.py"], timeout=600)
    last = (result.stdout.strip().splitlines() or [""])[-1]
    return Check("tests", result.returncode == 0, last if result.returncode == 0 else tail(result, 40))


def peak_during(action: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """(bytes the action's peak allocation reached above what was allocated before it or after
    it, whichever is more: what it needed only while it ran; its result)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = action()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - max(before, torch.cuda.memory_allocated(device)), result


def memory(work: pathlib.Path, steps: int) -> Check:
    device = torch.device("cuda", 0)
    cfg = one_learner_config(DEMO, work / "state", steps, model=MEMORY_MODEL, sync=MEMORY_SYNC,
                             trainer={"device": "cuda", "batch_size": 8, "eval_every": 10 ** 6})
    learner = cfg.learners[0].id
    cluster = LocalCluster(cfg, work / "run")
    try:
        cluster.start_shards()
        trainer = Trainer.from_config(cfg, learner, cache_dir=work / "cache", device=device)
        parameters = sum(p.numel() for p in trainer.model.parameters())
        sync = DecoupledDiLoCo(trainer.synced_module, cfg, learner, catch_up_seconds=0.0)
        largest = max(f.numel for f in sync.plan.fragments)
        fragment_bytes = 4 * largest
        payload_bytes = get_codec(cfg.sync.codec).encoded_size(largest, cfg.sync.codec_block_size)
        step_peaks, step_seconds = [], []
        with sync:
            while not sync.should_stop:
                stats = trainer.train_step()
                step_seconds.append(stats.seconds)
                step_peaks.append(peak_during(lambda: sync.step(tokens=stats.tokens, seconds=stats.seconds), device)[0])
            footprint = torch.cuda.memory_allocated(device)
            checkpoint_peak, checkpoint = peak_during(lambda: trainer.checkpoint({"diloco": sync.state_dict()}), device)
            export_peak, _ = peak_during(lambda: sync.export(work / "export"), device)
            copies = []
            for _ in range(3):
                for fragment in sync.plan.fragments:
                    started = time.perf_counter()
                    copy_to_host(fragment, sync.params).wait()
                    copies.append((time.perf_counter() - started, fragment.numel))
            syncs = sync.sync.stats.syncs_applied
        del trainer, sync
        gc.collect()  # the sync's objects hold device tensors in reference cycles: freed now, not during the restore
        torch.cuda.empty_cache()
        restored = Trainer.from_config(cfg, learner, cache_dir=work / "cache", device=device)
        restore_peak, _ = peak_during(lambda: restored.restore(checkpoint), device)
    finally:
        cluster.stop()
    copy_seconds = statistics.median(seconds for seconds, _ in copies)
    copy_rate = statistics.median(4 * numel / seconds for seconds, numel in copies)
    peaks = {"sync_step": max(step_peaks), "checkpoint": checkpoint_peak, "export": export_peak,
             "restore": restore_peak}
    # A sync step holds the fragment's snapshot (it becomes the new residual), its payload and the
    # codec's working chunk on the device; the anchor's copy and the residual are in the footprint.
    sync_bound = fragment_bytes + payload_bytes + workspace_bytes(device) + ALLOCATOR_SLACK_BYTES
    figures = {"parameters": parameters, "fragment_fp32_bytes": fragment_bytes, "footprint_bytes": footprint,
               "syncs_applied": syncs, "step_seconds_median": statistics.median(step_seconds),
               "peak_bytes": peaks, "peak_bytes_per_parameter": {k: v / parameters for k, v in peaks.items()},
               "peak_in_fragments": {k: v / fragment_bytes for k, v in peaks.items()},
               "sync_step_bound_bytes": sync_bound,
               "host_copy_seconds_per_fragment": copy_seconds, "host_copy_bytes_per_second": copy_rate}
    passed = syncs > 0 and peaks["checkpoint"] <= ALLOCATOR_SLACK_BYTES and peaks["export"] <= ALLOCATOR_SLACK_BYTES \
        and peaks["sync_step"] <= sync_bound and peaks["restore"] <= fragment_bytes + ALLOCATOR_SLACK_BYTES
    summary = (f"{parameters / 1e6:.1f}M parameters, footprint {footprint / parameters:.1f} B/param, "
               f"{syncs} syncs applied; device memory beyond it: "
               + ", ".join(f"{k} {v / parameters:.3f} B/param ({v / fragment_bytes:.2f} fragments)"
                           for k, v in peaks.items())
               + f"; a fragment ({fragment_bytes / 4 / 1e6:.1f}M values) to the host in {copy_seconds * 1e3:.1f} ms "
               f"({copy_rate / 1e9:.1f} GB/s)")
    return Check("memory", passed, summary, figures)


def two_learners(work: pathlib.Path, steps: int) -> Check:
    report_path = work / "report.json"
    result = run([sys.executable, "-m", "diloco", "sim", "--config", str(DEMO), "--learners", "2",
                  "--shards", "1", "--steps", str(steps), "--run-dir", str(work), "--report", str(report_path),
                  "--quiet", "--set", "trainer.device=cuda", "--set", "trainer.precision=bf16",
                  "--set", "trainer.grad_accum_steps=2", "--set", f"trainer.eval_every={steps}"], timeout=900)
    if result.returncode != 0 or not report_path.exists():
        return Check("learners", False, tail(result))
    report = json.loads(report_path.read_text())
    initial, final = report["initial_eval_loss"], report["final_eval_loss"]
    passed = report["state_hashes_agree"] and final is not None and final < initial
    figures = {k: report[k] for k in ("wall_seconds", "inner_steps", "outer_steps", "goodput", "initial_eval_loss",
                                      "final_eval_loss", "state_hashes_agree", "contributions")}
    return Check("learners", passed, f"2 learners x {steps} steps, bf16, 2 micro-batches: global model "
                 f"{initial:.3f} -> {final:.3f}, {report['outer_steps']} outer steps, goodput "
                 f"{report['goodput']:.1%}, state hashes agree {str(report['state_hashes_agree']).lower()}", figures)


def island(work: pathlib.Path, steps: int) -> Check:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return Check("island", None, f"skipped: {gpus} GPU (NCCL takes one GPU per rank; an island needs 2)")
    sections = {"trainer": {"device": "cuda"}, "sync": {"fragments": 2, "interval_steps": 10, "overlap_steps": 1}}
    per_rank = one_learner_config(DEMO, work / "state", steps, **sections).tokens_per_step()
    cfg = one_learner_config(DEMO, work / "state", steps, **sections,
                             syncer={"max_tokens_per_step": gpus * per_rank})  # every rank's tokens
    cluster = LocalCluster(cfg, work / "run")
    learner = cfg.learners[0]
    try:
        cluster.start_shards()
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
        result = run([torchrun, "--standalone", "--nproc-per-node", str(gpus), "-m", "diloco", "learner",
                      "--config", str(cluster.config_path), "--learner-id", learner.id, "--region", learner.region,
                      "--verify-island", "--catch-up-seconds", "0.5"], timeout=600)
    finally:
        cluster.stop()
    if result.returncode != 0:
        return Check("island", False, tail(result))
    report = json.loads(cluster.learner_report_path(learner.id).read_text())
    passed = report["world_size"] == gpus and report["island_checks"] > 0
    return Check("island", passed, f"{gpus} ranks on NCCL, {report['steps']} steps, {report['island_checks']} "
                 "applied fragments checked identical on every rank", {"world_size": gpus,
                                                                       "island_checks": report["island_checks"]})


def user_loop(work: pathlib.Path, pairs: int, tau: int, overrides: list[str]) -> Check:
    work.mkdir(parents=True)
    path = work / "user_loop.json"
    result = run([sys.executable, "bench/user_loop.py", "--device", "cuda", "--pairs", str(pairs), "--sizes", "demo",
                  "25M", "85M", "350M", "--tau", str(tau), *(f"--set={o}" for o in overrides), "--json", str(path)],
                 timeout=900)
    if not path.exists():
        return Check("user loop", False, tail(result))
    sizes = json.loads(path.read_text())["sizes"]
    summary = "; ".join(f"{r['size']} ({r['model_parameters'] / 1e6:.1f}M, H={r['H']}): {r['sync_off_step_seconds'] * 1e3:.1f} "
                        f"ms/step off, {r['sync_on_step_seconds'] * 1e3:.1f} on, ratio {r['ratio']:.3f} (sync.step() "
                        f"{r['step_calls_seconds_per_step'] * 1e3:.2f} ms/step, blocked "
                        f"{r['blocked_seconds_per_step'] * 1e3:.2f}; per sync {r['device_to_host_bytes_per_sync'] / 1e6:.2f} "
                        f"MB to the host, payload {r['encoded_bytes_per_sync'] / 1e6:.2f} MB, "
                        f"{r['host_to_device_bytes_per_sync'] / 1e6:.2f} MB back; round trip "
                        f"{r['round_trip_seconds'] * 1e3:.0f} ms against tau steps' {r['tau_steps_seconds'] * 1e3:.0f})"
                        for r in sizes)
    # The ratio is a figure to read, not a pass condition: the loop ran and synced.
    passed = all(r["syncs_per_run"] > 0 for r in sizes)
    return Check("user loop", passed, summary, {"sizes": sizes})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="inner steps of the memory check's learner")
    parser.add_argument("--sim-steps", type=int, default=200, help="inner steps per learner of the two-learner run")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs of the user-loop benchmark")
    # A result is due tau steps after its sync starts: at H=16 with the shards on the same host a
    # round trip takes 6 to 7 GPU steps at 85M and 350M (docs/gpus.md), so tau=3 blocks.
    parser.add_argument("--tau", type=int, default=8, help="sync.overlap_steps of the user-loop benchmark")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a config key of the user-loop benchmark, e.g. sync.wait_for_own_link=false")
    parser.add_argument("--json", help="also write every check and figure here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
              "nothing to check")
        return 0
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}), {len(names)} GPU(s): {', '.join(names)}",
          flush=True)
    checks = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = pathlib.Path(tmp)
        for name, check in (("tests", cuda_tests), ("memory", lambda: memory(work / "memory", args.steps)),
                            ("learners", lambda: two_learners(work / "learners", args.sim_steps)),
                            ("island", lambda: island(work / "island", 60)),
                            ("user loop", lambda: user_loop(work / "user-loop", args.pairs, args.tau, args.overrides))):
            started = time.monotonic()
            try:
                result = check()
            except Exception as error:  # a check that breaks is a failed check; the others still run
                result = Check(name, False, f"{type(error).__name__}: {error}")
            result.figures["seconds"] = time.monotonic() - started
            checks.append(result)
            verdict = {True: "ok", False: "FAILED", None: "skipped"}[result.passed]
            print(f"[{verdict:>7}] {result.name} ({result.figures['seconds']:.0f} s): {result.summary}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": names,
            "checks": [vars(c) for c in checks]}, indent=1))
    failed = [c.name for c in checks if c.passed is False]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'every check passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
