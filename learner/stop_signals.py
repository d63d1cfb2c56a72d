"""Signals that ask a learner to stop (SIGTERM from Kubernetes, torchrun or the local
cluster): while installed, each sets `received` instead of killing the process, so the
training loop can checkpoint and leave between steps."""
from __future__ import annotations

import signal
import threading


class StopSignals:
    def __init__(self, signals: tuple[signal.Signals, ...]):
        self.signals = signals
        self.received = threading.Event()
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """From the main thread only (Python's rule); elsewhere nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, lambda *_: self.received.set())

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
