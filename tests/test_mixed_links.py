"""Links that differ per region, in a real local cluster (`diloco sim --wan-mbps`): a learner on a
slow link does not make the others wait, and with `sync.wait_for_own_link: false` it does not
wait for its own results either; the run still ends with every learner holding the shards' bits."""
import json

import pytest

from tests.sim_command import run_sim

BLOCKED_SHARE = 0.1  # of a learner's training time


@pytest.mark.slow
def test_a_slow_region_does_not_block_the_others_nor_itself(tmp_path):
    # us-west's link takes ~10 steps to carry one fragment's push (tau = 2); the others are uncapped.
    report = run_sim(tmp_path, "--learners", "3", "--shards", "1", "--steps", "400", "--seed", "3",
                     "--wan-mbps", "us-west=0.5", "--wan-latency-ms", "us-west=20",
                     "--set", "syncer.grace.mode=adaptive", "--set", "sync.wait_for_own_link=false")
    learners = report["per_learner"]
    slow = learners["us-west-0"]
    assert slow["push_seconds"] > 2 * slow["step_seconds"]  # its own link outlasts tau steps
    for learner_id, learner in learners.items():
        training = learner["steps_run"] * learner["step_seconds"]
        period = report["config"]["H"] * learner["step_seconds"]
        steady = learner["blocked_seconds"] - first_result_wait(tmp_path, learner_id, period)
        assert steady <= BLOCKED_SHARE * training, (learner_id, learner)
    assert report["state_hashes_agree"]


def first_result_wait(tmp_path, learner_id: str, period: float) -> float:
    """The seconds a learner waited for its first result (fragment 0's, in its first period), before
    it had measured its link and while the others may still be starting: not what a slow link costs
    once the learner knows it (0 when that wait was too short to be recorded)."""
    report = json.loads((tmp_path / "run" / "state" / f"learner-{learner_id}" / "report.json").read_text())
    first_life = report["incarnations"][0]
    waits = first_life.get("waits", [])
    if not waits:
        return 0.0
    began, fragment, seconds, _ = waits[0]
    return seconds if fragment == 0 and began - first_life["started"] < period else 0.0
