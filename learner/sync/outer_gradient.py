"""A push's payload in the making: the outer gradient `anchor - theta` of a fragment, plus the
error-feedback residual, compressed. It is started on the training thread when the fragment's
sync is due and finished on the fragment's sync thread.

    outer = OuterGradient(fragment, params, anchor, feedback)   # training thread
    payload = outer.payload()       # sync thread: bytes; ValueError for a NaN or Inf
    outer.rollback()                # the push did not get through: the residual as it was

The same operations on every device, in one buffer: the fragment gathered into a flat fp32
snapshot (on the training thread: the next step changes the model), the outer gradient against
the anchor written over it, error feedback added, the codec (services/contract/codecs.py), and
the decoded payload subtracted, which leaves the new residual in that buffer. Where the model
lives decides who runs them:
- on a GPU the training thread launches them all on the training stream (ordered before the
  optimizer's next in-place update) without waiting for the device, against the anchor's copy
  and the residual there; only the payload and one flag saying whether every value was finite
  are copied into pinned host memory, on a side stream. The sync thread waits for that copy.
- on the CPU the training thread copies the fragment and the sync thread does the rest, in one
  pass of the compiled kernels where they are built (Codec.compress_outer): the same bits.
"""
from __future__ import annotations

from typing import Mapping

import torch

from diloco.learner.sync.host_copy import HostCopy, to_pinned
from diloco.services.contract.codecs import payload_bytes
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.fragments import Fragment, gather


def compress_when_taken(snapshot: torch.Tensor) -> bool:
    """Whether the training thread launches the compression as it takes the snapshot (a GPU's:
    launching costs it microseconds) rather than leave it to the sync thread (the CPU's)."""
    return snapshot.is_cuda


class OuterGradient:
    """One push's payload, in the making from a snapshot of the fragment; the residual it
    replaced, for a rollback."""

    def __init__(self, fragment: Fragment, params: Mapping[str, torch.Tensor], anchor: torch.Tensor,
                 feedback: ErrorFeedback):
        self.feedback = feedback
        self._residual_before = feedback.residual
        self._anchor = anchor  # on the residual's device
        self.device_to_host_bytes = 0  # what crossed from the device for it, once payload() returned
        self._snapshot = gather(fragment, params)  # now: the next step changes the model
        self._compressed: HostCopy | None = None
        if compress_when_taken(self._snapshot):  # launched now, on the training stream; only the payload crosses
            self._compressed = to_pinned(*self._compress())

    def _compress(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, finite): the outer gradient compressed in the snapshot's buffer, which
        becomes the new residual (ErrorFeedback.compress_outer)."""
        payload, finite = self.feedback.compress_outer(self._anchor, self._snapshot)
        return payload, finite.reshape(1)

    def payload(self) -> bytes:
        """The payload's bytes; ValueError for a NaN or Inf (the caller rolls back)."""
        if self._compressed is None:  # a CPU model's: compressed here, on the sync thread
            payload, finite = self._compress()
        else:
            payload, finite = self._compressed.wait(), self._compressed.copies[1]
            self.device_to_host_bytes = self._compressed.device_to_host_bytes
        if not bool(finite):
            raise ValueError(f"{self.feedback.codec.name} refuses to encode non-finite values (NaN or Inf in "
                             "the outer gradient, that is in the model): a NaN or Inf must never leave the sender")
        return payload_bytes(payload)

    def rollback(self) -> None:
        """The push did not get through: the residual is what it was before this outer gradient,
        so the next one still carries this progress and nothing is counted twice."""
        self.feedback.residual = self._residual_before
