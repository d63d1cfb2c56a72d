"""Hugging Face transformers with Decoupled DiLoCo (the `diloco[hf]` extra).

An HF `Trainer` run becomes a learner with one callback:

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[DecoupledDiLoCoCallback("cluster.yaml", "us-east-0", seq_len=64)])
    trainer.train()

and the built-in learner (`diloco learner`, `diloco sim`) trains a transformers Llama with
`model: "diloco.integrations.hf:llama"` in the cluster config (byte-level, vocab 256, random
init from a fixed small LlamaConfig: nothing is downloaded). Any other transformers causal LM
it trains as `model: {transformers: <class>, config: {...}, seq_len: N}` (learner/trainer/causal_lm.py).
"""
from __future__ import annotations

import os
import pathlib
import signal

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diloco.learner.sync.api import DecoupledDiLoCo
from diloco.services.contract.config import Config

VOCAB_SIZE = 256  # bytes are the tokens, as in the built-in models
LLAMA_SEQ_LEN = 64  # the factory's context: its max_position_embeddings
SYNC_STATE_FILE = "diloco_sync.pt"  # DecoupledDiLoCo.state_dict() in each Trainer checkpoint folder


def llama(seed: int) -> LlamaForCausalLM:
    """The model factory of `model: "diloco.integrations.hf:llama"`: a 2-layer LlamaForCausalLM
    of width 64 (about 132k parameters) on bytes, context 64 (its max_position_embeddings).
    build_model seeds torch before calling it, so every learner starts from the same bits."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=LLAMA_SEQ_LEN)
    return LlamaForCausalLM(config)


class DecoupledDiLoCoCallback(TrainerCallback):
    """Makes an HF `Trainer` run one learner of a Decoupled DiLoCo run.

    on_train_begin enters `DecoupledDiLoCo` around the Trainer's (unwrapped) model: it joins
    the run and seeds or pulls the global model. on_step_end (after every optimizer step) calls
    `step(tokens=...)` and stops training once `should_stop` (a budget of the config's trainer
    section, or SIGTERM). on_train_end leaves the block: the last contributions are delivered
    and, the budget spent, the model is the global model as of this learner's leave (what
    `trainer.save_model()` after `train()` saves; `self.sync.global_state_dict()` holds it too).
    The Trainer's checkpoints hold the local model, which the sync state beside them resumes.

    Tokens per optimizer step, per process (DecoupledDiLoCo.step multiplies by the island's
    ranks): with `TrainingArguments(include_num_input_tokens_seen=True)`, the Trainer's own
    count (its growth per step over args.world_size); otherwise per_device_train_batch_size x
    gradient_accumulation_steps x `seq_len`, for batches of full `seq_len`-token sequences.
    Set the Trainer's max_steps at least as high as the config's trainer.max_steps: the run's
    budget should end training, not the Trainer's. Every checkpoint the Trainer saves gets the
    learner's sync state (diloco_sync.pt), and `trainer.train(resume_from_checkpoint=...)`
    restores it.

    state_dir, tls_dir, catch_up_seconds, enabled and stop_signals are DecoupledDiLoCo's. An
    error in `step()` leaves the block and propagates out of trainer.train(); if the Trainer
    itself raises it skips on_train_end, and the learner's heartbeats end with the process (the
    shards expire it after their lease).
    """

    def __init__(self, config: str | os.PathLike | Config, learner_id: str, *, seq_len: int | None = None,
                 state_dir: str | os.PathLike | None = None, tls_dir: str | os.PathLike | None = None,
                 catch_up_seconds: float = 3.0, enabled: bool = True,
                 stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len <= 0):
            raise ValueError(f"DecoupledDiLoCoCallback: seq_len must be a positive int, got {seq_len!r}")
        self.config = config
        self.learner_id = learner_id
        self.seq_len = seq_len
        self.state_dir, self.tls_dir = state_dir, tls_dir
        self.catch_up_seconds, self.enabled, self.stop_signals = catch_up_seconds, enabled, stop_signals
        self.sync: DecoupledDiLoCo | None = None  # the learner of the latest trainer.train()
        self._inside = False
        self._tokens_seen = 0  # state.num_input_tokens_seen at the last step

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("DecoupledDiLoCoCallback: the Trainer passed no model to on_train_begin")
        if not counts_tokens(args) and self.seq_len is None:
            raise ValueError("DecoupledDiLoCoCallback: cannot tell how many tokens a step trains on: pass "
                             "seq_len= (tokens per sequence) or set TrainingArguments(include_num_input_tokens_seen=True)")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.sync = DecoupledDiLoCo(model, self.config, self.learner_id, state_dir=self.state_dir,
                                    tls_dir=self.tls_dir, catch_up_seconds=self.catch_up_seconds,
                                    enabled=self.enabled, stop_signals=self.stop_signals)
        saved = checkpoint_folder(args, state) / SYNC_STATE_FILE
        if state.global_step > 0 and saved.exists():  # trainer.train(resume_from_checkpoint=...)
            self.sync.load_state_dict(torch.load(saved, weights_only=True))
        self.sync.__enter__()
        self._inside = True
        self._tokens_seen = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        try:
            self.sync.step(tokens=self._step_tokens(args, state))
        except BaseException as error:
            self._leave(type(error), error, error.__traceback__)
            raise
        if self.sync.should_stop:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        """The Trainer wrote checkpoint-<step>/: this learner's sync state goes beside it, so a
        run resumed from that checkpoint rejoins like a restarted learner (pulling only what it
        missed, keeping its local progress)."""
        if self._inside and self.sync.island.leader:
            torch.save(self.sync.state_dict(), checkpoint_folder(args, state) / SYNC_STATE_FILE)

    def on_train_end(self, args, state, control, **kwargs):
        if self._inside:
            self._leave(None, None, None)

    def _step_tokens(self, args, state) -> int:
        if not counts_tokens(args):
            return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.seq_len
        # The Trainer's count is summed over its processes.
        step_tokens = int(state.num_input_tokens_seen - self._tokens_seen) // args.world_size
        self._tokens_seen = state.num_input_tokens_seen
        return step_tokens

    def _leave(self, exc_type, exc, tb) -> None:
        self._inside = False
        self.sync.__exit__(exc_type, exc, tb)


def checkpoint_folder(args, state) -> pathlib.Path:
    """Where the Trainer keeps its checkpoint of the current step (transformers' own naming)."""
    return pathlib.Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def counts_tokens(args) -> bool:
    """The Trainer counts input tokens (state.num_input_tokens_seen): TrainingArguments turns
    include_num_input_tokens_seen=True/False into "all"/"no"; "non_padding" counts too."""
    return args.include_num_input_tokens_seen not in ("no", False, None)
