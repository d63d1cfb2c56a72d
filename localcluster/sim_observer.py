"""What `diloco sim` learns from the shards while it runs: each shard's Status, polled for the
learners' progress and the counters the report adds up."""
from __future__ import annotations

import time
from collections import Counter

import grpc

from diloco.services.client import ShardClient
from diloco.services.contract.config import Config
from diloco.services.contract.tls import Identity


class Observer:
    """Polls the shards' Status: learners' steps for progress and goodput over time,
    counters accumulated across shard restarts (a restarted shard counts from zero)."""

    def __init__(self, cfg: Config, identity: Identity | None):
        self.clients = [ShardClient(s.address, cfg.rpc, identity=identity) for s in cfg.shards]
        self.steps: dict[str, int] = {}
        self.counters_before_restart: Counter[str] = Counter()
        self.last_counters: list[Counter[str]] = [Counter() for _ in self.clients]
        self.last_status: list = [None for _ in self.clients]

    def poll(self, require_all: bool = False) -> None:
        """One Status call per shard; a shard that is down keeps its last answer, unless
        `require_all`, when it is retried (for up to a minute) until it answers."""
        for i, client in enumerate(self.clients):
            status = _status_of(client, retry_seconds=60 if require_all else 0)
            if status is None:
                if require_all:
                    raise RuntimeError(f"shard {i} did not answer Status for a minute")
                continue
            self.last_status[i] = status
            self.last_counters[i] = Counter(status.counters)
            for learner in status.learners:
                self.steps[learner.learner_id] = max(self.steps.get(learner.learner_id, 0), learner.last_step)

    def shard_restarting(self, index: int) -> None:
        self.counters_before_restart.update(self.last_counters[index])
        self.last_counters[index] = Counter()

    def counters(self) -> Counter[str]:
        return sum(self.last_counters, Counter(self.counters_before_restart))

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _status_of(client: ShardClient, retry_seconds: float):
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            return client.status(timeout=2)
        except grpc.RpcError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)
