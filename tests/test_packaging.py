"""What `pip install .` puts into a user's environment: the one import name `diloco`, and no
top-level `services`, `learner`, `syncer`, `localcluster`, `integrations` or `planner` to collide with the
user's own modules."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_installs_diloco_and_nothing_else_at_top_level(wheel):
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/", 1)[0] for name in archive.namelist()}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"diloco"}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"diloco/cli.py", "diloco/services/cli/__init__.py", "diloco/learner/sync/streaming.py",
            "diloco/learner/trainer/main.py", "diloco/learner/island/ranks.py", "diloco/syncer/core.py",
            "diloco/services/contract/wire/diloco/v1/syncer_pb2.py", "diloco/localcluster/cluster.py",
            "diloco/localcluster/sim.py", "diloco/integrations/hf.py", "diloco/planner/diloco.py"} <= names


def test_an_empty_environment_imports_diloco_but_no_folder_of_the_checkout(wheel, tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # From an unrelated folder: nothing of the checkout is on sys.path.
    code = ("import importlib.util, diloco; "
            "print(diloco.__file__); "
            "print([n for n in ('services', 'learner', 'syncer', 'localcluster', 'integrations', 'planner') "
            "if importlib.util.find_spec(n)])")
    out = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    location, importable = out.splitlines()
    assert location.startswith(str(env)) and importable == "[]"
