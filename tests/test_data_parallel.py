"""The data-parallel baseline (`diloco sim --mode dp`, `diloco learner --data-parallel` under
torchrun) is data parallel: M processes end where one process training on all their batches
at once ends, and a killed rank restarts every rank from the last checkpoint, which then ends
exactly where an uninterrupted job ends."""
from __future__ import annotations

import pathlib

import pytest
import torch

from diloco.learner.trainer.data import build_data
from diloco.learner.trainer.model import build_model
from diloco.learner.trainer.train import Trainer
from diloco.localcluster.data_parallel import DataParallelJob
from tests.cluster_config import tiny_cluster
from tests.cluster_watch import wait_until

pytestmark = pytest.mark.slow

TIMEOUT = 180


def job_config(tmp_path: pathlib.Path, steps: int, **trainer):
    return tiny_cluster(tmp_path / "state", shards=1, learners=2, steps=steps, tls={"mode": "plaintext"},
                        syncer={"max_tokens_per_step": 2 * 8 * 32},  # both ranks' tokens of a step
                        trainer={"eval_every": 1000, "checkpoint_every": 10, **trainer})


def run_to_the_end(job: DataParallelJob) -> dict:
    """The job's final checkpoint, once it ended by itself."""
    job.proc.popen.wait(TIMEOUT)
    assert job.proc.returncode == 0, job.proc.log_tail(40)
    return torch.load(job.report_path.parent / "checkpoint.pt", weights_only=True)


def running(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class BothLearnersBatches:
    """Learner 0's batch and learner 1's, as one batch of twice the size."""

    def __init__(self, cfg):
        seq_len, cache = cfg.model.seq_len, pathlib.Path(cfg.run.state_dir) / "cache"
        self.sources = [build_data(cfg, index, seq_len, cache_dir=cache) for index in (0, 1)]

    def next_batch(self):
        x, y = zip(*(source.next_batch() for source in self.sources))
        return torch.cat(x), torch.cat(y)


def test_two_processes_hold_the_parameters_of_one_process_training_on_both_batches(tmp_path):
    cfg = job_config(tmp_path, steps=6)
    job = DataParallelJob(cfg, tmp_path / "run")
    job.proc.start()
    checkpoint = run_to_the_end(job)
    assert checkpoint["step"] == 6 and checkpoint["tokens"] == 6 * 8 * 32  # each rank's own count

    one = Trainer(build_model(cfg.model, seed=cfg.run.seed), BothLearnersBatches(cfg), cfg.trainer)
    for _ in range(6):
        one.train_step()
    alone = Trainer(build_model(cfg.model, seed=cfg.run.seed), BothLearnersBatches(cfg).sources[0], cfg.trainer)
    for _ in range(6):
        alone.train_step()
    for name, param in one.model.state_dict().items():
        torch.testing.assert_close(checkpoint["model"][name], param, rtol=1e-4, atol=1e-6, msg=name)
    # Not what one rank's batches alone give: the job averaged both ranks' gradients.
    assert any(not torch.allclose(checkpoint["model"][name], param, rtol=1e-4, atol=1e-6)
               for name, param in alone.model.state_dict().items())


def test_a_killed_rank_restarts_every_rank_from_the_last_checkpoint_and_ends_as_if_never_killed(tmp_path):
    cfg = job_config(tmp_path / "killed", steps=60)
    job = DataParallelJob(cfg, tmp_path / "killed" / "run")
    job.proc.start()
    wait_until(lambda: job.report().get("steps", 0) >= 30, TIMEOUT, "the job to pass step 30")
    ranks = set(job.rank_pids().values())
    job.fail(rank=1)
    assert job.proc.returncode is not None  # torchrun stopped the other rank and ended
    wait_until(lambda: not any(map(running, ranks)), 30, "the killed job's ranks to end")
    job.proc.start()
    killed = run_to_the_end(job)
    lives = job.report()["incarnations"]
    assert len(lives) == 2 and lives[1]["restored_step"] >= 30 and lives[1]["restored_step"] % 10 == 0

    twin = DataParallelJob(job_config(tmp_path / "twin", steps=60), tmp_path / "twin" / "run")
    twin.proc.start()
    uninterrupted = run_to_the_end(twin)
    assert killed["step"] == uninterrupted["step"] == 60
    for name, value in uninterrupted["model"].items():
        assert torch.equal(killed["model"][name], value), name
