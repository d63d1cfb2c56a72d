"""The rule that keeps one learner's abnormal outer gradient out of a fragment's merge.

A learner whose learning rate blew up, whose fp16 overflowed or whose memory flipped bits sends
finite but enormous outer gradients; merged, one of them sets the size of the outer step (the
RDA merge averages norms). A healthy outer gradient, one sync period of training, moves the
fragment by less than the fragment's own size; a learner whose weights were scaled up, or that
carries a flipped exponent bit, moves it by many times that. So a push whose L2 norm is more
than syncer.outlier_norm_factor times the norm of the fragment's global value is refused
(INVALID_ARGUMENT, reason "norm_outlier", counted per learner as outliers.<learner id>);
nothing of it is merged, and the learner heals itself after a few refusals in a row
(learner/sync/healing.py).

The reference is the global value, not the norms of recent contributions: those grow by two
orders of magnitude between a fragment's first rounds as the learning rate warms up, so a rule
on their median refuses healthy pushes early in every run. A fragment whose global value is
all zeros has no reference: only syncer.max_update_norm bounds its pushes.
"""
from __future__ import annotations


def outlier_limit(value_norm: float, factor: float | None) -> float | None:
    """The largest norm a push may have; None: no bound from the rule (off, or a zero value)."""
    if factor is None or value_norm == 0:
        return None
    return factor * value_norm
