"""Codecs: how a 1-D fp32 tensor (an outer gradient, an update, a snapshot) becomes bytes and back.

    codec = get_codec("int4")                  # or get_codec(pb.CODEC_INT4)
    payload = codec.encode(delta, block_size=128)
    delta_hat = codec.decode(payload, delta.numel(), block_size=128)   # fp32 again

Decoding always gives fp32: accumulation never happens in a compressed format.

The codecs are torch operations, so they run where the tensor lives; on the CPU the block codecs
run compiled kernels instead (`_codec_kernels.c`, one pass over the values, without the
interpreter lock) where the install could build them. On a GPU a fragment is
encoded there and only its payload crosses to the host: `encode_to_tensor` gives the payload as
a uint8 tensor on the values' device without waiting for the device, and `decode` takes a
payload as bytes (decoded on the host) or as a uint8 tensor (decoded on its device). The
kernels, the CPU's torch operations and a GPU's give the same payload and the same decoded
values, bit for bit (tests/test_codecs.py).

Payload layouts (little-endian; `n` values, `b = ceil(n / block_size)` blocks):

    fp32      n x float32
    bf16      n x bfloat16, rounded to nearest even
    int8      b x float32 scale, then n x int8 code          value = code * scale, |code| <= 127
    int4      b x float32 scale, then ceil(n / 2) bytes      value = code * scale, |code| <= 7
    fp4_e3m0  b x float32 scale, then ceil(n / 2) bytes      value = sign * scale * 2^(e - 7), or 0 if e = 0

The quantised codecs scale each block by its largest magnitude (absmax), so one outlier only
costs precision in its own block. 4-bit codes are packed two per byte, the first value in the
low nibble; an odd count leaves the last high nibble zero. An int4 code is a two's-complement
nibble; an fp4_e3m0 code is a sign bit (8) and a 3-bit exponent e (0..7), so the levels are 0
and 2^-6 .. 2^0 of the block's absmax. Every value goes to its nearest level.

`block_size` must be positive for every codec (fp32 and bf16 ignore it), so a payload header is
valid or not regardless of its codec.

Non-finite values: `encode` refuses any NaN or +-Inf, for every codec, with a ValueError that
counts them. A NaN outer gradient must never leave the learner, and one non-finite value would
poison its block's scale. bf16 also refuses finite values beyond its range (|x| > 3.39e38),
which would round to Inf. The quantised codecs accept every finite value, up to +-3.4e38,
without overflowing a scale. `decode` checks only the payload's length: bytes from a hostile or
broken sender can decode to NaN or Inf (fp32 and bf16 directly, the quantised codecs through
their scales), so a receiver that merges what it decodes must check the result itself.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np
import torch
import torch.nn.functional as F

from diloco.services.contract.state import apply_update
from diloco.services.contract.wire import pb

try:  # built by the install where a C compiler is (pyproject.toml); else torch operations
    from diloco.services.contract import _codec_kernels
except ImportError:
    _codec_kernels = None

DEFAULT_BLOCK_SIZE = 128

# Values per chunk of work. On the CPU each torch operation costs microseconds however small its
# chunk, and a codec takes about twenty per chunk: chunks of 1M values (4 MB temporaries) cost
# that overhead a few times per fragment, where cache-sized ones paid it hundreds of times. On a
# GPU each operation is a kernel launch on the calling thread: few enough launches per fragment,
# while bounding the temporaries beside it (WORKSPACE_BYTES_PER_CHUNK_VALUE per value of a chunk).
_CPU_CHUNK_VALUES = 1 << 20
_DEVICE_CHUNK_VALUES = 1 << 22
WORKSPACE_BYTES_PER_CHUNK_VALUE = 12
# The compiled kernels split a call over torch's intra-op threads (a shard's, by default every
# core), giving each at least this many values: starting a thread costs tens of microseconds.
_KERNEL_VALUES_PER_THREAD = 1 << 19


def workspace_bytes(device: torch.device) -> int:
    """At most what one encode or decode allocates on `device` beside its payload and output."""
    return WORKSPACE_BYTES_PER_CHUNK_VALUE * _chunk_values(device)

Payload = bytes | memoryview | torch.Tensor  # a tensor: uint8, 1-D, on any device


def _kernel_threads(numel: int) -> int:
    return max(1, min(torch.get_num_threads(), numel // _KERNEL_VALUES_PER_THREAD))


def _chunk_values(device: torch.device) -> int:
    return _CPU_CHUNK_VALUES if device.type == "cpu" else _DEVICE_CHUNK_VALUES


def _read(payload: Payload, dtype: torch.dtype, offset: int = 0, count: int = -1) -> torch.Tensor:
    """`count` values of `dtype` at byte `offset` of `payload`: of a tensor a view, on its
    device; of bytes a copy in a new host tensor (torch cannot wrap read-only memory such as
    `bytes` without warning; the block codecs read chunk by chunk, so the copies stay in cache).
    """
    size = -1 if count == -1 else count * dtype.itemsize
    if isinstance(payload, torch.Tensor):
        return payload[offset : None if size == -1 else offset + size].view(dtype)
    return torch.from_numpy(np.frombuffer(payload, np.uint8, size, offset).copy()).view(dtype)


def _size(payload: Payload) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else memoryview(payload).nbytes


def payload_bytes(payload: torch.Tensor) -> bytes:
    """A payload tensor's bytes (copied to the host first where it is on a device)."""
    return payload.cpu().numpy().tobytes()


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def non_finite_error(codec: "Codec", values: torch.Tensor) -> ValueError:
    """What `encode` raises for values of which some are NaN or Inf once encoded."""
    count = values.numel() - int(torch.isfinite(codec.as_sent(values)).sum())
    return ValueError(
        f"{codec.name} refuses to encode {count} non-finite value(s) out of {values.numel()}: "
        "a NaN or Inf must never leave the sender"
    )


class Codec(ABC):
    """One way to put a 1-D fp32 tensor on the wire. Instances are immutable and shared."""

    name: str  # as written in config files
    wire: int  # pb.Codec value

    def encode(self, values: torch.Tensor, block_size: int) -> bytes:
        """The payload of `values` (on any device), as bytes on the host."""
        payload, finite = self.encode_to_tensor(values, block_size)
        if not finite:
            raise non_finite_error(self, values)
        return payload_bytes(payload)

    def as_sent(self, values: torch.Tensor) -> torch.Tensor:
        """`values` in the precision the payload holds them before any scaling (where a value
        beyond that precision's range becomes Inf)."""
        return values

    def encode_to_tensor(self, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the payload, a uint8 tensor on `values`' device; whether every value is finite, a
        bool tensor there). Nothing waits for the device: where some value is not finite the
        payload is garbage, so a sender checks `finite` before it sends. An fp32 payload is
        `values`' own memory: copy it before changing them."""
        _check_block_size(block_size)
        if values.dtype != torch.float32 or values.dim() != 1:
            shape = tuple(values.shape)
            raise ValueError(f"{self.name} encodes 1-D float32 tensors, got {values.dtype} of shape {shape}")
        return self._encode(values.contiguous(), block_size)

    def decode(self, payload: Payload, numel: int, block_size: int,
               out: torch.Tensor | None = None, *, subtract: bool = False) -> torch.Tensor:
        """A 1-D fp32 tensor of `numel` values: a new one, or `out` (contiguous, fp32, `numel`
        values) overwritten, for a caller that decodes many payloads into one buffer, or with
        `subtract` less the decoded values (error feedback's residual, without a second buffer
        of the fragment's size). Bytes decode on the host, a tensor on its device (`out` there)."""
        expected = self.encoded_size(numel, block_size)
        size = _size(payload)
        if size != expected:
            raise ValueError(
                f"{self.name} payload of {size} bytes does not match numel={numel}, "
                f"block_size={block_size}: expected {expected}"
            )
        device = payload.device if isinstance(payload, torch.Tensor) else torch.device("cpu")
        if out is None:  # only now: a header's numel alone must not allocate
            if subtract:
                raise ValueError("decode(subtract=True) subtracts from out: give it")
            out = torch.empty(numel, device=device)
        elif out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 tensor of shape ({numel},), "
                             f"got {out.dtype} of shape {tuple(out.shape)}")
        elif out.device != device:
            raise ValueError(f"out is on {out.device}, the payload on {device}")
        if numel == 0:  # nothing to read (and torch cannot view an empty byte buffer as another dtype)
            return out
        return self._decode(payload, block_size, out, subtract)

    def compress_outer(self, anchor: torch.Tensor, values: torch.Tensor, residual: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback's compression of an outer gradient (ErrorFeedback.compress_outer):
        `values` = anchor - values + residual is encoded, then the decoded payload is subtracted
        from `values`, which end as the new residual. (payload, finite) as encode_to_tensor
        gives them; where finite is false `values` are garbage. All three on one device."""
        total = torch.sub(anchor, values, out=values).add_(residual)
        payload, finite = self.encode_to_tensor(total, block_size)
        if payload.untyped_storage().data_ptr() == total.untyped_storage().data_ptr():  # fp32: total itself
            payload = payload.clone()
        self.decode(payload, len(values), block_size, out=values, subtract=True)
        return payload, finite

    def compress_apply(self, update: torch.Tensor, residual: torch.Tensor, value: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Error feedback's compression of a shard's update, applied (ErrorFeedback.compress_apply):
        `residual` += update is encoded, then the decoded payload is subtracted from `residual`
        (the new residual) and added to `value` into a new tensor, as apply_update does.
        (payload, new value, finite) as encode_to_tensor gives them; where finite is false the
        residual and the new value are garbage. All on one device."""
        total = residual.add_(update)
        payload, finite = self.encode_to_tensor(total, block_size)
        if payload.untyped_storage().data_ptr() == total.untyped_storage().data_ptr():  # fp32: total itself
            payload = payload.clone()
        decoded = self.decode(payload, len(total), block_size)
        total.sub_(decoded)
        return payload, apply_update(value, decoded, out=decoded), finite

    def norm_bound(self, payload: Payload, numel: int, block_size: int) -> float:
        """An upper bound of the L2 norm of `decode(payload, ...)` of a payload of the right
        length, read from its first `scale_bytes(numel, block_size)` bytes alone (`payload`
        may hold just those). NaN or Inf when a decoded value could be non-finite (so any
        `bound <= limit` test fails), and when the layout has nothing to bound with: a
        receiver then decodes and checks the values; otherwise it can leave decoding until
        it needs the values."""
        return math.inf

    def scale_bytes(self, numel: int, block_size: int) -> int:
        """How many leading bytes of a payload norm_bound reads."""
        return 0

    def encoded_size(self, numel: int, block_size: int) -> int:
        """The exact length of what `encode` produces for `numel` values."""
        _check_block_size(block_size)
        if numel < 0:
            raise ValueError(f"numel must not be negative, got {numel}")
        return self._encoded_size(numel, block_size)

    @abstractmethod
    def _encode(self, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _decode(self, payload: Payload, block_size: int, out: torch.Tensor, subtract: bool) -> torch.Tensor: ...

    @abstractmethod
    def _encoded_size(self, numel: int, block_size: int) -> int: ...


@dataclass(frozen=True)
class FloatCodec(Codec):
    """Every value as a float of `dtype`: fp32 is exact, bf16 rounds to nearest even."""

    name: str
    wire: int
    dtype: torch.dtype

    def as_sent(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def _encode(self, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32: the values themselves, no copy. bf16 turns values beyond its range into Inf,
        # which `finite` refuses too.
        encoded = values.to(self.dtype)
        return encoded.view(torch.uint8), torch.isfinite(encoded).all()

    def _decode(self, payload: Payload, block_size: int, out: torch.Tensor, subtract: bool) -> torch.Tensor:
        values = _read(payload, self.dtype)
        return out.sub_(values) if subtract else out.copy_(values)

    def _encoded_size(self, numel: int, block_size: int) -> int:
        return numel * self.dtype.itemsize


@cache
def _largest_scale(top: float) -> float:
    """The largest fp32 scale whose `top * scale` is still finite in fp32."""
    scale = torch.tensor(torch.finfo(torch.float32).max / top, dtype=torch.float32)
    if scale.item() * top > torch.finfo(torch.float32).max:
        scale = scale.nextafter(torch.tensor(0.0))
    return scale.item()


def _block_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """fp32 scales such that |x| / scale rounds to at most `top` for every x of a block (codes
    need no clamping, even when the scale is subnormal) and `top * scale` never overflows."""
    exact = absmax.double() / top
    scale = exact.float()
    scale = torch.where(scale.double() < exact, scale.nextafter(torch.full_like(scale, math.inf)), scale)  # round up
    return scale.clamp_(max=_largest_scale(top))


class BlockCodec(Codec):
    """Block-wise absmax quantisation to `bits`-bit codes (8 or 4) with one fp32 scale per block.

    A subclass says how a scaled value r = x / scale, |r| <= top, becomes a code (one uint8 per
    value, low `bits` bits used) and what a code's unscaled value is.
    """

    bits: int
    top: float  # largest |x| / scale; the block's absmax maps to it

    @abstractmethod
    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor: ...

    def _code_bytes(self, count: int) -> int:
        return (count * self.bits + 7) // 8

    def _encoded_size(self, numel: int, block_size: int) -> int:
        return 4 * -(-numel // block_size) + self._code_bytes(numel)

    def _chunk_values(self, block_size: int, about: int) -> int:
        """Values per chunk, about `about` of them: whole blocks, and an even count so that 4-bit
        codes pack into whole bytes."""
        return block_size * 2 * max(1, about // (2 * block_size))

    def _kernel(self, device: torch.device) -> int | None:
        """This codec's kind for the compiled kernels where they do the work on `device`."""
        return getattr(_codec_kernels, self.name.upper()) if _codec_kernels and device.type == "cpu" else None

    def _kernel_taking(self, tensors: tuple[torch.Tensor, ...]) -> int | None:
        """_kernel, where the tensors are what the kernels take: 1-D, contiguous fp32."""
        if any(t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() for t in tensors):
            return None
        return self._kernel(tensors[0].device)

    def _encode(self, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        numel, device = values.numel(), values.device
        blocks = -(-numel // block_size)
        payload = torch.empty(4 * blocks + self._code_bytes(numel), dtype=torch.uint8, device=device)
        kernel = self._kernel(device)
        if kernel is not None:
            finite = _codec_kernels.encode(kernel, values.detach().numpy(), payload.numpy(), block_size,
                                           _kernel_threads(numel))
            return payload, torch.tensor(finite)
        scales, codes = payload[: 4 * blocks].view(torch.float32), payload[4 * blocks :]
        finite = torch.ones((), dtype=torch.bool, device=device)
        step = self._chunk_values(block_size, _chunk_values(device))
        for start in range(0, numel, step):
            x = values[start : start + step]
            count = len(x)
            if count % block_size:  # only the last block can be partial: pad it with zeros
                x = F.pad(x, (0, block_size - count % block_size))
            x = x.view(-1, block_size)
            absmax = x.abs().amax(1)  # NaN and Inf propagate into it
            finite &= torch.isfinite(absmax).all()
            scale = _block_scales(absmax, self.top)
            scales[start // block_size : start // block_size + len(scale)] = scale
            scaled = x / scale.masked_fill(scale == 0, 1.0)[:, None]  # an all-zero block stays zero
            first = self._code_bytes(start)
            codes[first : first + self._code_bytes(count)] = self._pack(self._to_codes(scaled.view(-1)[:count]))
        return payload, finite

    def compress_outer(self, anchor: torch.Tensor, values: torch.Tensor, residual: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = (anchor, values, residual)
        kernel = self._kernel_taking(tensors)
        if kernel is None:
            return super().compress_outer(anchor, values, residual, block_size)
        numel = values.numel()
        payload = torch.empty(self.encoded_size(numel, block_size), dtype=torch.uint8)
        # One pass in cache where the torch path takes four over the fragment: the same bits.
        finite = _codec_kernels.compress_outer(kernel, *(t.detach().numpy() for t in tensors), payload.numpy(),
                                               block_size, _kernel_threads(numel))
        return payload, torch.tensor(finite)

    def compress_apply(self, update: torch.Tensor, residual: torch.Tensor, value: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tensors = (update, residual, value)
        kernel = self._kernel_taking(tensors)
        if kernel is None:
            return super().compress_apply(update, residual, value, block_size)
        numel = update.numel()
        payload = torch.empty(self.encoded_size(numel, block_size), dtype=torch.uint8)
        new_value = torch.empty(numel)
        # One pass in cache where the torch path takes five over the fragment: the same bits.
        finite = _codec_kernels.compress_update(kernel, *(t.detach().numpy() for t in tensors), new_value.numpy(),
                                                payload.numpy(), block_size, _kernel_threads(numel))
        return payload, new_value, torch.tensor(finite)

    def norm_bound(self, payload: Payload, numel: int, block_size: int) -> float:
        # Every value of a block is at most the largest code's magnitude times the block's
        # scale, so reading the scales (4 bytes per block) bounds the norm. Sums in float64,
        # where squares of fp32 scales cannot overflow; a non-finite scale makes it NaN or Inf,
        # and so does a bound beyond fp32's range, where a code times its scale may overflow.
        blocks = -(-numel // block_size)
        scales = _read(payload, torch.float32, count=blocks).double()
        bound = float(torch.linalg.vector_norm(scales)) * math.sqrt(block_size) * self._largest_code
        return bound if bound <= torch.finfo(torch.float32).max else math.inf

    def scale_bytes(self, numel: int, block_size: int) -> int:
        return 4 * -(-numel // block_size)

    @cached_property
    def _largest_code(self) -> float:
        """The largest magnitude any code decodes to before scaling (a two's-complement int4
        nibble reaches -8, one more than encode writes)."""
        return float(self._from_codes(torch.arange(2**self.bits, dtype=torch.uint8)).abs().max())

    def _decode(self, payload: Payload, block_size: int, out: torch.Tensor, subtract: bool) -> torch.Tensor:
        kernel = self._kernel(out.device)
        if kernel is not None:
            data = payload.numpy() if isinstance(payload, torch.Tensor) else payload
            _codec_kernels.decode(kernel, data, out.detach().numpy(), block_size, subtract, _kernel_threads(len(out)))
            return out
        numel = len(out)
        blocks = -(-numel // block_size)
        scales = _read(payload, torch.float32, count=blocks)
        step = self._chunk_values(block_size, _chunk_values(out.device))
        scratch = torch.empty(min(step, numel), device=out.device) if subtract else None
        for start in range(0, numel, step):
            count = min(step, numel - start)
            chunk = out[start : start + count] if scratch is None else scratch[:count]
            self._unscaled(payload, 4 * blocks + self._code_bytes(start), chunk)
            scale = scales[start // block_size : start // block_size + -(-count // block_size)]
            whole = count // block_size * block_size  # whole blocks, then the partial one (if any)
            chunk[:whole].view(-1, block_size).mul_(scale[: whole // block_size, None])
            chunk[whole:].mul_(scale[whole // block_size :])
            if scratch is not None:
                out[start : start + count].sub_(chunk)
        return out

    def _unscaled(self, payload: Payload, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Writes the values of the len(out) codes at byte `offset` of the payload, before
        scaling, into `out`: one gather from the table of what each byte decodes to."""
        table = _byte_values(self, out.device)
        per_byte = 8 // self.bits
        whole = len(out) // per_byte  # bytes all of whose codes are wanted
        codes = _read(payload, torch.uint8, offset, whole + len(out) % per_byte).int()
        torch.index_select(table, 0, codes[:whole], out=out[: whole * per_byte].view(table.dtype))
        if len(out) % per_byte:  # an odd count of 4-bit codes ends on a low nibble
            out[-1:] = table.index_select(0, codes[whole:]).view(torch.float32)[:1]
        return out

    def _pack(self, chunk_codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return chunk_codes
        if len(chunk_codes) % 2:
            chunk_codes = F.pad(chunk_codes, (0, 1))
        # Each pair of codes read as one little-endian 16-bit c0 | c1 << 8: shifted down by 4
        # and or-ed in, c1 lands in the low byte's high nibble; the cast keeps that low byte.
        pairs = chunk_codes.view(torch.int16)
        return (pairs | (pairs >> 4)).to(torch.uint8)


@dataclass(frozen=True)
class IntCodec(BlockCodec):
    """Signed integer codes in [-top, top], top = 2^(bits-1) - 1: the nearest of evenly spaced
    levels, so the error is at most half a level, absmax / (2 * top)."""

    name: str
    wire: int
    bits: int

    @property
    def top(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        # int8 -> uint8 keeps the two's-complement bits; the mask keeps the low `bits` of them.
        return scaled.round_().to(torch.int8).view(torch.uint8) & (2**self.bits - 1)

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        shift = 8 - self.bits  # the code's sign bit up to the byte's, then back with sign extension
        return ((codes << shift).view(torch.int8) >> shift).float()


_FP32_ONE = 127 << 23  # the fp32 bits of 2^0; exponent e of a code stands for 2^(e - 7)
_HALF_MANTISSA = 1 << 22  # mantissa bits of 1.5: from there up, 2^(k+1) is nearer than 2^k


@dataclass(frozen=True)
class Fp4E3M0Codec(BlockCodec):
    """Sign and a 3-bit exponent, no mantissa: the levels are 0 and 2^-6 .. 2^0 of the block's
    absmax. A value goes to the nearest level, so the error is at most a third of the value
    for |x| >= 2^-6 * absmax, and at most 2^-7 * absmax below that (values under half the
    smallest level flush to zero)."""

    name: str
    wire: int
    bits = 4
    top = 1.0

    def _to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        # Work on the fp32 bits: for 2^k <= r < 2^(k+1) the nearest power of two is 2^(k+1)
        # exactly when the mantissa is >= 1.5, so adding half the mantissa range to the bits
        # carries into the exponent in precisely those cases.
        bits = scaled.view(torch.int32)
        magnitude = bits & 0x7FFFFFFF
        sign = (bits >> 28) & 8  # bit 31 to bit 3
        # r in [2^-7, 2^-6) is nearer 2^-6 than 0 (it is below the rounding midpoint of 2^-6).
        exponent = ((magnitude.clamp(min=_FP32_ONE - (6 << 23)) + _HALF_MANTISSA) >> 23) - (127 - 7)
        exponent *= magnitude >= _FP32_ONE - (7 << 23)  # below 2^-7 (half of 2^-6): zero
        return (exponent | sign).to(torch.uint8)

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.int()
        exponent = codes & 7
        bits = ((codes & 8) << 28) | ((exponent + (127 - 7)) << 23)
        return bits.masked_fill_(exponent == 0, 0).view(torch.float32)


@cache
def _byte_values(codec: BlockCodec, device: torch.device) -> torch.Tensor:
    """What each of the 256 byte values decodes to before scaling, on `device`: its code (8-bit),
    or its pair of codes, low nibble first (4-bit), held as integer bits so that a gather copies
    a byte's values whole, as one element."""
    codes = torch.arange(256, dtype=torch.uint8)
    if codec.bits == 8:
        return codec._from_codes(codes).view(torch.int32).to(device)
    pairs = torch.stack((codec._from_codes(codes & 0xF), codec._from_codes(codes >> 4)), dim=1)
    return pairs.contiguous().view(torch.int64).view(-1).to(device)


CODECS: tuple[Codec, ...] = (
    FloatCodec("fp32", pb.CODEC_FP32, torch.float32),
    FloatCodec("bf16", pb.CODEC_BF16, torch.bfloat16),
    IntCodec("int8", pb.CODEC_INT8, bits=8),
    IntCodec("int4", pb.CODEC_INT4, bits=4),
    Fp4E3M0Codec("fp4_e3m0", pb.CODEC_FP4_E3M0),
)
CODEC_NAMES: tuple[str, ...] = tuple(codec.name for codec in CODECS)
_BY_KEY: dict[str | int, Codec] = {key: codec for codec in CODECS for key in (codec.name, codec.wire)}


def get_codec(key: str | int) -> Codec:
    """The codec with this config name or pb.Codec value."""
    codec = _BY_KEY.get(key)
    if codec is None:
        valid = ", ".join(f"{codec.name} ({codec.wire})" for codec in CODECS)
        raise ValueError(f"unknown codec {key!r}; valid codecs: {valid}")
    return codec


def codec_name(key: str | int) -> str:
    """The codec's config name, for messages: also of a pb.Codec value a peer sent that names
    no codec of this version."""
    codec = _BY_KEY.get(key)
    return codec.name if codec else f"unknown codec {key}"
