"""Chunk codec: how an item's bytes are cut into chunks, checksummed and compressed.

An item is stored as one contiguous byte range of its rank's part file, made of chunks of
at most ``CHUNK_BYTES`` raw bytes. Each chunk carries the xxh3-64 of its *raw* bytes, so
the check is end to end (it covers compression too) and the same hash can serve dedup.
What an item's chunks are is its ``format.Record``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import xxhash
import zstandard

from .base import Buffer, Storage
from .format import ItemInfo, Record

CHUNK_BYTES = 8 << 20
ZSTD_LEVEL = 3


class ChecksumMismatch(Exception):
    """A chunk's bytes do not match the checksum recorded when it was written."""


def checksum(buf: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def split(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy slices of at most ``chunk_bytes``; one empty slice for an empty item."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) == 0:
        return [view]
    return [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]


class Encoder:
    """Turns raw chunks into the bytes stored on one tier (compressed or not)."""

    def __init__(self, codec: str | None) -> None:
        self.codec = codec or "raw"
        self._zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if codec == "zstd" else None

    def encode(self, chunk: memoryview) -> Buffer:
        if self._zc is None:
            return chunk
        return self._zc.compress(chunk)


def make_record(
    file: str,
    offset: int,
    stored: list[Buffer],
    raw: list[memoryview],
    hashes: list[int],
    codec: str,
    **facts: Any,
) -> Record:
    """The record of one item just encoded: ``file`` is its part's key, ``facts`` its rank,
    kind, dtype and shape."""
    chunks = tuple((memoryview(s).nbytes, len(r), h) for s, r, h in zip(stored, raw, hashes, strict=True))
    return Record(file, offset, codec, chunks, **facts)


def verify_raw(record: Record | ItemInfo, raw: memoryview) -> None:
    """Check every chunk of raw (uncompressed) bytes against the record (or the item's info)."""
    pos = 0
    for i, (n, h) in enumerate(record.raw_chunks):
        if checksum(raw[pos : pos + n]) != h:
            raise ChecksumMismatch(f"chunk {i} (bytes {pos}..{pos + n} of the item)")
        pos += n


def verify_stored(record: Record, stored: memoryview) -> None:
    """Check an item's stored bytes (as a peer sent them) against its record."""
    if len(stored) != record.length:
        raise ChecksumMismatch(f"{len(stored)} bytes where the record says {record.length}")
    if record.codec == "raw":
        verify_raw(record, stored)
        return
    for _ in _decoded_chunks(record, stored):
        pass


def iter_raw_chunks(store: Storage, record: Record) -> Iterator[bytes]:
    """An item's raw chunks read one at a time from ``store``, each verified."""
    zd = zstandard.ZstdDecompressor() if record.codec == "zstd" else None
    if record.codec not in ("raw", "zstd"):
        raise ChecksumMismatch(f"unknown codec {record.codec!r}")
    pos = record.offset
    for i, (s, n, h) in enumerate(record.chunks):
        stored = store.read(record.file, pos, s) if s else b""
        if len(stored) != s:
            raise ChecksumMismatch(f"chunk {i}: short read ({len(stored)} of {s} bytes)")
        pos += s
        raw = stored
        if zd is not None and n:
            try:
                raw = zd.decompress(stored, max_output_size=n)
            except zstandard.ZstdError as e:
                raise ChecksumMismatch(f"chunk {i} does not decompress: {e}") from e
        if len(raw) != n or checksum(raw) != h:
            raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
        yield raw


def read_item(store: Storage, record: Record, out: memoryview) -> None:
    """Read an item's stored bytes from ``store`` and decode them, verified, into ``out``."""
    stored = bytearray(record.length)
    if stored:
        store.read_into(record.file, record.offset, memoryview(stored))
    decode_into(record, memoryview(stored), out)


def _decoded_chunks(record: Record, stored: memoryview) -> Iterator[bytes]:
    """The raw chunks of an item's zstd-stored bytes, each checked against its checksum."""
    if record.codec != "zstd":
        raise ChecksumMismatch(f"unknown codec {record.codec!r}")
    zd = zstandard.ZstdDecompressor()
    pos = 0
    for i, (s, n, h) in enumerate(record.chunks):
        try:
            raw = zd.decompress(stored[pos : pos + s], max_output_size=n) if n else b""
        except zstandard.ZstdError as e:
            raise ChecksumMismatch(f"chunk {i} does not decompress: {e}") from e
        if len(raw) != n or checksum(raw) != h:
            raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
        pos += s
        yield raw


def decode_into(record: Record, stored: memoryview, out: memoryview) -> None:
    """Decode the stored bytes of an item into ``out`` (its raw size), verifying chunks."""
    if record.codec == "raw":
        out[:] = stored
        verify_raw(record, out)
        return
    pos = 0
    for raw in _decoded_chunks(record, stored):
        out[pos : pos + len(raw)] = raw
        pos += len(raw)
