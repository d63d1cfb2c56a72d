"""Sender-side error feedback: what quantisation dropped is kept and added to the next push, so
over any number of pushes nothing is lost for good, only delayed. Learners (their outer
gradients) and shards (their downlink updates) keep one per fragment."""
from __future__ import annotations

import torch

from diloco.services.contract.codecs import Codec, non_finite_error, payload_bytes


class ErrorFeedback:
    """Sender-side error feedback: keeps what quantisation dropped and adds it to the next push.

    Over any number of pushes, the sum of what was sent differs from the sum of the inputs by
    exactly the current residual, so nothing is lost for good, only delayed.
    """

    def __init__(self, codec: Codec, numel: int, block_size: int, device: torch.device | str = "cpu"):
        codec.encoded_size(numel, block_size)  # validates the arguments
        self.codec, self.numel, self.block_size = codec, numel, block_size
        self.device = torch.device(device)
        self._residual = torch.zeros(numel, device=self.device)

    @property
    def residual(self) -> torch.Tensor:
        """fp32, `numel` values on `device`; save it with a checkpoint and assign it back on
        restore (from any device)."""
        return self._residual

    @residual.setter
    def residual(self, value: torch.Tensor) -> None:
        if value.dtype != torch.float32 or value.shape != (self.numel,):
            expected, got = f"float32 of shape ({self.numel},)", f"{value.dtype} of shape {tuple(value.shape)}"
            raise ValueError(f"residual must be {expected}, got {got}")
        self._residual = value.to(self.device)

    def compress(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """(payload, decoded): the payload to send and exactly what the receiver will decode.

        The residual is replaced by a new tensor, never modified in place, so a caller may keep
        the old one to roll back a push that was lost. If encoding fails (a non-finite value)
        the residual is left as it was.
        """
        total = values + self._residual
        payload, finite = self.codec.encode_to_tensor(total, self.block_size)
        if not finite:
            raise non_finite_error(self.codec, total)
        sent = payload_bytes(payload)  # before total changes: an fp32 payload is total's memory
        decoded = self.codec.decode(payload, self.numel, self.block_size)
        self._residual = total.sub_(decoded)
        return sent, decoded

    def compress_apply(self, update: torch.Tensor, value: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """(payload, value + decoded) for a syncer shard's update: the payload to send, and
        `value` with exactly what receivers decode applied as apply_update does, in a new
        tensor (`value` is left as it was). The residual tensor itself is advanced (a shard
        never rolls back, and saves a copy of it); after a non-finite update it is garbage."""
        payload, new_value, finite = self.codec.compress_apply(update, self._residual, value, self.block_size)
        if not finite:
            raise non_finite_error(self.codec, update)
        return payload_bytes(payload), new_value

    def compress_outer(self, anchor: torch.Tensor, snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, finite) as Codec.encode_to_tensor gives them for the outer gradient
        anchor - snapshot plus the residual, all on the residual's device, without waiting for
        the device (a GPU's payload is then copied to the host once) and without a buffer of
        the fragment's size beside `snapshot`, which is consumed: it becomes the new residual
        (Codec.compress_outer). Where `finite` turns out false the new residual is garbage: the
        caller assigns back the residual it held before."""
        payload, finite = self.codec.compress_outer(anchor, snapshot, self._residual, self.block_size)
        self._residual = snapshot
        return payload, finite
