"""Speed of syncer shard processes on loopback: M concurrent pushers of a fragment set in int4,
against raw gRPC streaming of the same bytes and against the same arithmetic done in-process with
torch, all measured in the same run.

    python bench/syncer_push.py                          # 64M parameters, M = 4, one shard, as the target is stated
    python bench/syncer_push.py --params 8000000         # a quick run
    python bench/syncer_push.py --shards 1 2             # the same work on one shard, then on two
    python bench/syncer_push.py --state-dir /dev/shm/x   # keep the shards' state off the disk
    python bench/syncer_push.py --memory-state           # one more shard with its state in /dev/shm

Each iteration runs three shard rounds:
1. push path, all at once: every pusher streams its int4 outer gradient of every fragment to the
   shard that owns it, every stream at once (a learner pushes from one sync thread per
   fragment). The shard receives and verifies each one (checksum; NaN/Inf and the norm bound
   from the block scales) and logs it (fdatasync) before acknowledging it; contributions are
   decoded and merged when the round closes. An idle "observer" learner is joined, so no round
   can close yet: this is the push path alone. Its goodbye then lets the shards' tickers close
   every round, and the pull path is timed: every pusher pulls the round's update of every
   fragment, as the shard serves it (received and checksummed, the raw baseline's work), and
   again as a learner's client takes it (decoded and applied too, which the raw baseline does
   not do).
2. push path, one at a time: the same with each pusher's streams one after another, each pusher
   starting at a fragment of its own. Each push waits for its own fdatasync before the next one
   starts.
3. a whole round: the observer is away; every pusher pushes the fragments in order, and each
   fragment's round closes on its last push (merge, Nesterov, int4 + error feedback, the close
   record synced to the log, apply, install; a full snapshot only every few rounds), which is
   acknowledged once the new version is installed.
After the iterations, 16 learners of the config that never join (rounds do not wait for them)
take a snapshot of fragment 0, two rounds close, and they pull it together from that anchor: the
shard encodes the delta once and serves it to all (its `pulls.delta_encoded` and
`pulls.delta_reused` counters, read from Status before and after, are reported).
Every pushed byte crosses gRPC and is made durable, so the push path cannot beat the lower of
raw's rate and the state folder's rate of durable push-sized appends (each fdatasynced, as the
log does; measured in the same run). --memory-state adds one shard whose state is in /dev/shm:
the push path's own cost, without the disk's.
The raw baselines stream the same payloads with the same message types, chunking and
concurrency to a server per shard that only counts the bytes, and pull them back from it (it
streams the last payload pushed for the fragment), started the same way as the shards (their
own processes, the shards' malloc settings).
The in-process baseline does one round's arithmetic in this process after every iteration:
decode every contribution, radial-directional merge, Nesterov step, int4 encode with error
feedback, apply.

Reported: raw, push-path and pull-path MB/s of compressed bytes (targets: push path all at once
>= 0.9 x raw, pull path as served >= 0.6 x raw), and for whole rounds, contributions merged per
second and fp32 parameters per second (contributions x parameters per contribution) against
the in-process arithmetic (target >= 0.5 x). The in-process arithmetic is also reported as a
fraction of what the machine's memory bandwidth (measured in the same run: a large torch copy)
allows for the bytes a round must touch, round_bytes_per_parameter() of them per parameter.
Also the CPU that pushing all at once costs per MB (user and system time from /proc): the
servers' (the shards', the raw servers'), the pushers' (this process), and how busy that kept
the machine's cores, since pushers and servers share them here.
Medians over the iterations. Exits 1 if a target is missed.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from diloco.learner.sync.pulled import value_after  # noqa: E402
from diloco.services.client import ShardClient  # noqa: E402
from diloco.services.contract.state import state_hash  # noqa: E402
from diloco.localcluster.processes import free_ports  # noqa: E402
from diloco.services.contract.codecs import get_codec  # noqa: E402
from diloco.services.contract.error_feedback import ErrorFeedback  # noqa: E402
from diloco.services.contract.config import RpcConfig, load_config  # noqa: E402
from diloco.services.contract.payload import Reassembler, iter_chunks  # noqa: E402
from diloco.services.contract.rpc import Server  # noqa: E402
from diloco.services.contract.wire import pb, pb_grpc  # noqa: E402
from diloco.services.memory import keep_freed_memory  # noqa: E402
from diloco.syncer.merge import RoundAccumulator  # noqa: E402
from diloco.syncer.outer import OuterOptimizer  # noqa: E402

TARGET_PUSH_VS_RAW = 0.9  # issue 53
TARGET_PULL_VS_RAW = 0.6
TARGET_ROUND_VS_IN_PROCESS = 0.5
BLOCK = 128
ROUNDS_PER_ITERATION = 3  # the push path's two shapes, then a whole round
PULLERS = 16  # learners that pull one (anchor, value) pair together: one encode for them all
TENSORS = 8  # the parameter set is TENSORS equal tensors, packed into --fragments fragments
INT4 = get_codec("int4")


class Sink(pb_grpc.SyncerServicer):
    """The raw baseline: takes a push stream and only counts its bytes; a pull streams back the
    last payload pushed for that fragment."""

    def __init__(self):
        self.last: dict[int, bytes] = {}

    def PushFragment(self, request_iterator, context):
        header = next(request_iterator).header
        payload = b"".join(request.chunk.data for request in request_iterator)
        self.last[header.fragment_id] = payload
        return pb.PushResponse(result=pb.PUSH_RESULT_ACCEPTED, round=len(payload))

    def PullFragment(self, request, context):
        for chunk in iter_chunks(self.last[request.fragment_id]):
            yield pb.PullResponse(chunk=chunk)


def serve_sink(port: int) -> None:
    keep_freed_memory()  # the shard's malloc settings: the ratio is the push path's own work
    server = Server(RpcConfig(), ["diloco.v1.Syncer"])  # the shard's message limits and keepalive
    pb_grpc.add_SyncerServicer_to_server(Sink(), server.grpc_server)
    server.start(f"127.0.0.1:{port}")
    server.serve_until_signal(drain_seconds=0)


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


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used (this one's included if named)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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


def outer_gradients(pushers: int, fragments: list[tuple[int, int]]) -> list[dict[int, bytes]]:
    """Every pusher's int4 outer gradient of every fragment (fragment id, numel)."""
    return [{fragment: INT4.encode(torch.randn(n, generator=torch.Generator().manual_seed(i * 1000 + fragment)) * 1e-3, BLOCK)
             for fragment, n in fragments} for i in range(pushers)]


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a large torch copy moves (each byte read once and written once), median
    of a few; into a destination already touched, so that page faults are not counted."""
    source = torch.ones(megabytes * (1 << 20) // 4)
    destination = torch.empty_like(source).copy_(source)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        destination.copy_(source)
        seconds.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / statistics.median(seconds)


def logged_bytes_per_second(folder: Path, record_bytes: int, records: int = 32) -> float:
    """Appending records of one push's size to a file in the shards' state folder, each made
    durable (fdatasync) before the next, as a push waits for its log record: median rate."""
    folder.mkdir(parents=True, exist_ok=True)
    record = os.urandom(record_bytes)
    fd = os.open(folder / "log-bandwidth", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    seconds = []
    try:
        for _ in range(records):
            started = time.perf_counter()
            os.write(fd, record)
            os.fdatasync(fd)
            seconds.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        (folder / "log-bandwidth").unlink()
    return record_bytes / statistics.median(seconds)


def round_bytes_per_parameter(pushers: int) -> float:
    """The least memory traffic of a round's arithmetic per fp32 parameter: read the M int4
    contributions, read and write the value, the momentum and the error-feedback residual (4
    bytes each way), write the int4 update. Temporaries that stay in cache cost nothing."""
    int4 = 0.5 + 4 / BLOCK  # a code per parameter, a float32 scale per block
    return pushers * int4 + 3 * (4 + 4) + int4


class InProcessRound:
    """One round's arithmetic in this process: what the shards compute, without the wire, the
    processes or the durable log. Its rounds are timed between the shards' rounds, so that
    other load on the machine hits both alike."""

    def __init__(self, args: argparse.Namespace):
        numel = args.params // args.fragments
        self.fragments = [(fragment, numel) for fragment in range(args.fragments)]
        self.payloads = outer_gradients(args.pushers, self.fragments)
        self.optimizer = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
        self.value = {fragment: torch.zeros(n) for fragment, n in self.fragments}
        self.momentum = {fragment: torch.zeros(n) for fragment, n in self.fragments}
        self.feedback = {fragment: ErrorFeedback(INT4, n, BLOCK) for fragment, n in self.fragments}
        self.seconds: list[float] = []
        self.run()  # warm-up (allocations), as the shards' first round is
        self.seconds.clear()

    def run(self) -> None:
        started = time.perf_counter()
        for fragment, n in self.fragments:
            accumulator = RoundAccumulator(n, "rda")
            for per_pusher in self.payloads:  # decoded into the accumulator's buffer, as the shards do
                delta = INT4.decode(per_pusher[fragment], n, BLOCK, out=accumulator.scratch())
                accumulator.add(delta, 1.0, float(torch.linalg.vector_norm(delta)))
            merged = accumulator.merged()
            update = self.optimizer.end_period(self.momentum[fragment], merged, merged)
            _, self.value[fragment] = self.feedback[fragment].compress_apply(update, self.value[fragment])
        self.seconds.append(time.perf_counter() - started)


def measure_shards(args: argparse.Namespace, num_shards: int, in_process: InProcessRound,
                   state_root: str | None) -> dict:
    """Rounds of M pushers against `num_shards` shard processes (their state under
    `state_root`, default a temporary folder) and as many raw sinks, each followed by an
    in-process round."""
    work = Path(tempfile.mkdtemp(prefix="bench-syncer-"))  # the config, and the state unless state_root
    state_dir = Path(state_root) / f"shards-{num_shards}" if state_root else work / "state"
    learners = [f"pusher-{i}" for i in range(args.pushers)] + ["observer"]
    pullers = [f"puller-{i}" for i in range(PULLERS)]  # in the config, never joined: rounds do not wait for them
    ports = free_ports(2 * num_shards)  # the shards', then the raw baselines'
    config_path = work / "cluster.yaml"
    config_path.write_text(yaml.safe_dump({
        "run": {"state_dir": str(state_dir)},
        "shards": [{"address": f"127.0.0.1:{port}", "metrics_port": 0} for port in ports[:num_shards]],
        "learners": [{"id": learner, "region": "bench"} for learner in learners + pullers],
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
    shard_addresses = [shard.address for shard in cfg.shards]
    sink_addresses = [f"127.0.0.1:{port}" for port in ports[num_shards:]]
    processes = [
        subprocess.Popen([sys.executable, "-m", "diloco", "--log-level", "WARNING", "syncer",
                          "--config", str(config_path), "--shard-index", str(index), "--listen", address],
                         cwd=ROOT, env=env)
        for index, address in enumerate(shard_addresses)
    ] + [subprocess.Popen([sys.executable, __file__, "--sink", address.rsplit(":", 1)[1]], cwd=ROOT, env=env)
         for address in sink_addresses]
    clients: list[ShardClient] = []
    try:
        for address, process in zip(shard_addresses + sink_addresses, processes):
            wait_serving(address, process)
        numel = args.params // TENSORS
        manifest = [(f"layers.{i}.weight", (numel,)) for i in range(TENSORS)]
        incarnation = time.time_ns()

        def connect(addresses: list[str], learner: str) -> list[ShardClient]:
            return [ShardClient(address, cfg.rpc, learner, incarnation, identity=None) for address in addresses]

        pushers = [connect(shard_addresses, learner) for learner in learners[:-1]]
        observer = connect(shard_addresses, "observer")
        sinks = [connect(sink_addresses, learner) for learner in learners[:-1]]
        clients = [c for group in pushers + [observer] + sinks for c in group]
        owner: dict[int, int] = {}  # fragment id -> shard index
        fragments: list[tuple[int, int]] = []
        for shard, client in enumerate(pushers[0]):
            for fragment in client.join("bench", manifest).fragments:
                owner[fragment.fragment_id] = shard
                fragments.append((fragment.fragment_id, fragment.numel))
        for client in [c for group in pushers[1:] + [observer] for c in group]:
            client.join("bench", manifest)
        for fragment, n in fragments:  # every learner starts from the same value
            pushers[0][owner[fragment]].push(fragment, torch.zeros(n), codec="fp32", block_size=BLOCK,
                                             kind=pb.PUSH_KIND_SEED)
        values = [{fragment: value_after(pusher[owner[fragment]].pull(fragment), None) for fragment, _ in fragments}
                  for pusher in pushers]
        payloads = outer_gradients(args.pushers, fragments)
        payload_bytes = sum(len(p) for per_pusher in payloads for p in per_pusher.values())
        contributions = args.pushers * len(fragments)
        disk = logged_bytes_per_second(state_dir, max(len(p) for p in payloads[0].values()))
        print(f"{num_shards} shard process(es), M={args.pushers} pushers, {args.params / 1e6:.0f}M fp32 parameters "
              f"in {len(fragments)} fragments, int4/{BLOCK}: {payload_bytes / 1e6:.0f} MB per round; "
              f"state in {state_dir}", flush=True)

        def push_one(links, i, fragment, n, base_version):
            reply = links[owner[fragment]].push(
                fragment, payloads[i][fragment], numel=n, codec=INT4, block_size=BLOCK,
                base_version=base_version, c_steps=24, c_tokens=24 * 1024, step_seconds=0.1)
            if reply.result != pb.PUSH_RESULT_ACCEPTED:
                raise RuntimeError(f"push not accepted: {reply}")

        def concurrently(links, base_version):
            """Every pusher streams every fragment at once, as a learner's sync threads (one per
            fragment) may: the shard takes M x P streams together."""
            return in_parallel([lambda i=i, f=f, n=n: push_one(links[i], i, f, n, base_version)
                                for i in range(args.pushers) for f, n in fragments])

        def one_at_a_time(links, base_version, in_step=False):
            """Each pusher streams its fragments one after another; out of step, each starting at
            a fragment of its own, as learners that never wait for one another do."""
            def push_all(i):
                start = 0 if in_step else i % len(fragments)
                for fragment, n in fragments[start:] + fragments[:start]:
                    push_one(links[i], i, fragment, n, base_version)
            return in_parallel([lambda i=i: push_all(i) for i in range(args.pushers)])

        def pull_all(i, version):
            """As a learner's client takes the round's update: received, checksummed, decoded and applied."""
            for fragment, _ in fragments:
                result = pushers[i][owner[fragment]].pull(fragment, version, min_version=version + 1)
                values[i][fragment] = value_after(result, values[i][fragment])

        def pull_served(i, version, wait=False):
            """What the shard serves, received and checksummed as a learner does, not decoded;
            with wait, a pull that waits for the round to close."""
            for fragment, _ in fragments:
                request = pb.PullRequest(learner_id=learners[i], fragment_id=fragment, base_version=version,
                                         min_version=version + 1, max_wait_seconds=600 if wait else 0)
                assembler = None
                for response in pushers[i][owner[fragment]].stub.PullFragment(request, timeout=600):
                    if response.HasField("header"):
                        assembler = Reassembler(response.header.payload)
                    else:
                        assembler.add(response.chunk)
                assembler.finish()

        def pull_raw(i):
            for fragment, _ in fragments:
                stub = sinks[i][owner[fragment]].stub
                request = pb.PullRequest(learner_id=learners[i], fragment_id=fragment)
                sum(len(response.chunk.data) for response in stub.PullFragment(request, timeout=600))

        def close_rounds(version):
            """The observer's goodbye lets every round close; the pushers' pulls wait for that.
            The observer is back for the next round."""
            in_parallel([client.leave for client in observer] +
                        [lambda i=i: pull_served(i, version, wait=True) for i in range(args.pushers)])
            for client in observer:
                client.join("bench", manifest)

        times = {name: [] for name in ("raw", "push", "raw_sequential", "push_sequential", "raw_pull", "pull",
                                       "served", "round")}
        servers = {"raw": [p.pid for p in processes[num_shards:]], "push": [p.pid for p in processes[:num_shards]]}
        cpu = {"raw": [], "push": []}  # CPU seconds of (the servers, the pushers' process) per phase

        def measured_cpu(phase: str, run: Callable[[], float]) -> float:
            before = cpu_seconds(servers[phase]), cpu_seconds([os.getpid()])
            seconds = run()
            cpu[phase].append((cpu_seconds(servers[phase]) - before[0], cpu_seconds([os.getpid()]) - before[1]))
            return seconds
        for version in range(0, ROUNDS_PER_ITERATION * args.rounds, ROUNDS_PER_ITERATION):
            times["raw"].append(measured_cpu("raw", lambda: concurrently(sinks, version)))
            times["push"].append(measured_cpu("push", lambda: concurrently(pushers, version)))
            close_rounds(version)
            times["raw_pull"].append(in_parallel([lambda i=i: pull_raw(i) for i in range(args.pushers)]))
            times["pull"].append(in_parallel([lambda i=i: pull_all(i, version) for i in range(args.pushers)]))
            times["served"].append(in_parallel([lambda i=i: pull_served(i, version) for i in range(args.pushers)]))
            times["raw_sequential"].append(one_at_a_time(sinks, version + 1))
            times["push_sequential"].append(one_at_a_time(pushers, version + 1))
            close_rounds(version + 1)
            in_parallel([lambda i=i: pull_all(i, version + 1) for i in range(args.pushers)])  # untimed: keep the values
            # A whole round as a run has it: the observer is away, every pusher pushes the
            # fragments in order and each fragment's round closes on its last push, which is
            # acknowledged once the new version is installed (pulls are timed above).
            for client in observer:
                client.leave()
            times["round"].append(one_at_a_time(pushers, version + 2, in_step=True))
            in_parallel([lambda i=i: pull_all(i, version + 2) for i in range(args.pushers)])
            for client in observer:
                client.join("bench", manifest)
            in_process.run()
        for shard, client in enumerate(observer):  # every pusher holds the shards' bits
            for fragment in client.status().fragments:
                assert fragment.version == ROUNDS_PER_ITERATION * args.rounds, fragment
                assert all(state_hash(v[fragment.fragment_id]) == fragment.state_hash for v in values)

        # PULLERS learners holding the same value pull fragment 0 two rounds later, together: a
        # delta from their anchor, encoded once (counted by the shard) and served to each.
        first, first_numel = fragments[0]
        version = ROUNDS_PER_ITERATION * args.rounds
        readers = [connect([shard_addresses[owner[first]]], puller)[0] for puller in pullers]
        clients += readers
        anchors = [value_after(reader.pull(first), None) for reader in readers]  # a snapshot each: on the lineage
        for client in observer:
            client.leave()
        for base in (version, version + 1):
            in_parallel([lambda i=i: push_one(pushers[i], i, first, first_numel, base) for i in range(args.pushers)])
        counted = observer[owner[first]].status().counters
        shared_s = in_parallel([lambda reader=reader, anchor=anchor: reader.pull(
            first, version, anchor_hash=state_hash(anchor)) for reader, anchor in zip(readers, anchors)])
        after = observer[owner[first]].status().counters
        encodes, reuses = (after.get(f"pulls.{answer}", 0) - counted.get(f"pulls.{answer}", 0)
                           for answer in ("delta_encoded", "delta_reused"))
        median = {name: statistics.median(seconds) for name, seconds in times.items()}
        raw_s, push_s, raw_seq_s, push_seq_s = (median[name] for name in ("raw", "push", "raw_sequential",
                                                                          "push_sequential"))
        raw_pull_s, pull_s, served_s, round_s = (median[name] for name in ("raw_pull", "pull", "served", "round"))
        # every pushed byte crosses gRPC and is made durable: neither rate can be beaten
        bound = min(payload_bytes / raw_s, disk)
        megabytes = payload_bytes / 1e6
        cpu_figures = {phase: {"server_ms_per_mb": 1e3 * statistics.median(c[0] for c in cpu[phase]) / megabytes,
                               "pushers_ms_per_mb": 1e3 * statistics.median(c[1] for c in cpu[phase]) / megabytes,
                               "cores_busy": statistics.median((c[0] + c[1]) / t for c, t in zip(cpu[phase], times[phase]))
                               / os.cpu_count()}
                       for phase in cpu}
        return {"shards": num_shards, "bytes_per_round": payload_bytes,
                "raw_push_mbytes_per_second": payload_bytes / raw_s / 1e6,
                "push_mbytes_per_second": payload_bytes / push_s / 1e6, "push_vs_raw": raw_s / push_s,
                "push_vs_raw_by_iteration": [raw / push for raw, push in zip(times["raw"], times["push"])],
                "raw_push_sequential_mbytes_per_second": payload_bytes / raw_seq_s / 1e6,
                "push_sequential_mbytes_per_second": payload_bytes / push_seq_s / 1e6,
                "push_sequential_vs_raw": raw_seq_s / push_seq_s,
                "raw_pull_mbytes_per_second": payload_bytes / raw_pull_s / 1e6,
                "pull_mbytes_per_second": payload_bytes / pull_s / 1e6, "pull_decoded_vs_raw": raw_pull_s / pull_s,
                "pull_served_mbytes_per_second": payload_bytes / served_s / 1e6, "pull_vs_raw": raw_pull_s / served_s,
                "state_dir": str(state_root or "a temporary folder"), "log_mbytes_per_second": disk / 1e6,
                "push_bound_mbytes_per_second": bound / 1e6, "push_vs_bound": payload_bytes / push_s / bound,
                "push_seconds": push_s, "round_seconds": round_s, "cpu": cpu_figures,
                "contributions_per_second": contributions / round_s,
                "params_per_second": contributions * args.params / len(fragments) / round_s,
                "shared_pulls": {"learners": PULLERS, "encodes": encodes, "reuses": reuses, "seconds": shared_s,
                                 "fragment_params": first_numel}}
    finally:
        for client in clients:
            client.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=64_000_000)
    parser.add_argument("--pushers", type=int, default=4, help="M: concurrent pushing learners")
    parser.add_argument("--fragments", type=int, default=4, help="P: the parameters split into P fragments")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, nargs="+", default=[1], help="shard counts to measure, in turn")
    parser.add_argument("--state-dir", help="where the shards keep their state (default: a temporary folder)")
    parser.add_argument("--memory-state", action="store_true",
                        help="also one shard with its state in /dev/shm: the push path without the disk's share")
    parser.add_argument("--json", help="also write the figures here (bench/run_all.py reads them)")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)  # internal: serve the raw baseline
    args = parser.parse_args()
    if args.sink:
        serve_sink(args.sink)
        return 0

    in_process = InProcessRound(args)
    runs = [measure_shards(args, num_shards, in_process, args.state_dir) for num_shards in args.shards]
    memory_run = None
    if args.memory_state:
        memory_root = tempfile.mkdtemp(prefix="bench-syncer-", dir="/dev/shm")
        try:
            memory_run = measure_shards(args, 1, in_process, memory_root)
        finally:
            shutil.rmtree(memory_root, ignore_errors=True)
    in_process_s = statistics.median(in_process.seconds)
    in_process_rate = args.pushers * args.params / in_process_s
    bandwidth = memory_bandwidth()
    bytes_per_parameter = round_bytes_per_parameter(args.pushers)
    in_process_of_bandwidth = args.params * bytes_per_parameter / in_process_s / bandwidth
    for run in runs + ([memory_run] if memory_run else []):
        print(f"{run['shards']} shard(s), state in {run['state_dir']}:")
        print(f"  raw gRPC push streams  {run['raw_push_mbytes_per_second']:8.0f} MB/s, all at once")
        print(f"  push path (durable)    {run['push_mbytes_per_second']:8.0f} MB/s = {run['push_vs_raw']:.2f} x raw "
              f"(target >= {TARGET_PUSH_VS_RAW}); the state's disk logs {run['log_mbytes_per_second']:.0f} MB/s of "
              f"push-sized records (fdatasync each), so at most {run['push_bound_mbytes_per_second']:.0f} MB/s: "
              f"{run['push_vs_bound']:.2f} of that; {min(run['push_vs_raw_by_iteration']):.2f} to "
              f"{max(run['push_vs_raw_by_iteration']):.2f} x raw in single iterations")
        cpu = run["cpu"]
        print(f"  CPU per MB, all at once  the servers: push path {cpu['push']['server_ms_per_mb']:.2f} ms, raw "
              f"{cpu['raw']['server_ms_per_mb']:.2f} ms; the pushers {cpu['push']['pushers_ms_per_mb']:.2f} and "
              f"{cpu['raw']['pushers_ms_per_mb']:.2f} ms; the machine's {os.cpu_count()} cores "
              f"{cpu['push']['cores_busy']:.0%} and {cpu['raw']['cores_busy']:.0%} busy")
        print(f"  raw, one at a time     {run['raw_push_sequential_mbytes_per_second']:8.0f} MB/s, each pusher's "
              f"streams one after another")
        print(f"  push path, the same    {run['push_sequential_mbytes_per_second']:8.0f} MB/s = "
              f"{run['push_sequential_vs_raw']:.2f} x raw (each push waits for its record's fdatasync)")
        print(f"  raw gRPC pull stream   {run['raw_pull_mbytes_per_second']:8.0f} MB/s")
        print(f"  pull path (served)     {run['pull_served_mbytes_per_second']:8.0f} MB/s = {run['pull_vs_raw']:.2f} x raw "
              f"(target >= {TARGET_PULL_VS_RAW})")
        print(f"  pull, client decoding  {run['pull_mbytes_per_second']:8.0f} MB/s = {run['pull_decoded_vs_raw']:.2f} x raw")
        shared = run["shared_pulls"]
        print(f"  {shared['learners']} learners pulling one (anchor, value) pair of {shared['fragment_params'] / 1e6:.1f}M "
              f"values: {shared['encodes']} encode(s), {shared['reuses']} reused, {shared['seconds']:.2f} s in all")
        print(f"  whole rounds           {run['contributions_per_second']:8.1f} contributions/s, "
              f"{run['params_per_second'] / 1e6:.0f}M fp32 parameters/s = "
              f"{run['params_per_second'] / in_process_rate:.2f} x in-process (target >= {TARGET_ROUND_VS_IN_PROCESS}; "
              f"{run['round_seconds']:.2f} s per round, of which the push path alone takes {run['push_seconds']:.2f} s)")
    print(f"in-process torch arithmetic of a round: {in_process_rate / 1e6:.0f}M fp32 parameters/s "
          f"({in_process_s:.2f} s per round) = {in_process_of_bandwidth:.2f} of the memory bandwidth's bound "
          f"({bandwidth / 1e9:.1f} GB/s measured, {bytes_per_parameter:.1f} bytes per parameter)")
    if len(runs) > 1:
        print(f"{runs[-1]['shards']} shards vs {runs[0]['shards']}: "
              f"{runs[-1]['params_per_second'] / runs[0]['params_per_second']:.2f} x the round throughput")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "params": args.params, "pushers": args.pushers, "fragments": args.fragments, "rounds": args.rounds,
            "codec": "int4", "cores": os.cpu_count(), "target_push_vs_raw": TARGET_PUSH_VS_RAW, "target_pull_vs_raw": TARGET_PULL_VS_RAW,
            "target_round_vs_in_process": TARGET_ROUND_VS_IN_PROCESS, "runs": runs, "memory_run": memory_run,
            "in_process_round_seconds": in_process_s, "in_process_params_per_second": in_process_rate,
            "memory_bytes_per_second": bandwidth, "round_bytes_per_parameter": bytes_per_parameter,
            "in_process_of_memory_bandwidth": in_process_of_bandwidth}, indent=1))
    met = all(run["push_vs_raw"] >= TARGET_PUSH_VS_RAW and run["pull_vs_raw"] >= TARGET_PULL_VS_RAW
              and run["params_per_second"] / in_process_rate >= TARGET_ROUND_VS_IN_PROCESS for run in runs)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
