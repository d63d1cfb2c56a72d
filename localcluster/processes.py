"""The processes of a local cluster, each with the history of its lives: started with the
harness's environment (dying with it), killed, restarted cold or from a warm standby
(localcluster/standby.py), stopped."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from diloco.localcluster.standby import go_line
from diloco.services.process import DIE_WITH_PARENT_ENV


def free_ports(count: int) -> list[int]:
    """Ports the kernel reports free on 127.0.0.1 (all held open together, so distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Proc:
    """One service process and the history of its lives."""
    name: str
    argv: list[str]
    log_path: pathlib.Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    started_at: float = 0.0  # time.time() of the last start
    warm_restarts: bool = False  # after a kill, prepare the next life as a standby (localcluster/standby.py)
    standby: subprocess.Popen | None = None
    warm_starts: int = 0

    def start(self) -> None:
        """Starts its next life: the standby's, if one is waiting, else a new process."""
        self.starts += 1
        self.started_at = time.time()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.time():.3f}: {' '.join(self.argv)}\n".encode())
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is None:
            try:
                standby.stdin.write(go_line(time.monotonic()))
                standby.stdin.close()
                self.popen = standby
                self.warm_starts += 1
                return
            except BrokenPipeError:  # it died meanwhile: start cold
                standby.wait()
        self.popen = self._spawn(self.argv)

    def _spawn(self, argv: list[str], stdin: int | None = None) -> subprocess.Popen:
        # Its own session (a Ctrl-C meant for the harness reaches it only through the harness),
        # but it dies with the harness, which may be SIGKILLed (services.process.die_with_parent).
        env = {**os.environ, **self.env, DIE_WITH_PARENT_ENV: str(os.getpid())}
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(argv, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def prepare_standby(self) -> None:
        """With warm restarts: a standby for the next life, importing while this one is down."""
        if self.warm_restarts and self.standby is None:
            self.standby = self._spawn([self.argv[0], "-m", "diloco.localcluster.standby", *self.argv[1:]],
                                       stdin=subprocess.PIPE)

    def discard_standby(self) -> None:
        standby = self.standby
        self.kill_standby()
        self.standby = None
        if standby is not None:
            standby.wait()

    def kill_standby(self) -> None:
        """SIGKILL to a waiting standby, without waiting for it."""
        if self.standby is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.standby.pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: no goodbye, no flush — what a machine failure looks like. With warm
        restarts, the next life's standby starts importing."""
        if self.running:
            self.send(signal.SIGKILL)
            self.popen.wait()
            self.kills += 1
        self.prepare_standby()

    def request_stop(self) -> None:
        """SIGTERM once: the process drains and exits by itself."""
        self.send(signal.SIGTERM)

    def send(self, signum: int) -> None:
        """Signals the process (its group) if it runs, without waiting for it."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):  # it ended after the check
                os.killpg(self.popen.pid, signum)

    def wait_or_kill(self, timeout: float) -> None:
        """Waits for the exit a request_stop asked for; SIGKILL after `timeout`. A standby
        waiting for a next life is ended too."""
        self.discard_standby()
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def terminate(self, timeout: float) -> None:
        self.request_stop()
        self.wait_or_kill(timeout)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines its last life wrote (an error's traceback, say)."""
        text = self.log_path.read_text(errors="replace")
        life = text.rsplit("\n=== start ", 1)[-1].split("\n", 1)[-1]  # after the start line
        return "\n".join([line for line in life.splitlines() if line.strip()][-lines:])
