"""How `diloco sim` accounts for a learner's kills: a life killed before it recorded anything
was starting all along; steps are lost only where a killed life trained past the checkpoint
the next life restored."""
from diloco.localcluster.sim import killed_lives


def test_a_life_killed_before_it_recorded_anything_counts_whole_as_start_up():
    # Life 0 trains from 100 (recorded at 103) and is killed at step 96 at 130; life 1 starts at
    # 134 and is killed at 136, still starting; life 2 starts at 140 and trains from step 50.
    events = [{"event": "kill", "index": 0, "time": 130.0, "step": 96},
              {"event": "restart", "index": 0, "time": 134.0},
              {"event": "kill", "index": 0, "time": 136.0, "step": 96},  # the shards still say step 96
              {"event": "restart", "index": 0, "time": 140.0},
              {"event": "kill", "index": 1, "time": 120.0, "step": 7}]  # another learner's
    lives = [{"started": 103.0, "restored_step": 0}, {"started": 142.5, "restored_step": 50}]
    starting, lost_steps = killed_lives(events, 0, 100.0, lives)
    assert starting == 2.0  # 134 to 136
    assert lost_steps == 96 - 50  # once: the second kill lost no training


def test_every_life_recorded_counts_no_extra_start_up():
    events = [{"event": "kill", "index": 0, "time": 130.0, "step": 80},
              {"event": "restart", "index": 0, "time": 134.0}]
    lives = [{"started": 103.0, "restored_step": 0}, {"started": 136.0, "restored_step": 75}]
    assert killed_lives(events, 0, 100.0, lives) == (0.0, 5)


def test_a_life_killed_before_its_first_step_loses_nothing_more():
    """The shards last heard step 90 from life 0; life 1 began training at 122.2 from step 50
    and was killed at 122.9 before a step, still showing 90."""
    events = [{"event": "kill", "index": 0, "time": 116.3, "step": 90},
              {"event": "restart", "index": 0, "time": 120.0},
              {"event": "kill", "index": 0, "time": 122.9, "step": 90},
              {"event": "restart", "index": 0, "time": 127.0}]
    lives = [{"started": 104.1, "restored_step": 0}, {"started": 122.2, "restored_step": 50},
             {"started": 129.6, "restored_step": 50}]
    assert killed_lives(events, 0, 100.0, lives) == (0.0, 40)
