"""A sick learner heals or stops loudly.

A learner is sick when its model holds NaN or Inf (a fragment's outer gradient cannot be
encoded: learner/sync/pipeline.py never sends one) or when the shards refuse its pushes as
outliers (syncer/outliers.py) `after_refusals` times in a row. (A push beyond
syncer.max_update_norm but not an outlier says more of that setting than of the learner.) It
heals at the next step: its model takes back the global values it holds (the anchors, the
shards' values as of its last syncs), the error-feedback residuals built on the sick values are
dropped, and the inner optimizer's state is cleared; one ERROR line says why. A learner sick
again within `window_steps` of its last heal is not healing: it stops with LearnerDiverged (the
built-in learner exits non-zero), rather than train on values it cannot keep finite.

The sync threads report what their pushes met; the training thread asks `sick()` after each
step and then `heal(fragments, step)` (learner/sync/pipeline.py: FragmentPipeline.heal).
"""
from __future__ import annotations

import threading
from typing import Iterable, Protocol


class Healable(Protocol):
    def heal(self) -> None:
        """Takes back the global value it holds; drops what was built on the sick values."""


class LearnerDiverged(RuntimeError):
    """The learner got sick again soon after a heal: it stops instead of training on."""


class Healing:
    def __init__(self, after_refusals: int, window_steps: int):
        self.after_refusals, self.window_steps = after_refusals, window_steps
        self._lock = threading.Lock()  # sync threads report, the training thread reads
        self._why: str | None = None
        self._outliers_in_a_row = 0
        self._last_heal_step: int | None = None

    # ---- what the sync threads report -----------------------------------------------------

    def non_finite(self, fragment_id: int, detail: str) -> None:
        with self._lock:
            self._why = self._why or f"its model holds NaN or Inf (fragment {fragment_id}: {detail})"

    def refused_as_outlier(self, fragment_id: int, detail: str) -> None:
        with self._lock:
            self._outliers_in_a_row += 1
            if self._outliers_in_a_row >= self.after_refusals and self._why is None:
                self._why = (f"the shards refused {self._outliers_in_a_row} of its pushes in a row as outliers "
                             f"(fragment {fragment_id}: {detail})")

    def delivered(self) -> None:
        with self._lock:
            self._outliers_in_a_row = 0

    # ---- the training thread --------------------------------------------------------------

    def sick(self) -> bool:
        with self._lock:
            return self._why is not None

    def heal(self, fragments: Iterable[Healable], step: int) -> str:
        """Every fragment takes back the global value the learner holds (each waits for its
        push in flight to be answered); then `take(step)`."""
        for fragment in fragments:
            fragment.heal()
        return self.take(step)

    def take(self, step: int) -> str:
        """Why the learner heals at `step`; the reports so far are consumed (call it once the
        pushes of the sick values are answered). Raises LearnerDiverged when its last heal
        was within window_steps: healing did not help."""
        with self._lock:
            why, self._why, self._outliers_in_a_row = self._why, None, 0
            last, self._last_heal_step = self._last_heal_step, step
        if last is not None and step - last <= self.window_steps:
            raise LearnerDiverged(f"sick again {step - last} steps after its last heal (within "
                                  f"trainer.heal_window_steps={self.window_steps}): {why}")
        return why
