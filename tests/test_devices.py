"""Devices, precision and batch: a fragment goes to host memory and comes back exactly, a sync
leaves every parameter on its device in its dtype (bf16 included) with fp32 anchors on the
host and, on a GPU, the residual there and only payloads crossing to the host, a checkpoint takes no room on the model's device and carries its random state, the
built-in learner trains under bf16 autocast and with gradient accumulation and ends holding the
shards' bits, and a device or precision the config or the machine cannot give is refused naming
the key. CUDA cases (marked `cuda`: `make gpu-check` runs them) run where torch sees a GPU and
are skipped elsewhere."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from diloco import ConfigError, DecoupledDiLoCo
from diloco.learner.trainer.adamw import AdamW
from diloco.learner.trainer.checkpoint import checkpoint_state, restore_rng
from diloco.learner.trainer.device import DeviceUnavailable, resolve_device
from diloco.learner.sync.host_copy import copy_to_host
from diloco.learner.sync.outer_gradient import OuterGradient
from diloco.learner.trainer.model import build_model
from diloco.learner.trainer.train import Trainer, make_optimizer
from diloco.learner.sync.synced_parameters import manifest, named_parameters
from diloco.services.contract.config import GPTConfig, InnerOptimizerConfig, dump_config
from diloco.services.contract.fragments import plan_fragments, scatter
from tests.cluster_config import running_shards, tiny_cluster
from tests.cluster_watch import held_fragments, served_fragments, shard_fragments, wait_for_learners_to_finish

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.bfloat16]
TOKENS_PER_STEP = 16


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_a_fragment_copied_to_the_host_and_applied_back_is_exact(device, dtype):
    model = net().to(device, dtype)
    params = named_parameters(model)
    plan = plan_fragments(manifest(model), 2, 4)
    before = {name: p.detach().clone() for name, p in params.items()}
    copies = [copy_to_host(fragment, params) for fragment in plan.fragments]
    with torch.no_grad():  # training goes on: the copies hold the values they were taken at
        for p in params.values():
            p.add_(1.0)
    for fragment, copy in zip(plan.fragments, copies):
        values = copy.wait()
        assert values.device.type == "cpu" and values.dtype == torch.float32
        scatter(fragment, values, params)  # how a result is written back
    for name, p in params.items():
        assert p.device.type == device and p.dtype == dtype
        assert torch.equal(p, before[name]), name


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One plaintext shard; each test's learner joins the run the previous ones left."""
    folder = tmp_path_factory.mktemp("devices")
    cfg = tiny_cluster(folder / "state", shards=1, learners=1, tls={"mode": "plaintext"},
                       sync={"fragments": 2, "interval_steps": 4, "overlap_steps": 1},
                       syncer={"max_tokens_per_step": TOKENS_PER_STEP})
    with running_shards(cfg, folder / "run") as cluster:
        yield cluster


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_syncs_keep_each_parameter_on_its_device_in_its_dtype_and_sync_state_fp32(shard, device, dtype,
                                                                                   monkeypatch):
    cfg = shard.cfg
    model = net()
    sync = DecoupledDiLoCo(model, cfg, cfg.learners[0].id, catch_up_seconds=0.0)
    model.to(device, dtype)  # after making the learner, before entering: the moved tensors are synced
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    applied, pushed = [], []  # (payload bytes, bytes that crossed from the device) per push
    payload = OuterGradient.payload

    def payload_counted(outer):
        sent = payload(outer)
        pushed.append((len(sent), outer.device_to_host_bytes))
        return sent
    monkeypatch.setattr(OuterGradient, "payload", payload_counted)
    with sync:
        for _ in range(12):
            x = torch.randn(TOKENS_PER_STEP, 8, device=device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            applied += sync.step(tokens=TOKENS_PER_STEP)
    assert len(applied) >= 4  # 2 fragments every 4 steps, each applied a step after it started
    for name, p in model.named_parameters():
        assert (p.device.type, p.dtype) == (device, dtype), name
    for state in sync.sync.fragments.values():
        assert (state.anchor.device.type, state.anchor.dtype) == ("cpu", torch.float32)  # pulls are checked there
        assert (state.feedback.residual.device.type, state.feedback.residual.dtype) == (device, torch.float32)
        if device == "cuda":  # outer gradients are taken on the device, against the anchor's copy there
            assert torch.equal(state.device_anchor.cpu(), state.anchor)
        else:
            assert state.device_anchor is None
    # From a GPU only each push's payload crosses to the host (and a byte saying it was finite).
    assert pushed and all(crossed == (size + 1 if device == "cuda" else 0) for size, crossed in pushed)
    assert sync.sync.stats.device_to_host_bytes == sum(crossed for _, crossed in pushed)
    held = {str(fid): held for fid, held in sync.sync.fragment_hashes().items()}
    assert held == shard_fragments(cfg)  # the learner holds the shard's bits


@pytest.mark.slow
def test_the_builtin_learner_trains_under_bf16_with_accumulation_and_ends_with_the_shards_bits(
        tmp_path, cluster_factory):
    # One cluster for both settings: a run of its own each would double the file's time.
    steps = 60
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=steps,
                       trainer={"precision": "bf16", "grad_accum_steps": 2, "eval_every": 30, "device": "cpu"})
    cluster = cluster_factory(cfg)
    cluster.start_shards()
    cluster.start_learners()
    reports = wait_for_learners_to_finish(cluster)
    # The seeding learner's first evaluation is of the untrained model; a learner that started
    # later (a loaded machine) first evaluates the global model it pulled, already trained.
    untrained = max(report["evaluations"][0][3] for report in reports.values())
    for learner_id, report in reports.items():
        assert report["phase"] == "done" and report["steps"] == steps
        # The shards took every contribution: T grows with grad_accum_steps by default.
        assert report["tokens"] == steps * cfg.tokens_per_step() == steps * 8 * 2 * 32
        assert report["incarnations"][-1]["syncs_applied"] > 0
        last = report["evaluations"][-1][3]
        assert last < 0.8 * untrained, f"{learner_id}: validation loss {untrained:.3f} -> {last:.3f}"
        assert held_fragments(report) == served_fragments(cfg, learner_id), \
            f"{learner_id} does not hold the bits the shards served it"


def test_tokens_per_step_and_its_default_bound_grow_with_gradient_accumulation(tmp_path):
    cfg = tiny_cluster(tmp_path, trainer={"grad_accum_steps": 3})
    assert cfg.tokens_per_step() == cfg.max_tokens_per_step() == 8 * 3 * 32


@pytest.mark.parametrize("key,value", [("device", "tpu"), ("device", "cuda:x"), ("precision", "fp16"),
                                       ("grad_accum_steps", 0)])
def test_an_invalid_device_precision_or_accumulation_is_a_config_error_naming_the_key(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"trainer\.{key}: .*\(got {value!r}\)"):
        tiny_cluster(tmp_path, trainer={key: value})


def test_devices_resolve_to_the_cpu_or_the_local_ranks_gpu():
    assert resolve_device("cpu", 0) == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto", 0) == resolve_device("cuda", 0) == torch.device("cuda", 0)
        with pytest.raises(DeviceUnavailable, match=r"trainer.device: 'cuda:\d+' is GPU \d+"):
            resolve_device(f"cuda:{torch.cuda.device_count()}", 0)
    else:
        assert resolve_device("auto", 3) == torch.device("cpu")
        for setting in ("cuda", "cuda:1"):
            with pytest.raises(DeviceUnavailable, match=f"trainer.device: '{setting}' asks for a GPU"):
                resolve_device(setting, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_learner_asked_for_cuda_without_cuda_exits_1_naming_the_key(tmp_path):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, trainer={"device": "cuda"})
    path = tmp_path / "cluster.yaml"
    path.write_text(dump_config(cfg))
    learner = cfg.learners[0]
    result = subprocess.run([sys.executable, "-m", "diloco", "learner", "--config", str(path),
                             "--learner-id", learner.id, "--region", learner.region],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "trainer.device: 'cuda' asks for a GPU, but this machine has no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


class MetaAsAccelerator(TorchDispatchMode):
    """Code given a model on the meta device runs as if meta were an accelerator with no memory
    to spare: a copy from it to the host gives a host tensor of the right shape and dtype, and
    every other operation that makes a new meta tensor counts its bytes as allocated there."""

    def __init__(self):
        super().__init__()
        self.device_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.ops.aten._to_copy.default and source is not None and source.is_meta \
                and kwargs.get("device") == torch.device("cpu"):
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in func._schema.returns):  # a new tensor, not a view or in place
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    self.device_bytes += tensor.numel() * tensor.element_size()
        return out


def test_a_checkpoint_copies_the_model_and_optimizer_to_the_host_without_a_copy_on_their_device():
    with torch.device("meta"):
        model = build_model(GPTConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32), seed=0)
    optimizer = make_optimizer(model, InnerOptimizerConfig())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # its moments exist, on the meta device like the model
    with MetaAsAccelerator() as device:
        state = checkpoint_state(model=model, optimizer=optimizer, step=1, tokens=0, data_state={},
                                 extra={"anchor": torch.zeros(3)})
    assert device.device_bytes == 0
    held = [state["model"][name] for name in model.state_dict()] + \
        [moment for entry in state["optimizer"]["state"].values() for moment in (entry["exp_avg"], entry["exp_avg_sq"])]
    assert len(held) == len(model.state_dict()) + 2 * len(list(model.parameters()))
    assert all(tensor.device.type == "cpu" for tensor in held)


def test_meta_as_an_accelerator_counts_a_copy_made_on_the_device():
    """The check above can fail: a deep copy of the state, made where the state lives, is counted."""
    model = nn.Linear(64, 64, device="meta")
    with MetaAsAccelerator() as device:
        [p.clone() for p in model.parameters()]
    assert device.device_bytes == (64 * 64 + 64) * 4


def test_a_checkpoint_keeps_a_tied_tensor_once_and_leaves_the_model_untouched():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT's embedding and head
    optimizer = AdamW([{"params": model.parameters()}], lr=1e-3)
    state = checkpoint_state(model=model, optimizer=optimizer, step=0, tokens=0, data_state={}, extra={})
    assert state["model"]["0.weight"] is state["model"]["1.weight"]
    state["model"]["0.weight"].zero_()
    assert model[0].weight.abs().sum() > 0  # a copy, not the model's tensor
    assert state["cuda_rng"] == []  # the model is on no GPU


def test_a_checkpoint_of_other_gpus_restores_the_cpus_random_state_and_says_so(caplog):
    model = nn.Linear(2, 2)
    torch.manual_seed(3)
    state = checkpoint_state(model=model, optimizer=AdamW([{"params": model.parameters()}], lr=1e-3), step=0,
                             tokens=0, data_state={}, extra={})
    expected = torch.rand(4)
    state["cuda_rng"] = [torch.zeros(16, dtype=torch.uint8)]  # taken on a machine with one GPU
    with caplog.at_level(logging.WARNING):
        restore_rng(state, model)
    assert torch.equal(torch.rand(4), expected)
    assert "random state of 1 GPU(s), the model is on 0" in caplog.text


@pytest.mark.parametrize("device", DEVICES)
def test_a_restored_checkpoint_continues_the_random_stream_of_the_models_device(tmp_path, device):
    cfg = tiny_cluster(tmp_path / "state", shards=1, learners=1, model={"n_layer": 1, "n_head": 2, "n_embd": 32,
                                                                         "seq_len": 32, "dropout": 0.5})
    trainer = Trainer.from_config(cfg, cfg.learners[0].id, device=torch.device(device))
    trainer.train_step()
    checkpoint = trainer.checkpoint()
    expected = trainer.train_step().loss  # its dropout masks come from the random state checkpointed
    torch.manual_seed(99)
    if device == "cuda":
        torch.cuda.manual_seed(99)
    resumed = Trainer.from_config(cfg, cfg.learners[0].id, device=torch.device(device))
    resumed.restore(checkpoint)
    assert [t.device.type for t in checkpoint["cuda_rng"]] == (["cpu"] if device == "cuda" else [])
    assert resumed.train_step().loss == expected
