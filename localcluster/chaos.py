"""Failures on a schedule: processes SIGKILLed at exponentially distributed intervals and
restarted after a delay (`diloco sim --chaos-mtbf`, `--chaos-shards`; bench/run_all.py computes
the same schedule without starting anything)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Downtime:
    """A process killed by chaos and when it comes back."""
    proc_index: int
    killed_at: float
    restart_at: float


class Chaos:
    """Kills processes at exponentially distributed intervals (mean `mtbf` per process)
    and restarts each `restart_delay` seconds later. Every event is logged."""

    def __init__(self, kind: str, count: int, mtbf: float | None, restart_delay: float,
                 rng: random.Random, now: float):
        self.kind, self.mtbf, self.restart_delay, self.rng = kind, mtbf, restart_delay, rng
        self.next_kill = [self._draw(now) for _ in range(count)]
        self.down: dict[int, Downtime] = {}
        self.events: list[dict] = []
        self.down_seconds = [0.0] * count

    def _draw(self, now: float) -> float:
        return now + self.rng.expovariate(1.0 / self.mtbf) if self.mtbf else float("inf")

    def due_kills(self, now: float) -> list[int]:
        return [i for i, at in enumerate(self.next_kill) if at <= now and i not in self.down]

    def killed(self, index: int, now: float, last_step: int = 0, **detail) -> None:
        """`detail`: what else the event records (an island's group: whether it led)."""
        self.down[index] = Downtime(index, now, now + self.restart_delay)
        self.events.append({"event": "kill", "kind": self.kind, "index": index, "time": now,
                            "step": last_step, **detail})

    def due_restarts(self, now: float) -> list[Downtime]:
        return [d for d in self.down.values() if d.restart_at <= now]

    def restarted(self, downtime: Downtime, now: float) -> None:
        del self.down[downtime.proc_index]
        self.down_seconds[downtime.proc_index] += now - downtime.killed_at
        self.next_kill[downtime.proc_index] = self._draw(now)
        self.events.append({"event": "restart", "kind": self.kind, "index": downtime.proc_index,
                            "time": now})

    def end(self, now: float) -> None:
        """The run is over: a process still down was down until now."""
        for downtime in self.down.values():
            self.down_seconds[downtime.proc_index] += now - downtime.killed_at
        self.down.clear()

    def retire(self, index: int) -> None:
        """A finished process is not killed any more."""
        self.next_kill[index] = float("inf")

    def redraw_all(self, now: float) -> None:
        """Every process's next failure drawn afresh from now (a job restarted as a whole: the
        failures due while it was down happened to no running process)."""
        self.next_kill = [self._draw(now) for _ in self.next_kill]
