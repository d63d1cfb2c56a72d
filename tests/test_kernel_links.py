"""`diloco sim --kernel-links`: learners in network namespaces whose links the kernel shapes
(localcluster/kernel_links.py) instead of pacing their own bytes. Needs root and iproute2."""
from __future__ import annotations

import subprocess

import pytest

from tests.sim_command import run_sim, sim_command
from tests.test_deploy_machines import can_make_namespaces

# xdist_group: one test at a time adds namespaces and bridges to the host's network (make test runs two workers).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("host_network")]


def test_a_sim_with_kernel_links_trains_through_the_shaped_links_and_ends_with_the_shards_bits(tmp_path):
    if not can_make_namespaces():
        pytest.skip("needs root, ip and tc, and network namespaces")
    report = run_sim(tmp_path, "--learners", "2", "--regions", "us-east,us-west", "--steps", "60", "--kernel-links",
                     "--wan-mbps", "us-east=20,us-west=4/8")
    assert report["state_hashes_agree"] is True and "kernel_links" in report
    for learner_id, link in report["links"].items():
        pushed = report["per_learner"][learner_id]
        assert link["kernel_bytes_up"] > 0 and link["kernel_bytes_down"] > 0
        assert link["kernel_bytes_up"] + link["kernel_bytes_down"] >= link["bytes"], (learner_id, link, pushed)
    assert report["links"]["us-west-0"]["up_mbps"] == 4  # the configured link, reported as asked for
    # Nothing of the run is left behind: its namespaces and bridge are gone.
    assert "dls" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_kernel_links_are_refused_for_data_parallel_naming_why(tmp_path):
    result = subprocess.run(sim_command(tmp_path, "--mode", "dp", "--kernel-links"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--kernel-links" in result.stderr
