"""Goodput and badput: the one definition that `diloco sim`'s report, the learners' metrics,
the recording rules and `diloco plan` all use (docs/monitoring.md, Goodput and badput).

Goodput is the share of provisioned learner time that became training progress that was kept:

    goodput = kept compute seconds / provisioned seconds

A learner is provisioned from the start of the run until its budget is spent, down or not.
Its kept compute is the compute of the inner steps it ran, less the steps lost (redone after a
crash, or carried by a contribution the syncer refused). Every other provisioned second is
badput, in one of BADPUT's categories, and REMAINDER is what none of them explains (the loop's
own bookkeeping; the recording rules call it `overhead`), so that goodput and badput add up
to the provisioned time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

BADPUT = ("startup", "restore", "blocked", "lost", "down", "evaluation", "checkpoint")
# What a learner can count itself: a process that is down cannot (the rules take it from `up`).
MEASURED_BY_LEARNER = tuple(category for category in BADPUT if category != "down")
REMAINDER = "other"

# What each category is, for reports and documentation.
MEANING = {
    "startup": "from the process starting to its checkpoint loaded and its model built",
    "restore": "joining the run and pulling the global model (catching up after a rejoin); "
               "an island regrouping after losing or regaining a replica group; "
               "reconfiguring or reloading a checkpoint in data-parallel modes",
    "blocked": "waiting for a fragment's result past tau; in data parallel, waiting for the slowest slice",
    "lost": "steps run again after a crash (work since the last delivered sync or checkpoint), "
            "and contributions refused as stale",
    "down": "provisioned but not running: failed and not yet repaired, or stopped for another's failure",
    "evaluation": "the training loop's evaluations of the validation loss",
    "checkpoint": "copying the state for a checkpoint",
    REMAINDER: "the rest: sync bookkeeping on the training thread, the loop itself",
}


def no_badput() -> dict[str, float]:
    """Every category at zero: an account to add seconds to."""
    return dict.fromkeys(BADPUT, 0.0)


def fragment_compute_seconds(c_steps: int, step_seconds: float, fragment_numel: int, model_numel: int) -> float:
    """The learner compute one contribution embodies: its steps times the step time, for the
    fragment's share of the model. Kept when the syncer merges it, lost when it refuses it."""
    return c_steps * step_seconds * fragment_numel / model_numel


@dataclass(frozen=True)
class Goodput:
    provisioned_seconds: float
    kept_seconds: float
    badput_seconds: Mapping[str, float]  # every category of BADPUT, and REMAINDER

    @property
    def share(self) -> float:
        return self.kept_seconds / self.provisioned_seconds if self.provisioned_seconds else 0.0

    def badput_shares(self) -> dict[str, float]:
        return {category: seconds / self.provisioned_seconds if self.provisioned_seconds else 0.0
                for category, seconds in self.badput_seconds.items()}


def account(provisioned_seconds: float, kept_seconds: float, badput_seconds: Mapping[str, float]) -> Goodput:
    """The goodput of `kept_seconds` in `provisioned_seconds`, with the categories' seconds and
    the remainder that none of them explains."""
    remainder = max(0.0, provisioned_seconds - kept_seconds - sum(badput_seconds.values()))
    return Goodput(provisioned_seconds, kept_seconds, {**badput_seconds, REMAINDER: remainder})
