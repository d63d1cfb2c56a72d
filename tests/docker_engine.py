"""A Docker daemon for tests: the one that answers, else Debian's `dockerd` (docker.io,
scripts/install-debian-packages.sh) started as root for the test and stopped after it. Where
none can run, the test is skipped with the reason."""
from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

INSTALL = "scripts/install-debian-packages.sh"
START_SECONDS = 60
# No iptables rules and no default bridge: the host's firewall stays as it is, and the
# containers need only compose's own networks. overlay2 where the kernel has it; vfs (a full
# copy per layer and container, slow but anywhere) otherwise.
DOCKERD_FLAGS = ["--iptables=false", "--bridge=none"]
STORAGE_DRIVERS = ("overlay2", "vfs")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`docker ARGS`; a failure fails the test with docker's output."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} exited {result.returncode}:\n{result.stdout[-2000:]}"
                    f"{result.stderr[-3000:]}", pytrace=False)
    return result


def answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def start_dockerd(driver: str, log: pathlib.Path) -> subprocess.Popen | None:
    """dockerd with `driver`, once `docker info` answers; None (and stopped) if it never does."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(["dockerd", f"--storage-driver={driver}", *DOCKERD_FLAGS],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        if answers():
            return proc
        time.sleep(0.5)
    stop_dockerd(proc)
    return None


def stop_dockerd(proc: subprocess.Popen) -> None:
    """SIGTERM stops its containers and shuts down cleanly; the image store stays on disk."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def docker_daemon() -> Iterator[None]:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        pytest.skip(f"no Docker: the docker CLI or docker-compose is not on PATH ({INSTALL} installs docker.io "
                    "and docker-compose)")
    if answers():
        yield
        return
    if shutil.which("dockerd") is None:
        pytest.skip(f"no Docker daemon answers and dockerd is not installed ({INSTALL} installs docker.io)")
    if subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() != "0":
        pytest.skip("no Docker daemon answers, and only root can start dockerd")
    log = pathlib.Path(tempfile.mkdtemp(prefix="dockerd-")) / "dockerd.log"
    for driver in STORAGE_DRIVERS:
        proc = start_dockerd(driver, log)
        if proc is not None:
            break
    else:
        pytest.skip(f"dockerd could not start here (storage drivers {', '.join(STORAGE_DRIVERS)}):\n"
                    + log.read_text(errors="replace")[-2000:])
    try:
        yield
    finally:
        stop_dockerd(proc)
