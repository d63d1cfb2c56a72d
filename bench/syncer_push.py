"""Speed of one syncer shard process on loopback: M concurrent pushers of a fragment set in int4,
against raw gRPC streaming of the same bytes measured in the same run.

    python bench/syncer_push.py                          # 64M parameters, M = 4, as the target is stated
    python bench/syncer_push.py --params 8000000         # a quick run
    python bench/syncer_push.py --state-dir /dev/shm/x   # keep the shard's state off the disk

Each round has two timed phases:
1. push: every pusher streams its int4 outer gradient of every fragment. The shard receives,
   verifies, decodes, checks, logs (fsync) and merges each one before acknowledging it. An
   idle "observer" learner is joined, so no round can close yet: this is the push path alone.
2. close + pull: the observer leaves; the shard's ticker closes every round (merge, Nesterov,
   int4 + error feedback, snapshot with fsync) and the pushers' waiting pulls receive and
   apply the updates.
The raw baseline streams the same payloads with the same message types and chunking to a
server that only counts the bytes, started the same way as the shard (its own process).

Reported: raw and push-path MB/s of compressed bytes (target: push path >= 0.7 x raw), and
for whole rounds, contributions merged per second and fp32 parameters per second
(contributions x parameters per contribution). Medians over the rounds. Exits 1 if the
target is missed.
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.client import ShardClient, state_hash  # noqa: E402
from services.codecs import get_codec  # noqa: E402
from services.config import RpcConfig, load_config  # noqa: E402
from services.rpc import Server  # noqa: E402
from services.wire import pb, pb_grpc  # noqa: E402

TARGET_VS_RAW = 0.7
BLOCK = 128
TENSORS = 8  # the parameter set is TENSORS equal tensors, packed into --fragments fragments


class Sink(pb_grpc.SyncerServicer):
    """The raw baseline: takes a push stream and only counts its bytes."""

    def PushFragment(self, request_iterator, context):
        received = sum(len(request.chunk.data) for request in request_iterator)
        return pb.PushResponse(result=pb.PUSH_RESULT_ACCEPTED, round=received)


def serve_sink(port: int) -> None:
    server = Server(RpcConfig(), ["diloco.v1.Syncer"])  # the shard's message limits and keepalive
    pb_grpc.add_SyncerServicer_to_server(Sink(), server.grpc_server)
    server.start(f"127.0.0.1:{port}")
    server.serve_until_signal(drain_seconds=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"server at {address} exited with {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise SystemExit(f"server at {address} not serving after {timeout}s")


def in_parallel(jobs) -> float:
    """Runs the callables on one thread each; wall seconds until the last one is done."""
    errors = []

    def run(job):
        try:
            job()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=64_000_000)
    parser.add_argument("--pushers", type=int, default=4, help="M: concurrent pushing learners")
    parser.add_argument("--fragments", type=int, default=4, help="P: the parameters split into P fragments")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-dir", help="where the shard keeps its state (default: a temporary folder)")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)  # internal: serve the raw baseline
    args = parser.parse_args()
    if args.sink:
        serve_sink(args.sink)
        return 0

    work = Path(tempfile.mkdtemp(prefix="bench-syncer-"))  # the config, and the state unless --state-dir
    state_dir = Path(args.state_dir) if args.state_dir else work / "state"
    learners = [f"pusher-{i}" for i in range(args.pushers)] + ["observer"]
    config_path = work / "cluster.yaml"
    config_path.write_text(yaml.safe_dump({
        "run": {"state_dir": str(state_dir)},
        "shards": [{"address": f"127.0.0.1:{free_port()}", "metrics_port": 0}],
        "learners": [{"id": learner, "region": "bench"} for learner in learners],
        "sync": {"fragments": args.fragments, "interval_steps": max(2, args.fragments), "overlap_steps": 1,
                 "codec": "int4", "codec_block_size": BLOCK},
        # Only "every live learner contributed" closes a round: the observer decides when.
        "syncer": {"quorum": args.pushers, "grace": {"mode": "fixed", "seconds": 3600.0},
                   "history_versions": 2, "lease_seconds": 3600.0, "max_update_norm": 1.0e9},
        "rpc": {"deadline_seconds": 600.0},
        # Plaintext like the raw baseline's server, so the ratio compares the push path alone.
        "tls": {"mode": "plaintext"},
    }))
    cfg = load_config(config_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    shard_address, sink_address = cfg.shards[0].address, f"127.0.0.1:{free_port()}"
    processes = [
        subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "WARNING", "syncer",
                          "--config", str(config_path), "--shard-index", "0", "--listen", shard_address],
                         cwd=ROOT, env=env),
        subprocess.Popen([sys.executable, __file__, "--sink", sink_address.rsplit(":", 1)[1]], cwd=ROOT, env=env),
    ]
    clients: list[ShardClient] = []
    try:
        wait_serving(shard_address, processes[0])
        wait_serving(sink_address, processes[1])
        numel = args.params // TENSORS
        manifest = [(f"layers.{i}.weight", (numel,)) for i in range(TENSORS)]
        incarnation = time.time_ns()
        pushers = [ShardClient(shard_address, cfg.rpc, learner, incarnation, identity=None) for learner in learners[:-1]]
        observer = ShardClient(shard_address, cfg.rpc, "observer", incarnation, identity=None)
        sinks = [ShardClient(sink_address, cfg.rpc, learner, incarnation, identity=None) for learner in learners[:-1]]
        clients = pushers + [observer] + sinks
        fragments = [(f.fragment_id, f.numel) for f in pushers[0].join("bench", manifest).fragments]
        for client in pushers[1:] + [observer]:
            client.join("bench", manifest)
        for fragment, n in fragments:  # every learner starts from the same value
            pushers[0].push(fragment, torch.zeros(n), codec="fp32", block_size=BLOCK, kind=pb.PUSH_KIND_SEED)
        values = [{fragment: pusher.pull(fragment).apply(None) for fragment, _ in fragments} for pusher in pushers]

        int4 = get_codec("int4")
        payloads = [{fragment: int4.encode(torch.randn(n, generator=torch.Generator().manual_seed(i * 1000 + fragment)) * 1e-3, BLOCK)
                     for fragment, n in fragments} for i in range(args.pushers)]
        payload_bytes = sum(len(p) for per_pusher in payloads for p in per_pusher.values())
        contributions = args.pushers * len(fragments)
        print(f"one shard process, M={args.pushers} pushers, {args.params / 1e6:.0f}M fp32 parameters in "
              f"{len(fragments)} fragments, int4/{BLOCK}: {payload_bytes / 1e6:.0f} MB per round; "
              f"state in {state_dir}", flush=True)

        def push_all(client, i, base_version):
            for fragment, n in fragments:
                reply = client.push(fragment, payloads[i][fragment], numel=n, codec=int4, block_size=BLOCK,
                                    base_version=base_version, c_steps=24, c_tokens=24 * 1024, step_seconds=0.1)
                if reply.result != pb.PUSH_RESULT_ACCEPTED:
                    raise RuntimeError(f"push not accepted: {reply}")

        def pull_all(i, version):
            for fragment, _ in fragments:
                result = pushers[i].pull(fragment, version, min_version=version + 1, max_wait_seconds=600)
                values[i][fragment] = result.apply(values[i][fragment])

        raw, push, close = [], [], []
        for version in range(args.rounds):
            raw.append(in_parallel([lambda i=i: push_all(sinks[i], i, version) for i in range(args.pushers)]))
            push.append(in_parallel([lambda i=i: push_all(pushers[i], i, version) for i in range(args.pushers)]))
            # The observer's goodbye lets every round close; the pushers' pulls wait for that.
            close.append(in_parallel([observer.leave] + [lambda i=i: pull_all(i, version) for i in range(args.pushers)]))
            observer.join("bench", manifest)  # back for the next round
        status = {f.fragment_id: f for f in observer.status().fragments}
        for fragment, _ in fragments:  # every pusher holds the shard's bits, a round further each time
            assert status[fragment].version == args.rounds, status[fragment]
            assert all(state_hash(v[fragment]) == status[fragment].state_hash for v in values)

        raw_s, push_s, close_s = (statistics.median(t) for t in (raw, push, close))
        ratio = raw_s / push_s
        round_s = push_s + close_s
        print(f"raw gRPC stream          {payload_bytes / raw_s / 1e6:8.0f} MB/s   ({raw_s:.2f} s per round)")
        print(f"push path (durable)      {payload_bytes / push_s / 1e6:8.0f} MB/s   ({push_s:.2f} s) = "
              f"{ratio:.2f} x raw  (target >= {TARGET_VS_RAW})")
        print(f"whole rounds             {contributions / round_s:8.1f} contributions/s, "
              f"{contributions * args.params / len(fragments) / round_s / 1e6:.0f}M fp32 parameters/s "
              f"({push_s:.2f} s push + {close_s:.2f} s close and pull per round)")
        return 0 if ratio >= TARGET_VS_RAW else 1
    finally:
        for client in clients:
            client.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
