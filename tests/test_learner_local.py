"""The learner's local half: model, data, inner loop, checkpoint. No syncer involved."""

import gc
import os
import subprocess
import sys
import logging
import pathlib
import math
import weakref

import numpy as np
import pytest
import torch
import yaml

from diloco.learner.trainer.adamw import AdamW
from diloco.learner.trainer.checkpoint import (CheckpointError, CheckpointWriter, checkpoint_state, load_checkpoint,
                                       save_checkpoint)
from diloco.learner.trainer.data import (FILE_SEPARATOR, CorpusShard, build_data, is_validation, load_corpus,
                          read_corpus)
from diloco.learner.trainer.model import build_model
import diloco.learner.sync.known_hashes as known_hashes
import diloco.learner.trainer.train
from diloco.learner.trainer.train import Trainer, lr_at
from diloco.learner.sync.synced_parameters import manifest, named_parameters
from diloco.services.contract.config import ConfigError, GPTConfig, InnerOptimizerConfig, parse_config
from diloco.services.contract.state import state_hash
from tests import user_plugins

TINY_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64}
CORPUS = {"max_bytes": 2_000_000, "validation_fraction": 0.05}


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    # One state dir for the module, so the corpus cache under it is built once.
    return tmp_path_factory.mktemp("state")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # Trainer sets torch's process-wide thread count; other tests run in this process too.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_config(state_dir, *, learners=2, trainer=None, model=None, data=None):
    return parse_config({
        "run": {"seed": 7, "state_dir": str(state_dir)},
        "shards": [{"address": "127.0.0.1:50061"}],
        "learners": [{"id": f"learner-{i}", "region": "local"} for i in range(learners)],
        "trainer": {"batch_size": 8, "max_steps": 150, "eval_batches": 4, "threads": 1,
                    **(trainer or {})},
        "model": TINY_GPT if model is None else model,
        "data": CORPUS if data is None else data,
        # A model factory's config bounds what its learners may claim (seq_len is the factory's).
        "syncer": {"max_tokens_per_step": 8 * 64} if isinstance(model, str) else {},
    })


def shard(state_dir, learner_index, num_learners=2, seq_len=64):
    train, validation = load_corpus(make_config(state_dir).data, state_dir / "cache")
    return CorpusShard(train, validation, learner_index=learner_index, num_learners=num_learners,
                       seq_len=seq_len, batch_size=8, eval_batches=4, seed=7)


# --- model -------------------------------------------------------------------------------

def test_the_model_trains_on_the_builtin_corpus(state_dir):
    # lr 3e-3 and a short warm-up: the default 4e-4 is tuned for long runs, not 150 steps.
    cfg = make_config(state_dir, trainer={"inner_optimizer": {"lr": 3.0e-3, "warmup_steps": 10}})
    trainer = Trainer.from_config(cfg, "learner-0")
    curve = [(0, trainer.evaluate())]
    for _ in range(150):
        stats = trainer.train_step()
        assert math.isfinite(stats.loss) and stats.tokens == 8 * 64 and stats.seconds > 0
        if trainer.step % 50 == 0:
            curve.append((trainer.step, trainer.evaluate()))
    print("validation loss by step:", ", ".join(f"{step}: {loss:.3f}" for step, loss in curve))
    initial, final = curve[0][1], curve[-1][1]
    assert initial == pytest.approx(math.log(256), rel=0.05)  # uniform over bytes at init
    assert final < 0.7 * initial  # measured: 5.43 -> 2.68 (0.49x)
    assert trainer.step == 150 and trainer.tokens == 150 * 8 * 64


def test_same_seed_builds_the_same_weights():
    first = build_model(GPTConfig(**TINY_GPT), seed=3).state_dict()
    again = build_model(GPTConfig(**TINY_GPT), seed=3).state_dict()
    other = build_model(GPTConfig(**TINY_GPT), seed=4).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["blocks.0.attn.qkv.weight"], other["blocks.0.attn.qkv.weight"])


def test_tied_head_is_one_parameter_under_one_name():
    model = build_model(GPTConfig(**TINY_GPT), seed=0)
    assert model.lm_head.weight is model.token_embedding.weight
    names = [name for name, _ in manifest(model)]
    assert "lm_head.weight" not in names and names[0] == "token_embedding.weight"
    assert "blocks.1.attn.qkv.weight" in names  # the strided planner reads the layer index here
    assert list(named_parameters(model)) == names
    assert sum(p.numel() for p in named_parameters(model).values()) == \
        sum(p.numel() for p in model.parameters())


# --- data --------------------------------------------------------------------------------

def test_learners_read_their_own_shards(state_dir):
    train, _ = load_corpus(make_config(state_dir).data, state_dir / "cache")
    first, second = shard(state_dir, 0), shard(state_dir, 1)
    half = len(train) // 2
    assert np.array_equal(first.shard, train[:half]) and np.array_equal(second.shard, train[half:2 * half])
    x0, y0 = first.next_batch()
    x1, _ = second.next_batch()
    assert x0.shape == y0.shape == (8, 64) and x0.dtype == torch.int64
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one byte
    assert not torch.equal(x0, x1)


def test_validation_is_fixed_shared_and_held_out_by_file(state_dir):
    corpus_cfg = make_config(state_dir).data
    train, validation = load_corpus(corpus_cfg, state_dir / "cache")
    files = read_corpus(corpus_cfg)
    held_out = [path for path, _ in files if is_validation(path, corpus_cfg.validation_fraction)]
    assert 0 < len(held_out) < len(files) // 5
    # Each side is exactly its own files: no file contributes to both.
    assert bytes(validation) == FILE_SEPARATOR.join(c for p, c in files if p in held_out)
    assert bytes(train) == FILE_SEPARATOR.join(c for p, c in files if p not in held_out)

    batches = shard(state_dir, 0).validation_batches()
    assert len(batches) == 4
    for other in (shard(state_dir, 1), shard(state_dir, 0)):
        assert all(torch.equal(a, b) for pair in zip(batches, other.validation_batches())
                   for a, b in zip(*pair))
    # Evenly spaced over the whole validation set: the first window at its start, the last at its end.
    assert batches[0][0][0].tolist() == validation[:64].tolist()
    assert batches[-1][1][-1].tolist() == validation[-64:].tolist()


def test_a_files_corpus_reads_the_files_its_patterns_match_in_sorted_order(tmp_path):
    for name, text in (("b/two.md", "second"), ("a.md", "first"), ("b/three.txt", "third"), ("c/skip.md", "x")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    corpus_cfg = parse_config({
        "shards": [{"address": "127.0.0.1:1"}], "learners": [{"id": "a", "region": "r"}],
        "data": {"corpus": "files", "files": [f"{tmp_path}/*.md", f"{tmp_path}/b/**/*", f"{tmp_path}/a.md"]},
    }).data
    # Paths relative to each pattern's fixed part (what the validation split hashes); no repeats.
    assert read_corpus(corpus_cfg) == [("a.md", b"first"), ("three.txt", b"third"), ("two.md", b"second")]
    with pytest.raises(ConfigError, match="data.files: .*nothing.md.*matches no file"):
        read_corpus(corpus_cfg.model_copy(update={"files": [f"{tmp_path}/nothing.md"]}))
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"shards": [{"address": "127.0.0.1:1"}], "learners": [{"id": "a", "region": "r"}],
                                      "data": {"corpus": "files", "files": [f"{tmp_path}/nothing.md"]}}))
    (tmp_path / "w.safetensors").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "diloco", "evaluate", "--config", str(config), "--weights",
                             str(tmp_path / "w.safetensors")], capture_output=True, text=True, timeout=120)
    # One line naming the key, not a traceback.
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"invalid: data.files: '{tmp_path}/nothing.md' matches no file here (relative patterns start at {os.getcwd()})"]


@pytest.mark.parametrize("data, says", [({"corpus": "files"}, "data.files"),
                                        ({"corpus": "python-stdlib", "files": ["*.md"]}, "data.files")])
def test_files_go_with_the_files_corpus_and_only_with_it(data, says):
    with pytest.raises(ConfigError, match=says):
        parse_config({"shards": [{"address": "127.0.0.1:1"}], "learners": [{"id": "a", "region": "r"}],
                      "data": data})


def test_data_state_round_trip(state_dir):
    original = shard(state_dir, 1)
    for _ in range(3):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(3)]

    resumed = shard(state_dir, 1)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip((resumed.next_batch() for _ in range(3)), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="cannot continue learner 0"):
        shard(state_dir, 0).load_state_dict(state)


def test_corpus_cache_is_reused(state_dir):
    corpus_cfg = make_config(state_dir).data
    train, _ = load_corpus(corpus_cfg, state_dir / "cache")
    assert isinstance(train, np.memmap)  # mapped, not read into every learner's memory
    assert not list((state_dir / "cache").glob("*.tmp"))
    cached = sorted((state_dir / "cache").iterdir())
    load_corpus(corpus_cfg, state_dir / "cache")
    assert [p.stat().st_mtime_ns for p in sorted((state_dir / "cache").iterdir())] == \
        [p.stat().st_mtime_ns for p in cached]


# --- inner loop --------------------------------------------------------------------------

def test_lr_schedule():
    opt = InnerOptimizerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, opt, max_steps=110) == pytest.approx(1e-4)  # first warm-up step
    assert lr_at(9, opt, max_steps=110) == pytest.approx(1e-3)  # last warm-up step
    assert lr_at(10, opt, max_steps=110) == pytest.approx(1e-3)  # cosine starts at the top
    assert lr_at(60, opt, max_steps=110) == pytest.approx(0.55e-3)  # half way: mid-point
    assert lr_at(110, opt, max_steps=110) == pytest.approx(1e-4)  # lr * min_lr_ratio
    assert lr_at(500, opt, max_steps=110) == pytest.approx(1e-4)  # and stays there


def test_trainer_applies_the_schedule_and_decays_only_matrices(state_dir):
    cfg = make_config(state_dir, trainer={"inner_optimizer": {"lr": 1e-3, "warmup_steps": 4}})
    trainer = Trainer.from_config(cfg, "learner-0")
    stats = [trainer.train_step() for _ in range(5)]
    assert [s.lr for s in stats] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    decayed, undecayed = trainer.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in undecayed["params"])


def adamw_pair(seed: int):
    """The same model twice, one under our AdamW and one under torch.optim.AdamW, with a
    decayed and an undecayed group and a gradient that changes every step."""
    pairs = []
    for _ in range(2):
        model = build_model(GPTConfig(**TINY_GPT), seed=seed)
        pairs.append((model, [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]))
    (ours, our_groups), (theirs, their_groups) = pairs
    return (ours, AdamW(our_groups, lr=1e-3, betas=(0.9, 0.95))), \
        (theirs, torch.optim.AdamW(their_groups, lr=1e-3, betas=(0.9, 0.95)))


def adamw_steps(model, optimizer, steps: range) -> None:
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * (step + 1) / 5  # the schedule moves lr between steps
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()


def test_adamw_matches_torch_optim_adamw_bit_for_bit():
    (ours, our_optimizer), (theirs, their_optimizer) = adamw_pair(seed=3)
    adamw_steps(ours, our_optimizer, range(5))
    adamw_steps(theirs, their_optimizer, range(5))
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(mine, other), name
    assert not torch.equal(next(ours.parameters()), next(build_model(GPTConfig(**TINY_GPT), seed=3).parameters()))


def test_adamw_state_survives_a_checkpoint_and_refuses_another_model(tmp_path):
    (model, optimizer), _ = adamw_pair(seed=4)
    adamw_steps(model, optimizer, range(3))
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=optimizer, step=3, tokens=0, data_state={}, extra={})
    (resumed, resumed_optimizer), _ = adamw_pair(seed=4)
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    adamw_steps(model, optimizer, range(3, 5))
    adamw_steps(resumed, resumed_optimizer, range(3, 5))
    for mine, other in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(mine, other)
    smaller = build_model(GPTConfig(**{**TINY_GPT, "n_embd": TINY_GPT["n_embd"] // 2}), seed=4)
    other = AdamW([{"params": [p for p in smaller.parameters() if p.dim() >= 2]},
                   {"params": [p for p in smaller.parameters() if p.dim() < 2]}], lr=1e-3)
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(checkpoint["optimizer"])
    assert other.state == {}  # refused whole: nothing half-loaded


def test_grad_clipping_bounds_the_norm(state_dir):
    def grad_norm(model):
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()

    clipped = Trainer.from_config(make_config(state_dir, trainer={"inner_optimizer": {"grad_clip": 0.05}}),
                                  "learner-0")
    stats = clipped.train_step()
    assert stats.grad_norm > 0.05  # clipping had something to do
    assert grad_norm(clipped.model) <= 0.05 * (1 + 1e-4)

    unclipped = Trainer.from_config(make_config(state_dir, trainer={"inner_optimizer": {"grad_clip": 0.0}}),
                                    "learner-0")
    stats = unclipped.train_step()
    assert grad_norm(unclipped.model) == pytest.approx(stats.grad_norm)



def test_a_slowed_learner_sleeps_for_the_extra_share_of_each_step(state_dir, monkeypatch):
    cfg = parse_config({**make_config(state_dir).model_dump(mode="json"),
                        "learners": [{"id": "learner-0", "region": "local", "slowdown": 2.0},
                                     {"id": "learner-1", "region": "local"}]})
    slept = []
    real_sleep = diloco.learner.trainer.train.time.sleep
    monkeypatch.setattr(diloco.learner.trainer.train.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    normal = Trainer.from_config(cfg, "learner-1").train_step()
    assert slept == []
    slow = Trainer.from_config(cfg, "learner-0").train_step()
    # Slept as long again as the step computed, and the step time the sync reports includes it.
    assert len(slept) == 1 and slept[0] > 0
    assert slow.seconds >= 2 * slept[0] * 0.99
    assert normal.seconds > 0

# --- checkpoint --------------------------------------------------------------------------

def test_checkpoint_resumes_bit_for_bit(state_dir, tmp_path):
    # Dropout on, so the restored random state matters too.
    cfg = make_config(state_dir, model={**TINY_GPT, "dropout": 0.1})
    uninterrupted = Trainer.from_config(cfg, "learner-1")
    for _ in range(5):
        uninterrupted.train_step()
    extra = {"anchors": {"3": torch.arange(4.0)}, "versions": [2, 5], "incarnation": "abc"}
    writer = CheckpointWriter(tmp_path / "learner.ckpt")
    writer.write(uninterrupted.checkpoint(extra=extra))  # a copy: serialised and written on its own thread
    expected = [uninterrupted.train_step().loss for _ in range(2)]  # while training goes on
    extra["versions"].append(6)
    writer.wait()

    resumed = Trainer.from_config(cfg, "learner-1")
    checkpoint = load_checkpoint(tmp_path / "learner.ckpt")
    resumed.restore(checkpoint)
    assert (resumed.step, resumed.tokens) == (5, 5 * 8 * 64)
    assert [resumed.train_step().loss for _ in range(2)] == expected  # exactly, not approximately
    for name, param in named_parameters(uninterrupted.model).items():
        assert torch.equal(param, named_parameters(resumed.model)[name])
    assert torch.equal(checkpoint["extra"]["anchors"]["3"], extra["anchors"]["3"])
    assert checkpoint["extra"]["versions"] == [2, 5] and checkpoint["extra"]["incarnation"] == "abc"
    assert checkpoint["step"] == 5


def test_the_checkpoint_writer_keeps_order_and_reports_a_failed_write(tmp_path):
    model = build_model(GPTConfig(**TINY_GPT), seed=0)
    optimizer = AdamW([{"params": model.parameters()}], lr=1e-3)
    writer = CheckpointWriter(tmp_path / "learner.ckpt")
    for step in range(3):
        writer.write(checkpoint_state(model=model, optimizer=optimizer, step=step, tokens=0, data_state={}, extra={}))
    writer.wait()
    assert load_checkpoint(tmp_path / "learner.ckpt")["step"] == 2
    (tmp_path / "blocked").write_text("a file where the checkpoint's folder should be")
    failing = CheckpointWriter(tmp_path / "blocked" / "learner.ckpt")
    failing.write({"step": 0})
    with pytest.raises(OSError):
        failing.wait()
    failing.wait()  # raised once


def test_damaged_checkpoints_are_refused(state_dir, tmp_path, caplog):
    model = build_model(GPTConfig(**TINY_GPT), seed=0)
    path = tmp_path / "learner.ckpt"
    assert load_checkpoint(path) is None  # none yet: a first start
    save_checkpoint(path, model=model, optimizer=AdamW([{"params": model.parameters()}], lr=1e-3), step=1,
                    tokens=2, data_state={}, extra={})
    assert load_checkpoint(path)["step"] == 1
    assert torch.load(path, weights_only=True)["step"] == 1  # a user needs nothing of ours to open it
    assert [p.name for p in tmp_path.iterdir()] == ["learner.ckpt"]  # no temporary file left
    blob = path.read_bytes()

    path.write_bytes(blob[: len(blob) // 2])  # torn write
    with caplog.at_level(logging.WARNING, logger="diloco.learner.trainer.checkpoint"):
        assert load_checkpoint(path, start_fresh=True) is None
    assert "not a whole checkpoint" in caplog.text

    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0xFF  # one flipped byte; torch.load alone would accept it
    path.write_bytes(bytes(damaged))
    assert torch.load(path, weights_only=True)["step"] == 1
    with caplog.at_level(logging.WARNING, logger="diloco.learner.trainer.checkpoint"):
        assert load_checkpoint(path, start_fresh=True) is None
    assert "checksum mismatch" in caplog.text

    path.write_bytes(b"not a checkpoint")
    assert load_checkpoint(path, start_fresh=True) is None


def test_a_torn_checkpoint_falls_back_to_the_one_before_and_none_readable_is_refused(tmp_path, caplog):
    """Starting over from step 0 would train the learner's whole budget again: only on request."""
    model = build_model(GPTConfig(**TINY_GPT), seed=0)
    optimizer = AdamW([{"params": model.parameters()}], lr=1e-3)
    path = tmp_path / "learner.ckpt"
    for step in (1, 2):
        save_checkpoint(path, model=model, optimizer=optimizer, step=step, tokens=2 * step, data_state={}, extra={})
    previous = tmp_path / "learner.ckpt.previous"
    assert load_checkpoint(previous)["step"] == 1 and load_checkpoint(path)["step"] == 2
    path.write_bytes(path.read_bytes()[:1000])  # torn
    with caplog.at_level(logging.WARNING, logger="diloco.learner.trainer.checkpoint"):
        assert load_checkpoint(path)["step"] == 1
    assert f"{path}: not a whole checkpoint" in caplog.text and f"resuming from {previous}" in caplog.text
    previous.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=rf"{path}: not a whole.*{previous}: not a whole.*--start-fresh"):
        load_checkpoint(path)
    assert load_checkpoint(path, start_fresh=True) is None


# --- user plugins ------------------------------------------------------------------------

def test_user_model_and_data_factories(state_dir):
    user_plugins.calls.clear()
    cfg = make_config(state_dir, learners=3, trainer={"inner_optimizer": {"lr": 1e-2, "warmup_steps": 0}},
                      model="tests.user_plugins:make_model", data="tests.user_plugins:make_data")
    trainer = Trainer.from_config(cfg, "learner-2")
    assert isinstance(trainer.model, user_plugins.Bigram)
    assert user_plugins.calls == [
        {"factory": "make_model", "seed": 7},
        {"factory": "make_data", "learner_index": 2, "num_learners": 3, "seq_len": 16,
         "batch_size": 8, "seed": 7},
    ]
    before = trainer.evaluate()
    for _ in range(30):
        assert trainer.train_step().tokens == 8 * 16
    assert trainer.evaluate() < before


@pytest.mark.parametrize("key, factory, complaint", [
    ("model", "tests.user_plugins:missing", "has no attribute 'missing'"),
    ("model", "tests.no_such_module:make_model", "cannot import module 'tests.no_such_module'"),
    ("model", "tests.user_plugins:NOT_CALLABLE", "not callable"),
    ("model", "tests.user_plugins:make_not_a_module", "not a torch.nn.Module"),
    ("data", "tests.user_plugins:missing", "has no attribute 'missing'"),
    ("data", "tests.user_plugins:make_incomplete_data", "lacks the DataSource methods"),
])
def test_bad_factories_are_named(state_dir, key, factory, complaint):
    cfg = make_config(state_dir, **{key: factory})
    with pytest.raises(ValueError, match=rf"{key}: '{factory}': .*{complaint}"):
        Trainer.from_config(cfg, "learner-0")


def test_builtin_data_refuses_a_shard_too_small(state_dir):
    cfg = make_config(state_dir, data={"max_bytes": 1000, "validation_fraction": 0.05})
    with pytest.raises(ValueError, match="raise data.max_bytes"):
        build_data(cfg, 0, seq_len=64)


def test_learner_command_refuses_an_unknown_id_or_a_wrong_region():
    import subprocess
    import sys
    config = str(pathlib.Path(__file__).resolve().parent.parent / "examples" / "local-4-regions.yaml")
    for learner_id, region, message in (
            ("eu-0", "eu", "learners: no learner with id 'eu-0'"),
            ("us-east-0", "eu", "--region eu: learner us-east-0 is in region us-east")):
        result = subprocess.run([sys.executable, "-m", "diloco", "learner", "--config", config,
                                 "--learner-id", learner_id, "--region", region],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr


# --- sync: applying a round's result ------------------------------------------------------

def _sync_of_one_fragment(tmp_path, mix_alpha=0.0, shapes=None, steps=200):
    """A StreamingSync of one fragment (H 4, tau 1, never blocking) of the tensors `shapes`
    (default one of 8 values), not joined, with its pipeline at version 0, for `steps` steps;
    and the tensors."""
    from diloco.learner.sync.pipeline import FragmentPipeline
    from diloco.learner.sync.streaming import StreamingSync
    from diloco.services.contract.codecs import get_codec
    from diloco.services.contract.error_feedback import ErrorFeedback
    from diloco.services.contract.fragments import plan_for_config
    from tests.cluster_config import tiny_cluster

    cfg = tiny_cluster(tmp_path, shards=1, learners=1, steps=steps, tls={"mode": "plaintext"},
                       sync={"fragments": 1, "interval_steps": 4, "overlap_steps": 1, "codec": "fp32",
                             "max_block_seconds": 0.0, "mix_alpha": mix_alpha})
    shapes = shapes or {"w": (8,)}
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    plan = plan_for_config(cfg, list(shapes.items()))
    numel = plan.fragments[0].numel
    sync = StreamingSync(cfg, cfg.learners[0].id, cfg.learners[0].region, params, plan, identity=None)
    fragment = plan.fragments[0]
    sync.fragments[0] = FragmentPipeline(fragment, torch.zeros(numel), 0,
                                         ErrorFeedback(get_codec("fp32"), numel, cfg.sync.codec_block_size),
                                         sync.sessions[0], sync._context)
    return sync, params


def _sync_with_a_held_result(tmp_path, monkeypatch, mix_alpha=0.0, shapes=None, steps=200):
    """_sync_of_one_fragment, its push + pull replaced by one that returns the global value
    100 once `release` is set."""
    import threading
    from diloco.learner.sync.stats import SyncOutcome
    from diloco.services.contract.wire import pb

    sync, params = _sync_of_one_fragment(tmp_path, mix_alpha, shapes, steps)
    numel = sync.plan.fragments[0].numel
    release = threading.Event()
    monkeypatch.setattr(sync.fragments[0], "exchange", lambda *_: (release.wait(10),
                        SyncOutcome(torch.full((numel,), 100.0), 1, pb.PUSH_RESULT_ACCEPTED))[1])
    return sync, params, release


def _train_until_applied(sync, params, release, release_after_step: int) -> int:
    """Inner steps that each add 1 to every weight; returns the step that applied the result."""
    for step in range(20):
        for param in params.values():
            param += 1
        if sync.after_step(step, tokens=10, step_seconds=0.01):
            return step
        if step == release_after_step:
            release.set()
            sync.fragments[0].in_flight.result(timeout=10)
    raise AssertionError("the result was never applied")


@pytest.mark.parametrize("answer, waits_for_the_round", [("PUSH_RESULT_ACCEPTED", True),
                                                         ("PUSH_RESULT_REFUSED_STALE", False)])
def test_only_a_pull_that_waited_for_the_pushs_round_tells_how_early_the_push_was(
        tmp_path, monkeypatch, answer, waits_for_the_round):
    # A stale push's pull is a re-anchoring snapshot, not a wait for the others: no lead.
    import time
    import types
    from diloco.learner.sync.pipeline import PushMeta
    from diloco.services.contract.wire import pb
    sync, _ = _sync_of_one_fragment(tmp_path)
    pipeline, session = sync.fragments[0], sync.sessions[0]
    numel = pipeline.fragment.numel
    monkeypatch.setattr(pipeline, "_push", lambda outer, meta: (getattr(pb, answer), 1, 100))

    def pull_checked(*_, **__):
        time.sleep(0.05)  # the round's other pushes, or the snapshot's transfer
        return types.SimpleNamespace(version=1, items=[None], payload_bytes=4 * numel), torch.ones(numel)

    monkeypatch.setattr(session, "pull_checked", pull_checked)
    outcome = pipeline.exchange(torch.zeros(numel), None, PushMeta(0, 1, 10, 0.01))
    assert outcome.version == 1 and torch.equal(outcome.anchor, torch.ones(numel))
    if waits_for_the_round:
        assert outcome.early_seconds >= 0.04
    else:
        assert outcome.early_seconds == 0.0
    sync.close(leave=False)


def test_a_result_in_on_time_replaces_the_fragment(tmp_path, monkeypatch):
    sync, params, release = _sync_with_a_held_result(tmp_path, monkeypatch)
    started = sync.plan.fragments[0].offset_step
    applied = _train_until_applied(sync, params, release, release_after_step=started)
    assert applied == started + 1  # tau steps after the sync started
    assert torch.equal(params["w"], torch.full((8,), 100.0))  # alpha 0: the global value
    assert sync.schedule.fragments[0].steps_since_sync == 0 and sync.stats.syncs_late == 0
    sync.close(leave=False)


def test_a_late_result_keeps_the_steps_trained_past_its_apply_step(tmp_path, monkeypatch):
    sync, params, release = _sync_with_a_held_result(tmp_path, monkeypatch)
    started = sync.plan.fragments[0].offset_step
    applied = _train_until_applied(sync, params, release, release_after_step=started + 2)
    assert applied == started + 3 and sync.stats.syncs_late == 1 and sync.stats.blocked_seconds == 0
    # Applied on time it would have replaced the fragment after step started + 1; the two
    # steps since are added back, and the next outer gradient counts them.
    assert torch.equal(params["w"], torch.full((8,), 102.0))
    assert sync.schedule.fragments[0].steps_since_sync == 2 and sync.schedule.fragments[0].tokens_since_sync == 20
    assert torch.equal(sync.fragments[0].anchor, torch.full((8,), 100.0))
    # The others reached the round two steps after this learner needed it: its schedule stands
    # still two steps, so its next sync starts H + 2 steps after the last, in phase with theirs.
    step = applied
    while sync.stats.syncs_started < 2:
        step += 1
        sync.after_step(step, tokens=10, step_seconds=0.01)
    assert step == started + sync.cfg.sync.interval_steps + 2 and sync.stats.held_steps == 2
    sync.close(leave=False)


def test_a_late_result_is_averaged_into_every_tensor_of_the_fragment_as_at_its_apply_step(tmp_path, monkeypatch):
    sync, params, release = _sync_with_a_held_result(tmp_path, monkeypatch, mix_alpha=0.5,
                                                     shapes={"w": (8,), "v": (2, 3)})
    started = sync.plan.fragments[0].offset_step
    _train_until_applied(sync, params, release, release_after_step=started + 2)
    at_apply = started + 2  # every weight after step started + 1, the apply step (tau 1)
    expected = 0.5 * at_apply + 0.5 * 100.0 + 2  # averaged as then, the two steps since added back
    for name, param in params.items():
        assert torch.equal(param, torch.full(param.shape, expected)), name
    sync.close(leave=False)


def test_a_value_is_hashed_once_and_known_hashes_keep_no_value_alive(monkeypatch):
    hashed = []
    monkeypatch.setattr(known_hashes, "state_hash", lambda value: hashed.append(value) or state_hash(value))
    hashes = known_hashes.KnownHashes()
    anchor, pulled, later = torch.zeros(8), torch.ones(8), torch.full((8,), 2.0)
    hashes.remember(0, pulled, "checked by the pull")  # a pull's checked hash is taken as is
    assert hashes.of(0, pulled) == "checked by the pull" and not hashed
    assert hashes.of(0, anchor) == hashes.of(0, anchor) == state_hash(anchor) and len(hashed) == 1
    assert hashes.of(0, pulled) == "checked by the pull"  # the anchor held and the pull not adopted yet
    assert hashes.of(1, anchor) == state_hash(anchor) and len(hashed) == 2  # per fragment
    hashes.remember(0, later, "next pull")  # a third value: the least recent goes
    assert hashes.of(0, later) == "next pull" and hashes.of(0, anchor) == state_hash(anchor)
    assert len(hashed) == 2
    dropped = weakref.ref(later)
    del later
    gc.collect()
    assert dropped() is None


def test_heartbeats_say_at_once_which_fragments_sync_no_more_before_the_budget_ends(tmp_path, monkeypatch):
    # 6 steps, H = 4, tau = 1: the sync started after step 0 is applied after step 1; the next
    # turn (step 4) could not be applied within the budget, so no round need wait for it.
    sync, _, release = _sync_with_a_held_result(tmp_path, monkeypatch, steps=6)
    beats = []
    monkeypatch.setattr(sync.sessions[0], "heartbeat_now", lambda: beats.append(sync.progress().skipped))
    release.set()
    sync.after_step(0, tokens=10, step_seconds=0.1)
    sync.fragments[0].in_flight.result(timeout=10)
    assert sync.after_step(1, tokens=10, step_seconds=0.1) == [0] and sync.progress().skipped == ()
    sync.after_step(2, tokens=10, step_seconds=0.1)
    assert beats == [(0,)] and sync.progress().skipped == (0,)
    sync.close(leave=False)


def test_heartbeats_report_a_moving_average_of_the_step_time_not_the_last_step(tmp_path, monkeypatch):
    # The others extrapolate this learner's schedule by it: one fast step read as the rate
    # placed it steps ahead of where it was.
    from diloco.learner.sync.streaming import STEP_TIME_SMOOTHING
    sync, _, release = _sync_with_a_held_result(tmp_path, monkeypatch)
    release.set()
    for step in range(5):
        sync.after_step(step, tokens=10, step_seconds=0.1)
    sync.after_step(5, tokens=10, step_seconds=0.02)
    progress = sync.progress()
    assert progress.step_seconds == pytest.approx(0.1 + STEP_TIME_SMOOTHING * (0.02 - 0.1))
    assert progress.tokens_per_second == pytest.approx(10 / progress.step_seconds)
    sync.close(leave=False)
