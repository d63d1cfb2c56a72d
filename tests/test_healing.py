"""A sick learner heals or stops loudly (learner/sync/healing.py): the decisions on their own, then
a user's loop through `DecoupledDiLoCo` against a real shard process whose model goes NaN, is
scaled up 1000x (the shard refuses its pushes as outliers), or goes NaN again right after a heal."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco import DecoupledDiLoCo, LearnerDiverged
from diloco.learner.sync.healing import Healing
from tests.cluster_config import tiny_cluster

H = 4
STEP_LIMIT = 60  # every case heals (or stops) well within this many steps


@pytest.fixture
def cfg(tmp_path):
    """One shard, one fragment synced every H steps, in plaintext."""
    return tiny_cluster(tmp_path / "state", shards=1, learners=2, tls={"mode": "plaintext"},
                        sync={"fragments": 1, "interval_steps": H, "overlap_steps": 1},
                        syncer={"max_tokens_per_step": 256})


# ---- the decisions ----------------------------------------------------------------------------

def test_nan_in_the_model_makes_the_learner_sick_at_once():
    healing = Healing(after_refusals=2, window_steps=10)
    assert not healing.sick()
    healing.non_finite(0, "int4 refuses to encode 3 non-finite value(s)")
    assert healing.sick() and "NaN or Inf" in healing.take(step=5) and not healing.sick()


def test_outlier_refusals_make_it_sick_only_in_a_row():
    healing = Healing(after_refusals=2, window_steps=10)
    healing.refused_as_outlier(0, "norm 1e3")
    healing.delivered()  # a push got through in between: not in a row
    healing.refused_as_outlier(1, "norm 1e3")
    assert not healing.sick()
    healing.refused_as_outlier(0, "norm 1e3")
    assert healing.sick() and "2 of its pushes in a row as outliers" in healing.take(step=5)


def test_sick_again_within_the_window_is_diverged_and_after_it_heals_again():
    healing = Healing(after_refusals=1, window_steps=10)
    healing.non_finite(0, "x")
    healing.take(step=5)
    healing.non_finite(0, "x")
    healing.take(step=16)  # 11 steps later: outside the window
    healing.non_finite(0, "x")
    with pytest.raises(LearnerDiverged, match=r"sick again 4 steps after its last heal \(within "
                                              r"trainer.heal_window_steps=10\)"):
        healing.take(step=20)


# ---- a user's loop against a real shard -------------------------------------------------------

def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def train_until(sync: DecoupledDiLoCo, net: nn.Module, optimizer, done, limit: int = STEP_LIMIT) -> int:
    """Steps of a plain loop until `done()`; returns how many it took."""
    for step in range(limit):
        x = torch.randn(16, 8)
        loss = nn.functional.cross_entropy(net(x), (x[:, 0] > 0).long())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.step(tokens=16)
        if done():
            return step + 1
    pytest.fail(f"not done after {limit} steps")


def held_global_model(sync: DecoupledDiLoCo) -> dict[str, torch.Tensor]:
    return sync.global_state_dict()


def test_a_learner_whose_model_goes_nan_takes_the_global_model_back_and_trains_on(cfg, shard, caplog):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with DecoupledDiLoCo(net, cfg, "us-east-0", catch_up_seconds=0.0, optimizer=optimizer) as sync:
        train_until(sync, net, optimizer, lambda: sync.sync.stats.syncs_applied >= 1)
        with torch.no_grad():
            net[0].weight[0, 0] = float("nan")
        steps = train_until(sync, net, optimizer, lambda: sync.heals == 1)
        assert steps <= 2 * H  # the next sync's snapshot finds it
        assert all(torch.isfinite(p).all() for p in net.parameters())
        assert all(torch.equal(p.detach(), held_global_model(sync)[name]) for name, p in net.named_parameters())
        assert not optimizer.state  # momentum built on NaN: cleared
        assert sync.sync.progress().skipped == (0,)  # heartbeats: the open round need not wait for it
        applied = sync.sync.stats.syncs_applied
        train_until(sync, net, optimizer, lambda: sync.sync.stats.syncs_applied >= applied + 2)
        assert all(torch.isfinite(p).all() for p in net.parameters())
        assert sync.sync.progress().skipped == ()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "healed" in errors[0] and "NaN or Inf" in errors[0]


def test_a_scaled_up_learner_is_refused_by_the_shard_named_there_and_heals(cfg, shard):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with DecoupledDiLoCo(net, cfg, "us-east-0", catch_up_seconds=0.0, optimizer=optimizer) as sync:
        train_until(sync, net, optimizer, lambda: sync.sync.stats.syncs_applied >= 1)
        global_before = held_global_model(sync)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(1000.0)
        train_until(sync, net, optimizer, lambda: sync.heals == 1)
        status = sync.sync.sessions[0].client.status(timeout=5.0)
        assert status.counters["outliers.us-east-0"] >= cfg.trainer.heal_after_refusals
        for name, value in held_global_model(sync).items():  # nothing of the sick pushes was merged
            assert float(value.abs().max()) < 10 * float(global_before[name].abs().max()) + 1.0


def test_a_learner_sick_again_right_after_healing_stops_with_learner_diverged(cfg, shard):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sync = DecoupledDiLoCo(net, cfg, "us-east-0", catch_up_seconds=0.0, optimizer=optimizer)
    with pytest.raises(LearnerDiverged, match="sick again"):
        with sync:
            train_until(sync, net, optimizer, lambda: sync.sync.stats.syncs_applied >= 1)
            for _ in range(2):
                with torch.no_grad():
                    net[0].weight[0, 0] = float("nan")
                heals = sync.heals
                train_until(sync, net, optimizer, lambda: sync.heals > heals)
    assert sync.heals == 1
