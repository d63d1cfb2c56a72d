"""Ctrl-C and SIGTERM on `diloco sim`: the first ends the run early, as --duration would
(every process is stopped the usual way, the summary is printed marked interrupted, the
report written); a second, or one during the cleanup, SIGKILLs every process of the run."""
from __future__ import annotations

import contextlib
import logging
import signal
from typing import Iterator, Protocol

log = logging.getLogger(__name__)


class Interrupted(BaseException):
    """A stop signal came while the run was going: raised in the main thread, caught by the
    loop that drives the run (`ends_early`); a second one (every process killed), or one
    before the run started, by `diloco sim`."""

    def __init__(self, signum: int, processes_killed: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.processes_killed = processes_killed


class Killable(Protocol):
    def kill_now(self) -> None: ...


class StopSignals:
    """Installed for the whole of `diloco sim`. `cleaning_up`: the run is over and its
    processes are being stopped; a signal then only hurries that along."""

    def __init__(self, processes: Killable):
        self.processes = processes
        self.cleaning_up = False
        self.received = 0
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame) -> None:
        self.received += 1
        if self.received > 1:
            log.warning("%s again: killing every process of the run", signal.Signals(signum).name)
            self.processes.kill_now()
        if not self.cleaning_up:
            raise Interrupted(signum, processes_killed=self.received > 1)


@contextlib.contextmanager
def ends_early(outcome: dict) -> Iterator[None]:
    """Around the loop that drives a run: a stop signal ends the loop, and `outcome` records
    it as {"interrupted": "SIGINT"} for the report."""
    try:
        yield
    except Interrupted as interrupted:
        log.warning("%s: ending the run early (a second one kills every process)", interrupted.name)
        outcome["interrupted"] = interrupted.name
