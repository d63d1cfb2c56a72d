"""Islands of replica groups in a local cluster (config island.replica_groups > 1).

Each learner island is its replica groups, one process each, and a torchft lighthouse
(localcluster/lighthouse.py) that decides which groups are in. The cluster's learner process is
group 0, which leads the island from the start (LocalCluster.learners, as for any learner); this
module starts the lighthouses and the other groups, and, like a supervisor (Kubernetes' restart
policy in a deployment), restarts any group, group 0 too, that died or exited with an error after
the restart delay. A group that exits 0 has finished with its island. `diloco sim
--chaos-replicas` kills groups, the leading one too (another group takes the lead).
"""
from __future__ import annotations

import logging
import pathlib
import sys

from diloco.learner.island.leader_lease import LeaderLease
from diloco.localcluster.chaos import Chaos
from diloco.localcluster.processes import Proc, free_ports
from diloco.services.contract.config import Config

log = logging.getLogger(__name__)


class Islands:
    """The lighthouses and the replica groups of every learner: `groups` those besides group 0,
    `members` every group (group 0, the cluster's learner process, once `adopt` gave it)."""

    def __init__(self, cfg: Config, run_dir: pathlib.Path, learner_argv: dict[str, list[str]],
                 warm_restarts: bool = False):
        groups, island = cfg.island.replica_groups, cfg.island
        self.state_dir = pathlib.Path(cfg.run.state_dir)
        ports = free_ports(len(cfg.learners))
        self.lighthouse_urls = {l.id: f"http://127.0.0.1:{port}" for l, port in zip(cfg.learners, ports)}
        # Waits for a straggler (a leader evaluating, say) long enough that the groups do not
        # form a quorum without it; a dead group is dropped once its heartbeats stop.
        self.lighthouses = [
            Proc(f"{l.id}-lighthouse", [sys.executable, "-m", "diloco.localcluster.lighthouse", "--min_replicas", "1",
                                        "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "60000",
                                        "--heartbeat_timeout_ms", str(int(island.heartbeat_timeout_seconds * 1000)),
                                        "--quorum_tick_ms", "50"],
                 run_dir / "logs" / f"{l.id}-lighthouse.log", env={"RUST_LOG": "warn"})
            for l, port in zip(cfg.learners, ports)]
        self.groups = [  # every group but group 0, learner by learner
            Proc(f"{l.id}-group-{g}", learner_argv[l.id] + self.group_flags(l.id, g),
                 run_dir / "logs" / f"{l.id}-group-{g}.log", warm_restarts=warm_restarts)
            for l in cfg.learners for g in range(1, groups)]
        self.members = list(self.groups)

    def adopt(self, first_groups: list[Proc]) -> None:
        """Each learner's group 0 (the cluster's learner processes), supervised with the others."""
        self.members = first_groups + self.groups

    def group_flags(self, learner_id: str, group: int) -> list[str]:
        return ["--replica-group", str(group), "--lighthouse", self.lighthouse_urls[learner_id]]

    def start(self) -> None:
        for proc in self.lighthouses + self.groups:
            proc.start()

    def supervise(self, chaos: Chaos, now: float, finished: set[str], spared: frozenset[str] = frozenset()) -> None:
        """One pass of the supervisor and of the groups' chaos: a group that died is restarted
        after the restart delay; chaos kills a group now and then, but not once its island is
        done, nor in the islands of the `spared` learners."""
        for i, proc in enumerate(self.members):
            island = learner_of(proc.name)
            if island in finished or island in spared:
                chaos.retire(i)
            if i not in chaos.down and proc.returncode not in (None, 0):
                log.warning("replica group %s exited with %s; restarting it", proc.name, proc.returncode)
                chaos.killed(i, now)
        for i in chaos.due_kills(now):
            proc = self.members[i]
            led = self.leads(proc)
            proc.kill()
            chaos.killed(i, now, led=led)
            log.info("chaos: killed replica group %s%s", proc.name, " (it led its island)" if led else "")
        for downtime in chaos.due_restarts(now):
            self.members[downtime.proc_index].start()
            chaos.restarted(downtime, now)

    def leads(self, proc: Proc) -> bool:
        """Whether the group holds its island's lease (learner/island/leader_lease.py)."""
        lease = self.state_dir / f"learner-{learner_of(proc.name)}" / "leader.lock"
        return proc.running and LeaderLease.holder(lease) == proc.popen.pid

    def stop(self, timeout: float) -> None:
        """The groups (their leaders stopped them, or SIGTERM does), then the lighthouses."""
        for proc in self.groups:
            proc.request_stop()
        for proc in self.groups:
            proc.wait_or_kill(timeout)
        for proc in self.lighthouses:
            proc.terminate(timeout)

    @property
    def processes(self) -> list[Proc]:
        return self.lighthouses + self.groups


def learner_of(group_name: str) -> str:
    """The learner whose island a group process belongs to (group 0 is named as its learner)."""
    return group_name.rsplit("-group-", 1)[0]


def recoveries(chaos_events: list[dict], changes: list[dict], names: list[str], learner_id: str,
               lives: list[dict] = ()) -> list[dict]:
    """For each kill of one of `learner_id`'s groups: how long its leader took to train again
    without it (the first step with fewer groups; where the killed group led, until the life of
    the learner that took the lead began to train, from the report's `lives`) and, from the start
    of the life that came back (a group killed again while starting has several), to train with
    it again, from the leader's record of the groups in each step."""
    found = []
    for kill in (e for e in chaos_events if e["event"] == "kill" and e["kind"] == "replica"
                 and learner_of(names[e["index"]]) == learner_id):
        after = [c for c in changes if c["time"] >= kill["time"]]
        # The first change after the kill, if it is the loss (a group still starting was not in).
        fewer = after[0] if after and after[0]["groups"] < _groups_before(changes, kill["time"]) else None
        took_lead = next((life["started"] for life in lives if life["started"] > kill["time"]), None)
        trained_again = (took_lead if kill.get("led") else None if fewer is None else fewer["time"])
        more = next((c for c in after if fewer is not None and c["groups"] > fewer["groups"]), None)
        restart = max((e["time"] for e in chaos_events if e["event"] == "restart" and e["kind"] == "replica"
                       and e["index"] == kill["index"] and more is not None and e["time"] <= more["time"]),
                      default=None)
        found.append({"group": names[kill["index"]], "led": kill.get("led", False), "killed_at": kill["time"],
                      "trained_again_seconds": None if trained_again is None else trained_again - kill["time"],
                      "rejoined_seconds_after_restart": None if restart is None else more["time"] - restart})
    return found


def _groups_before(changes: list[dict], at: float) -> int:
    before = [c["groups"] for c in changes if c["time"] < at]
    return before[-1] if before else 0


def leader_kills(chaos_events: list[dict], names: list[str], learner_id: str, index: int,
                 lives: list[dict]) -> tuple[list[dict], float]:
    """`learner_id`'s kills of the group that led its island, as learner kills (`index` its
    learner's), each followed at once by a restart: the life of the group that took the lead,
    which began when it took it (its start-up and restore precede its record's `started`).
    And the seconds the learner had no leader, from each such kill to that takeover."""
    events, leaderless = [], 0.0
    for kill in (e for e in chaos_events if e["event"] == "kill" and e["kind"] == "replica" and e.get("led")
                 and learner_of(names[e["index"]]) == learner_id):
        successor = next((life for life in lives if life["started"] > kill["time"]), None)
        if successor is None:
            continue
        took_lead = successor["started"] - successor["startup_seconds"] - successor["restore_seconds"]
        leaderless += max(0.0, took_lead - kill["time"])
        events += [{"event": "kill", "index": index, "time": kill["time"]},
                   {"event": "restart", "index": index, "time": max(kill["time"], took_lead)}]
    return events, leaderless
