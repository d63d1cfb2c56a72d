"""What a user's model and report hold when a learner of their own loop joins and leaves a run
of real shard processes: the model after leaving is the global model as of its leave, two
learners leaving at different times hold consistent versions of one run, joining a run with
progress or a spent budget says so (a learner started beside one that is training need not be
told), and a resumed learner's report keeps its earlier lives."""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import pathlib
import threading
import time

import pytest
import torch
from torch import nn

from diloco import DecoupledDiLoCo
from diloco.services.export import fetch_global_model
from diloco.services.contract.config import parse_config
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import served_fragments

TOKENS = 16  # per step: the batch below


class Killed(Exception):
    """Stands in for a process killed inside its `with` block."""


@pytest.fixture
def cfg(tmp_path):
    """One shard, two fragments, two learners (us-east-0, us-west-0), 14 steps each: the last
    sync of each fragment starts a few steps before the budget ends."""
    return tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=14, tls={"mode": "plaintext"},
                        sync={"fragments": 2, "interval_steps": 4, "overlap_steps": 1},
                        syncer={"max_tokens_per_step": TOKENS})


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def train(sync: DecoupledDiLoCo, steps: int | None = None) -> None:
    """SGD on random regression batches until the budget is spent (or for `steps` steps)."""
    net = sync.model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    done = 0
    while not sync.should_stop and (steps is None or done < steps):
        x = torch.randn(TOKENS, 8)
        loss = nn.functional.mse_loss(net(x), x[:, :2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.step(tokens=TOKENS)
        done += 1


def model_is_the_global_model(sync: DecoupledDiLoCo) -> bool:
    global_values = sync.global_state_dict()
    return all(torch.equal(param, global_values[name]) for name, param in sync.model.named_parameters())


def test_a_learner_that_spent_its_budget_leaves_holding_the_global_model_bit_for_bit(cfg, shard):
    with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.5) as sync:
        train(sync)
        assert not model_is_the_global_model(sync)  # local steps since each fragment's last sync
    assert sync.budget_spent and model_is_the_global_model(sync)


def test_two_learners_leaving_at_different_times_hold_the_run_as_of_their_leave_and_the_last_holds_its_end(
        cfg, shard):
    first = DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.5)
    second = DecoupledDiLoCo(model(), cfg, "us-west-0", catch_up_seconds=0.5)
    with contextlib.ExitStack() as first_in_run:
        first_in_run.enter_context(first)
        train(first, steps=6)  # the second joins a run with progress
        with second:
            while not first.should_stop:
                train(first, steps=1)
                train(second, steps=1)
            first_in_run.close()  # the first leaves while the second trains on
            train(second)
    at_first_leave, at_end = first.fragment_versions(), second.fragment_versions()
    assert model_is_the_global_model(first) and model_is_the_global_model(second)
    assert all(at_first_leave[fid] <= at_end[fid] for fid in at_end)
    assert any(at_first_leave[fid] < at_end[fid] for fid in at_end)  # the run went on without it
    # The run's final model, as `diloco export` pulls it once every learner has left, is at the
    # last one's versions; the last one holds the bits the shard served it: the shard's own, or
    # one delta's encoding error from them (docs/protocol.md, "The downlink").
    final = fetch_global_model(cfg, identity=None)
    assert {f.fragment_id: f.version for f in final.fragments} == at_end
    assert served_fragments(cfg, "us-west-0") == {str(fid): held for fid, held in second.sync.fragment_hashes().items()}


def test_a_resumed_learner_keeps_its_earlier_lives_traffic_in_its_report(cfg, shard):
    with pytest.raises(Killed):
        with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.0) as first:
            train(first, steps=9)
            checkpoint = copy.deepcopy(first.state_dict())
            raise Killed
    assert first.sync.stats.bytes_up > 0 and first.sync.stats.syncs_started > 0

    resumed = DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.0)
    resumed.load_state_dict(checkpoint)
    with resumed:
        train(resumed)
    lives = json.loads((resumed.state_dir / "report.json").read_text())["incarnations"]
    assert len(lives) == 2
    assert lives[0]["bytes_up"] == first.sync.stats.bytes_up > 0
    assert lives[0]["syncs_started"] == first.sync.stats.syncs_started > 0


def test_a_fresh_learner_joining_a_run_with_progress_is_told_the_run_its_versions_and_tokens(cfg, shard, caplog):
    with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.2) as first:
        train(first)
    with caplog.at_level(logging.WARNING, logger="diloco.learner.sync.streaming"):
        with DecoupledDiLoCo(model(), cfg, "us-west-0", catch_up_seconds=0.0) as late:
            assert late.fragment_versions() == first.fragment_versions()
    versions = ", ".join(f"{fid}: v{version}" for fid, version in sorted(first.fragment_versions().items()))
    assert (f"learner us-west-0 joined run 'test', which already has progress (fragments {versions}; "
            f"{first.tokens} tokens trained)") in caplog.text
    assert "--new-run" in caplog.text


def test_a_learner_started_beside_one_that_is_training_is_not_told_it_joined_a_run_with_progress(
        cfg, shard, caplog):
    synced, leave = threading.Event(), threading.Event()

    def first_learner():  # trains slowly, so that it is still training when the second joins
        with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.0, stop_signals=()) as first:
            while not (first.should_stop or leave.is_set()):
                train(first, steps=1)
                time.sleep(0.05)
                if max(first.fragment_versions().values()) > 0:
                    synced.set()

    thread = threading.Thread(target=first_learner)
    thread.start()
    try:
        assert synced.wait(30)
        with caplog.at_level(logging.WARNING, logger="diloco.learner.sync.streaming"):
            with DecoupledDiLoCo(model(), cfg, "us-west-0", catch_up_seconds=0.0) as beside:
                assert max(beside.fragment_versions().values()) > 0  # it joined the first's progress
    finally:
        leave.set()
        thread.join(30)
    assert "already has progress" not in caplog.text


def test_a_learner_joining_a_run_whose_token_budget_is_spent_is_told_so_and_trains_nothing(cfg, shard, caplog):
    data = cfg.model_dump(mode="json")
    data["trainer"]["max_run_tokens"] = 10 * TOKENS
    cfg = parse_config(data, source="a run of 10 steps' tokens")
    with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.2) as first:
        train(first)
    with caplog.at_level(logging.WARNING, logger="diloco.learner.sync.streaming"):
        with DecoupledDiLoCo(model(), cfg, "us-west-0", catch_up_seconds=0.0) as late:
            assert late.should_stop
    assert (f"learner us-west-0 joined run 'test', whose token budget is spent ({first.tokens} tokens trained "
            f"of trainer.max_run_tokens {10 * TOKENS}): it trains nothing") in caplog.text


def test_a_shard_restarted_on_a_run_says_it_resumes_it_and_one_started_with_new_run_starts_afresh(
        cfg, shard, caplog):
    with DecoupledDiLoCo(model(), cfg, "us-east-0", catch_up_seconds=0.2) as first:
        train(first)
    process = shard.shards[0]
    process.terminate(10)
    shard.restart_shard(0)
    assert "shard 0 resumes run 'test' from its state in" in process.log_tail(40)

    process.terminate(10)
    process.argv.append("--new-run")
    shard.restart_shard(0)
    with caplog.at_level(logging.WARNING, logger="diloco.learner.sync.streaming"):
        with DecoupledDiLoCo(model(), cfg, "us-west-0", catch_up_seconds=0.0) as fresh:
            assert set(fresh.fragment_versions().values()) == {0}
    assert "already has progress" not in caplog.text
    (kept,) = pathlib.Path(cfg.run.state_dir).glob("shard-0.replaced-*")
    assert any(kept.iterdir())
    assert "starting a new run: the earlier run's state of shard-0 is kept in" in process.log_tail(40)
