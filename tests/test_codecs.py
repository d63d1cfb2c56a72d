"""Codecs: error bounds per codec, exact sizes, the non-finite policy, error feedback."""

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from diloco.services.contract import codecs
from diloco.services.contract.codecs import CODEC_NAMES, DEFAULT_BLOCK_SIZE, get_codec
from diloco.services.contract.error_feedback import ErrorFeedback
from diloco.services.contract.state import apply_update
from diloco.services.contract.wire import pb

QUANTISED = ("int8", "int4", "fp4_e3m0")
FLT_MAX = torch.finfo(torch.float32).max
TINY = 2.0**-148  # absolute slack of two subnormal steps: scales and products round there
BF16_TINY = 2.0**-134  # half the smallest bf16 subnormal
ROUNDING = 2.0**-20  # relative slack for fp32 rounding in scale, division and product


def block_absmax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each value's block absmax."""
    blocks = F.pad(values.abs(), (0, -len(values) % block_size)).view(-1, block_size)
    return blocks.amax(1).repeat_interleave(block_size)[: len(values)]


def error_bound(name: str, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest |x - decode(encode(x))| each codec allows, per value."""
    magnitude = values.abs()
    if name == "fp32":
        return torch.zeros_like(values)
    if name == "bf16":  # 8 significant bits, round to nearest
        return magnitude * 2.0**-8 + BF16_TINY
    absmax = block_absmax(values, block_size)
    if name in ("int8", "int4"):  # half of the step absmax / top
        top = {"int8": 127, "int4": 7}[name]
        return absmax / (2 * top) * (1 + ROUNDING) + TINY
    # fp4_e3m0 levels are 0 and absmax * 2^-6 .. 2^0. Between two powers of two the worst case
    # is the midpoint 1.5 * 2^k, a third of the value away from either. Below 2^-6 the nearest
    # level is 0 (under 2^-7) or 2^-6, at most absmax * 2^-7 away.
    return torch.maximum(magnitude / 3, absmax * 2.0**-7) * (1 + ROUNDING) + TINY


def round_trip(name: str, values: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    codec = get_codec(name)
    payload = codec.encode(values, block_size)
    assert len(payload) == codec.encoded_size(len(values), block_size)
    decoded = codec.decode(payload, len(values), block_size)
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    return decoded


def assert_within_bound(name: str, values: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE):
    decoded = round_trip(name, values, block_size)
    assert torch.isfinite(decoded).all()
    error = (values.double() - decoded.double()).abs()
    excess = error - error_bound(name, values, block_size).double()
    assert (excess <= 0).all(), f"{name}: error exceeds its bound by {excess.max().item():.3g}"
    return decoded


def outlier_among_tiny() -> torch.Tensor:
    values = torch.full((300,), 1e-6)
    values[7] = -1e3  # costs precision in block 0 only
    return values


def huge() -> torch.Tensor:
    values = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 1e37
    values[[3, 150, 299]] = torch.tensor([3e38, -3e38, 2e38])
    return values


INPUTS = {
    "normal": lambda: torch.randn(1001, generator=torch.Generator().manual_seed(0)),
    "zeros": lambda: torch.zeros(300),
    "huge": huge,
    "outlier": outlier_among_tiny,
    "subnormal": lambda: torch.tensor([1e-45, -3e-45, 0.0, 1e-40, -2e-39] * 30),
    **{f"length{n}": (lambda n=n: torch.linspace(-2, 3, n)) for n in (0, 1, 127, 129)},
}


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("make", INPUTS.values(), ids=INPUTS.keys())
def test_round_trip_error_within_bound(name, make):
    assert_within_bound(name, make())


@pytest.mark.parametrize("name", QUANTISED)
def test_subnormal_scales_never_overflow_codes(name):
    # Blocks of two whose absmax / top rounds to nearest as 1 ulp: codes of 190 and 10 would wrap.
    ulp = 2.0**-149
    values = torch.tensor([190 * ulp, -5 * ulp, 10 * ulp, 3 * ulp, ulp, 0.0])
    assert_within_bound(name, values, block_size=2)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zero_blocks_decode_to_exact_zeros(name):
    payload = get_codec(name).encode(torch.zeros(300), DEFAULT_BLOCK_SIZE)
    assert payload == bytes(len(payload))  # zero scales, zero codes: nothing was divided by zero
    values = torch.zeros(3 * DEFAULT_BLOCK_SIZE)
    values[DEFAULT_BLOCK_SIZE + 5] = 1.0  # one live block between two all-zero ones
    decoded = round_trip(name, values)
    assert torch.equal(decoded[:DEFAULT_BLOCK_SIZE], torch.zeros(DEFAULT_BLOCK_SIZE))
    assert torch.equal(decoded[2 * DEFAULT_BLOCK_SIZE :], torch.zeros(DEFAULT_BLOCK_SIZE))
    assert decoded[DEFAULT_BLOCK_SIZE + 5] == pytest.approx(1.0, rel=1e-6)


def test_fp32_is_exact_and_bf16_rounds_to_nearest():
    values = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    assert torch.equal(round_trip("fp32", values), values)
    assert torch.equal(round_trip("bf16", values), values.to(torch.bfloat16).float())


@pytest.mark.parametrize("name", QUANTISED)
def test_largest_finite_values_do_not_overflow(name):
    values = torch.tensor([FLT_MAX, -FLT_MAX, 1.0, FLT_MAX / 3])
    decoded = assert_within_bound(name, values, block_size=4)
    assert decoded[0] > 3e38 and decoded[1] < -3e38


@pytest.mark.parametrize("name", QUANTISED)
def test_outlier_costs_precision_in_its_own_block_only(name):
    values = outlier_among_tiny()
    error = (round_trip(name, values) - values).abs()
    assert error[:DEFAULT_BLOCK_SIZE].max() > 1e-7  # 1e-6 is far below a step of a block scaled by 1e3
    assert error[DEFAULT_BLOCK_SIZE:].max() < 1e-12  # later blocks keep their own scale


def test_fp4_decodes_to_the_nearest_level():
    values = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 0, 2000)
    block_size = 100
    decoded = round_trip("fp4_e3m0", values, block_size)
    absmax = block_absmax(values, block_size)[:, None]
    magnitudes = torch.cat((torch.zeros(1), 2.0 ** torch.arange(-6.0, 1.0)))
    levels = torch.cat((magnitudes, -magnitudes)) * absmax  # every level of each value's block
    nearest = (values[:, None] - levels).abs().min(dim=1).values
    assert ((values - decoded).abs() <= nearest * (1 + ROUNDING)).all()
    assert torch.isin(decoded / absmax[:, 0], torch.cat((magnitudes, -magnitudes))).all()


def test_fp4_flushes_only_below_half_the_smallest_level():
    smallest = 2.0**-6
    values = torch.tensor([1.0, 0.49, 0.51, 0.76, -1.49, -1.51]) * torch.tensor([1.0] + [smallest] * 5)
    expected = torch.tensor([1.0, 0.0, smallest, smallest, -smallest, -2 * smallest])
    assert torch.equal(round_trip("fp4_e3m0", values), expected)


def test_int4_decodes_every_byte_as_two_nibbles_low_first():
    """Each byte value, in every position, the last one of an odd count (a lone low nibble) too."""
    nibbles = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1], dtype=torch.float32)
    packed = torch.arange(256, dtype=torch.uint8)
    expected = torch.stack((nibbles[(packed & 0xF).long()], nibbles[(packed >> 4).long()]), dim=1).view(-1)
    scale = torch.tensor([0.5]).numpy().tobytes()
    for numel in (512, 511):
        for last in range(256):  # every byte value as the payload's last byte
            codes = torch.cat((packed[:255], torch.tensor([last], dtype=torch.uint8)))
            decoded = get_codec("int4").decode(scale + codes.numpy().tobytes(), numel, block_size=512)
            want = torch.cat((expected[:510], expected[2 * last : 2 * last + 2]))[:numel] * 0.5
            assert torch.equal(decoded, want)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(CODEC_NAMES),
    numel=st.integers(0, 700),
    block_size=st.sampled_from([1, 2, 3, 7, 32, 128]),
    exponent=st.integers(-38, 37),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_error_within_bound_for_random_lengths_and_scales(name, numel, block_size, exponent, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) * 10.0**exponent
    assert_within_bound(name, values, block_size)


def test_chunking_does_not_change_the_result(monkeypatch):
    values = torch.randn(1001, generator=torch.Generator().manual_seed(4))
    cases = [(get_codec(name), block_size) for name in QUANTISED for block_size in (1, 3, 7)]
    whole = [codec.encode(values, block_size) for codec, block_size in cases]
    decoded = [codec.decode(payload, 1001, block_size) for (codec, block_size), payload in zip(cases, whole)]
    monkeypatch.setattr(codecs, "_CPU_CHUNK_VALUES", 10)  # many chunks of a few blocks each
    for (codec, block_size), payload, expected in zip(cases, whole, decoded):
        assert codec.encode(values, block_size) == payload
        assert torch.equal(codec.decode(payload, 1001, block_size), expected)
        residual = values.clone()
        codec.decode(payload, 1001, block_size, out=residual, subtract=True)
        assert torch.equal(residual, values - expected)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block_size", [1, 7, 128])
def test_encoded_size_is_exact(name, block_size):
    codec = get_codec(name)
    for numel in (0, 1, 2, 127, 128, 129, 1001):
        assert len(codec.encode(torch.ones(numel), block_size)) == codec.encoded_size(numel, block_size)


def test_bytes_per_parameter():
    numel = 1 << 16
    ideal = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5, "fp4_e3m0": 0.5}
    for name in CODEC_NAMES:
        size = get_codec(name).encoded_size(numel, DEFAULT_BLOCK_SIZE)
        scales = 0 if name in ("fp32", "bf16") else 4 / DEFAULT_BLOCK_SIZE
        assert size / numel == ideal[name] + scales
    assert get_codec("int4").encoded_size(numel, DEFAULT_BLOCK_SIZE) / numel <= 0.55


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite_values(name, bad):
    values = torch.randn(300)
    values[[5, 200]] = bad
    with pytest.raises(ValueError, match=rf"^{name} refuses to encode 2 non-finite value\(s\) out of 300"):
        get_codec(name).encode(values, DEFAULT_BLOCK_SIZE)


def test_bf16_refuses_values_beyond_its_range():
    with pytest.raises(ValueError, match="1 non-finite"):
        get_codec("bf16").encode(torch.tensor([1.0, FLT_MAX]), DEFAULT_BLOCK_SIZE)


def test_float_decode_passes_hostile_nan_through():
    """Documented: fp32/bf16 decode does not check values; the receiver does."""
    values = torch.tensor([math.nan, 1.5, math.inf])
    fp32 = values.numpy().tobytes()
    bf16 = values.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    for name, payload in (("fp32", fp32), ("bf16", bf16)):
        decoded = get_codec(name).decode(payload, 3, DEFAULT_BLOCK_SIZE)
        assert decoded[0].isnan() and decoded[1] == 1.5 and decoded[2] == math.inf


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_refuses_wrong_length(name):
    codec = get_codec(name)
    payload = codec.encode(torch.randn(1001), DEFAULT_BLOCK_SIZE)
    expected = len(payload)
    message = rf"^{name} payload of {expected - 1} bytes does not match numel=1001, block_size=128: "
    message += rf"expected {expected}$"
    with pytest.raises(ValueError, match=message):
        codec.decode(payload[:-1], 1001, DEFAULT_BLOCK_SIZE)
    with pytest.raises(ValueError, match=f"^{name} payload of {expected} bytes does not match numel=1000"):
        codec.decode(payload, 1000, DEFAULT_BLOCK_SIZE)


def test_decode_reads_memoryview_and_returns_a_writable_copy():
    payload = bytearray(get_codec("fp32").encode(torch.ones(4), DEFAULT_BLOCK_SIZE))
    decoded = get_codec("fp32").decode(memoryview(payload), 4, DEFAULT_BLOCK_SIZE)
    payload[:] = bytes(len(payload))
    decoded += 1  # decoded owns its memory: writable, and zeroing the buffer did not touch it
    assert torch.equal(decoded, torch.full((4,), 2.0))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_into_a_buffer_gives_the_same_values(name):
    codec = get_codec(name)
    values = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    payload = codec.encode(values, 7)
    buffer = torch.full((1001,), math.nan)
    assert codec.decode(payload, 1001, 7, out=buffer) is buffer
    assert torch.equal(buffer, codec.decode(payload, 1001, 7))
    for wrong in (torch.empty(1000), torch.empty(1001, dtype=torch.float64), torch.empty(2002)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            codec.decode(payload, 1001, 7, out=wrong)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_invalid_arguments(name):
    codec = get_codec(name)
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        codec.encode(torch.ones(3), 0)
    with pytest.raises(ValueError, match="block_size must be positive"):
        codec.decode(b"", 0, 0)
    with pytest.raises(ValueError, match="numel must not be negative"):
        codec.encoded_size(-1, 128)
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.ones(3, dtype=torch.float64), 128)
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(torch.ones(2, 2), 128)


def test_get_codec_by_name_and_wire_value():
    wire = {
        "fp32": pb.CODEC_FP32,
        "bf16": pb.CODEC_BF16,
        "int8": pb.CODEC_INT8,
        "int4": pb.CODEC_INT4,
        "fp4_e3m0": pb.CODEC_FP4_E3M0,
    }
    assert set(CODEC_NAMES) == set(wire)
    for name, value in wire.items():
        assert get_codec(name) is get_codec(value)
        assert (get_codec(name).name, get_codec(name).wire) == (name, value)
    for unknown in ("int2", "INT4", pb.CODEC_UNSPECIFIED, 99):
        with pytest.raises(ValueError, match=rf"unknown codec {unknown!r}; valid codecs: fp32 \(1\), bf16 \(2\)"):
            get_codec(unknown)


def test_codecs_are_immutable():
    with pytest.raises(AttributeError):
        get_codec("int4").name = "int8"


# --- error feedback --------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTISED + ("bf16",))
def test_error_feedback_loses_nothing_but_the_residual(name):
    generator = torch.Generator().manual_seed(5)
    numel = 1001
    feedback = ErrorFeedback(get_codec(name), numel, DEFAULT_BLOCK_SIZE)
    sent = torch.zeros(numel, dtype=torch.float64)
    inputs = torch.zeros(numel, dtype=torch.float64)
    for _ in range(30):
        values = torch.randn(numel, generator=generator) * 1e-2
        total = values + feedback.residual
        payload, decoded = feedback.compress(values)
        assert torch.equal(decoded, get_codec(name).decode(payload, numel, DEFAULT_BLOCK_SIZE))
        # The residual is one push's quantisation error: it does not grow with the pushes.
        assert (feedback.residual.abs() <= error_bound(name, total, DEFAULT_BLOCK_SIZE)).all()
        inputs += values.double()
        sent += decoded.double()
    assert torch.allclose(inputs - sent, feedback.residual.double(), rtol=0, atol=1e-6)


def test_error_feedback_tracks_a_small_constant_signal_that_plain_int4_flushes():
    numel, pushes, signal = DEFAULT_BLOCK_SIZE, 200, 0.01
    values = torch.full((numel,), signal)
    values[0] = 1.0  # the block's scale: signal / step = 0.07, rounds to code 0
    int4 = get_codec("int4")
    plain = int4.decode(int4.encode(values, DEFAULT_BLOCK_SIZE), numel, DEFAULT_BLOCK_SIZE)
    assert torch.equal(plain[1:], torch.zeros(numel - 1))
    feedback = ErrorFeedback(int4, numel, DEFAULT_BLOCK_SIZE)
    sent = sum(feedback.compress(values)[1] for _ in range(pushes))
    # Each value's total is off by at most its residual, half a step (1 / 14), over 200 pushes.
    assert ((sent[1:] / pushes - signal).abs() <= 1 / 14 / pushes + 1e-6).all()


def test_error_feedback_residual_survives_a_checkpoint():
    int4 = get_codec("int4")
    values = torch.randn(300, generator=torch.Generator().manual_seed(6))
    original = ErrorFeedback(int4, 300, DEFAULT_BLOCK_SIZE)
    original.compress(values)
    restored = ErrorFeedback(int4, 300, DEFAULT_BLOCK_SIZE)
    restored.residual = original.residual.clone()
    assert original.compress(values)[0] == restored.compress(values)[0]
    with pytest.raises(ValueError, match=r"residual must be float32 of shape \(300,\)"):
        restored.residual = torch.zeros(299)


def test_error_feedback_keeps_its_residual_when_encoding_fails():
    feedback = ErrorFeedback(get_codec("int8"), 300, DEFAULT_BLOCK_SIZE)
    feedback.compress(torch.randn(300))
    before = feedback.residual.clone()
    values = torch.randn(300)
    values[10] = math.nan
    with pytest.raises(ValueError, match="1 non-finite"):
        feedback.compress(values)
    assert torch.equal(feedback.residual, before)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(CODEC_NAMES), numel=st.integers(1, 700), block_size=st.integers(1, 130),
       seed=st.integers(0, 2**32 - 1))
def test_norm_bound_is_never_below_the_decoded_norm(name, numel, block_size, seed):
    """Any bytes of the right length, including codes no encoder writes (int4's -8) and NaN or
    Inf scales: either the bound is at least the norm of what decodes, or it is not a number
    any limit can clear."""
    codec = get_codec(name)
    size = codec.encoded_size(numel, block_size)
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    payload = payload.numpy().tobytes()
    bound = codec.norm_bound(payload, numel, block_size)
    norm = float(torch.linalg.vector_norm(codec.decode(payload, numel, block_size).double()))
    if math.isfinite(norm):
        assert not bound < norm
    else:
        assert not bound <= 1e300


@pytest.mark.parametrize("name", ["int8", "int4", "fp4_e3m0"])
def test_norm_bound_of_a_block_codec_is_within_a_small_factor(name):
    """The bound clears honest pushes against a limit a few times their norm, so they are not decoded on receipt."""
    codec = get_codec(name)
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    payload = codec.encode(values, DEFAULT_BLOCK_SIZE)
    decoded_norm = float(torch.linalg.vector_norm(codec.decode(payload, values.numel(), DEFAULT_BLOCK_SIZE)))
    assert decoded_norm <= codec.norm_bound(payload, values.numel(), DEFAULT_BLOCK_SIZE) < 5 * decoded_norm


# ---- the same codec on every device ----------------------------------------------------------

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def awkward_values(numel: int, block_size: int) -> torch.Tensor:
    """Random magnitudes over many decades, a block of zeros, exact ties and a partial last block."""
    generator = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=generator) * 10.0 ** torch.randint(-30, 30, (numel,), generator=generator)
    if numel >= 2 * block_size + 4:
        values[block_size : 2 * block_size] = 0.0  # a whole block of zeros
        values[2 * block_size : 2 * block_size + 4] = torch.tensor([3.5, -2.5, 0.5, 7.0])  # ties round to even
    return values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("numel", [1, 255, 1001, (1 << 20) + 3])
def test_encoding_on_a_device_gives_the_hosts_bytes_and_decoded_values(device, name, numel, monkeypatch):
    monkeypatch.setattr(codecs, "_DEVICE_CHUNK_VALUES", 1 << 18)  # several chunks on a device too
    codec, block_size = get_codec(name), 7 if numel < 1000 else DEFAULT_BLOCK_SIZE
    values = awkward_values(numel, block_size)
    payload = codec.encode(values, block_size)
    on_device, finite = codec.encode_to_tensor(values.to(device), block_size)
    assert on_device.device.type == device and on_device.dtype == torch.uint8 and bool(finite)
    assert codecs.payload_bytes(on_device) == payload
    decoded = codec.decode(payload, numel, block_size)
    decoded_there = codec.decode(on_device, numel, block_size)
    assert decoded_there.device.type == device
    assert torch.equal(decoded_there.cpu(), decoded)
    residual = values.to(device, copy=True)
    codec.decode(on_device, numel, block_size, out=residual, subtract=True)
    assert torch.equal(residual.cpu(), values - decoded)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("kernels", ["compiled where built", "torch operations"])
def test_a_non_finite_value_is_flagged_on_every_device(device, name, bad, kernels, monkeypatch):
    if kernels == "torch operations":
        monkeypatch.setattr(codecs, "_codec_kernels", None)
    values = torch.randn(300)
    values[257] = bad
    codec = get_codec(name)
    _, finite = codec.encode_to_tensor(values.to(device), 128)
    assert not bool(finite)
    with pytest.raises(ValueError, match="1 non-finite"):
        codec.encode(values.to(device), 128)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_feedback_on_a_device_sends_and_keeps_what_it_does_on_the_host(device, name):
    host, there = ErrorFeedback(get_codec(name), 1001, 64), ErrorFeedback(get_codec(name), 1001, 64, device)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        values = torch.randn(1001, generator=generator)
        payload, _ = host.compress(values)
        on_device, finite = there.compress_outer(torch.zeros(1001, device=device), -values.to(device))
        assert bool(finite) and codecs.payload_bytes(on_device) == payload
        assert there.residual.device.type == device
        assert torch.equal(there.residual.cpu(), host.residual)


def test_decode_refuses_an_out_on_another_device_than_its_payload():
    codec = get_codec("int4")
    payload, _ = codec.encode_to_tensor(torch.randn(10), 4)
    with pytest.raises(ValueError, match="out is on meta, the payload on cpu"):
        codec.decode(payload, 10, 4, out=torch.empty(10, device="meta"))
    with pytest.raises(ValueError, match="subtract"):
        codec.decode(payload, 10, 4, subtract=True)


# ---- the compiled CPU kernels against torch operations ---------------------------------------


def test_the_install_built_the_compiled_kernels_where_a_c_compiler_is():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the codecs use torch operations")
    assert codecs._codec_kernels is not None, "pip install -e . did not build services/contract/_codec_kernels.c"


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("numel", [1, 2, 255, 1001, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("block_size", [1, 3, 7, 65, 128, 5000])
def test_the_compiled_kernels_give_torchs_bytes_and_decoded_values(name, numel, block_size, monkeypatch):
    codec, values = get_codec(name), awkward_values(numel, block_size)
    residual = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    payload = codec.encode(values, block_size)
    decoded = codec.decode(payload, numel, block_size)
    kept = codec.decode(payload, numel, block_size, out=residual.clone(), subtract=True)
    monkeypatch.setattr(codecs, "_codec_kernels", None)
    assert codec.encode(values, block_size) == payload
    assert torch.equal(codec.decode(payload, numel, block_size), decoded)
    assert torch.equal(codec.decode(payload, numel, block_size, out=residual, subtract=True), kept)


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("numel", [1, 1001, (1 << 16) + 5])
@pytest.mark.parametrize("block_size", [3, 128])
@pytest.mark.parametrize("threads", [2, 7])
def test_the_compiled_kernels_split_over_threads_give_one_threads_bytes(name, numel, block_size, threads,
                                                                        monkeypatch):
    codec, values = get_codec(name), awkward_values(numel, block_size)
    residual = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    payload = codec.encode(values, block_size)
    decoded = codec.decode(payload, numel, block_size)
    kept = codec.decode(payload, numel, block_size, out=residual.clone(), subtract=True)
    monkeypatch.setattr(codecs, "_KERNEL_VALUES_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert codec.encode(values, block_size) == payload
    assert torch.equal(codec.decode(payload, numel, block_size), decoded)
    assert torch.equal(codec.decode(payload, numel, block_size, out=residual, subtract=True), kept)
    values[-1] = math.nan  # in the last thread's range
    assert not bool(codec.encode_to_tensor(values, block_size)[1])


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("numel", [1, 255, 1001, 4097, (1 << 18) + 3])
@pytest.mark.parametrize("block_size", [1, 7, 128, 5000])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_outer_gradient_compression_gives_torchs_payload_and_residual(name, numel, block_size, threads,
                                                                                 monkeypatch):
    codec, values = get_codec(name), awkward_values(numel, block_size)
    generator = torch.Generator().manual_seed(3)
    anchor, residual = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-3
    if numel >= 2 * block_size + 4:
        anchor[block_size : 2 * block_size] = values[block_size : 2 * block_size] + 0.0  # an outer gradient of zeros
        residual[block_size : 2 * block_size] = 0.0
    monkeypatch.setattr(codecs, "_KERNEL_VALUES_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    compiled = values.clone()
    payload, finite = codec.compress_outer(anchor, compiled, residual, block_size)
    monkeypatch.setattr(codecs, "_codec_kernels", None)
    expected, expected_finite = codec.compress_outer(anchor, values, residual, block_size)
    assert bool(finite) and bool(expected_finite)
    assert torch.equal(payload, expected) and torch.equal(compiled, values)


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_the_compiled_outer_gradient_compression_flags_a_non_finite_value(name, bad):
    anchor, values = torch.zeros(1001), torch.randn(1001)
    anchor[700] = bad
    _, finite = get_codec(name).compress_outer(anchor, values, torch.zeros(1001), 64)
    assert not bool(finite)


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("numel", [1, 255, 1001, 4097, (1 << 18) + 3])
@pytest.mark.parametrize("block_size", [1, 7, 128, 5000])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_compiled_update_compression_gives_torchs_payload_residual_and_value(name, numel, block_size, threads,
                                                                                monkeypatch):
    """A shard's close: residual + update encoded, the residual advanced, the decoded update
    applied to the value; the same bits as error feedback's compress and apply_update."""
    codec, update = get_codec(name), awkward_values(numel, block_size)
    generator = torch.Generator().manual_seed(4)
    residual, value = torch.randn(numel, generator=generator) * 1e-3, torch.randn(numel, generator=generator)
    if numel >= 2 * block_size + 4:
        residual[block_size : 2 * block_size] = -update[block_size : 2 * block_size]  # a block that sums to zeros
    feedback = ErrorFeedback(codec, numel, block_size)
    feedback.residual = residual.clone()
    expected_payload, decoded = feedback.compress(update)
    expected_value = apply_update(value.clone(), decoded)
    results = {}
    for built in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(codecs, "_KERNEL_VALUES_PER_THREAD", 1)
            patch.setattr(torch, "get_num_threads", lambda: threads)
            if not built:
                patch.setattr(codecs, "_codec_kernels", None)
            advanced, before = residual.clone(), value.clone()
            payload, new_value, finite = codec.compress_apply(update, advanced, value, block_size)
            assert bool(finite) and torch.equal(value, before)  # the value itself is left as it was
            results[built] = codecs.payload_bytes(payload), advanced, new_value
    for payload, advanced, new_value in results.values():
        assert payload == expected_payload
        assert torch.equal(advanced, feedback.residual) and torch.equal(new_value, expected_value)


@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_shards_non_finite_update_is_refused(name, bad):
    update = torch.randn(1001)
    update[700] = bad
    with pytest.raises(ValueError, match="1 non-finite value"):
        ErrorFeedback(get_codec(name), 1001, 64).compress_apply(update, torch.zeros(1001))


@pytest.mark.skipif(codecs._codec_kernels is None, reason="the compiled kernels are not built")
def test_the_compiled_kernels_refuse_a_payload_of_the_wrong_length():
    kernels = codecs._codec_kernels
    with pytest.raises(ValueError, match="payload of 9 bytes for 10 values: expected 13"):
        kernels.encode(kernels.INT4, torch.zeros(10).numpy(), bytearray(9), 7)
    with pytest.raises(ValueError, match="block_size must be positive"):
        kernels.decode(kernels.INT8, bytes(14), torch.zeros(10).numpy(), 0, False)
    with pytest.raises(ValueError, match="unknown codec kind 9"):
        kernels.decode(9, bytes(14), torch.zeros(10).numpy(), 7, False)
    with pytest.raises(ValueError, match=r"anchor \(36 bytes\), values \(40\) and residual \(40\) differ in length"):
        kernels.compress_outer(kernels.INT4, torch.zeros(9).numpy(), torch.zeros(10).numpy(), torch.zeros(10).numpy(),
                               bytearray(13), 7)
    with pytest.raises(ValueError, match=r"update \(40 bytes\), residual \(40\), value \(36\) and out \(40\)"):
        kernels.compress_update(kernels.INT4, *(torch.zeros(n).numpy() for n in (10, 10, 9, 10)), bytearray(13), 7)
