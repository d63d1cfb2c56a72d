"""An island of replica groups that survives losing one (island.replica_groups > 1).

Each replica group is a process of its own. torchft does the fault tolerance: a Manager per
group, and a lighthouse per island that decides which groups are in. Every step the groups
average their gradients over a gloo process group that torchft rebuilds when a group dies or
joins; a group that joins (a repaired one, or one behind) first receives the island's current
state (parameters, inner optimizer, counters) from a healthy one, and nobody restarts.
torch.distributed.elastic was the other candidate: it restarts every worker of the job when one
fails, which is a learner restart by another name.

One group leads the island: it alone talks to the syncer (as rank 0 does under torchrun) and
after each step shares what it applied, and whether to stop, with the other groups. Its state is
the island's: the others heal from it, never it from them. The leader is the group holding the
island's lease (learner/island/leader_lease.py: a lock in the learner's state folder; group 0 takes it
at the start). When the leader dies its lease is free: the first group to find no leader in
its quorum takes the lease and the lead (LeadTaken), and goes on as the learner from the island's
last checkpoint (learner/trainer/main.py; docs/reliability.md, "Losing a replica group").

Every step, on every group:  quorum (heal if behind) -> which group leads? -> forward/backward
-> average gradients -> commit? -> optimizer step -> (committed) the leader's applied fragments.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

from diloco.learner.island.ranks import IslandBroken, LeadTaken, params_digest
from diloco.learner.island.leader_lease import LeaderLease
from diloco.services.contract.config import IslandConfig
from diloco.services.contract.fragments import FragmentPlan, gather, scatter

log = logging.getLogger(__name__)

WAIT_FOR_LEADER_SECONDS = 0.2  # a group without a leader in its quorum asks again this often
# A quorum that takes longer than this is the island regrouping (a group lost, or one joining and
# receiving the state), not a step's routine ask of the lighthouse.
ROUTINE_QUORUM_SECONDS = 0.25
# torchft heals the groups behind from one with the highest step: a leader counts its steps from
# its lease's term times this, above every group that followed an earlier leader.
TERM_STEPS = 1 << 40


class StandingStill:
    """Whether the island stands still, for the heartbeats (read on their thread): from a step
    dropped because a group failed during it until the next quorum is in, and in a quorum that
    outlasts a routine one. Shards do not hold rounds for an island that stands still."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._since: float | None = None  # when the quorum in progress (or the regroup) began
        self._regrouping = False

    def step_dropped(self) -> None:
        self._since, self._regrouping = self._clock(), True

    def quorum_started(self) -> None:
        if self._since is None:
            self._since = self._clock()

    def quorum_done(self) -> None:
        self._since, self._regrouping = None, False

    def __call__(self) -> bool:
        since = self._since
        return since is not None and (self._regrouping or self._clock() - since >= ROUTINE_QUORUM_SECONDS)


class ReplicaGroups:
    """This process's replica group of an island; the Island interface (learner/island/ranks.py) over
    torchft. `world_size` is the number of groups in the current step: what the step's tokens
    are multiplied by."""

    def __init__(self, group: int, cfg: IslandConfig, lighthouse: str, device: torch.device, lease: LeaderLease):
        self.rank = group
        self.lease = lease
        # Group 0 leads from the start, unless another group took the lead while it was down.
        self.leader = group == 0 and lease.try_take()
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
        self._leader_wait_seconds = cfg.leader_wait_seconds
        self._started = time.monotonic()
        self._leader_group = group if self.leader else None  # the group that led the last step
        self._missed_share: str | None = None  # why this follower missed what the leader shared
        self._island_state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None
        self._groups_now = 0
        self.standing_still = StandingStill()
        self.changes: list[dict] = []  # when the groups in the step changed: time, step, groups
        self.dropped_steps = 0  # steps trained but not committed (a group died during them)
        self.verified: dict | None = None  # the last check that every group held the same bits
        self.took_lead_at: float | None = None  # when this group took the lead from a leader that left

    @property
    def world_size(self) -> int:
        return self._groups_now

    def keep_state(self, state: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a joining group receives (`state` on a healthy group, `load` on the joining one);
        called again by a group that took the lead, with its new sync's."""
        first = self._island_state is None
        self._island_state = (state, load)
        if first:  # torchft takes one function per key, for good
            self._manager.register_state_dict_fn("island", self._load_island_state, lambda: self._island_state[0]())

    def _load_island_state(self, value: dict) -> None:
        if self.leader:
            raise IslandBroken(f"replica group {self.rank} led the island but was behind another group: it stops, "
                               "as a learner failure")
        self._island_state[1](value)
        log.info("replica group %d joined the island with its state", self.rank)

    # ---- a step ----------------------------------------------------------------------

    def begin_step(self) -> bool:
        """Before the forward pass: the step's quorum (a group behind takes the island's state
        here); a group that has not met the leader yet waits for it. True when the island
        regrouped (a group lost or back) since its last step: it stood still meanwhile.
        Raises LeadTaken in the group that takes the lead of an island whose leader left."""
        self.standing_still.quorum_started()
        try:
            return self._quorum()
        finally:
            self.standing_still.quorum_done()

    def _quorum(self) -> bool:
        while True:
            self._manager.start_quorum()
            leading = torch.zeros(self.groups, dtype=torch.int64, device=self.device)
            leading[self.rank] = int(self.leader)
            self._manager.allreduce(leading, reduce_op=ReduceOp.SUM).wait()
            if self._manager.errored():
                break  # the step is dropped at commit, whoever is in
            if leading.any():
                if self._missed_share:
                    raise IslandBroken(f"replica group {self.rank} missed what the leader shared: it leaves the "
                                       f"island ({self._missed_share})")
                self._met_leader = True
                self._leader_group = int(leading.nonzero()[0])
                break
            # A free lease that some group held means its leader left, whether or not this group
            # met it; one never held means the island is starting, and group 0 is given up to
            # island.leader_wait_seconds to take it.
            led_before = self._met_leader or self.lease.taken_before()
            waited_out = time.monotonic() - self._started >= self._leader_wait_seconds
            if (led_before or waited_out) and self.lease.try_take():
                left, self.leader, self._leader_group = self._leader_group, True, self.rank
                self.took_lead_at, self._missed_share = time.time(), None
                why = (f"the island's leader (group {left}) left" if left is not None else
                       "the island's leader left before this group met it" if led_before else
                       f"no leader came within island.leader_wait_seconds ({self._leader_wait_seconds:g} s)")
                raise LeadTaken(f"replica group {self.rank}: {why}; this group leads the island now, "
                                "from its last checkpoint")
            time.sleep(WAIT_FOR_LEADER_SECONDS)
        groups = self._manager.num_participants()
        if groups == self._groups_now:
            return False
        regrouped = self._groups_now > 0  # not the island's first quorum
        step = self._manager.current_step() % TERM_STEPS
        self.changes.append({"time": time.time(), "step": step, "groups": groups})
        log.info("replica group %d: %d of %d groups train from step %d", self.rank, groups, self.groups, step)
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
            self.standing_still.step_dropped()
        return committed

    # ---- the Island interface --------------------------------------------------------

    def share_start(self, params: dict[str, torch.Tensor], counters: list[int]) -> list[int]:
        """The leader's step count leads torchft's (by its term, and by one), so every other
        group is behind and heals from the leader, even one that followed a leader of an earlier
        term from a later checkpoint; the others' counters arrive with that state."""
        if self.leader:
            step = self.lease.term * TERM_STEPS + counters[0] + 1
            self._manager.load_state_dict({"step": step, "batches_committed": 0})
        return counters

    def share_step(self, plan: FragmentPlan, applied: list[int], stop: bool,
                   params: dict[str, torch.Tensor]) -> tuple[list[int], bool]:
        """After a committed step: the leader's applied fragment values and its decision to stop
        reach every group. Sums where only the leader contributes, over the values' bits (int32),
        so every group ends with the leader's exact bits. A group that misses them cannot be
        trusted to train on with this leader: at its next step it exits if the leader is still
        there (it rejoins with the leader's state), or takes the lead if the leader left (the
        checkpoint it restores replaces what it missed)."""
        flags = torch.zeros(len(plan.fragments) + 1, dtype=torch.int64, device=self.device)
        if self.leader:
            flags[applied] = 1
            flags[-1] = stop
        if not self._reduce_shared(flags):
            return [], False
        applied = flags[:-1].nonzero().flatten().tolist()
        for fragment_id in applied:
            fragment = plan.fragments[fragment_id]
            bits = gather(fragment, params).float().to(self.device).view(torch.int32) if self.leader else \
                torch.zeros(fragment.numel, dtype=torch.int32, device=self.device)
            if not self._reduce_shared(bits):
                return [], False
            if not self.leader:
                scatter(fragment, bits.view(torch.float32), params)
        return applied, bool(flags[-1])

    def gather(self, value) -> list:
        """Each group keeps its own data position; only the leader checkpoints (its own)."""
        return [value]

    def verify_identical(self, params: dict[str, torch.Tensor]) -> None:
        """Checks that every group in the step holds the leader's bits (each puts its digest in
        its own row; a group not in the step leaves its row zero). Raises on every group. A
        group that has not been in a step since it started (restarted after the island spent
        its budget) has no quorum to check in, and nothing trained to compare: it skips."""
        if self._groups_now == 0:
            log.info("replica group %d trained no step in this process: nothing to verify", self.rank)
            return
        rows = torch.zeros(self.groups, 8, dtype=torch.int64, device=self.device)
        rows[self.rank] = torch.tensor(list(params_digest(params)), dtype=torch.int64)
        self._reduce(rows)
        present = [g for g in range(self.groups) if rows[g].any()]
        differ = [g for g in present if not torch.equal(rows[g], rows[self._leader_group])]
        if differ:
            raise RuntimeError(f"replica groups {differ} hold different parameters from the leader's")
        self.verified = {"step": self._manager.current_step() % TERM_STEPS, "groups": len(present)}

    def record(self) -> dict:
        """For the leader's report: the island's groups and what losing and regaining them cost."""
        return {"replica_groups": self.groups, "leader_group": self.rank, "took_lead_at": self.took_lead_at,
                "changes": self.changes, "dropped_steps": self.dropped_steps, "verified": self.verified}

    def _reduce_shared(self, tensor: torch.Tensor) -> bool:
        """Sums what the leader shares; False where a group missed it (a follower remembers)."""
        self._manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        if self._manager.errored() and not self.leader:
            self._missed_share = str(self._manager.errored())
            return False
        return True

    def _reduce(self, tensor: torch.Tensor) -> None:
        if not self._reduce_shared(tensor):
            raise IslandBroken(f"replica group {self.rank} missed what the leader shared: it leaves the island "
                               f"({self._missed_share})")

    def close(self) -> None:
        self._manager.shutdown(wait=False)
        self.lease.release()
