"""The lease of an island's lead (learner/island/leader_lease.py): one holder at a time, free again
the moment its holder dies, however it dies, and each taking a term later than the last."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from diloco.learner.island.leader_lease import LeaderLease


def test_only_one_holder_takes_the_lease_until_it_releases_it(tmp_path):
    path = tmp_path / "learner-a" / "leader.lock"
    first, second = LeaderLease(path), LeaderLease(path)
    assert first.try_take() and first.held
    assert first.try_take()  # taking it again changes nothing
    assert not second.try_take() and not second.held
    first.release()
    assert second.try_take()
    assert (first.term, second.term) == (1, 2)
    assert path.read_text().split() == ["2", str(os.getpid())]  # the holder's pid, for an operator
    assert LeaderLease.holder(path) == os.getpid() and LeaderLease.holder(tmp_path / "none.lock") is None


def test_a_lease_says_whether_the_island_has_had_a_leader(tmp_path):
    path = tmp_path / "leader.lock"
    holder, waiting = LeaderLease(path), LeaderLease(path)
    assert not waiting.taken_before()  # no file yet: the island is starting
    path.touch()  # a take that failed leaves the file empty
    assert not waiting.taken_before()
    holder.try_take()
    holder.release()
    assert waiting.taken_before()  # free again, after a leader that left


def test_the_lease_of_a_killed_holder_is_free_at_once(tmp_path):
    path = tmp_path / "leader.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from diloco.learner.island.leader_lease import LeaderLease; "
         "assert LeaderLease(sys.argv[1]).try_take(); print('held', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not LeaderLease(path).try_take()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 5
        lease = LeaderLease(path)
        while not lease.try_take() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.held and lease.term == 2
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
