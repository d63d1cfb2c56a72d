"""A push's payload in the making: the outer gradient `anchor - theta` of a fragment, plus the
error-feedback residual, compressed. It is started on the training thread when the fragment's
sync is due and finished on the fragment's sync thread.

    outer = start_outer_gradient(fragment, params, anchor, device_anchor, feedback)  # training thread
    payload = outer.payload()       # sync thread: bytes; ValueError for a NaN or Inf
    outer.rollback()                # the push did not get through: the residual as it was

Where the model lives decides who does the work:
- on a GPU everything runs on the device, launched by the training thread without waiting
  for it: the fragment gathered into one flat buffer on the training stream (ordered before
  the optimizer's next in-place update), the outer gradient against the anchor's copy on the
  device, the codec (services/contract/codecs.py), the new residual; then only the encoded
  payload (and one flag saying whether every value was finite) is copied into pinned host
  memory on a side stream. The sync thread waits for that copy alone.
- on the CPU the training thread copies the fragment (the snapshot must be taken before the
  next step changes it) and the sync thread does the rest.
"""
from __future__ import annotations

from typing import Mapping

import torch

from diloco.learner.host_copy import HostCopy, copy_to_host, to_pinned
from diloco.services.contract.codecs import ErrorFeedback, payload_bytes
from diloco.services.contract.fragments import Fragment, gather


class OuterGradient:
    """One push's payload; the residual it replaced, for a rollback."""

    def __init__(self, feedback: ErrorFeedback):
        self.feedback = feedback
        self._residual_before = feedback.residual
        self.device_to_host_bytes = 0  # what crossed from the device for it, once payload() returned

    def payload(self) -> bytes:
        raise NotImplementedError

    def rollback(self) -> None:
        """The push did not get through: the residual is what it was before this outer gradient,
        so the next one still carries this progress and nothing is counted twice."""
        self.feedback.residual = self._residual_before


class HostOuterGradient(OuterGradient):
    """A CPU model's: the snapshot copied now, compressed on the sync thread."""

    def __init__(self, fragment: Fragment, params: Mapping[str, torch.Tensor], anchor: torch.Tensor,
                 feedback: ErrorFeedback):
        super().__init__(feedback)
        self._anchor = anchor
        self._local: HostCopy = copy_to_host(fragment, params)

    def payload(self) -> bytes:
        payload, _ = self.feedback.compress(self._anchor - self._local.wait())  # the residual: only if it encodes
        return payload


class DeviceOuterGradient(OuterGradient):
    """A GPU model's: compressed on the device now, its payload copied to the host on a side stream."""

    def __init__(self, fragment: Fragment, params: Mapping[str, torch.Tensor], device_anchor: torch.Tensor,
                 feedback: ErrorFeedback):
        super().__init__(feedback)
        flat = gather(fragment, params)
        torch.sub(device_anchor, flat, out=flat)  # the outer gradient, in the snapshot's buffer
        payload, finite = feedback.compress_on_device(flat)
        self._copy = to_pinned(payload, finite.reshape(1))

    def payload(self) -> bytes:
        payload = self._copy.wait()
        self.device_to_host_bytes = self._copy.device_to_host_bytes
        if not bool(self._copy.copies[1]):
            raise ValueError(f"{self.feedback.codec.name} refuses to encode non-finite values (NaN or Inf in "
                             "the outer gradient, that is in the model): a NaN or Inf must never leave the sender")
        return payload_bytes(payload)


def start_outer_gradient(fragment: Fragment, params: Mapping[str, torch.Tensor], anchor: torch.Tensor,
                         device_anchor: torch.Tensor | None, feedback: ErrorFeedback) -> OuterGradient:
    """The outer gradient of the fragment's values now against its anchor (the host's `anchor`,
    or on a GPU its copy `device_anchor` there)."""
    if device_anchor is None:
        return HostOuterGradient(fragment, params, anchor, feedback)
    return DeviceOuterGradient(fragment, params, device_anchor, feedback)
