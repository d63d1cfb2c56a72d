"""Each mistake a user can make with `DecoupledDiLoCo` around their own loop gets an error that
says what is wrong: a learner id the config lacks, calls outside or inside the `with` block at
the wrong time, a batch the shards would refuse, parameters replaced behind its back, a model
that is not the run's, a wrapper instead of the model, and entering the block a second time.
Moving the model (a device, a dtype) between making the learner and entering is no mistake."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from diloco import ConfigError, DecoupledDiLoCo, JoinRefused
from diloco.localcluster.processes import free_ports
from tests.cluster_config import tiny_cluster

MAX_TOKENS_PER_STEP = 256


@pytest.fixture
def cfg(tmp_path):
    """One shard and two learners (us-east-0, us-west-0) in plaintext."""
    return tiny_cluster(tmp_path / "state", shards=1, learners=2, tls={"mode": "plaintext"},
                        sync={"fragments": 1, "interval_steps": 4, "overlap_steps": 1},
                        syncer={"max_tokens_per_step": MAX_TOKENS_PER_STEP})


def model(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))


def offline(cfg, net: nn.Module) -> DecoupledDiLoCo:
    """A learner that never contacts a shard (enabled=False): the checks are the same."""
    return DecoupledDiLoCo(net, cfg, "us-east-0", enabled=False)


def test_a_learner_id_missing_from_the_config_is_a_config_error_naming_it(cfg):
    with pytest.raises(ConfigError, match="no learner with id 'eu-north-7'"):
        DecoupledDiLoCo(model(), cfg, "eu-north-7", enabled=False)


def test_step_before_entering_the_block_says_to_enter_it_first(cfg):
    sync = offline(cfg, model())
    with pytest.raises(RuntimeError, match=r"step\(\) called outside its `with DecoupledDiLoCo"):
        sync.step(tokens=16)


def test_load_state_dict_inside_the_block_says_to_call_it_before_entering(cfg):
    sync = offline(cfg, model())
    with sync:
        state = sync.state_dict()
        with pytest.raises(RuntimeError, match="call it before entering"):
            sync.load_state_dict(state)


def test_more_tokens_per_step_than_the_config_allows_names_the_key(cfg):
    with offline(cfg, model()) as sync:
        sync.step(tokens=MAX_TOKENS_PER_STEP)
        with pytest.raises(ValueError, match=f"syncer.max_tokens_per_step={MAX_TOKENS_PER_STEP}"):
            sync.step(tokens=MAX_TOKENS_PER_STEP + 1)


def test_a_parameter_replaced_by_a_new_nn_parameter_between_steps_is_named(cfg):
    net = model()
    with offline(cfg, net) as sync:
        sync.step(tokens=16)
        net[2].weight = nn.Parameter(torch.zeros(2, 8))
        with pytest.raises(RuntimeError, match=r"parameter\(s\) 2.weight of the model were replaced"):
            sync.step(tokens=16)


def test_a_parameter_whose_data_was_reassigned_between_steps_is_named(cfg):
    net = model()
    with offline(cfg, net) as sync:
        sync.step(tokens=16)
        net[0].bias.data = torch.zeros(8)
        with pytest.raises(RuntimeError, match=r"parameter\(s\) 0.bias of the model were replaced"):
            sync.step(tokens=16)


def test_a_model_moved_after_making_the_learner_and_before_entering_trains_without_complaint(cfg):
    net = model()
    sync = offline(cfg, net)
    net.to(torch.float64)  # new tensors for every parameter, as .to(device) makes them
    with sync:
        for _ in range(3):
            sync.step(tokens=16)
    assert sync.params["0.weight"] is net[0].weight and sync.params["0.weight"].dtype == torch.float64


def test_entering_a_second_time_is_refused_and_a_new_learner_goes_on_from_its_state(cfg):
    first = offline(cfg, model())
    with first:
        for _ in range(3):
            first.step(tokens=16)
    with pytest.raises(RuntimeError, match=r"already left the run; to go on where it left off, make a new "
                                           r"DecoupledDiLoCo and call its load_state_dict\(old.state_dict\(\)\)"):
        first.__enter__()
    again = offline(cfg, first.model)
    again.load_state_dict(first.state_dict())
    with again:
        again.step(tokens=16)
    assert (again.steps, again.tokens) == (4, 4 * 16)


def test_a_parameter_replaced_while_syncing_with_a_shard_is_named_before_the_next_sync(cfg, shard):
    net = model()
    with DecoupledDiLoCo(net, cfg, "us-east-0", catch_up_seconds=0.0) as sync:
        for _ in range(2):  # the first sync starts and its result is applied: the next step is between syncs
            sync.step(tokens=16)
        syncs_started = sync.sync.stats.syncs_started
        net[0].weight = nn.Parameter(torch.zeros(8, 8))
        with pytest.raises(RuntimeError, match=r"parameter\(s\) 0.weight of the model were replaced"):
            sync.step(tokens=16)
        # Nothing was pushed from the tensor training no longer updates.
        assert sync.sync.stats.syncs_started == syncs_started


def test_a_learner_with_another_model_is_refused_by_the_shard_the_first_one_seeded(cfg, shard):
    with DecoupledDiLoCo(model(width=8), cfg, "us-east-0", catch_up_seconds=0.0):
        other = DecoupledDiLoCo(model(width=16), cfg, "us-west-0", catch_up_seconds=0.0)
        with pytest.raises(JoinRefused, match=r"manifest differs from the one this run started with \(this learner's model is not the "
                           r"run's\): "
                           r"tensor 0 is '0.weight' \[16, 16\], expected '0.weight' \[8, 8\]"):
            with other:
                pass


def test_a_ddp_wrapper_is_refused_with_a_pointer_to_its_module(cfg):
    port, = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model())
        with pytest.raises(TypeError, match=r"pass the module inside DistributedDataParallel \(ddp.module\)"):
            DecoupledDiLoCo(wrapped, cfg, "us-east-0", enabled=False)
    finally:
        dist.destroy_process_group()


def test_something_other_than_a_module_is_refused(cfg):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        DecoupledDiLoCo(dict(model().named_parameters()), cfg, "us-east-0", enabled=False)
