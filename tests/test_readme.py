"""The README's "Use it from your own training code" snippet runs as written: as a script of
its own, against real shards of examples/own_loop/cluster.yaml (on free ports, few steps)."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from diloco.localcluster.cluster import LocalCluster
from diloco.services.contract.config import dump_config
from tests.cluster_watch import held_fragments, shard_fragments
from tests.own_loop_run import own_loop_config

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Use it from your own training code", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_readme_snippet_trains_and_ends_holding_the_shards_bits(tmp_path):
    cfg = own_loop_config(tmp_path / "state", steps=60)
    config_path = tmp_path / "examples" / "own_loop" / "cluster.yaml"  # the path the snippet names
    config_path.parent.mkdir(parents=True)
    config_path.write_text(dump_config(cfg))
    cluster = LocalCluster(cfg, tmp_path / "run")
    try:
        cluster.start_shards()
        result = subprocess.run([sys.executable, "-c", readme_snippet()], cwd=tmp_path, capture_output=True,
                                text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads((tmp_path / "state" / "learner-us-east-0" / "report.json").read_text())
        assert report["phase"] == "done" and report["steps"] == 60
        assert held_fragments(report) == shard_fragments(cfg)
    finally:
        cluster.stop(timeout=10)
