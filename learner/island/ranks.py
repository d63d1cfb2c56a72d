"""A learner island: the processes of one learner under torchrun (DDP inside the island).
Rank 0 alone talks to the syncer; after each step it tells the other ranks which fragments it
applied (and their values) and whether to stop, so every rank stays identical and stops at the
same step. One process (no process group) is an island of one and none of this costs anything.

The broadcasts run where the process group's backend works: on the rank's GPU with NCCL (the
built-in learner's choice when it trains on GPUs), on the CPU with gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import xxhash

from diloco.services.contract.fragments import FragmentPlan, gather, scatter


def params_digest(params: dict[str, torch.Tensor]) -> bytes:
    """8 bytes of an xxh3-128 of every parameter's raw bytes, whatever the dtype (numpy has no
    bfloat16): equal on every rank or group that holds the same bits."""
    hasher = xxhash.xxh3_128()
    for param in params.values():
        hasher.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.digest()[:8]


class IslandBroken(RuntimeError):
    """This process cannot go on as part of its island of replica groups (it missed what the
    leader shared): it exits, and a restarted one rejoins with the island's state."""


class LeadTaken(Exception):
    """This replica group took the lead of its island, whose leader left: it goes on as the
    learner, from the island's last checkpoint (learner/trainer/main.py)."""


class Island:
    """The ranks of the default process group (the caller initialises it, as DDP needs it)."""

    def __init__(self):
        grouped = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if grouped else 1
        self.rank = dist.get_rank() if grouped else 0
        # NCCL only moves GPU tensors: the rank's current GPU (set before the group was made).
        nccl = grouped and dist.get_backend() == dist.Backend.NCCL
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @staticmethod
    def standing_still() -> bool:
        """Never: torchrun's ranks fail together (an island of replica groups regroups)."""
        return False

    def share_start(self, params: dict[str, torch.Tensor], counters: list[int]) -> list[int]:
        """Every rank starts from rank 0's weights (the global model) and counters."""
        if self.world_size == 1:
            return counters
        for tensor in params.values():
            dist.broadcast(tensor.data, src=0)
        shared = torch.tensor(counters, dtype=torch.int64, device=self.device)
        dist.broadcast(shared, src=0)
        return [int(v) for v in shared]

    def share_step(self, plan: FragmentPlan, applied: list[int], stop: bool,
                   params: dict[str, torch.Tensor]) -> tuple[list[int], bool]:
        """Rank 0's applied fragment values and its decision to stop reach every rank (one
        broadcast of flags, then one per applied fragment). Returns both on every rank."""
        if self.world_size == 1:
            return applied, stop
        flags = torch.zeros(len(plan.fragments) + 1, dtype=torch.uint8, device=self.device)
        flags[applied] = 1
        flags[-1] = stop
        dist.broadcast(flags, src=0)
        applied = flags[:-1].nonzero().flatten().tolist()
        for fragment_id in applied:
            fragment = plan.fragments[fragment_id]
            flat = gather(fragment, params).to(self.device) if self.leader else \
                torch.empty(fragment.numel, device=self.device)
            dist.broadcast(flat, src=0)
            if not self.leader:
                scatter(fragment, flat, params)
        return applied, bool(flags[-1])

    def gather(self, value) -> list:
        """Every rank's `value` (anything picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def record(self) -> dict | None:
        """Nothing for the report: the ranks fail together (an island of replica groups records)."""
        return None

    def verify_identical(self, params: dict[str, torch.Tensor]) -> None:
        """Checks that every rank holds the same bits (diloco learner --verify-island)."""
        if self.world_size == 1:
            return
        mine = torch.tensor(list(params_digest(params)), dtype=torch.uint8, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(mine, other) for other in every):
            raise RuntimeError(f"island ranks hold different parameters (rank {self.rank})")
