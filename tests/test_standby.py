"""A warm standby (localcluster/standby.py) becomes a learner's next life: it runs the life's
command in the interpreter that imported torch while the learner was down, and that life's
start-up counts from when the cluster started it, not from the standby's own start."""
import json
import pathlib
import subprocess
import sys
import time

from diloco.localcluster.processes import Proc

LIFE = """
import json, os, sys
from diloco.learner.sync.report import process_started
print(json.dumps({"argv": sys.argv[1:], "torch_loaded": "torch" in sys.modules,
                  "started": process_started(), "path0": sys.path[0]}))
sys.exit(3)
"""


def wait_exit(popen: subprocess.Popen, timeout: float = 60) -> int:
    return popen.wait(timeout)


def test_a_standby_runs_the_life_it_was_prepared_for_when_started(tmp_path: pathlib.Path):
    script = tmp_path / "life.py"
    script.write_text(LIFE)
    proc = Proc("learner-a", [sys.executable, str(script), "--learner-id", "a"], tmp_path / "a.log",
                warm_restarts=True)
    proc.prepare_standby()
    standby_pid = proc.standby.pid
    time.sleep(0.5)  # the standby is importing, or waiting
    before = time.monotonic()
    proc.start()
    assert proc.popen.pid == standby_pid and proc.warm_starts == 1
    assert wait_exit(proc.popen) == 3  # the life's own exit status
    printed = json.loads(proc.log_tail().splitlines()[-1])
    assert printed["argv"] == ["--learner-id", "a"]
    assert printed["torch_loaded"]
    assert printed["path0"] == str(tmp_path)  # as `python SCRIPT` sets it
    assert printed["started"] >= before  # this life started when it was started, not at the prepare


def test_a_proc_without_warm_restarts_starts_a_new_process(tmp_path: pathlib.Path):
    script = tmp_path / "life.py"
    script.write_text(LIFE)
    proc = Proc("learner-a", [sys.executable, str(script)], tmp_path / "a.log")
    proc.kill()  # not running: nothing to kill, and no standby to prepare
    assert proc.standby is None
    proc.start()
    assert proc.warm_starts == 0 and wait_exit(proc.popen) == 3


def test_a_discarded_standby_runs_nothing(tmp_path: pathlib.Path):
    marker = tmp_path / "ran"
    script = tmp_path / "life.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = Proc("learner-a", [sys.executable, str(script)], tmp_path / "a.log", warm_restarts=True)
    proc.prepare_standby()
    standby = proc.standby
    proc.wait_or_kill(5)  # what stopping the cluster does
    assert proc.standby is None and standby.returncode is not None
    assert not marker.exists()


def test_a_standby_whose_cluster_closes_its_stdin_exits_without_running(tmp_path: pathlib.Path):
    marker = tmp_path / "ran"
    script = tmp_path / "life.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    standby = subprocess.Popen([sys.executable, "-m", "diloco.localcluster.standby", str(script)],
                               stdin=subprocess.PIPE)
    standby.stdin.close()
    assert wait_exit(standby) == 0
    assert not marker.exists()
