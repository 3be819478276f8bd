"""Dedup on a tier: a part's large tensor items go to the root's block store (``storage.blocks``).

Both writers of a tier use it: the save path for the fastest tier (``parts.encode_part``)
and the writer process for the slower ones (``process.copy_part``). Either way the part's
block list is written first, then the GC lease is waited for, then each block the root
lacks is written (the writer process reads it from the faster tier only then). What is
left of the part (small items, pickled values) is written to the part file as before.

Replicas (``replicate.Swap``) follow the same order in the peer's root: the peer claims
the blocks the part uses there (their list, then the GC lease), looks which it lacks, and
only those travel, as the sender's block files; each is checked against the part's
checksums and its id before it is written. Torch-free: the writer process uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from tiered_dcp.storage.base import Buffer
from tiered_dcp.storage.blocks import (
    BlockPut,
    PutResult,
    block_id,
    fetch_raw,
    held,
    pool,
    wait_for_gc,
    write_refs,
)
from tiered_dcp.storage.codec import ChecksumMismatch, Encoder, decode_chunk
from tiered_dcp.storage.format import (
    BLOCK_HEADER,
    BLOCK_LIMIT,
    Chunk,
    ItemInfo,
    Record,
    block_key,
    blocks_dir,
    is_block_id,
    parse_block_header,
)

from .catalog import TierView

K = TypeVar("K")
Held = tuple[str, int]  # a block in a root: (its codec, its stored length)


@dataclass
class BlockedItem:
    """One item to store as blocks: its raw chunks (or a way to read each), its info (their
    lengths and checksums among its facts), its block ids."""

    chunks: list[Buffer | None]  # raw bytes per block; None: read with ``fetch(i)`` if needed
    info: ItemInfo
    ids: list[str]
    fetch: Callable[[int], bytes] | None = None


def claim(view: TierView, step: int, rank: int, ids: Iterable[str]) -> None:
    """From now on no GC deletes these blocks from the view's own root: rank's list of the
    blocks its part of ``step`` uses is written there, then a GC in progress waited for."""
    ns = view.config.namespace
    write_refs(view.own, ns, step, rank, ids)
    wait_for_gc(view.own, ns)  # after the list: a GC from now on keeps these blocks


def put_items(
    view: TierView,
    step: int,
    rank: int,
    items: Mapping[K, BlockedItem],
    skip: Iterable[str] = (),
    kept: dict[str, list[Buffer]] | None = None,
) -> tuple[dict[K, Record], PutResult]:
    """Store ``items`` as blocks in the view's own root; their records, and what was written.

    ``kept`` (if given) receives each block file written, as written: the replicas send them.
    """
    ns = view.config.namespace
    claim(view, step, rank, (b for it in items.values() for b in it.ids))
    epoch = view.placement.starts_block_epoch
    put = BlockPut(view.own, ns, Encoder(view.tier.compression), skip, kept, starts_epoch=epoch)
    once: dict[str, Future] = {}  # a block two items use (an alias, a repeat) is put once

    def submit(
        block: str, raw: Buffer | None, dtype: str | None, fetch: Callable[[], bytes] | None
    ) -> Future:
        if block not in once:
            once[block] = pool().submit(put.put, block, raw, dtype, fetch)
        return once[block]

    futures = {
        key: [
            submit(
                block,
                raw,
                it.info.dtype,
                None if it.fetch is None else (lambda i=i, f=it.fetch: f(i)),
            )
            for i, (block, raw) in enumerate(zip(it.ids, it.chunks, strict=True))
        ]
        for key, it in items.items()
    }
    records: dict[K, Record] = {}
    for key, futs in futures.items():
        it = items[key]
        got = [f.result() for f in futs]
        stored = tuple(s for s, _ in got)
        records[key] = block_record(ns, it.ids, stored, [c for _, c in got], put.enc.codec, it.info)
    return records, put.result


def block_record(
    namespace: str, ids: list[str], stored: tuple[int, ...], codecs: list[str], default: str, info: ItemInfo
) -> Record:
    """The record of an item stored as the blocks ``ids`` (``stored``: their stored lengths
    in this root; ``codecs``: each block's codec there)."""
    first = codecs[0] if codecs else default
    mixed = any(c != first for c in codecs)
    return Record(
        blocks_dir(namespace),
        0,
        first,
        stored,
        info,
        blocks=tuple(ids),
        codecs=tuple(codecs) if mixed else None,
    )


# -- replicas ---------------------------------------------------------------------------


def block_ids(records: Mapping[K, Record]) -> list[str]:
    """The distinct blocks a part's records use, in the order they first appear (a peer's
    records name them: each must be a block id, as it becomes a file name)."""
    ids = list(dict.fromkeys(b for rec in records.values() for b in rec.blocks or ()))
    bad = [b for b in ids if not is_block_id(b)]
    if bad:
        raise ValueError(f"not a block id: {bad[0]!r}")
    return ids


def block_chunks(records: Mapping[K, Record]) -> dict[str, Chunk]:
    """Each block of a part: (stored length in the root the records describe, raw length, checksum)."""
    blocked = (rec for rec in records.values() if rec.blocks is not None)
    return {
        b: (s, n, h)
        for rec in blocked
        for b, s, (n, h) in zip(rec.blocks or (), rec.stored, rec.info.raw_chunks, strict=True)
    }


def holdings(view: TierView, ids: Iterable[str]) -> dict[str, Held | None]:
    """Which of ``ids`` the view's own root holds, and how (checked in parallel)."""
    unique = list(dict.fromkeys(ids))
    bdir = blocks_dir(view.config.namespace)
    return dict(zip(unique, pool().map(lambda b: held(view.own, bdir, b), unique), strict=True))


def block_file(view: TierView, kept: Mapping[str, list[Buffer]], block: str) -> list[Buffer] | None:
    """A block file of this rank's root (header, then stored bytes), for a peer lacking it:
    as this save wrote it, else read back (None if it cannot be)."""
    if block in kept:
        return kept[block]
    try:
        data = memoryview(view.own.read(block_key(blocks_dir(view.config.namespace), block), 0, BLOCK_LIMIT))
    except OSError:
        return None
    return [data[:BLOCK_HEADER], data[BLOCK_HEADER:]]


def land_block(view: TierView, block: str, data: memoryview, chunk: Chunk) -> Held:
    """A block file a peer sent, checked (its header, its raw bytes against ``chunk``'s
    checksum and against its id), then written into the view's own root."""
    _, n, h = chunk
    try:
        codec = parse_block_header(bytes(data[:BLOCK_HEADER]))
    except ValueError as e:
        raise ChecksumMismatch(f"block {block}: {e}") from e
    raw = bytearray(n)
    try:
        decode_chunk(codec, data[BLOCK_HEADER:], n, memoryview(raw), 0, h)
    except ChecksumMismatch as e:
        raise ChecksumMismatch(f"block {block}: {e}") from e
    if block_id(raw) != block:
        raise ChecksumMismatch(f"block {block}: its bytes have another id")
    view.own.write(block_key(blocks_dir(view.config.namespace), block), [data])
    return codec, len(data) - BLOCK_HEADER


def as_held(namespace: str, records: Mapping[K, Record], here: Mapping[str, Held | None]) -> dict[K, Record]:
    """A peer's records as this root holds their blocks (``here``: each block's codec and
    stored length in it); records without blocks stay as they are."""
    out: dict[K, Record] = {}
    for key, rec in records.items():
        if rec.blocks is None:
            out[key] = rec
            continue
        got: list[Held] = []
        for b in rec.blocks:
            g = here.get(b)
            if g is None:
                raise ChecksumMismatch(f"block {b} is neither in this root nor arrived")
            got.append(g)
        stored = tuple(s for _, s in got)
        out[key] = block_record(namespace, list(rec.blocks), stored, [c for c, _ in got], rec.codec, rec.info)
    return out


def copy_items(
    src: TierView,
    dst: TierView,
    step: int,
    rank: int,
    records: Mapping[K, Record],
    pause: Callable[[], None] = lambda: None,
) -> tuple[dict[K, Record], PutResult]:
    """Dedup records of a part on ``src`` into ``dst``'s root: a block ``dst`` holds is
    neither read from ``src`` nor written; ``pause`` runs before each block is read."""

    def fetch(i: int, rec: Record) -> bytes:
        pause()
        return fetch_raw(src.own, rec, i)

    items = {}
    for key, rec in records.items():
        assert rec.blocks is not None
        items[key] = BlockedItem(
            [None] * len(rec.stored),
            rec.info,
            list(rec.blocks),
            fetch=functools.partial(fetch, rec=rec),
        )
    return put_items(dst, step, rank, items)
