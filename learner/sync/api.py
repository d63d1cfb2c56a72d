"""Decoupled DiLoCo around your own training loop: your model, your optimizer, your data.

    from diloco import DecoupledDiLoCo

    with DecoupledDiLoCo(model, config="cluster.yaml", learner_id="us-east-0") as sync:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            sync.step(tokens=x.numel())
            if sync.should_stop:  # a budget of the config's trainer section is spent, or SIGTERM
                break

Entering joins every shard, seeds the global model from `model` (the first learner) or pulls
it into `model`, starts heartbeats and serves /metrics (learners[].metrics_port). `step()`
after every optimizer step starts each fragment's sync when it is due and applies results
tau steps later; everything else (pushes, pulls, retries, rejoining a restarted shard)
happens on background threads. Leaving the block delivers the last contributions, leaves the
run, pulls the global model until it is quiet for catch_up_seconds (`global_state_dict()`,
`export()`) and writes the learner report. A learner whose budget is spent then holds that
global model in `model` too; one that was stopped keeps its local model, whose progress since
its last syncs its next life pushes. That is the global model as of this learner's leave:
learners that leave later hold newer versions, and the run's final model is the last one's,
which `diloco export` pulls from the shards once every learner has left.

Only parameters are synced, by name (a tied tensor once); the optimizer and its state stay
yours. Put `state_dict()` in your checkpoint and give it back with `load_state_dict()` before
entering: the restarted learner pulls only what it missed and keeps its local progress.
Under torchrun (DDP inside one learner), every rank makes the same calls; rank 0 syncs and the
others receive what it applied, so the ranks stay identical.

Devices and precision stay yours too: the model may live on any device (move it before entering
the block) and train under torch.autocast, with parameters in fp32 or kept in bf16. The sync
keeps its own state in fp32 whatever the model's dtype: per parameter a 4 B anchor (the global
value) in host memory and a 4 B error-feedback residual, plus a 4 B snapshot of each fragment
in flight. On a GPU the residual and a copy of the anchor live on the device, where the outer
gradient `anchor - theta` is taken and compressed without the training thread waiting for the
device, and only the encoded payload is copied to the host (learner/sync/outer_gradient.py; 8 B per
parameter of device memory, docs/gpus.md). A result is merged on the model's device between
steps and written back in each parameter's own device and dtype (bf16 parameters hold the
global value rounded to bf16, and that rounding is part of their next outer gradient).

One object is one stay in the run: entering it again after leaving is refused. To go on where
it left off, make a new one and give it `state_dict()` of the old one (as after a restart).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import time
from typing import Iterator

import torch
from torch import nn

from diloco.services.export import is_transformers_model
from diloco.learner.island.ranks import Island
from diloco.learner.sync.records import LearnerRecords
from diloco.learner.sync.report import Report, process_started
from diloco.learner.sync.stop_signals import StopSignals
from diloco.learner.sync.streaming import StreamingSync
from diloco.learner.sync.synced_parameters import SyncedParameters
from diloco.learner.sync.synced_parameters import manifest
from diloco.services.contract.config import Config, ConfigError, load_config
from diloco.services.export import ExportedFragment, GlobalModel, pretrained_config, write_export
from diloco.services.contract.fragments import plan_for_config
from diloco.learner.sync.metrics import LearnerMetrics
from diloco.services.contract.tls import learner_name, load_identity

log = logging.getLogger(__name__)


class DecoupledDiLoCo:
    """One learner of a Decoupled DiLoCo run, driven by the caller's training loop.

    model       the nn.Module whose parameters are synced (not a DDP wrapper: its .module)
    config      the run's cluster YAML (a path) or a loaded Config; the same file the shards use
    learner_id  this learner's id in the config's learners
    region      checked against the config when given
    state_dir   where the report goes (default <run.state_dir>/learner-<id>)
    tls_dir     this learner's ca.crt, tls.crt and tls.key (default <tls.dir>/learner-<id>)
    catch_up_seconds  on leaving, pull until no fragment changed for this long
    enabled     False: train alone, never contacting a shard (a baseline), with the same
                budgets, report and metrics
    stop_signals  signals that set should_stop (handlers installed while inside the block, from
                the main thread only)
    finish_signals  signals that end the run for this learner as if its budget were spent:
                should_stop, and leaving delivers, leaves and pulls until a stop signal
    optimizer   your inner optimizer, whose state a heal clears (a learner whose model went NaN
                or whose pushes the shards refuse as outliers takes the global model back:
                learner/sync/healing.py); without it, clear it yourself when `heals` grows
    island      the processes of this learner: default the torchrun ranks of the default
                process group (learner/island/ranks.py); the built-in learner passes its replica
                groups (learner/island/replica_groups.py) when island.replica_groups > 1
    """

    def __init__(self, model: nn.Module, config: str | os.PathLike | Config, learner_id: str, *,
                 region: str | None = None, state_dir: str | os.PathLike | None = None,
                 tls_dir: str | os.PathLike | None = None, catch_up_seconds: float = 3.0,
                 enabled: bool = True, stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
                 finish_signals: tuple[signal.Signals, ...] = (signal.SIGUSR1,), island: Island | None = None,
                 optimizer: torch.optim.Optimizer | None = None):
        self._process_started = process_started()
        if not isinstance(model, nn.Module):
            raise TypeError(f"DecoupledDiLoCo: model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError("DecoupledDiLoCo: pass the module inside DistributedDataParallel (ddp.module), "
                            "whose parameter names are the model's own")
        self.cfg = config if isinstance(config, Config) else load_config(config)
        self.learner = self.cfg.learner(learner_id)
        if region is not None and region != self.learner.region:
            raise ConfigError(f"learners: learner {learner_id} is in region {self.learner.region}, not {region}")
        self.model = model
        self._manifest = manifest(model)
        if not self._manifest:
            raise ValueError("DecoupledDiLoCo: the model has no parameters to sync")
        self.plan = plan_for_config(self.cfg, self._manifest)
        self.params: dict[str, torch.Tensor] = {}  # the synced tensors, taken on entering
        self.enabled = enabled
        self.catch_up_seconds = catch_up_seconds
        self.island = island or Island()
        self.optimizer = optimizer
        self.state_dir = pathlib.Path(state_dir or pathlib.Path(self.cfg.run.state_dir) / f"learner-{learner_id}")
        self._tls_dir = tls_dir
        self._stop_signals = StopSignals(stop_signals, finish_signals)
        self._restored: dict = {}
        self._max_tokens_per_step = self.cfg.max_tokens_per_step()
        self.steps = 0  # inner steps trained, over every incarnation
        self.tokens = 0  # tokens trained, every rank of the island, over every incarnation
        self.sync: StreamingSync | None = None
        self.records: LearnerRecords | None = None  # rank 0's report and /metrics
        self.report: Report | None = None  # records.report
        self.metrics: LearnerMetrics | None = None  # records.metrics
        self._inside = False
        self._left = False  # left the block once: entering again is refused
        self._finished = False  # finish() ran
        self._stopping = False
        self._last_step_done = 0.0  # perf_counter when the last step() returned
        self._restore_started = 0.0  # monotonic: joining and pulling the global model began
        self._synced: SyncedParameters | None = None  # taken on entering

    # ---- checkpoint state -----------------------------------------------------------

    def state_dict(self) -> dict:
        """What this learner's checkpoint needs besides the model and optimizer: counters, each
        fragment's version, anchor and residual, the report's history. Plain tensors (weights_only
        loads them), the live ones: deep-copy them to write the checkpoint on another thread."""
        state = {"steps": self.steps, "tokens": self.tokens}
        if self.sync is not None:
            state["sync"] = self.sync.state_dict()
        if self.report is not None:
            self.report.update(self.sync)  # this life's record as of now, or a restart would lose its counters
            state["report"] = self.report.persistent()
        return state

    def load_state_dict(self, state: dict) -> None:
        """A state_dict() from a checkpoint; before entering the block."""
        if self._inside:
            raise RuntimeError("DecoupledDiLoCo.load_state_dict: call it before entering the `with` block")
        missing = {"steps", "tokens"} - set(state)
        if missing:
            raise ValueError(f"DecoupledDiLoCo.load_state_dict: not a DecoupledDiLoCo state_dict "
                             f"(missing {', '.join(sorted(missing))})")
        self._restored = state
        self.steps, self.tokens = int(state["steps"]), int(state["tokens"])

    # ---- entering and leaving -------------------------------------------------------

    def __enter__(self) -> DecoupledDiLoCo:
        if self._inside:
            raise RuntimeError("DecoupledDiLoCo: this learner is already inside its `with` block")
        if self._left:
            raise RuntimeError("DecoupledDiLoCo: this learner already left the run; to go on where it left off, "
                               "make a new DecoupledDiLoCo and call its load_state_dict(old.state_dict()) "
                               "before entering")
        self._synced = SyncedParameters(self.model, self._manifest)
        self.params = self._synced.params
        self._restore_started = time.monotonic()  # the leader restarts this clock once /metrics is served
        if self.island.leader:
            self.records = LearnerRecords(self.cfg, self.learner, self.state_dir, self._restored.get("report"),
                                          self.plan.total_numel)
            self.report = self.records.report
            try:
                self._start_leader()
            except BaseException:
                self._close(leave=False)
                raise
        self.steps, self.tokens = self.island.share_start(self.params, [self.steps, self.tokens])
        self._stop_signals.install()
        self._inside = True
        self._stopping = self.budget_spent
        restore_seconds = time.monotonic() - self._restore_started
        startup_seconds = self._restore_started - self._process_started
        if self.island.leader:
            self.records.started(self.sync, self.steps, startup_seconds, restore_seconds)
            self._write_report("training")  # so this incarnation's record exists, should it die
        self._last_step_done = time.perf_counter()
        return self

    def _start_leader(self) -> None:
        """Rank 0: metrics, then (enabled) join every shard and pull the global model."""
        identity = load_identity(self.cfg, learner_name(self.learner.id), self._tls_dir) if self.enabled else None
        self.records.serve_metrics()
        self.metrics = self.records.metrics
        self._restore_started = time.monotonic()
        if not self.enabled:
            return
        self.records.joining(self.steps, identity)
        if warning := self.cfg.momentum_warning():
            log.warning("learner %s: %s", self.learner.id, warning)
        self.sync = StreamingSync(self.cfg, self.learner.id, self.learner.region, self.params, self.plan,
                                  observer=self.metrics, identity=identity, standing_still=self.island.standing_still)
        self.sync.start(self._restored.get("sync"), should_stop=self._stop_signals.received.is_set, step=self.steps,
                        tokens=self.tokens, process_started=self._process_started)
        self.records.watch(self.sync)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._left = True
        try:
            if exc_type is None:
                self.finish()
                if self.island.leader:
                    self._write_report("done" if self.budget_spent else "training")
        finally:
            self._close(leave=True)

    def finish(self) -> None:
        """Ends training (leaving the block does it if you do not): a learner whose budget is spent
        delivers its last contributions, leaves the run, pulls until the global model is quiet and
        writes it into `model` (rank 0's under torchrun; bf16 parameters get it rounded); one that
        was stopped (SIGTERM) waits for its syncs in flight, pulls, and keeps its local model."""
        _check_inside(self._inside, "finish")
        if self._finished or not self.island.leader:
            self._finished = True
            return
        self._finished = True
        spent = self.budget_spent
        if self.sync and not spent:
            self.sync.flush()  # may wait for late results: still provisioned training time
        self.records.training_ended(spent)
        if self.sync:
            if spent:
                self.sync.deliver()  # the last contributions are in; their rounds need not wait for us
                self.sync.leave()
                self._write_report("catching_up")
            self.sync.catch_up(self.catch_up_seconds, should_stop=self._stop_signals.received.is_set)
            if spent:  # a stopped learner keeps its local steps: its next life pushes them
                self.sync.take_global_model()

    def _close(self, leave: bool) -> None:
        self._inside = False
        self._stop_signals.restore()
        if self.sync is not None:
            self.sync.close(leave=leave)
        if self.records is not None:
            self.records.close()

    # ---- the training loop's calls ----------------------------------------------------

    def step(self, tokens: int, seconds: float | None = None) -> list[int]:
        """Call after every optimizer step. `tokens`: what this process trained on in the step
        (under torchrun each rank passes its own; the island's are that times the ranks).
        `seconds`: the step's compute time, default the time since the last step() returned.
        Returns the ids of the fragments whose global values were applied to the model."""
        entered = time.perf_counter()
        _check_inside(self._inside, "step")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"DecoupledDiLoCo.step: tokens must be a non-negative int, got {tokens!r}")
        island_tokens = tokens * self.island.world_size
        if island_tokens > self._max_tokens_per_step:
            raise ValueError(f"DecoupledDiLoCo.step: {island_tokens} tokens in one step (x {self.island.world_size} "
                             f"ranks) is more than syncer.max_tokens_per_step={self._max_tokens_per_step} of the "
                             "config allows; the shards would refuse this learner's contributions")
        self._synced.check()
        compute_seconds = entered - self._last_step_done if seconds is None else seconds
        applied = []
        if self.sync is not None:
            started, heals = self.sync.stats.syncs_started, self.heals
            applied = self.sync.after_step(self.steps, island_tokens, compute_seconds)
            if applied or self.sync.stats.syncs_started != started:
                self._synced.check(by_name=True)
            if self.heals != heals and self.optimizer is not None:
                self.optimizer.state.clear()  # moments built on the sick values
        self.steps += 1
        self.tokens += island_tokens
        stop = self.budget_spent or self._stop_signals.received.is_set()
        applied, self._stopping = self.island.share_step(self.plan, applied, stop, self.params)
        if self.island.leader:
            self.records.stepped(compute_seconds, compute_seconds + time.perf_counter() - entered, island_tokens,
                                 self.steps)
        self._last_step_done = time.perf_counter()
        return applied

    @property
    def heals(self) -> int:
        """Times this learner was sick and took the global model back (learner/sync/healing.py)."""
        return self.sync.stats.heals if self.sync is not None else 0

    def rephase(self, stood_still_seconds: float = 0.0) -> None:
        """Call after the training stood still while the others trained on (an island regrouping):
        the sync schedule takes their phase again, as after a join. `stood_still_seconds` (the
        regroup, and any step it dropped) is badput "restore", not the next step's compute."""
        if stood_still_seconds > 0:
            self._book_badput("restore", stood_still_seconds, report_key="regroup")
        if self.sync is not None:
            self.sync.rephase()

    @property
    def should_stop(self) -> bool:
        """The config's trainer.max_steps, trainer.max_tokens or the run's trainer.max_run_tokens
        is spent, or a stop signal came. Every rank of an island sees the same answer after each
        step()."""
        return self._stopping or (self.island.world_size == 1 and self._stop_signals.received.is_set())

    @contextlib.contextmanager
    def timed(self, category: str) -> Iterator[None]:
        """Counts the time of the block as badput of `category` ("evaluation" or "checkpoint")
        instead of as the next step's compute."""
        if category not in ("evaluation", "checkpoint"):
            raise ValueError(f"DecoupledDiLoCo.timed: category must be 'evaluation' or 'checkpoint', got {category!r}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self._book_badput(category, time.perf_counter() - started)

    def _book_badput(self, category: str, seconds: float, report_key: str | None = None) -> None:
        """Counts `seconds` of the loop as badput `category` (in the report under `report_key`,
        default the category), not as the next step's compute."""
        self._last_step_done += seconds
        if self.records is not None:
            self.records.spent(category, seconds, report_key)

    def record_evaluation(self, loss: float, global_loss: float | None = None) -> None:
        """Records your validation loss of the model at this step (and, given, of the global
        model it holds: global_state_dict()) in this learner's report, where `diloco sim` draws
        the learners' losses and the global model against them. Rank 0 records; others ignore it."""
        _check_inside(self._inside, "record_evaluation")
        if self.report is not None and self.island.leader:
            self.report.evaluation(self.steps, self.tokens, loss, global_loss)

    # ---- the run's product ------------------------------------------------------------

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The run's global model as this learner last pulled it, fp32, by parameter name
        (after leaving the block: as of its leave; the versions are fragment_versions()). Rank 0
        only."""
        return _holder(self.sync, "global_state_dict").global_state_dict()

    def fragment_versions(self) -> dict[int, int]:
        """The version of each fragment in global_state_dict(), by fragment id."""
        return _holder(self.sync, "fragment_versions").held_versions()

    def export(self, out: str | os.PathLike) -> None:
        """Writes the global model as `diloco export` does: model.safetensors and a manifest, and
        for a transformers model its config.json: AutoModelForCausalLM.from_pretrained(out)."""
        global_values = self.global_state_dict()
        fragments = tuple(ExportedFragment(fid, self.plan.fragments[fid].shard, version, digest, None)
                          for fid, (version, digest) in sorted(self.sync.fragment_hashes().items()))
        config = pretrained_config(self.model) if is_transformers_model(self.model) else None
        write_export(GlobalModel(self.cfg.run.name, self.plan.digest, fragments, global_values, config),
                     pathlib.Path(out))

    @property
    def budget_spent(self) -> bool:
        """trainer.max_steps, trainer.max_tokens or the run's trainer.max_run_tokens is spent, or
        a finish signal ended the run here (should_stop without a stop signal)."""
        budget = self.cfg.trainer
        run_over = self.sync is not None and self.sync.schedule.run_over(self.sync.tokens)
        return self.steps >= budget.max_steps or (budget.max_tokens is not None and self.tokens >= budget.max_tokens) \
            or run_over or self._stop_signals.finish.is_set()

    def _write_report(self, phase: str, background: bool = False) -> None:
        self.records.write(phase, self.steps, self.tokens, self.island, self.sync, background)

    def write_report(self) -> None:
        """Writes <state_dir>/report.json as of now, as training (leaving the block writes the
        final one), on a thread of its own: the training thread only takes the record. Rank 0
        only; others do nothing."""
        _check_inside(self._inside, "write_report")
        if self.island.leader:
            self._write_report("training", background=True)


def _check_inside(inside: bool, call: str) -> None:
    if not inside:
        raise RuntimeError(f"DecoupledDiLoCo.{call}() called outside its `with DecoupledDiLoCo(...)` block: "
                           "enter the block first (it joins the run)")


def _holder(sync: StreamingSync | None, call: str) -> StreamingSync:
    """The sync that holds the global model."""
    if sync is None:
        raise RuntimeError(f"DecoupledDiLoCo.{call}: only rank 0 of a syncing learner "
                           "(enabled=True) holds the global model, once it has entered")
    return sync
