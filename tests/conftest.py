"""Fixtures more than one test module uses. Helper modules that assert are rewritten as test
modules are, so that a failing comparison in them shows both sides."""
import pytest

from diloco.localcluster.cluster import LocalCluster

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
