"""What a learner may claim about its own work, checked where the numbers come off the wire.

Pushes and heartbeats carry numbers the shard cannot measure: inner steps and tokens since a
sync (the merge weight c_tokens^2 / c_steps), step times, token rates and counts (the run's
token budget, the phase a restarting learner takes). One learner's numbers reach every
learner's answers, so each must be finite, in range and plausible, or the call is refused
with INVALID_ARGUMENT naming the field, before anything is recorded:

- tokens per step: at most syncer.max_tokens_per_step (T; by default trainer.batch_size x
  trainer.grad_accum_steps x model.seq_len, one process per island), for c_tokens / c_steps and for a heartbeat's
  tokens_per_second x step_seconds and tokens / step;
- steps: c_steps and a heartbeat's step at most trainer.max_steps, the learner's budget;
- step times: 0 (not measured yet) or between MIN_STEP_SECONDS and MAX_STEP_SECONDS;
- a heartbeat's tokens grow no faster than the learner's claimed rate allows since its last
  heartbeat, with a lease of slack in time and one step in tokens.

Within those bounds a contribution still counts for at most what an honest learner at T
tokens per step earns in one sync period of H steps: a merge weight of H * T^2 and H * T
tokens of the run's count (several periods' work after failed syncs is clamped, not refused).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.services.contract.config import Config
from diloco.services.contract.wire import pb
from diloco.syncer.membership import HeartbeatReport, Learner
from diloco.syncer.refusal import Refusal

# No inner step of a real model takes less than a microsecond, nor more than a day; a learner
# divides by the step times other learners report.
MIN_STEP_SECONDS = 1e-6
MAX_STEP_SECONDS = 86_400.0
_ROUNDING = 1 + 1e-9  # a rate computed as tokens / seconds, times seconds again


@dataclass(frozen=True)
class ClaimBounds:
    tokens_per_step: int  # T
    max_steps: int  # trainer.max_steps
    period_steps: int  # H, sync.interval_steps
    max_sync_step: int  # a step plus the phase a learner took (< H)
    lease_seconds: float
    fragments: int  # P, sync.fragments

    @classmethod
    def from_config(cls, cfg: Config) -> ClaimBounds:
        return cls(cfg.max_tokens_per_step(), cfg.trainer.max_steps, cfg.sync.interval_steps,
                   cfg.trainer.max_steps + cfg.sync.interval_steps, cfg.syncer.lease_seconds,
                   cfg.sync.fragments)

    @property
    def max_weight(self) -> float:
        """c_tokens^2 / c_steps of a learner at T tokens per step over one sync period."""
        return float(self.period_steps) * self.tokens_per_step * self.tokens_per_step

    @property
    def max_contribution_tokens(self) -> int:
        return self.period_steps * self.tokens_per_step

    # ---- pushes ------------------------------------------------------------------------

    def check_push(self, header: pb.PushHeader) -> None:
        """An outer gradient's c_steps, c_tokens and step_seconds (c_steps > 0 and c_tokens > 0
        are already checked)."""
        if header.c_steps > self.max_steps:
            _refuse("c_steps", f"c_steps={header.c_steps}: more inner steps since a sync than a learner's "
                               f"whole budget (trainer.max_steps={self.max_steps})")
        if header.c_tokens > header.c_steps * self.tokens_per_step:
            _refuse("c_tokens", f"c_tokens={header.c_tokens} over c_steps={header.c_steps} is "
                                f"{header.c_tokens / header.c_steps:.6g} tokens per step, more than "
                                f"{self._tokens_per_step_source()}")
        _check_step_seconds(header.step_seconds)

    def clamped(self, header: pb.PushHeader) -> pb.PushHeader:
        """A logged contribution's header with its claims brought into range (a record
        admitted before these bounds, or under a larger bound): merged, never refused."""
        clamped = pb.PushHeader()
        clamped.CopyFrom(header)
        clamped.c_steps = min(max(header.c_steps, 1), self.max_steps)
        clamped.c_tokens = min(max(header.c_tokens, 1), clamped.c_steps * self.tokens_per_step)
        if not _valid_step_seconds(header.step_seconds):
            clamped.step_seconds = 0.0
        return clamped

    # ---- heartbeats --------------------------------------------------------------------

    def check_heartbeat(self, report: HeartbeatReport, previous: Learner | None, now: float) -> None:
        """`previous`: this learner's record on the shard, to judge its tokens' growth (None
        before its first heartbeat since it joined)."""
        if report.step > self.max_steps:
            _refuse("step", f"step={report.step} is beyond the learner's budget "
                            f"(trainer.max_steps={self.max_steps})")
        if report.sync_step > self.max_sync_step:
            _refuse("sync_step", f"sync_step={report.sync_step} is beyond trainer.max_steps + "
                                 f"sync.interval_steps={self.max_sync_step}")
        _check_step_seconds(report.step_seconds)
        if report.waiting_for is not None and report.waiting_for >= self.fragments:
            _refuse("waiting_for", f"waiting_for_fragment={report.waiting_for} is not a fragment "
                                   f"(sync.fragments={self.fragments})")
        rate = report.tokens_per_second
        if not (math.isfinite(rate) and rate >= 0):
            _refuse("tokens_per_second", f"tokens_per_second={rate!r} is not a finite number >= 0")
        if rate * report.step_seconds > self.tokens_per_step * _ROUNDING or (rate and not report.step_seconds):
            _refuse("tokens_per_second", f"tokens_per_second={rate:.6g} at step_seconds={report.step_seconds:.6g} "
                                         f"is more tokens per step than {self._tokens_per_step_source()}")
        if report.tokens > report.step * self.tokens_per_step:
            _refuse("tokens", f"tokens={report.tokens} in {report.step} steps is more tokens per step than "
                              f"{self._tokens_per_step_source()}")
        if previous is not None and previous.heartbeat_at:
            elapsed = max(0.0, now - previous.heartbeat_at)
            allowed = max(previous.tokens_per_second, rate) * (elapsed + self.lease_seconds) + self.tokens_per_step
            if report.tokens - previous.tokens > allowed:
                _refuse("tokens", f"tokens={report.tokens} grew by {report.tokens - previous.tokens} in "
                                  f"{elapsed:.3g}s since the last heartbeat, more than its rate allows "
                                  f"({allowed:.6g})")

    def _tokens_per_step_source(self) -> str:
        return (f"T={self.tokens_per_step} (syncer.max_tokens_per_step, by default trainer.batch_size x "
                "trainer.grad_accum_steps x model.seq_len)")


def _valid_step_seconds(seconds: float) -> bool:
    return seconds == 0.0 or MIN_STEP_SECONDS <= seconds <= MAX_STEP_SECONDS  # NaN fails both


def _check_step_seconds(seconds: float) -> None:
    if not _valid_step_seconds(seconds):
        _refuse("step_seconds", f"step_seconds={seconds!r} is neither 0 (not measured) nor between "
                                f"{MIN_STEP_SECONDS:g} and {MAX_STEP_SECONDS:g}")


def _refuse(field: str, message: str) -> None:
    raise Refusal(f"bad_{field}", "INVALID_ARGUMENT", message)
