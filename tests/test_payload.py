"""Payload framing: chunking, reassembly and every way a stream can be wrong."""

import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from diloco.services.contract.codecs import get_codec
from diloco.services.contract.payload import (
    CHUNK_BYTES,
    PayloadError,
    Reassembler,
    decode_payload,
    describe,
    encode_payload,
    iter_chunks,
    leading_bytes,
    seed_chunk_bytes,
)
from diloco.services.contract.wire import pb

INT4 = get_codec("int4")
BLOCK_SIZE = 128


def int4_payload(numel: int = 5000, chunk_bytes: int = 1000):
    """An int4 payload of `numel` values (2,657 bytes for 5,000) and its header and chunks."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = INT4.encode(values, BLOCK_SIZE)
    header = describe(INT4, numel, payload, BLOCK_SIZE, chunk_bytes)
    return header, payload, list(iter_chunks(payload, chunk_bytes))


def reassemble(header: pb.PayloadHeader, chunks, **limits) -> bytes:
    assembler = Reassembler(header, **limits)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def test_round_trip_over_several_chunks():
    header, payload, chunks = int4_payload()
    assert (header.payload_bytes, header.chunk_count, len(chunks)) == (len(payload), 3, 3)
    assert [len(chunk.data) for chunk in chunks] == [1000, 1000, len(payload) - 2000]
    assembler = Reassembler(header)
    for chunk in chunks:
        assert not assembler.complete
        assembler.add(chunk)
    assert assembler.complete and assembler.finish() == payload
    assert torch.equal(decode_payload(header, payload), INT4.decode(payload, 5000, BLOCK_SIZE))


def test_encode_payload_describes_default_one_mebibyte_chunks():
    values = torch.randn(2_500_000)
    header, payload = encode_payload(get_codec("int8"), values, BLOCK_SIZE)
    assert header.codec == pb.CODEC_INT8 and header.numel == 2_500_000 and header.block_size == BLOCK_SIZE
    assert header.payload_bytes == len(payload) and header.crc32 == zlib.crc32(payload)
    chunks = list(iter_chunks(payload))
    assert header.chunk_count == len(chunks) == 3 and len(chunks[0].data) == CHUNK_BYTES
    expected = get_codec("int8").decode(payload, 2_500_000, BLOCK_SIZE)
    assert torch.equal(decode_payload(header, reassemble(header, chunks)), expected)


@pytest.mark.parametrize("payload_bytes, chunks", [
    (4_000, 1), (450_000, 7), (8 << 20, 16), (2 << 30, 2048), (2_000_000_004, 1908)])
def test_a_seed_comes_in_several_chunks_but_never_more_than_sixteen_or_a_pushs(payload_bytes, chunks):
    assert -(-payload_bytes // seed_chunk_bytes(payload_bytes)) == chunks
    assert chunks <= max(16, -(-payload_bytes // CHUNK_BYTES))


def test_empty_payload_has_no_chunks():
    header, payload = encode_payload(INT4, torch.zeros(0), BLOCK_SIZE)
    assert payload == b"" and list(iter_chunks(payload)) == [] and header.chunk_count == 0
    assert Reassembler(header).complete
    assert decode_payload(header, reassemble(header, [])).numel() == 0


def test_sender_may_cut_chunks_unevenly():
    header, payload, _ = int4_payload()
    cuts = [0, 1, 1, 2000, len(payload)]  # including an empty chunk
    chunks = [pb.Chunk(index=i, data=payload[a:b]) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    header.chunk_count = len(chunks)
    assert reassemble(header, chunks) == payload


@settings(max_examples=50, deadline=None)
@given(numel=st.integers(0, 700), chunk_bytes=st.integers(1, 700), data=st.data())
def test_any_payload_survives_any_chunk_size(numel, chunk_bytes, data):
    payload = data.draw(st.binary(min_size=4 * numel, max_size=4 * numel))  # fp32 bytes, any bits
    header = describe(get_codec("fp32"), numel, payload, BLOCK_SIZE, chunk_bytes)
    chunks = list(iter_chunks(payload, chunk_bytes))
    assert len(chunks) == header.chunk_count == -(-len(payload) // chunk_bytes)
    assert [chunk.index for chunk in chunks] == list(range(len(chunks)))
    assert all(0 < len(chunk.data) <= chunk_bytes for chunk in chunks)
    assert reassemble(header, chunks) == payload


def test_checksum_detects_one_flipped_byte():
    header, payload, _ = int4_payload()
    corrupted = bytearray(payload)
    corrupted[1123] ^= 0x10
    chunks = list(iter_chunks(bytes(corrupted), 1000))
    actual = zlib.crc32(corrupted)
    message = rf"^crc32 mismatch: header says {header.crc32:#010x}, payload has {actual:#010x}$"
    with pytest.raises(PayloadError, match=message):
        reassemble(header, chunks)


@pytest.mark.parametrize(
    "order, message",
    [
        ([0, 2], r"^chunk 2 arrived, expected 1 \(missing chunk 1\)$"),
        ([1, 0, 2], r"^chunk 1 arrived, expected 0 \(missing chunk 0\)$"),
        ([0, 1, 1], r"^duplicate chunk 1$"),
    ],
)
def test_out_of_order_chunks_are_refused(order, message):
    header, _, chunks = int4_payload()
    assembler = Reassembler(header)
    with pytest.raises(PayloadError, match=message):
        for index in order:
            assembler.add(chunks[index])


def test_extra_chunk_is_refused():
    header, payload, chunks = int4_payload()
    assembler = Reassembler(header)
    for chunk in chunks:
        assembler.add(chunk)
    with pytest.raises(PayloadError, match=r"^chunk 3 beyond chunk_count=3$"):
        assembler.add(pb.Chunk(index=3, data=b"x"))
    assert assembler.finish() == payload  # the refusal did not corrupt what was there


def test_missing_last_chunk_is_refused():
    header, _, chunks = int4_payload()
    with pytest.raises(PayloadError, match=r"^received 2 of 3 chunks$"):
        reassemble(header, chunks[:2])


def test_chunks_with_too_many_bytes_are_refused():
    header, payload, chunks = int4_payload()
    chunks[2] = pb.Chunk(index=2, data=chunks[2].data + b"\0")
    size = len(payload)
    message = rf"^chunk 2 brings the payload to {size + 1} bytes, beyond payload_bytes={size}$"
    with pytest.raises(PayloadError, match=message):
        reassemble(header, chunks)


def test_chunks_with_too_few_bytes_are_refused():
    header, payload, chunks = int4_payload()
    chunks[2] = pb.Chunk(index=2, data=chunks[2].data[:-1])
    with pytest.raises(PayloadError, match=rf"^received {len(payload) - 1} of {len(payload)} bytes$"):
        reassemble(header, chunks)


def test_header_whose_size_does_not_match_its_codec_is_refused():
    header, payload, _ = int4_payload()
    header.numel += 2  # one more byte of codes
    message = rf"^header says payload_bytes={len(payload)}, but int4 of numel=5002, block_size=128 takes "
    message += rf"{len(payload) + 1}$"
    with pytest.raises(PayloadError, match=message):
        Reassembler(header)
    header.numel, header.block_size = 5000, 64  # more blocks, more scales
    with pytest.raises(PayloadError, match="but int4 of numel=5000, block_size=64 takes"):
        Reassembler(header)


def test_header_over_the_size_limit_is_refused():
    header, payload, chunks = int4_payload()
    assert reassemble(header, chunks, max_payload_bytes=len(payload)) == payload
    message = rf"^payload of {len(payload)} bytes exceeds the limit of {len(payload) - 1}$"
    with pytest.raises(PayloadError, match=message):
        Reassembler(header, max_payload_bytes=len(payload) - 1)


@pytest.mark.parametrize("codec", [pb.CODEC_UNSPECIFIED, 42])
def test_header_with_unknown_codec_is_refused(codec):
    header, _, _ = int4_payload()
    header.codec = codec
    with pytest.raises(PayloadError, match=rf"^bad payload header: unknown codec {codec}; valid codecs: "):
        Reassembler(header)
    with pytest.raises(PayloadError, match=f"unknown codec {codec}"):
        decode_payload(header, b"")


def test_header_with_zero_block_size_is_refused():
    header, _, _ = int4_payload()
    header.block_size = 0
    with pytest.raises(PayloadError, match="block_size must be positive"):
        Reassembler(header)


@pytest.mark.parametrize("chunk_count, numel", [(0, 5000), (1, 0)])
def test_header_whose_chunk_count_cannot_carry_its_bytes_is_refused(chunk_count, numel):
    header, _, _ = int4_payload()
    header.numel = numel
    header.payload_bytes = INT4.encoded_size(numel, BLOCK_SIZE)
    header.chunk_count = chunk_count
    message = f"^chunk_count={chunk_count} cannot carry payload_bytes={header.payload_bytes}$"
    with pytest.raises(PayloadError, match=message):
        Reassembler(header)


def test_decode_payload_refuses_a_payload_of_the_wrong_size():
    header, payload, _ = int4_payload()
    message = f"^int4 payload of {len(payload) - 1} bytes does not match numel=5000"
    with pytest.raises(PayloadError, match=message):
        decode_payload(header, payload[:-1])


@given(parts=st.lists(st.binary(max_size=9), max_size=8), count=st.integers(0, 80))
def test_leading_bytes_of_chunks_are_the_joined_payloads_prefix(parts, count):
    assert leading_bytes(tuple(parts), count) == b"".join(parts)[:count]


def test_finish_chunks_hands_back_the_chunks_as_received():
    header, payload, chunks = int4_payload()
    assembler = Reassembler(header)
    for chunk in chunks:
        assembler.add(chunk)
    assert assembler.finish_chunks() == tuple(chunk.data for chunk in chunks)
    assert b"".join(assembler.finish_chunks()) == payload
