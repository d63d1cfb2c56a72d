"""Hugging Face transformers models in a run (the `hf` extra): examples/hf/train.py (a tiny
LlamaForCausalLM in its user's own loop) and examples/hf/trainer.py (the HF Trainer with
DecoupledDiLoCoCallback) as two real learner processes each against two real shards, the
built-in learner training the `diloco.integrations.hf:llama` factory in `diloco sim`, and the
errors a Trainer user or a learner with another Llama gets."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer,  # noqa: E402
                          TrainingArguments)

from diloco import DecoupledDiLoCo, JoinRefused  # noqa: E402
from diloco.integrations.hf import DecoupledDiLoCoCallback  # noqa: E402
from diloco.localcluster.cluster import LocalCluster  # noqa: E402
from diloco.cli import main  # noqa: E402
from diloco.services.contract.config import dump_config, parse_config  # noqa: E402
from tests.cluster_config import export_both_ways, running_shards, tiny_cluster  # noqa: E402
from tests.own_loop_run import OwnLoopRun, assert_every_script_holds_the_shards_bits, own_loop_config  # noqa: E402
from tests.sim_command import run_sim  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "hf"
sys.path.insert(0, str(EXAMPLE))
from byte_llama import SEQ_LEN, ByteWindows, learner_text, tiny_llama  # noqa: E402


class HFExampleRun(OwnLoopRun):
    """Shards of examples/hf/cluster.yaml and one `script` process per learner."""

    def __init__(self, cfg, folder: pathlib.Path, script: str):
        self.script = script
        super().__init__(cfg, folder)

    def argv(self, learner_id: str) -> list[str]:
        # A catch-up that only SIGTERM ends: a script that finished first follows the global
        # model until the last one has finished too (finish_all).
        return [sys.executable, str(EXAMPLE / self.script), "--config", str(self.cluster.config_path),
                "--learner-id", learner_id, "--losses", str(self.losses_path(learner_id)),
                "--catch-up-seconds", "600", "--export", str(self.export_folder(learner_id))]

    def export_folder(self, learner_id: str) -> pathlib.Path:
        return self.folder / f"{learner_id}-export"


@pytest.fixture
def hf_example_run(tmp_path):
    runs: list[HFExampleRun] = []

    def start(script: str, steps: int) -> HFExampleRun:
        runs.append(HFExampleRun(own_loop_config(tmp_path / "state", steps, example=EXAMPLE), tmp_path, script))
        return runs[-1].start()

    yield start
    for run in runs:
        run.stop()


def finish_learned_and_bit_identical(run: HFExampleRun) -> dict[str, dict]:
    """Every script spends its budget and exits 0, holds the shards' bits and learned (its export,
    as from_pretrained opens it, validated); their reports."""
    reports = run.finish_all()
    assert_every_script_holds_the_shards_bits(run, reports)
    for learner_id in run.scripts:
        _, loading = AutoModelForCausalLM.from_pretrained(run.export_folder(learner_id), output_loading_info=True)
        assert not loading["missing_keys"] and not loading["unexpected_keys"]
    for learner_id in run.scripts:
        validation = json.loads(run.losses_path(learner_id).read_text())["validation"]
        assert validation["end"] < 0.8 * validation["start"], f"{learner_id} did not learn: {validation}"
    return reports


@pytest.mark.slow
def test_two_user_loops_train_a_tiny_llama_and_end_bit_identical_with_the_shards(hf_example_run):
    run = hf_example_run("train.py", steps=80)
    finish_learned_and_bit_identical(run)
    for learner_id in run.scripts:
        steps = [step for step, _ in json.loads(run.losses_path(learner_id).read_text())["train"]]
        assert steps == list(range(1, 81))


@pytest.mark.slow
def test_two_hf_trainers_with_the_callback_train_a_tiny_llama_and_end_bit_identical_with_the_shards(hf_example_run):
    run = hf_example_run("trainer.py", steps=40)
    for report in finish_learned_and_bit_identical(run).values():
        assert report["tokens"] == 40 * 8 * SEQ_LEN  # the Trainer's own count, step by step


@pytest.mark.slow
def test_the_built_in_learner_trains_the_hf_llama_factory_in_sim_and_ends_with_the_shards_bits(tmp_path):
    report = run_sim(tmp_path, "--learners", "2", "--shards", "1", "--steps", "30",
                     "--set", "model=diloco.integrations.hf:llama", "--set", "syncer.max_tokens_per_step=512")
    assert report["inner_steps"] == 2 * 30
    assert report["state_hashes_agree"] is True
    assert report["final_eval_loss"] < 0.8 * report["initial_eval_loss"]


@pytest.mark.slow
def test_the_built_in_learner_trains_a_transformers_gpt2_by_class_and_config_and_both_exports_open_with_from_pretrained(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gpt2 = {"transformers": "GPT2LMHeadModel", "seq_len": 32,
            "config": {"vocab_size": 256, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32}}
    data = tiny_cluster(tmp_path / "state", shards=2, learners=1, steps=30, tls={"mode": "plaintext"}).model_dump()
    cfg = parse_config({**data, "model": gpt2}, source="a GPT-2 of transformers")
    exports = export_both_ways(cfg, tmp_path)
    for export in exports:
        model, loading = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
        assert type(model).__name__ == "GPT2LMHeadModel"
        assert not loading["missing_keys"] and not loading["unexpected_keys"]
        weights = load_file(export / "model.safetensors")  # the model's own names, no adapter's
        assert "transformer.wte.weight" in weights
        assert all(torch.equal(param, weights[name]) for name, param in model.named_parameters())
    assert max(f["version"] for f in json.loads((exports[1] / "export.json").read_text())["fragments"]) >= 1


@pytest.mark.slow
def test_both_exports_of_a_factory_built_transformers_model_open_with_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tiny_cluster(tmp_path / "state", shards=2, learners=1, steps=20, tls={"mode": "plaintext"}).model_dump()
    data["syncer"]["max_tokens_per_step"] = 512
    cfg = parse_config({**data, "model": "diloco.integrations.hf:llama"}, source="the llama factory")
    for export in export_both_ways(cfg, tmp_path):
        model, loading = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert not loading["missing_keys"] and not loading["unexpected_keys"]
        weights = load_file(export / "model.safetensors")
        assert all(torch.equal(param, weights[name]) for name, param in model.named_parameters())


TINY_LLAMA_CONFIG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 32}


@pytest.mark.parametrize("model, expected", [
    ({"transformers": "LlamaForCausalLM", "config": TINY_LLAMA_CONFIG, "seq_len": 32},
     "model      transformers LlamaForCausalLM, context 32"),
    ({"transformers": "LlamaForCasualLM", "config": TINY_LLAMA_CONFIG, "seq_len": 32},
     "invalid: model.transformers: transformers has no model class 'LlamaForCasualLM'"),
    ({"transformers": "LlamaForCausalLM", "config": {**TINY_LLAMA_CONFIG, "vocab_size": 32}, "seq_len": 32},
     "invalid: model.config.vocab_size: 32; the learner's tokens are bytes, so it must be at least 256"),
    ({"transformers": "LlamaForCausalLM", "config": TINY_LLAMA_CONFIG, "seq_len": 64},
     "invalid: model.seq_len: 64 is longer than model.config.max_position_embeddings (32)"),
])
def test_config_check_summarises_a_transformers_model_or_names_what_does_not_fit(tmp_path, capsys, model, expected):
    data = tiny_cluster(tmp_path / "state", shards=1, learners=1).model_dump()
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(parse_config({**data, "model": model})))
    main(["config", "check", str(path)])
    assert expected in "".join(capsys.readouterr())


@pytest.fixture
def cfg(tmp_path):
    """One shard and two learners (us-east-0, us-west-0) in plaintext, a step budget of 3."""
    return tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=3, tls={"mode": "plaintext"},
                        sync={"fragments": 2, "interval_steps": 4, "overlap_steps": 1},
                        syncer={"max_tokens_per_step": 8 * SEQ_LEN})


def tiny_trainer(tmp_path, callback: DecoupledDiLoCoCallback, **arguments) -> Trainer:
    arguments = {"max_steps": 100, "per_device_train_batch_size": 2, **arguments}
    arguments = {"save_strategy": "no", **arguments}
    training = TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True,
                                 disable_tqdm=True, **arguments)
    return Trainer(model=tiny_llama(), args=training, train_dataset=ByteWindows(learner_text(0)[1], SEQ_LEN),
                   callbacks=[callback])


def test_the_runs_step_budget_ends_a_trainer_that_counts_batch_times_accumulation_times_seq_len_tokens(cfg, tmp_path):
    callback = DecoupledDiLoCoCallback(cfg, "us-east-0", seq_len=SEQ_LEN, enabled=False)
    trainer = tiny_trainer(tmp_path, callback, gradient_accumulation_steps=2)
    trainer.train()

    assert trainer.state.global_step == 3  # the config's trainer.max_steps, not the Trainer's 100
    assert callback.sync.steps == 3 and callback.sync.tokens == 3 * 2 * 2 * SEQ_LEN


def test_a_trainer_resumed_from_its_checkpoint_resumes_the_learners_sync_state(cfg, tmp_path):
    callback = DecoupledDiLoCoCallback(cfg, "us-east-0", seq_len=SEQ_LEN, enabled=False)
    trainer = tiny_trainer(tmp_path, callback, save_strategy="steps", save_steps=2)
    trainer.train()
    assert (tmp_path / "trainer" / "checkpoint-2" / "diloco_sync.pt").exists()

    resumed = DecoupledDiLoCoCallback(cfg, "us-east-0", seq_len=SEQ_LEN, enabled=False)
    trainer = tiny_trainer(tmp_path, resumed, save_strategy="steps", save_steps=2)
    trainer.train(resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-2"))
    # Steps 1-2 came with the checkpoint; step 3 is the config's budget.
    assert resumed.sync.report.incarnations[0]["restored_step"] == 0
    assert resumed.sync.report.incarnations[-1]["restored_step"] == 2 and resumed.sync.steps == 3


def test_a_trainer_saves_the_global_model_after_train_and_its_checkpoints_the_local_one(cfg, tmp_path):
    callback = DecoupledDiLoCoCallback(cfg, "us-east-0", seq_len=SEQ_LEN, catch_up_seconds=0.2)
    trainer = tiny_trainer(tmp_path, callback, save_strategy="steps", save_steps=3)
    with running_shards(cfg, tmp_path / "run"):
        trainer.train()
    trainer.save_model(str(tmp_path / "saved"))

    global_values = callback.sync.global_state_dict()
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert all(torch.equal(saved[name], value) for name, value in global_values.items())
    # The checkpoint of the last step is the local model that the sync state beside it resumes.
    checkpoint = load_file(tmp_path / "trainer" / "checkpoint-3" / "model.safetensors")
    assert not all(torch.equal(checkpoint[name], value) for name, value in global_values.items())


def test_a_users_own_loop_exports_its_transformers_model_in_a_folder_from_pretrained_opens(cfg, tmp_path):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = ByteWindows(learner_text(0)[1], SEQ_LEN)[0]
    with running_shards(cfg, tmp_path / "run"):
        with DecoupledDiLoCo(model, cfg, "us-east-0", catch_up_seconds=0.2) as sync:
            while not sync.should_stop:
                model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                sync.step(tokens=SEQ_LEN)
    sync.export(tmp_path / "export")

    exported, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    global_values = sync.global_state_dict()
    assert all(torch.equal(param, global_values[name]) for name, param in exported.named_parameters())


def test_a_step_the_shards_would_refuse_ends_training_with_the_error_and_leaves_the_block(cfg, tmp_path):
    callback = DecoupledDiLoCoCallback(cfg, "us-east-0", seq_len=SEQ_LEN, enabled=False)
    trainer = tiny_trainer(tmp_path, callback, per_device_train_batch_size=16)  # 1024 tokens a step
    with pytest.raises(ValueError, match=r"1024 tokens in one step .* syncer.max_tokens_per_step=512"):
        trainer.train()
    with pytest.raises(RuntimeError, match=r"step\(\) called outside its `with DecoupledDiLoCo"):
        callback.sync.step(tokens=1)


def test_a_trainer_callback_that_cannot_count_tokens_says_how_to_tell_it(cfg, tmp_path):
    trainer = tiny_trainer(tmp_path, DecoupledDiLoCoCallback(cfg, "us-east-0", enabled=False))
    with pytest.raises(ValueError, match=r"pass seq_len= \(tokens per sequence\) or set "
                                         r"TrainingArguments\(include_num_input_tokens_seen=True\)"):
        trainer.train()


def test_a_llama_of_another_shape_is_refused_naming_the_tensor_that_differs(cfg, tmp_path):
    cluster = LocalCluster(cfg, tmp_path / "run")
    try:
        cluster.start_shards()
        with DecoupledDiLoCo(tiny_llama(), cfg, "us-east-0", catch_up_seconds=0.0):
            wider_mlp = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4))
            with pytest.raises(JoinRefused, match=r"this learner's model is not the run's\): tensor 5 is "
                                                  r"'model.layers.0.mlp.gate_proj.weight' \[128, 64\], expected "
                                                  r"'model.layers.0.mlp.gate_proj.weight' \[172, 64\]"):
                with DecoupledDiLoCo(wider_mlp, cfg, "us-west-0", catch_up_seconds=0.0):
                    pass
    finally:
        cluster.stop(timeout=10)
