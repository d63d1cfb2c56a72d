"""Signals that end a learner's training (from Kubernetes, torchrun or the local cluster):
while installed, each sets an event instead of killing the process, so the training loop ends
between steps.

    stop    (SIGTERM)  stop now: wait for the syncs in flight, pull once more, leave
    finish  (SIGUSR1)  end the run here, as if the budget were spent: deliver the last
                       contributions, leave, and keep pulling the global model until stopped
"""
from __future__ import annotations

import signal
import threading


class StopSignals:
    def __init__(self, stop: tuple[signal.Signals, ...], finish: tuple[signal.Signals, ...] = ()):
        self.received = threading.Event()  # a stop signal
        self.finish = threading.Event()  # a finish signal
        self._by_signal = {**{signum: self.finish for signum in finish}, **{signum: self.received for signum in stop}}
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """From the main thread only (Python's rule); elsewhere nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, event in self._by_signal.items():
            self._previous[signum] = signal.signal(signum, lambda *_, event=event: event.set())

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
