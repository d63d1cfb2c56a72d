"""Encoded tensors on gRPC streams: a PayloadHeader, then the payload cut into Chunks.

Sender:

    header, payload = encode_payload(codec, delta, block_size)
    yield header ...; yield from iter_chunks(payload)

Receiver:

    assembler = Reassembler(header, max_payload_bytes=limit)   # refuses a bad header at once
    for chunk in chunks: assembler.add(chunk)                    # refuses gaps, repeats, overflow
    values = decode_payload(header, assembler.finish())          # finish() checks count and crc32

Nothing is decoded, let alone merged, before the whole payload is there and its checksum
matches. Every refusal is a PayloadError whose message names what is wrong.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from isal.isal_zlib import crc32

from diloco.services.contract.codecs import Codec, get_codec
from diloco.services.contract.wire import pb

CHUNK_BYTES = 1 << 20
SEED_MIN_CHUNK_BYTES = 64 << 10
SEED_CHUNKS = 16


class PayloadError(ValueError):
    """Malformed or corrupted payload; the message names what is wrong."""


class ChecksumMismatch(PayloadError):
    """Every chunk and byte the header announced arrived, and they are not what was sent."""


def encode_payload(codec: Codec, values: torch.Tensor, block_size: int) -> tuple[pb.PayloadHeader, bytes]:
    payload = codec.encode(values, block_size)
    return describe(codec, values.numel(), payload, block_size), payload


def describe(
    codec: Codec, numel: int, payload: bytes, block_size: int, chunk_bytes: int = CHUNK_BYTES
) -> pb.PayloadHeader:
    """The header announcing `payload` as iter_chunks(payload, chunk_bytes) will send it."""
    return pb.PayloadHeader(
        codec=codec.wire,
        numel=numel,
        payload_bytes=len(payload),
        chunk_count=-(-len(payload) // chunk_bytes),
        crc32=crc32(payload),
        block_size=block_size,
    )


def seed_chunk_bytes(payload_bytes: int) -> int:
    """The chunk size of a seed. Learners race to seed a fragment, and a loser is refused at its
    next chunk (syncer/intake.py): a seed cut into SEED_CHUNKS pieces (at least
    SEED_MIN_CHUNK_BYTES, at most CHUNK_BYTES) stops a loser on a slow link within a sixteenth
    of its upload, and is never cut into more chunks than max(SEED_CHUNKS, a push's)."""
    return min(CHUNK_BYTES, max(SEED_MIN_CHUNK_BYTES, -(-payload_bytes // SEED_CHUNKS)))


def iter_chunks(payload: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """The payload as numbered chunks of at most `chunk_bytes`; an empty payload has none."""
    view = memoryview(payload)
    for index, start in enumerate(range(0, len(view), chunk_bytes)):
        # protobuf takes bytes only, so each chunk costs one copy of its slice.
        yield pb.Chunk(index=index, data=bytes(view[start : start + chunk_bytes]))


def push_requests(header: pb.PushHeader, payload: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.PushRequest]:
    """A PushFragment stream: the header, then the payload's chunks."""
    yield pb.PushRequest(header=header)
    for chunk in iter_chunks(payload, chunk_bytes):
        yield pb.PushRequest(chunk=chunk)


class Reassembler:
    """Collects the chunks of one payload, in order, checking each against the header as it
    arrives. Chunks are kept as received and joined once, by finish()."""

    def __init__(self, header: pb.PayloadHeader, max_payload_bytes: int | None = None):
        try:
            codec = get_codec(header.codec)
            expected = codec.encoded_size(header.numel, header.block_size)
        except ValueError as error:
            raise PayloadError(f"bad payload header: {error}") from error
        if header.payload_bytes != expected:
            raise PayloadError(
                f"header says payload_bytes={header.payload_bytes}, but {codec.name} of "
                f"numel={header.numel}, block_size={header.block_size} takes {expected}"
            )
        if max_payload_bytes is not None and header.payload_bytes > max_payload_bytes:
            raise PayloadError(
                f"payload of {header.payload_bytes} bytes exceeds the limit of {max_payload_bytes}"
            )
        # Senders may cut the payload as they like, but bytes need at least one chunk and no bytes none.
        if (header.chunk_count == 0) != (header.payload_bytes == 0):
            raise PayloadError(
                f"chunk_count={header.chunk_count} cannot carry payload_bytes={header.payload_bytes}"
            )
        self.header = header
        self._chunks: list[bytes] = []
        self._received_bytes = 0
        self._next_index = 0
        self._crc32 = 0

    @property
    def complete(self) -> bool:
        """Whether all chunk_count chunks are in (at once for an empty payload); finish() then
        still checks the byte count and the checksum."""
        return self._next_index == self.header.chunk_count

    def add(self, chunk: pb.Chunk) -> bytes:
        """Checks the chunk against the header and keeps it; returns its data."""
        index, expected, header = chunk.index, self._next_index, self.header
        data = chunk.data  # protobuf copies a bytes field at each access: read it once
        if index >= header.chunk_count:
            raise PayloadError(f"chunk {index} beyond chunk_count={header.chunk_count}")
        if index < expected:
            raise PayloadError(f"duplicate chunk {index}")
        if index > expected:
            raise PayloadError(f"chunk {index} arrived, expected {expected} (missing chunk {expected})")
        end = self._received_bytes + len(data)
        if end > header.payload_bytes:
            limit = header.payload_bytes
            raise PayloadError(f"chunk {index} brings the payload to {end} bytes, beyond payload_bytes={limit}")
        self._chunks.append(data)
        self._crc32 = crc32(data, self._crc32)
        self._received_bytes = end
        self._next_index += 1
        return data

    def finish(self) -> bytes:
        """The whole payload, once every chunk is in and the checksum matches."""
        return b"".join(self.finish_chunks())

    def finish_chunks(self) -> tuple[bytes, ...]:
        """The payload's chunks as they arrived, once every chunk is in and the checksum
        matches: for a receiver that stores the payload without needing it in one buffer
        (joining the chunks copies every byte once more)."""
        header = self.header
        if self._next_index != header.chunk_count:
            raise PayloadError(f"received {self._next_index} of {header.chunk_count} chunks")
        if self._received_bytes != header.payload_bytes:
            raise PayloadError(f"received {self._received_bytes} of {header.payload_bytes} bytes")
        if self._crc32 != header.crc32:
            raise ChecksumMismatch(
                f"crc32 mismatch: header says {header.crc32:#010x}, payload has {self._crc32:#010x}"
            )
        return tuple(self._chunks)


def leading_bytes(chunks: tuple[bytes, ...], count: int) -> bytes:
    """The first `count` bytes of a chunked payload (all of it if shorter), copying only those."""
    head, size = [], 0
    for chunk in chunks:
        if size >= count:
            break
        head.append(chunk[: count - size])
        size += len(head[-1])
    return b"".join(head)


def decode_payload(header: pb.PayloadHeader, payload: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of a payload that `header` describes (in `out` if given: Codec.decode)."""
    try:
        return get_codec(header.codec).decode(payload, header.numel, header.block_size, out)
    except ValueError as error:
        raise PayloadError(str(error)) from error
