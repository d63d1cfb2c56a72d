"""A learner's abnormal outer gradient is refused before it counts (syncer/outliers.py), on the
shard's core with a fake clock: the rule against the fragment's global value, a round of one
contributor, the first round, a fragment of zeros, the int4 path that clears a push without
decoding it, and the reference following the value from version to version, measured once by the
close that made it."""
import pytest
import torch

from diloco.services.contract.wire import pb
from diloco.syncer.outliers import outlier_limit
from diloco.syncer.refusal import Refusal
from tests.shard_harness import LEARNERS, Shard, delta, make_config


def scaled(values: torch.Tensor, norm: float) -> torch.Tensor:
    return values * (norm / float(torch.linalg.vector_norm(values)))


def value_norm(shard, fid=0) -> float:
    return float(torch.linalg.vector_norm(shard.value(fid)))


def test_the_limit_is_the_factor_times_the_values_norm_and_none_without_one():
    assert outlier_limit(3.0, 10.0) == 30.0
    assert outlier_limit(0.0, 10.0) is None
    assert outlier_limit(3.0, None) is None


def test_a_scaled_up_learners_push_is_refused_naming_the_rule_and_counted_for_it():
    shard = Shard(make_config(quorum=3))
    before = shard.core.fragments[0].committed
    blown_up = -999.0 * shard.value()  # anchor - 1000 * anchor: the learner's weights x1000
    with pytest.raises(Refusal) as refused:
        shard.push("b", 0, blown_up)
    assert (refused.value.status, refused.value.reason) == ("INVALID_ARGUMENT", "norm_outlier")
    assert "syncer.outlier_norm_factor=10" in refused.value.message and "global value" in refused.value.message
    assert shard.core.fragments[0].round.count == 0 and shard.core.fragments[0].committed is before
    counters = shard.core.counters.snapshot()
    assert counters["outliers.b"] == 1 and counters["refusals.norm_outlier"] == 1
    assert counters["contributions.refused"] == 1
    shard.push("b", 0, scaled(delta(2, shard.numel()), 5.0 * value_norm(shard)))  # large, within the rule
    assert shard.core.fragments[0].round.count == 1


def test_a_round_of_one_contributor_is_checked_like_any_other():
    shard = Shard(make_config(quorum=1))
    shard.core.leave("b", 1)
    shard.core.leave("c", 1)
    shard.push("a", 0, delta(1, shard.numel()))
    assert shard.version() == 1
    with pytest.raises(Refusal, match="outlier"):
        shard.push("a", 0, scaled(delta(2, shard.numel()), 11.0 * value_norm(shard)), base=1)
    assert shard.version() == 1


def test_a_fragment_of_zeros_has_no_reference_and_takes_any_push_within_the_norm_bound():
    cfg = make_config(quorum=3)
    shard = Shard(cfg, seed=False)
    for fid, state in shard.core.fragments.items():
        shard.push("a", fid, torch.zeros(state.fragment.numel), kind=pb.PUSH_KIND_SEED)
    shard.push("a", 0, delta(1, shard.numel(), scale=10.0))
    with pytest.raises(Refusal) as refused:
        shard.push("b", 0, delta(2, shard.numel(), scale=1.0e4))
    assert refused.value.reason == "norm_too_large"


def test_with_the_rule_off_an_outlier_is_merged():
    shard = Shard(make_config(quorum=3, outlier_norm_factor=None))
    shard.push("a", 0, -99.0 * shard.value())  # within max_update_norm
    assert shard.core.fragments[0].round.count == 1


def test_int4_pushes_are_judged_by_their_decoded_norm_not_the_bound_from_their_scales():
    shard = Shard(make_config(quorum=3, codec="int4"))
    healthy = scaled(delta(5, shard.numel()), 9.0 * value_norm(shard))  # its scales' bound is above 10x
    assert shard.push("a", 0, healthy).result == pb.PUSH_RESULT_ACCEPTED
    with pytest.raises(Refusal, match="outlier"):
        shard.push("b", 0, healthy * 1.2)


def test_the_reference_is_the_value_of_the_version_now():
    shard = Shard(make_config(quorum=3))
    first = value_norm(shard)
    for i, learner in enumerate(LEARNERS):  # moves the value by -10x its norm: lr 0.7, a new norm
        shard.push(learner, 0, scaled(delta(i, shard.numel()), 9.0 * first))
    assert shard.version() == 1 and shard.core.fragments[0].value_norm() == pytest.approx(value_norm(shard))
    assert value_norm(shard) != pytest.approx(first)


def test_the_close_measures_the_new_value_once_so_the_next_rounds_pushes_do_not(monkeypatch):
    shard = Shard(make_config(quorum=3))
    for i, learner in enumerate(LEARNERS):
        shard.push(learner, 0, delta(i, shard.numel()))
    first = shard.core.fragments[0].committed.value
    measured = []  # the tensors whose norm was taken
    norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda values, *a, **k: measured.append(values) or
                        norm(values, *a, **k))
    for i, learner in enumerate(LEARNERS):
        shard.push(learner, 0, delta(10 + i, shard.numel()), base=1)
    assert shard.version() == 2
    second = shard.core.fragments[0].committed.value
    assert [t is first for t in measured].count(True) == 0  # measured by its own close
    assert [t is second for t in measured].count(True) == 1
