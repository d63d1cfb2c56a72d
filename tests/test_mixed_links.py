"""Links that differ per region, in a real local cluster (`diloco sim --wan-mbps`): a learner on a
slow link does not make the others wait, and with `sync.wait_for_own_link: false` it does not
wait for its own results either; the run still ends with every learner holding the shards' bits."""
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
    # Besides: the slow learner waits for its first result, before it has measured its link
    # (its push, the close and its pull: about two pushes' time).
    first_result = 3 * slow["push_seconds"]
    for learner_id, learner in learners.items():
        training = learner["steps_run"] * learner["step_seconds"]
        assert learner["blocked_seconds"] <= BLOCKED_SHARE * training + first_result, (learner_id, learner)
    assert report["state_hashes_agree"]
