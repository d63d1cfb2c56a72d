"""Receiving and checking a push, before it changes anything: what its header must say (all of
it judged before a byte of payload is read), its payload reassembled and verified chunk by
chunk as it arrives and spooled, and its values finite and within the norm bounds.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from diloco.services.contract.codecs import codec_name
from diloco.services.contract.config import Config
from diloco.services.contract.payload import ChecksumMismatch, PayloadError, Reassembler, decode_payload, leading_bytes
from diloco.services.contract.wire import pb
from diloco.syncer.claims import ClaimBounds
from diloco.syncer.fragment_state import FragmentState
from diloco.syncer.journal import Spool
from diloco.syncer.membership import Membership
from diloco.syncer.outliers import outlier_limit
from diloco.syncer.owned import OwnedFragments
from diloco.syncer.pull import FP32
from diloco.syncer.refusal import Refusal

_KIND_NAMES = {pb.PUSH_KIND_SEED: "seed", pb.PUSH_KIND_RESTORE: "restore", pb.PUSH_KIND_OUTER_GRADIENT: "outer gradient"}


class PushChecks:
    def __init__(self, cfg: Config, claims: ClaimBounds, membership: Membership, owned: OwnedFragments,
                 clock: Callable[[], float]):
        self.max_update_norm = cfg.syncer.max_update_norm
        self.outlier_norm_factor = cfg.syncer.outlier_norm_factor
        self.claims, self.membership, self.owned, self.clock = claims, membership, owned, clock

    def check_header(self, header: pb.PushHeader) -> FragmentState:
        """The fragment the push is for, once its header passes every check."""
        self.membership.authenticate(header.learner_id, header.incarnation, self.clock())
        state = self.owned.get(header.fragment_id)
        if header.kind not in (pb.PUSH_KIND_SEED, pb.PUSH_KIND_OUTER_GRADIENT, pb.PUSH_KIND_RESTORE):
            raise Refusal("bad_kind", "INVALID_ARGUMENT",
                          f"push kind {header.kind} is neither a seed, a restore nor an outer gradient")
        _check_payload(state, header)
        if header.kind == pb.PUSH_KIND_SEED:
            if header.base_version != 0:
                raise Refusal("bad_seed", "INVALID_ARGUMENT", f"a seed has base_version 0, got {header.base_version}")
            check_unseeded(state)
        elif header.kind == pb.PUSH_KIND_RESTORE:
            if header.base_version < 1:
                raise Refusal("bad_restore", "INVALID_ARGUMENT",
                              "a restore has base_version >= 1 (the version of the value it carries), got 0")
            state.check_restorable(header.base_version)
        else:
            for field in ("c_steps", "c_tokens"):
                if getattr(header, field) == 0:
                    raise Refusal(f"zero_{field[2:]}", "INVALID_ARGUMENT",
                                  f"an outer gradient with {field}=0 has no merge weight (w = c_tokens * c_tokens / c_steps)")
            self.claims.check_push(header)
        return state

    def check_norm(self, state: FragmentState, header: pb.PayloadHeader, chunks: tuple[bytes, ...]) -> None:
        """Refuses NaN or Inf values, a norm above syncer.max_update_norm and an outlier's
        (syncer/outliers.py). The codec's bound from the block scales clears a well-formed push
        without decoding it (the push path then costs little more than receiving the bytes);
        only a push it cannot clear is decoded here."""
        outlier = outlier_limit(state.value_norm(), self.outlier_norm_factor)
        limit = self.max_update_norm if outlier is None else min(outlier, self.max_update_norm)
        scales = leading_bytes(chunks, state.codec.scale_bytes(header.numel, header.block_size))
        if state.codec.norm_bound(scales, header.numel, header.block_size) <= limit:
            return
        norm = _finite_norm(state, decode_payload(header, b"".join(chunks)))
        if outlier is not None and norm > outlier:  # the rule that names a sick learner comes first
            raise Refusal("norm_outlier", "INVALID_ARGUMENT",
                          f"fragment {state.id}: outer gradient norm {norm:.4g} is an outlier, more than "
                          f"syncer.outlier_norm_factor={self.outlier_norm_factor:g} times the norm "
                          f"{outlier / self.outlier_norm_factor:.4g} of the fragment's global value")
        if norm > self.max_update_norm:
            raise Refusal("norm_too_large", "INVALID_ARGUMENT",
                          f"fragment {state.id}: outer gradient norm {norm:.4g} exceeds "
                          f"syncer.max_update_norm={self.max_update_norm:.4g}")


def reassembler(header: pb.PayloadHeader) -> Reassembler:
    """Refuses a payload header that does not add up before anything is written for it."""
    try:
        return Reassembler(header)
    except PayloadError as error:
        raise Refusal("bad_payload_header", "INVALID_ARGUMENT", str(error)) from None


def receive(assembler: Reassembler, chunks: Iterator[pb.Chunk], spool: Spool) -> tuple[bytes, ...]:
    """The payload, verified, as its chunks, each written to the spool as it arrives."""
    try:
        for chunk in chunks:
            spool.write(assembler.add(chunk))
        return assembler.finish_chunks()
    except ChecksumMismatch as error:
        raise Refusal("checksum", "DATA_LOSS", f"payload corrupted: {error}") from None
    except PayloadError as error:
        raise Refusal("bad_chunks", "INVALID_ARGUMENT", f"bad payload stream: {error}") from None


def finite_value(state: FragmentState, header: pb.PayloadHeader, chunks: tuple[bytes, ...]) -> torch.Tensor:
    """A seed's or restore's decoded value, refusing NaN and Inf."""
    values = decode_payload(header, b"".join(chunks))
    _finite_norm(state, values)
    return values


def until_seeded(state: FragmentState, chunks: Iterator[pb.Chunk]) -> Iterator[pb.Chunk]:
    """A seed's chunks, refused as soon as another learner's seed of the fragment is in: one
    on a slow link stops uploading a whole fragment the shard no longer needs."""
    for chunk in chunks:
        check_unseeded(state)
        yield chunk


def check_unseeded(state: FragmentState) -> None:
    if state.committed is not None:
        raise Refusal("already_seeded", "ALREADY_EXISTS",
                      f"fragment {state.id} is already seeded (the first seed wins): pull it")


def _check_payload(state: FragmentState, header: pb.PushHeader) -> None:
    """Seeds and restores are fp32 values; outer gradients use the cluster codec and block size."""
    value = header.kind in (pb.PUSH_KIND_SEED, pb.PUSH_KIND_RESTORE)
    expected = FP32 if value else state.codec
    payload = header.payload
    if payload.codec != expected.wire:
        raise Refusal("wrong_codec", "INVALID_ARGUMENT",
                      f"fragment {state.id}: a {_KIND_NAMES[header.kind]} must be "
                      f"{expected.name}, got {codec_name(payload.codec)}")
    if not value and payload.block_size != state.block_size:
        raise Refusal("wrong_block_size", "INVALID_ARGUMENT",
                      f"fragment {state.id}: codec block size must be {state.block_size}, "
                      f"got {payload.block_size}")
    if payload.numel != state.fragment.numel:
        raise Refusal("wrong_numel", "INVALID_ARGUMENT",
                      f"fragment {state.id} has {state.fragment.numel} elements, "
                      f"the push has {payload.numel}")


def _finite_norm(state: FragmentState, values: torch.Tensor) -> float:
    """The L2 norm, refusing NaN and Inf. One fast pass in the common case: any non-finite
    value makes the norm non-finite, and only then are they counted (a norm that merely
    overflowed is left to the norm bound)."""
    norm = float(torch.linalg.vector_norm(values))
    if not math.isfinite(norm):
        bad = values.numel() - int(torch.isfinite(values).sum())
        if bad:
            raise Refusal("non_finite", "INVALID_ARGUMENT",
                          f"fragment {state.id}: {bad} of {values.numel()} decoded values are NaN or Inf")
    return norm
