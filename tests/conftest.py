"""Fixtures more than one test module uses. Helper modules that assert are rewritten as test
modules are, so that a failing comparison in them shows both sides."""
import pytest

from diloco.localcluster.cluster import LocalCluster
from tests.cluster_config import running_shards

pytest.register_assert_rewrite("tests.cluster_watch", "tests.own_loop_run", "tests.sim_command")


@pytest.fixture
def cluster_factory(tmp_path):
    """LocalCluster(cfg, a run folder of its own) for each config given; every one is stopped
    after the test."""
    started = []

    def make(cfg) -> LocalCluster:
        cluster = LocalCluster(cfg, tmp_path / f"run-{len(started)}")
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        cluster.stop(timeout=10)


@pytest.fixture
def shard(cfg, tmp_path):
    """The shards of the test module's `cfg` fixture, as real processes, for the test."""
    with running_shards(cfg, tmp_path / "run") as cluster:
        yield cluster
