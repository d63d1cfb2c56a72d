"""An island of replica groups that survives losing one (island.replica_groups > 1).

Each replica group is a process of its own. torchft does the fault tolerance: a Manager per
group, and a lighthouse per island that decides which groups are in. Every step the groups
average their gradients over a gloo process group that torchft rebuilds when a group dies or
joins; a group that joins (a repaired one, or one behind) first receives the island's current
state (parameters, inner optimizer, counters) from a healthy one, and nobody restarts.
torch.distributed.elastic was the other candidate: it restarts every worker of the job when one
fails, which is a learner restart by another name.

Group 0 is the island's leader: it alone talks to the syncer (as rank 0 does under torchrun) and
after each step shares what it applied, and whether to stop, with the other groups. Its state is
the island's: the others heal from it, never it from them, so losing it is a learner failure
(the other groups see it gone and exit; docs/reliability.md, "Losing a replica group").

Every step, on every group:  quorum (heal if behind) -> is the leader in? -> forward/backward
-> average gradients -> commit? -> optimizer step -> (committed) the leader's applied fragments.
"""
from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

from diloco.learner.island import IslandBroken
from diloco.services.contract.config import IslandConfig
from diloco.services.contract.fragments import FragmentPlan, gather, scatter

log = logging.getLogger(__name__)

LEADER = 0  # the replica group that syncs; the others heal from it
WAIT_FOR_LEADER_SECONDS = 0.2  # a group that has not met the leader yet asks again this often


class ReplicaGroups:
    """This process's replica group of an island; the Island interface (learner/island.py) over
    torchft. `world_size` is the number of groups in the current step: what the step's tokens
    are multiplied by."""

    def __init__(self, group: int, cfg: IslandConfig, lighthouse: str, device: torch.device):
        self.rank = group
        self.groups = cfg.replica_groups
        # NCCL moves GPU tensors only: what the groups exchange lives on the training GPU there.
        self.device = device if device.type == "cuda" else torch.device("cpu")
        timeout = timedelta(seconds=cfg.timeout_seconds)
        group_pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        # A group is one process: its own store, which torchft's Manager requires.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._manager = Manager(
            pg=group_pg, load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, replica_id=str(group), store_addr="127.0.0.1", store_port=self._store.port,
            rank=0, world_size=1, lighthouse_addr=lighthouse, timeout=timeout,
            # A step's quorum waits while the leader evaluates, checkpoints or starts up.
            quorum_timeout=timedelta(hours=1), connect_timeout=timedelta(seconds=60))
        self._met_leader = self.leader
        self._groups_now = 0
        self.changes: list[dict] = []  # when the groups in the step changed: time, step, groups
        self.dropped_steps = 0  # steps trained but not committed (a group died during them)
        self.verified: dict | None = None  # the last check that every group held the same bits

    @property
    def leader(self) -> bool:
        return self.rank == LEADER

    @property
    def world_size(self) -> int:
        return self._groups_now

    def keep_state(self, state: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a joining group receives (`state` on a healthy group, `load` on the joining one)."""
        def load_unless_leader(value: dict) -> None:
            if self.leader:
                raise IslandBroken("replica group 0 was behind another group: it stops, as a learner failure")
            load(value)
            log.info("replica group %d joined the island with its state", self.rank)

        self._manager.register_state_dict_fn("island", load_unless_leader, state)

    # ---- a step ----------------------------------------------------------------------

    def begin_step(self) -> bool:
        """Before the forward pass: the step's quorum (a group behind takes the island's state
        here); a group that has not met the leader yet waits for it. True when the island
        regrouped (a group lost or back) since its last step: it stood still meanwhile."""
        while True:
            self._manager.start_quorum()
            present = torch.tensor([int(self.leader)], dtype=torch.int64, device=self.device)
            self._manager.allreduce(present, reduce_op=ReduceOp.SUM).wait()
            if self._manager.errored():
                break  # the step is dropped at commit, whoever is in
            if present.item() == 1:
                self._met_leader = True
                break
            if self._met_leader:
                raise IslandBroken(f"replica group {self.rank}: the island's leader (group 0) left; "
                                   "the island stops, as a learner failure")
            time.sleep(WAIT_FOR_LEADER_SECONDS)
        groups = self._manager.num_participants()
        if groups == self._groups_now:
            return False
        regrouped = self._groups_now > 0  # not the island's first quorum
        self.changes.append({"time": time.time(), "step": self._manager.current_step(), "groups": groups})
        log.info("replica group %d: %d of %d groups train from step %d", self.rank, groups, self.groups,
                 self._manager.current_step())
        self._groups_now = groups
        return regrouped

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """The mean of every group's gradients, in place (one all-reduce of them all)."""
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def commit(self) -> bool:
        """Whether to step the optimizer: False when a group failed during the step (the step is
        dropped everywhere and the next quorum leaves that group out)."""
        committed = self._manager.should_commit()
        if not committed:
            self.dropped_steps += 1
        return committed

    # ---- the Island interface --------------------------------------------------------

    def share_start(self, params: dict[str, torch.Tensor], counters: list[int]) -> list[int]:
        """The leader's step count leads torchft's (by one), so a group that joins is always the
        one behind and heals from the leader; the others' counters arrive with that state."""
        if self.leader:
            self._manager.load_state_dict({"step": counters[0] + 1, "batches_committed": 0})
        return counters

    def share_step(self, plan: FragmentPlan, applied: list[int], stop: bool,
                   params: dict[str, torch.Tensor]) -> tuple[list[int], bool]:
        """After a committed step: the leader's applied fragment values and its decision to stop
        reach every group. Sums where only the leader contributes, over the values' bits (int32),
        so every group ends with the leader's exact bits. A group that misses them cannot be
        trusted: it raises and its process exits (it rejoins with the leader's state)."""
        flags = torch.zeros(len(plan.fragments) + 1, dtype=torch.int64, device=self.device)
        if self.leader:
            flags[applied] = 1
            flags[-1] = stop
        self._reduce(flags)
        applied = flags[:-1].nonzero().flatten().tolist()
        for fragment_id in applied:
            fragment = plan.fragments[fragment_id]
            bits = gather(fragment, params).float().to(self.device).view(torch.int32) if self.leader else \
                torch.zeros(fragment.numel, dtype=torch.int32, device=self.device)
            self._reduce(bits)
            if not self.leader:
                scatter(fragment, bits.view(torch.float32), params)
        return applied, bool(flags[-1])

    def gather(self, value) -> list:
        """Each group keeps its own data position; only the leader checkpoints (its own)."""
        return [value]

    def verify_identical(self, params: dict[str, torch.Tensor]) -> None:
        """Checks that every group in the step holds the leader's bits (each puts its digest in
        its own row; a group not in the step leaves its row zero). Raises on every group."""
        digest = hashlib.sha256(b"".join(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                                         for p in params.values())).digest()
        rows = torch.zeros(self.groups, 8, dtype=torch.int64, device=self.device)
        rows[self.rank] = torch.tensor(list(digest[:8]), dtype=torch.int64)
        self._reduce(rows)
        present = [g for g in range(self.groups) if rows[g].any()]
        differ = [g for g in present if not torch.equal(rows[g], rows[LEADER])]
        if differ:
            raise RuntimeError(f"replica groups {differ} hold different parameters from the leader's")
        self.verified = {"step": self._manager.current_step(), "groups": len(present)}

    def record(self) -> dict:
        """For the leader's report: the island's groups and what losing and regaining them cost."""
        return {"replica_groups": self.groups, "changes": self.changes, "dropped_steps": self.dropped_steps,
                "verified": self.verified}

    def _reduce(self, tensor: torch.Tensor) -> None:
        self._manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        if self._manager.errored() and not self.leader:
            raise IslandBroken(f"replica group {self.rank} missed what the leader shared: it leaves the island "
                               f"({self._manager.errored()})")

    def close(self) -> None:
        self._manager.shutdown(wait=False)
