"""Data parallel behind emulated WAN links (learner/trainer/wan_allreduce.py): real DDP in a
one-rank gloo group, its gradient buckets held back as a ring over the links would carry them."""
import socket
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from diloco.learner.trainer.wan_allreduce import PacedAllReduce
from diloco.localcluster.wan import WanLink
from diloco.services.contract.config import LinkConfig

PARAMETERS = 250_000  # 1 MB of fp32 gradients


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_step(ddp: nn.Module, x: torch.Tensor) -> None:
    ddp.zero_grad()
    ddp(x).square().sum().backward()


def test_a_bucket_is_held_until_the_slowest_link_of_the_ring_has_carried_it(gloo_group):
    torch.manual_seed(0)
    model = nn.Linear(PARAMETERS // 10, 10, bias=False)
    plain = nn.Linear(PARAMETERS // 10, 10, bias=False)
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)
    # Two regions: each link carries 2 (2 - 1) / 2 = all of the 1 MB bucket each way; the slower
    # link (up 20 Mbit/s: 2.5 MB/s) takes 0.4 s; two hops of 2 x 25 ms of latency add 0.1 s.
    ring = [WanLink(LinkConfig(up_mbps=80.0, down_mbps=80.0, latency_ms=5.0)),
            WanLink(LinkConfig(up_mbps=20.0, down_mbps=40.0, latency_ms=25.0))]
    paced = PacedAllReduce(ring, regions=2)
    ddp.register_comm_hook(None, paced.hook)
    x = torch.randn(4, PARAMETERS // 10)
    started = time.monotonic()
    ddp_step(ddp, x)
    elapsed = time.monotonic() - started
    waited, overlap = paced.take_step()
    assert elapsed >= 0.5 - 0.01  # not released before the slowest link carried it (load only delays it more)
    assert 0.0 <= waited <= elapsed  # of which the wait beyond the real all-reduce
    assert overlap == 0.0  # one bucket: nothing goes out before the backward pass ends
    plain(x).square().sum().backward()
    assert torch.equal(model.weight.grad, plain.weight.grad)  # the gradients the all-reduce gave, untouched
    assert paced.take_step() == (0.0, 0.0)  # taken: the next step starts from nothing


def test_the_ring_sends_two_thirds_of_a_bucket_through_each_of_three_regions_links():
    paced = PacedAllReduce([], regions=3)
    assert paced.ring_bytes(3_000_000) == 4_000_000
