"""A push's payload: the outer gradient compressed in the buffer of the fragment's snapshot, the
same operations on every device. On a GPU they are launched by the training thread and only the
payload (and a finite flag) crosses to the host; on the CPU the sync thread runs them. Either
way the payload and the residual are the bits ErrorFeedback.compress gives on the host."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from diloco import DecoupledDiLoCo
from diloco.learner.sync import outer_gradient
from diloco.learner.sync.outer_gradient import OuterGradient
from diloco.learner.sync.synced_parameters import manifest, named_parameters
from diloco.services.contract.codecs import CODEC_NAMES, Codec, get_codec
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.fragments import gather, plan_fragments
from tests.cluster_config import running_shards, tiny_cluster
from tests.cluster_watch import shard_fragments

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def model_and_fragment(device: str):
    model = nn.Sequential(nn.Linear(37, 29), nn.ReLU(), nn.Linear(29, 3)).to(device)
    params = named_parameters(model)
    fragment = plan_fragments(manifest(model), 1, 4).fragments[0]
    return params, fragment


def train_a_little(params) -> None:
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn_like(p) * 0.01)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_push_carries_the_bits_and_keeps_the_residual_of_compressing_on_the_host(device, name):
    params, fragment = model_and_fragment(device)
    anchor = gather(fragment, params).cpu()
    codec = get_codec(name)
    host, there = ErrorFeedback(codec, fragment.numel, 16), ErrorFeedback(codec, fragment.numel, 16, device)
    for _ in range(3):
        train_a_little(params)
        expected, _ = host.compress(anchor - gather(fragment, params).cpu())
        outer = OuterGradient(fragment, params, anchor.to(device), there)
        with torch.no_grad():  # the next step changes the model before the sync thread runs
            for p in params.values():
                p.add_(1.0)
        assert outer.payload() == expected
        assert torch.equal(there.residual.cpu(), host.residual)
        with torch.no_grad():
            for p in params.values():
                p.sub_(1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_payload_and_a_finite_flag_cross_from_a_gpu(device):
    params, fragment = model_and_fragment(device)
    feedback = ErrorFeedback(get_codec("int4"), fragment.numel, 16, device)
    outer = OuterGradient(fragment, params, gather(fragment, params) + 0.5, feedback)
    payload = outer.payload()
    assert len(payload) == get_codec("int4").encoded_size(fragment.numel, 16)
    assert outer.device_to_host_bytes == (len(payload) + 1 if device == "cuda" else 0)


@pytest.mark.parametrize("name", [pytest.param(name, marks=CUDA) for name in ("int8", "int4", "fp4_e3m0", "bf16")])
def test_starting_a_push_on_a_gpu_never_waits_for_the_device(name):
    params, fragment = model_and_fragment("cuda")
    feedback = ErrorFeedback(get_codec(name), fragment.numel, 16, "cuda")
    anchor = gather(fragment, params) + 0.5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises: the training thread would wait
    try:
        outer = OuterGradient(fragment, params, anchor, feedback)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outer.payload()) == get_codec(name).encoded_size(fragment.numel, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_in_the_model_is_refused_and_the_residual_rolled_back(device):
    params, fragment = model_and_fragment(device)
    feedback = ErrorFeedback(get_codec("int4"), fragment.numel, 16, device)
    feedback.residual = torch.full((fragment.numel,), 0.25)
    before = feedback.residual
    with torch.no_grad():
        next(iter(params.values())).view(-1)[3] = float("nan")
    outer = OuterGradient(fragment, params, gather(fragment, params).nan_to_num(), feedback)
    with pytest.raises(ValueError, match="int4 refuses to encode non-finite values"):
        outer.payload()
    outer.rollback()
    assert feedback.residual is before and torch.equal(before.cpu(), torch.full((fragment.numel,), 0.25))


# ---- the GPU-shaped step, in CI form: a loop whose step leaves the host's cores alone ------------

STEP_TOKENS = 16


def spied(method, record):
    """`method`, calling `record()` first."""
    def call(*args, **kwargs):
        record()
        return method(*args, **kwargs)
    return call


def test_a_gpu_shaped_loop_leaves_the_codec_off_the_training_thread_and_hands_over_only_payloads(tmp_path,
                                                                                               monkeypatch):
    """A step that waits without using a core (what a GPU step is to the host), then changes
    every parameter: the training thread's share of each sync is one snapshot of the fragment
    (on a GPU, launching the device's work); every encode and decode of the learner runs on the
    sync's threads, and what they hand over is exactly the payload's encoded size."""
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, tls={"mode": "plaintext"},
                       sync={"fragments": 2, "interval_steps": 4, "overlap_steps": 1},
                       syncer={"max_tokens_per_step": STEP_TOKENS})
    codec = get_codec(cfg.sync.codec)
    training_thread = threading.get_ident()
    codec_threads, snapshots, payloads = [], [], []

    monkeypatch.setattr(Codec, "encode_to_tensor",
                        spied(Codec.encode_to_tensor, lambda: codec_threads.append(threading.get_ident())))
    monkeypatch.setattr(Codec, "decode", spied(Codec.decode, lambda: codec_threads.append(threading.get_ident())))
    monkeypatch.setattr(ErrorFeedback, "compress_outer",
                        spied(ErrorFeedback.compress_outer, lambda: codec_threads.append(threading.get_ident())))
    monkeypatch.setattr(outer_gradient, "gather",
                        spied(outer_gradient.gather, lambda: snapshots.append(threading.get_ident())))
    payload = OuterGradient.payload

    def payload_counted(outer):
        sent = payload(outer)
        payloads.append(len(sent) - codec.encoded_size(outer.feedback.numel, cfg.sync.codec_block_size))
        return sent
    monkeypatch.setattr(OuterGradient, "payload", payload_counted)

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with running_shards(cfg, tmp_path / "run"):
        with DecoupledDiLoCo(model, cfg, cfg.learners[0].id, catch_up_seconds=0.0) as sync:
            codec_threads.clear()  # joining pulled on this thread; from here on only steps
            for _ in range(16):
                time.sleep(0.005)  # the device computes; the host's cores are free
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)
                sync.step(tokens=STEP_TOKENS)
            started = sync.sync.stats.syncs_started
    assert started >= 6  # 2 fragments every 4 steps
    assert snapshots.count(training_thread) == started  # one snapshot per sync: the only per-value pass
    assert codec_threads and training_thread not in codec_threads
    assert payloads and payloads == [0] * len(payloads)  # every payload exactly its encoded size


def test_the_gpus_schedule_compressing_as_the_snapshot_is_taken_ends_on_the_shards_bits(tmp_path, monkeypatch):
    """A GPU's learner compresses when the training thread takes the snapshot, not on the sync
    thread: the same path, run here on the CPU, trains, syncs and ends holding the shard's bits."""
    monkeypatch.setattr(outer_gradient, "compress_when_taken", lambda snapshot: True)
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, tls={"mode": "plaintext"},
                       sync={"fragments": 2, "interval_steps": 4, "overlap_steps": 1},
                       syncer={"max_tokens_per_step": STEP_TOKENS})
    training_thread = threading.get_ident()
    encoded_on = []
    monkeypatch.setattr(ErrorFeedback, "compress_outer", spied(ErrorFeedback.compress_outer,
                                                               lambda: encoded_on.append(threading.get_ident())))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with running_shards(cfg, tmp_path / "run"):
        with DecoupledDiLoCo(model, cfg, cfg.learners[0].id, catch_up_seconds=0.0) as sync:
            encoded_on.clear()
            applied = []
            for _ in range(16):
                model(torch.randn(STEP_TOKENS, 8)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                applied += sync.step(tokens=STEP_TOKENS)
        assert len(applied) >= 6 and sync.sync.stats.pushes >= 6
        assert encoded_on and set(encoded_on) == {training_thread}
        held = {str(fid): held for fid, held in sync.sync.fragment_hashes().items()}
        assert held == shard_fragments(cfg)
