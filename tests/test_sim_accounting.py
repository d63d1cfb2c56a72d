"""How `diloco sim` accounts for a learner's kills: a life killed before it recorded anything
was starting all along; a killed life loses its time after its last record, and the recorded
steps past the checkpoint the next life restored; the hashes compared at the end are those of
the learners that finished."""
from types import SimpleNamespace

from diloco.localcluster.sim_summary import global_vs_local, hashes_agree, killed_lives

STEP = 0.1  # seconds per step


def life(started: float, recorded_at: float, restored_step: int, steps: int) -> dict:
    return {"started": started, "recorded_at": recorded_at, "restored_step": restored_step, "steps": steps}


def test_a_life_killed_before_it_recorded_anything_counts_whole_as_start_up():
    # Life 0 trains from 100 (recorded at 103, last at 128) and is killed at 130; life 1 starts
    # at 134 and is killed at 136, still starting; life 2 starts at 140.
    events = [{"event": "kill", "index": 0, "time": 130.0, "step": 96},
              {"event": "restart", "index": 0, "time": 134.0},
              {"event": "kill", "index": 0, "time": 136.0, "step": 96},
              {"event": "restart", "index": 0, "time": 140.0},
              {"event": "kill", "index": 1, "time": 120.0, "step": 7}]  # another learner's
    lives = [life(103.0, 128.0, 0, 90), life(142.5, 150.0, 90, 30)]
    starting, lost = killed_lives(events, 0, 100.0, lives, STEP)
    assert starting == 2.0  # 134 to 136
    assert lost == 2.0  # 128 to 130: the second kill lost no training


def test_a_kill_loses_the_time_after_the_last_record():
    events = [{"event": "kill", "index": 0, "time": 130.0, "step": 80},
              {"event": "restart", "index": 0, "time": 134.0}]
    lives = [life(103.0, 126.5, 0, 75), life(136.0, 140.0, 75, 10)]
    assert killed_lives(events, 0, 100.0, lives, STEP) == (0.0, 3.5)


def test_recorded_steps_past_the_restored_checkpoint_are_lost_too():
    """Life 0 recorded step 100, but its checkpoint of step 100 did not reach the disk: life 1
    restored step 50 and trains the 50 steps again."""
    events = [{"event": "kill", "index": 0, "time": 116.0, "step": 100},
              {"event": "restart", "index": 0, "time": 120.0}]
    lives = [life(104.0, 115.0, 0, 100), life(122.2, 125.0, 50, 20)]
    starting, lost = killed_lives(events, 0, 100.0, lives, STEP)
    assert starting == 0.0
    assert abs(lost - (1.0 + 50 * STEP)) < 1e-9


def shard_status(*fragments: tuple[int, int, str]) -> SimpleNamespace:
    return SimpleNamespace(fragments=[SimpleNamespace(fragment_id=fid, version=v, state_hash=h, served=[])
                                      for fid, v, h in fragments])


def learner_report(phase: str, version: int, digest: str) -> dict:
    return {"phase": phase, "fragments": {"0": {"version": version, "state_hash": digest}}}


def test_a_learner_down_when_the_run_ended_is_not_compared_but_one_that_finished_is():
    statuses = [shard_status((0, 6, "f22f"))]
    down = learner_report("training", 4, "fad1")  # its last report, written while it trained
    assert hashes_agree({"a": learner_report("done", 6, "f22f"), "b": down}, statuses)
    assert not hashes_agree({"a": learner_report("done", 6, "f22f"), "b": learner_report("done", 5, "29e4")},
                            statuses)
    assert not hashes_agree({"b": down}, statuses)  # nobody finished: nothing agrees


def test_the_global_model_is_set_beside_the_learners_own_at_each_step_both_were_evaluated():
    # Each learner evaluates its own model and the global one it holds at steps 0, 50 and 100;
    # at step 100 it evaluates again once it holds the final global model: not counted.
    def learner(own: list[float], held: list[float]) -> dict:
        steps = [0, 50, 100]
        return {"evaluations": [[0.0, s, 0, loss] for s, loss in zip(steps, own)] + [[0.0, 100, 0, 9.0]],
                "global_evaluations": [[0.0, s, 0, loss] for s, loss in zip(steps, held)] + [[0.0, 100, 0, 9.0]]}
    curve = global_vs_local({"a": learner([5.0, 3.0, 2.0], [5.0, 3.4, 2.2]),
                             "b": learner([5.0, 3.2, 2.2], [5.0, 3.4, 2.4]),
                             "c": {"evaluations": [[0.0, 0, 0, 5.0]], "global_evaluations": []}})  # no --eval-global
    assert curve == [[0, 5.0, 5.0], [50, 3.1, 3.4], [100, 2.1, 2.3]]
