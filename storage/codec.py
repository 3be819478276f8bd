"""Chunk codec: how an item's bytes are cut into chunks, checksummed and compressed.

An item is stored as one contiguous byte range of its rank's part file, made of chunks of
at most ``CHUNK_BYTES`` raw bytes. Each chunk carries the xxh3-64 of its *raw* bytes, so
the check is end to end (it covers compression too) and the same hash can serve dedup.
What an item's chunks are is its ``format.Record``.

Compressed tiers choose a codec per chunk: plain zstd, or zstd after *byte grouping*
(``zstd-bg2``/``zstd-bg4``: the i-th byte of every 2- or 4-byte float value is gathered
into stream i before compression). The bytes of a float's sign and exponent are far more
regular than its mantissa's, and zstd's entropy coder sees that only once they are
apart. Dedup records (``Record.blocks``) keep each chunk in a block file of its own whose
header names its codec; ``read_item`` reads and decodes such chunks in parallel.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

import xxhash
import zstandard

from .base import Buffer, Storage
from .forks import ThreadPool
from .format import BLOCK_HEADER, BLOCK_LIMIT, ItemInfo, Record, block_header, block_key, parse_block_header
from .records import CHUNK_BYTES

ZSTD_LEVEL = 3
GROUPED_LEVEL = 1  # byte-grouped streams: level 1 stores less than 3 here (0.68 vs 0.71 on bf16)
CODECS = ("raw", "zstd", "zstd-bg2", "zstd-bg4")
GROUP_WIDTH = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}
SAMPLE_BYTES = 64 << 10  # what the per-chunk choice compresses both ways
MIN_GROUPED = 16 << 10  # smaller chunks stay plain: a few hundred bytes saved at most
GROUPED_GAIN = 0.98  # byte grouping is chosen when its sample is at least 2% smaller


class ChecksumMismatch(Exception):
    """A chunk's bytes do not match the checksum recorded when it was written."""


def checksum(buf: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def checksummer() -> Any:
    """``checksum`` fed piece by piece (``update``, then ``intdigest``): the same value."""
    return xxhash.xxh3_64()


def split(view: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    """Zero-copy slices of at most ``chunk_bytes``; one empty slice for an empty item."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if len(view) == 0:
        return [view]
    return [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]


def group_bytes(raw: memoryview, width: int) -> list[bytes]:
    """The bytes of ``width``-byte values as ``width`` streams: all first bytes, all second..."""
    data = bytes(raw)  # bytes' strided slicing runs in C; a memoryview's is 20x slower
    return [data[i::width] for i in range(width)]


def compress_grouped(zc: zstandard.ZstdCompressor, raw: memoryview, width: int) -> bytes:
    """Byte-grouped zstd: each stream one frame (its own entropy tables), after a header of
    the frames' lengths (``width`` little-endian u32)."""
    frames = [zc.compress(s) for s in group_bytes(raw, width)]
    return struct.pack(f"<{width}I", *map(len, frames)) + b"".join(frames)


def decompress_grouped(stored: Buffer, width: int, n: int, out: memoryview) -> None:
    """Undo ``compress_grouped`` into ``out`` (``n`` raw bytes)."""
    view = memoryview(stored).cast("B")
    lengths = struct.unpack_from(f"<{width}I", view)
    pos, each = 4 * width, n // width
    zd = zstandard.ZstdDecompressor()
    raw = bytearray(n)  # bytearray's strided assignment runs in C; a memoryview's is 10x slower
    for i, length in enumerate(lengths):
        stream = zd.decompress(view[pos : pos + length], max_output_size=each) if each else b""
        if len(stream) != each:
            raise ValueError(f"stream {i} decompresses to {len(stream)} bytes, not {each}")
        raw[i::width] = stream
        pos += length
    if pos != len(view):
        raise ValueError(f"{len(view) - pos} stray bytes after the streams")
    out[:] = raw


def codec_width(codec: str) -> int:
    return int(codec.removeprefix("zstd-bg")) if codec.startswith("zstd-bg") else 1


class Encoder:
    """Turns raw chunks into the bytes stored on one tier (compressed or not).

    ``codec`` is the tier's (None or "zstd"); on a zstd tier each chunk of a bf16, fp16 or
    fp32 tensor is stored byte-grouped where a sample of it says that helps
    (``choose``), the rest plain.
    """

    def __init__(self, codec: str | None) -> None:
        self.codec = codec or "raw"
        self._local = threading.local()  # a zstd compressor must not be shared by threads

    @property
    def _zc(self) -> zstandard.ZstdCompressor | None:
        return self._compressor("plain", ZSTD_LEVEL)

    @property
    def _zg(self) -> zstandard.ZstdCompressor | None:
        return self._compressor("grouped", GROUPED_LEVEL)

    def _compressor(self, kind: str, level: int) -> zstandard.ZstdCompressor | None:
        if self.codec != "zstd":
            return None
        zc = getattr(self._local, kind, None)
        if zc is None:
            zc = zstandard.ZstdCompressor(level=level)
            setattr(self._local, kind, zc)
        return zc

    def encode(self, chunk: memoryview) -> Buffer:
        """A chunk with the tier's plain codec."""
        if self._zc is None:
            return chunk
        return self._zc.compress(chunk)

    def choose(self, chunk: memoryview, dtype: str | None) -> str:
        """This chunk's codec: the tier's, or byte-grouped zstd where the sample gains."""
        width = GROUP_WIDTH.get(dtype or "", 1)
        if self._zc is None or width == 1 or len(chunk) % width or len(chunk) < MIN_GROUPED:
            return self.codec
        n = min(len(chunk), SAMPLE_BYTES) // width * width
        sample = chunk[:n]
        plain = len(self._zc.compress(sample))
        assert self._zg is not None
        grouped = len(compress_grouped(self._zg, sample, width))
        return f"zstd-bg{width}" if grouped < GROUPED_GAIN * plain else "zstd"

    def encode_as(self, chunk: memoryview, codec: str) -> Buffer:
        if codec == "raw":
            return chunk
        width = codec_width(codec)
        if width > 1:
            return compress_grouped(self._zg or zstandard.ZstdCompressor(level=GROUPED_LEVEL), chunk, width)
        return (self._zc or zstandard.ZstdCompressor(level=ZSTD_LEVEL)).compress(chunk)

    def encode_item(
        self, chunks: list[memoryview], dtype: str | None
    ) -> tuple[list[Buffer], str, tuple[str, ...] | None]:
        """An item's stored chunks, its record's ``codec`` and (where chunks differ) ``codecs``."""
        codecs = [self.choose(c, dtype) for c in chunks]
        stored = [self.encode_as(c, k) for c, k in zip(chunks, codecs, strict=True)]
        first = codecs[0] if codecs else self.codec
        return stored, first, None if all(k == first for k in codecs) else tuple(codecs)


def make_record(
    file: str,
    offset: int,
    stored: list[Buffer],
    codec: str,
    info: ItemInfo,
    codecs: tuple[str, ...] | None = None,
) -> Record:
    """The record of one item just encoded into ``stored`` chunks at ``offset`` of ``file``
    (its part's key)."""
    return Record(file, offset, codec, tuple(memoryview(s).nbytes for s in stored), info, codecs=codecs)


def verify_raw(info: ItemInfo, raw: memoryview) -> None:
    """Check every chunk of an item's raw (uncompressed) bytes against its checksums, the
    chunks of a large item in parallel (xxhash lets go of the GIL: a 4 GiB item is 0.3 s on
    one core)."""
    calls, pos = [], 0
    for i, (n, h) in enumerate(info.raw_chunks):
        calls.append((_verify_chunk, raw[pos : pos + n], h, i, pos))
        pos += n
    _parallel(calls)


def _verify_chunk(raw: memoryview, h: int, i: int, pos: int) -> None:
    if checksum(raw) != h:
        raise ChecksumMismatch(f"chunk {i} (bytes {pos}..{pos + len(raw)} of the item)")


def decode_chunk(codec: str, stored: Buffer, n: int, out: memoryview, i: int, h: int) -> None:
    """Decode one stored chunk of ``n`` raw bytes into ``out`` and check it against ``h``."""
    if codec == "raw":
        if memoryview(stored).nbytes != n:
            raise ChecksumMismatch(f"chunk {i}: {memoryview(stored).nbytes} bytes where {n} were stored")
        out[:] = stored
    elif codec == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=n) if n else b""
        except zstandard.ZstdError as e:
            raise ChecksumMismatch(f"chunk {i} does not decompress: {e}") from e
        if len(raw) != n:
            raise ChecksumMismatch(f"chunk {i} decompresses to {len(raw)} bytes, not {n}")
        out[:] = raw
    elif codec in CODECS:
        try:
            decompress_grouped(stored, codec_width(codec), n, out)
        except (zstandard.ZstdError, ValueError, struct.error) as e:
            raise ChecksumMismatch(f"chunk {i} does not decompress: {e}") from e
    else:
        raise ChecksumMismatch(f"chunk {i}: unknown codec {codec!r}")
    if checksum(out) != h:
        raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")


def verify_stored(record: Record, stored: memoryview) -> None:
    """Check an item's stored bytes (as a peer sent them) against its record."""
    if len(stored) != record.length:
        raise ChecksumMismatch(f"{len(stored)} bytes where the record says {record.length}")
    if record.codec == "raw" and record.codecs is None:  # checked where they lie: no copy
        verify_raw(record.info, stored)
        return
    decode_into(record, stored, memoryview(bytearray(record.info.raw_length)))


# -- blocks -----------------------------------------------------------------------------


def encode_block(codec: str, stored: Buffer) -> list[Buffer]:
    """A block file's content: its header (naming the codec), then the stored chunk."""
    return [block_header(codec), stored]


def read_block(store: Storage, record: Record, i: int) -> tuple[str, bytes]:
    """Chunk i of a dedup record: (its codec, from the block's header; its stored bytes)."""
    assert record.blocks is not None
    data = store.read(block_key(record.file, record.blocks[i]), 0, BLOCK_LIMIT)
    try:
        codec = parse_block_header(data)
    except ValueError as e:
        raise ChecksumMismatch(f"chunk {i} (block {record.blocks[i]}): {e}") from e
    return codec, data[BLOCK_HEADER:]


def _block_into(store: Storage, record: Record, i: int, out: memoryview) -> None:
    n, h = record.info.raw_chunks[i]
    codec, stored = read_block(store, record, i)
    decode_chunk(codec, stored, n, out, i, h)


# threads that read and decode chunks in parallel (zstd and file reads release the GIL)
_pool = ThreadPool("tdcp-codec", lambda: min(8, os.cpu_count() or 1))


def _parallel(calls: list[tuple[Any, ...]]) -> None:
    if len(calls) <= 1:
        for fn, *args in calls:
            fn(*args)
        return
    for f in [_pool().submit(fn, *args) for fn, *args in calls]:
        f.result()


# -- reading ----------------------------------------------------------------------------


def iter_raw_chunks(store: Storage, record: Record) -> Iterator[Buffer]:
    """An item's raw chunks read one at a time from ``store``, each verified. A raw chunk is
    the buffer it was read into (the writer process holds one chunk, not three copies)."""
    pos = record.offset
    for i, (s, (n, h)) in enumerate(zip(record.stored, record.info.raw_chunks, strict=True)):
        if record.blocks is not None:
            raw = bytearray(n)
            _block_into(store, record, i, memoryview(raw))
            yield raw
            continue
        stored = store.read(record.file, pos, s) if s else b""
        if len(stored) != s:
            raise ChecksumMismatch(f"chunk {i}: short read ({len(stored)} of {s} bytes)")
        pos += s
        if record.chunk_codec(i) == "raw" and s == n:
            if checksum(stored) != h:
                raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
            yield stored
            continue
        raw = bytearray(n)
        decode_chunk(record.chunk_codec(i), stored, n, memoryview(raw), i, h)
        yield raw


def read_item(store: Storage, record: Record, out: memoryview) -> None:
    """Read an item's stored bytes from ``store`` and decode them, verified, into ``out``.

    Raw chunks are read straight into ``out`` (no temporary, no copy), then checked."""
    out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    if record.blocks is not None:
        calls, pos = [], 0
        for i, (n, _) in enumerate(record.info.raw_chunks):
            calls.append((_block_into, store, record, i, out[pos : pos + n]))
            pos += n
        _parallel(calls)
        return
    if record.codec == "raw" and record.codecs is None:
        if record.length != len(out):
            raise ChecksumMismatch(f"{record.length} bytes stored where {len(out)} are asked for")
        if len(out):
            store.read_into(record.file, record.offset, out)
        verify_raw(record.info, out)
        return
    stored = store.read(record.file, record.offset, record.length) if record.length else b""
    if len(stored) != record.length:
        raise ChecksumMismatch(f"short read ({len(stored)} of {record.length} bytes)")
    decode_into(record, memoryview(stored), out)


def chunk_spans(record: Record) -> list[tuple[int, int, int]]:
    """Each chunk's (raw start in the item, raw length, stored offset in ``record.file``)."""
    spans, at, pos = [], 0, record.offset
    for s, (n, _) in zip(record.stored, record.info.raw_chunks, strict=True):
        spans.append((at, n, pos))
        at, pos = at + n, pos + s
    return spans


def read_chunk_into(store: Storage, record: Record, i: int, out: memoryview) -> None:
    """Chunk ``i`` of an item read from ``store`` and decoded, verified, into ``out`` (its
    raw length): the unit a load streams through a bounded buffer (``device_reads``)."""
    if record.blocks is not None:
        _block_into(store, record, i, out)
        return
    (_, n, pos), s, h = chunk_spans(record)[i], record.stored[i], record.info.raw_chunks[i][1]
    codec = record.chunk_codec(i)
    if codec == "raw":
        if s != n:
            raise ChecksumMismatch(f"chunk {i}: {s} bytes stored where {n} were written")
        if n:
            store.read_into(record.file, pos, out)
        if checksum(out) != h:
            raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
        return
    stored = store.read(record.file, pos, s) if s else b""
    if len(stored) != s:
        raise ChecksumMismatch(f"chunk {i}: short read ({len(stored)} of {s} bytes)")
    decode_chunk(codec, stored, n, out, i, h)


def read_chunk_placed(store: Storage, record: Record, i: int, room: memoryview) -> int:
    """Chunk ``i`` of an item read, decoded and verified into ``room`` (its raw length plus
    ``direct_io.PLACE_SPARE``), where the store places it (``Storage.read_placed``: a raw chunk
    on a local disk straight from the device, no copy after); where it starts in ``room``."""
    (_, n, pos), h = chunk_spans(record)[i], record.info.raw_chunks[i][1]
    if record.blocks is None and record.chunk_codec(i) == "raw" and record.stored[i] == n and n:
        at = store.read_placed(record.file, pos, n, room)
        if at is not None:
            if checksum(room[at : at + n]) != h:
                raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
            return at
    read_chunk_into(store, record, i, room[:n])
    return 0


def read_chunks(store: Storage, record: Record, first: int, last: int, out: memoryview) -> None:
    """Chunks ``first`` to ``last`` (exclusive) of an item read from ``store`` and decoded,
    verified, into ``out`` (their raw bytes back to back): the part of an item a piece of it
    needs. Raw chunks in the part file are one read straight into ``out``; compressed ones
    one read of their stored bytes (one request to a bucket), decoded in parallel."""
    spans = chunk_spans(record)[first:last]
    if not spans:
        return
    base = spans[0][0]
    raw = record.blocks is None and all(
        record.chunk_codec(i) == "raw" and record.stored[i] == record.info.raw_chunks[i][0]
        for i in range(first, last)
    )
    if raw:
        if len(out):
            store.read_into(record.file, spans[0][2], out)
        for i, (at, n, _) in enumerate(spans, start=first):
            if checksum(out[at - base : at - base + n]) != record.info.raw_chunks[i][1]:
                raise ChecksumMismatch(f"chunk {i} of the item does not match its checksum")
        return
    if record.blocks is not None:
        _parallel(
            [
                (_block_into, store, record, i, out[at - base : at - base + n])
                for i, (at, n, _) in enumerate(spans, start=first)
            ]
        )
        return
    length = sum(record.stored[first:last])
    stored = memoryview(store.read(record.file, spans[0][2], length) if length else b"")
    if len(stored) != length:
        raise ChecksumMismatch(f"short read ({len(stored)} of {length} bytes)")
    calls = []
    for i, (at, n, pos) in enumerate(spans, start=first):
        piece = stored[pos - spans[0][2] : pos - spans[0][2] + record.stored[i]]
        calls.append(
            (
                decode_chunk,
                record.chunk_codec(i),
                piece,
                n,
                out[at - base : at - base + n],
                i,
                record.info.raw_chunks[i][1],
            )
        )
    _parallel(calls)


def decode_into(record: Record, stored: memoryview, out: memoryview) -> None:
    """Decode the stored bytes of an item into ``out`` (its raw size), verifying chunks."""
    if record.codec == "raw" and record.codecs is None:
        out[:] = stored
        verify_raw(record.info, out)
        return
    calls, pos, at = [], 0, 0
    for i, (s, (n, h)) in enumerate(zip(record.stored, record.info.raw_chunks, strict=True)):
        calls.append((decode_chunk, record.chunk_codec(i), stored[pos : pos + s], n, out[at : at + n], i, h))
        pos, at = pos + s, at + n
    _parallel(calls)
