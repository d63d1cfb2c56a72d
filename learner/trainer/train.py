"""The learner's inner loop: AdamW on its own data, warm-up then cosine learning rate,
gradient clipping, and the step time and tokens that the sync metadata and goodput need.

An inner step is trainer.grad_accum_steps micro-batches of trainer.batch_size sequences, their
gradients summed (each loss scaled by 1 / grad_accum_steps) before one optimizer step. With
trainer.precision bf16 the forward pass and loss run under torch.autocast(bfloat16); the
weights, gradients and optimizer state stay fp32. The model trains on the device it is given
(learner/trainer/device.py resolves trainer.device); batches are moved there.

    trainer = Trainer.from_config(cfg, learner_id)
    while trainer.step < cfg.trainer.max_steps:
        stats = trainer.train_step()        # StepStats(loss, tokens, seconds, lr, grad_norm)
        if trainer.step % cfg.trainer.eval_every == 0:
            val_loss = trainer.evaluate()

Nothing here talks to the syncer. The sync client reads and writes the model's parameters
between steps (named_parameters, manifest) and may wrap the model for an island's data
parallel training (`trainer.forward_module = DistributedDataParallel(trainer.model)`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from diloco.learner.trainer.adamw import AdamW
from diloco.learner.trainer.causal_lm import synced_module
from diloco.learner.trainer.checkpoint import checkpoint_state, rank_state, restore_rng
from diloco.learner.trainer.data import DataSource, build_data
from diloco.learner.trainer.model import build_model
from diloco.learner.trainer.wan_allreduce import PacedAllReduce
from diloco.learner.sync.synced_parameters import named_parameters
from diloco.services.contract.config import Config, InnerOptimizerConfig, TrainerConfig

if TYPE_CHECKING:  # torchft is imported only by islands of replica groups
    from diloco.learner.island.replica_groups import ReplicaGroups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int  # consumed by this step on this process: batch_size * grad_accum_steps * seq_len
    seconds: float  # wall time of the whole step, data included (a regroup before it not)
    lr: float
    grad_norm: float  # total L2 norm of the gradients before clipping
    committed: bool = True  # False: a replica group failed during the step, which was dropped
    regrouped: bool = False  # the island of replica groups regrouped before the step (it stood still)
    regroup_seconds: float = 0.0  # how long that regroup held the step back
    wan_seconds: float = 0.0  # of `seconds`, waited for an emulated WAN link's all-reduce (wan_allreduce)
    wan_overlap_seconds: float = 0.0  # how long that all-reduce's buckets overlapped the backward pass


def lr_at(step: int, opt: InnerOptimizerConfig, max_steps: int) -> float:
    """Learning rate of inner step `step` (0-based): linear warm-up over warmup_steps up to
    lr, then cosine decay to lr * min_lr_ratio at max_steps, constant after that."""
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    min_lr = opt.lr * opt.min_lr_ratio
    if step >= max_steps:
        return min_lr
    progress = (step - opt.warmup_steps) / (max_steps - opt.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (opt.lr - min_lr)


def weight_decay_groups(model: nn.Module, opt: InnerOptimizerConfig) -> list[dict]:
    """nanoGPT's parameter groups: weight decay on matrices and embeddings (dim >= 2), none on
    biases and norms."""
    params = named_parameters(model).values()
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, opt: InnerOptimizerConfig) -> AdamW:
    return AdamW(weight_decay_groups(model, opt), lr=opt.lr, betas=(opt.beta1, opt.beta2))


class Trainer:
    """One learner's inner loop.

    `model` is the plain module, on the device it trains on: its parameters are what gets
    synced and checkpointed. `forward_module` runs the training forward pass; it is the model
    itself unless the caller wraps it (DistributedDataParallel inside an island)."""

    def __init__(self, model: nn.Module, data: DataSource, cfg: TrainerConfig, *,
                 forward_module: nn.Module | None = None, slowdown: float = 1.0):
        torch.set_num_threads(cfg.threads)
        self.model = model
        self.data = data
        self.cfg = cfg
        self.slowdown = slowdown  # a step lasts slowdown x its compute time (LearnerConfig.slowdown)
        self.forward_module = forward_module if forward_module is not None else model
        # An island of replica groups (learner/island/replica_groups.py) averages gradients and decides
        # whether each step counts; None: this process (with DDP, its torchrun job) alone.
        self.replicas: ReplicaGroups | None = None
        # Data parallel behind an emulated WAN link (learner/trainer/wan_allreduce.py); None: none.
        self.wan_allreduce: PacedAllReduce | None = None
        # What the run syncs and exports: a transformers model under its own parameter names.
        self.synced_module = synced_module(model)
        self.device = next(model.parameters()).device
        self.optimizer = make_optimizer(model, cfg.inner_optimizer)
        self.step = 0  # inner steps done
        self.tokens = 0  # tokens trained on by this process
        model.train()

    @classmethod
    def from_config(cls, cfg: Config, learner_id: str, *, rank: int = 0,
                    cache_dir: str | os.PathLike | None = None,
                    device: torch.device = torch.device("cpu")) -> Trainer:
        """Model, data and optimizer of learner `learner_id` as the config describes them, the
        model on `device` (built on the CPU first: the same seed gives the same weights anywhere)."""
        learner = cfg.learner(learner_id)
        model = build_model(cfg.model, seed=cfg.run.seed).to(device)
        data = build_data(cfg, cfg.learners.index(learner), model.seq_len, rank=rank, cache_dir=cache_dir)
        return cls(model, data, cfg.trainer, slowdown=learner.slowdown)

    def train_step(self) -> StepStats:
        started = time.perf_counter()
        # A group behind takes the island's state (its step too) here.
        regrouped = self.replicas.begin_step() if self.replicas else False
        regroup_seconds = time.perf_counter() - started if regrouped else 0.0
        started += regroup_seconds
        lr = lr_at(self.step, self.cfg.inner_optimizer, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        micro_batches = self.cfg.grad_accum_steps
        loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for micro in range(micro_batches):
            x, y = (t.to(self.device, non_blocking=True) for t in self.data.next_batch())
            with self._gradient_sync(last=micro == micro_batches - 1):
                with self._autocast():  # the forward pass only: backward runs in the ops' own dtypes
                    _, loss = self.forward_module(x, y)
                (loss / micro_batches).backward()
            loss_sum += loss.detach().double()  # read once per step: .item() waits for the device
            tokens += x.numel()
        wan_seconds, wan_overlap = self.wan_allreduce.take_step() if self.wan_allreduce else (0.0, 0.0)
        if self.replicas:
            self.replicas.average_gradients(self.model.parameters())
        # With clipping off the norm is still measured (max_norm=inf scales by exactly 1).
        max_norm = self.cfg.inner_optimizer.grad_clip or math.inf
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.replicas and not self.replicas.commit():
            return StepStats(loss=loss_sum.item() / micro_batches, tokens=0, seconds=time.perf_counter() - started,
                             lr=lr, grad_norm=grad_norm.item(), committed=False, regrouped=regrouped,
                             regroup_seconds=regroup_seconds)
        self.optimizer.step()
        if self.slowdown > 1.0:  # emulated slower hardware: the step takes longer, for real
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - started - wan_seconds))
        self.step += 1
        self.tokens += tokens
        return StepStats(loss=loss_sum.item() / micro_batches, tokens=tokens, seconds=time.perf_counter() - started,
                         lr=lr, grad_norm=grad_norm.item(), regrouped=regrouped, regroup_seconds=regroup_seconds,
                         wan_seconds=wan_seconds, wan_overlap_seconds=wan_overlap)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces gradients on the last micro-batch of a step only (the sum is the same)."""
        if last or not isinstance(self.forward_module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.forward_module.no_sync()

    def evaluate(self, values: dict[str, torch.Tensor] | None = None) -> float:
        """Mean loss over the fixed validation set of the model, or (`values`: parameters by the
        synced module's names) of a copy of it holding those values."""
        model = self.model
        if values is not None:
            model = copy.deepcopy(self.model)
            synced_module(model).load_state_dict(values, strict=False)
        model.eval()  # no dropout
        try:
            with torch.no_grad():  # no graph to build: it is never backpropagated
                losses = [model(x.to(self.device), y.to(self.device))[1].item()
                          for x, y in self.data.validation_batches()]
        finally:
            model.train()
        return sum(losses) / len(losses)

    def checkpoint(self, extra: dict | None = None, ranks: list[dict] | None = None) -> dict:
        """A copy of the local state for CheckpointWriter; `extra` carries the sync client's
        state, `ranks` every rank's rank_state() of an island."""
        return checkpoint_state(model=self.model, optimizer=self.optimizer, step=self.step,
                                tokens=self.tokens, data_state=self.data.state_dict(), extra=extra or {},
                                ranks=ranks)

    def rank_state(self) -> dict:
        """What this process alone holds (its data position, its random state)."""
        return rank_state(self.model, self.data.state_dict())

    def restore(self, checkpoint: dict, rank: int | None = 0) -> None:
        """Continue from a checkpoint (as load_checkpoint returns it) exactly where it was taken:
        rank `rank` of an island takes its own data position and random state (None: this
        process keeps its own, as a replica group that takes the lead of its island does)."""
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        ranks = checkpoint.get("ranks") or [checkpoint]
        if rank is not None and rank < len(ranks):
            self.data.load_state_dict(ranks[rank]["data"])
            restore_rng(ranks[rank], self.model)
        elif rank is not None:
            log.warning("the checkpoint holds the data position and random state of %d rank(s): rank %d "
                        "starts its own afresh", len(ranks), rank)
        self.step = checkpoint["step"]
        self.tokens = checkpoint["tokens"]
