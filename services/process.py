"""What a harness and the processes it starts agree on through the environment: a started
process dies with its harness, and a warm standby tells the learner it becomes when its life
began."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

# Set by localcluster.cluster to the pid of the process starting this one (the sim, a test's or a
# benchmark's cluster): this process must not outlive it.
DIE_WITH_PARENT_ENV = "DILOCO_DIE_WITH_PARENT"
# Set by a warm standby (localcluster/standby.py) when it becomes a learner's life: the time.monotonic
# at which that life started, which is not when the standby's process did (learner/sync/report.py).
LIFE_STARTED_ENV = "DILOCO_LIFE_STARTED"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """When started by a cluster harness, asks the kernel for SIGKILL when the harness
    ends, however it ends (SIGKILL included): Linux's PR_SET_PDEATHSIG. Elsewhere the
    harness's own cleanup is all there is."""
    parent = os.environ.pop(DIE_WITH_PARENT_ENV, None)  # not for processes this one starts
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # the harness ended before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
