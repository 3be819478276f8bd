"""Dedup on a tier: a part's large tensor items go to the root's block store (``storage.blocks``).

Both writers of a tier use it: the save path for the fastest tier (``writer.encode_part``)
and the writer process for the slower ones (``persist.copy_part``). Either way the part's
block list is written first, then the GC lease is waited for, then each block the root
lacks is written (the writer process reads it from the faster tier only then). What is
left of the part (small items, pickled values) is written to the part file as before.
Torch-free: the writer process uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from tiered_dcp.storage.base import Buffer
from tiered_dcp.storage.blocks import BlockPut, PutResult, fetch_raw, pool, wait_for_gc, write_refs
from tiered_dcp.storage.codec import Encoder
from tiered_dcp.storage.format import Chunk, Record, blocks_dir

from .catalog import TierView

K = TypeVar("K")


@dataclass
class BlockedItem:
    """One item to store as blocks: its raw chunks (or a way to read each), checksums, ids."""

    chunks: list[Buffer | None]  # raw bytes per block; None: read with ``fetch(i)`` if needed
    raw_lengths: list[int]
    hashes: list[int]
    ids: list[str]
    facts: dict[str, Any]  # rank, kind, dtype, shape
    fetch: Callable[[int], bytes] | None = None


def put_items(
    view: TierView, step: int, rank: int, items: Mapping[K, BlockedItem], skip: Iterable[str] = ()
) -> tuple[dict[K, Record], PutResult]:
    """Store ``items`` as blocks in the view's own root; their records, and what was written."""
    ns = view.config.namespace
    store = view.own
    write_refs(store, ns, step, rank, (b for it in items.values() for b in it.ids))
    wait_for_gc(store, ns)  # after the list: a GC from now on keeps these blocks
    put = BlockPut(store, ns, Encoder(view.tier.compression), skip)
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
                it.facts.get("dtype"),
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
        chunks: tuple[Chunk, ...] = tuple(
            (stored, n, h) for (stored, _), n, h in zip(got, it.raw_lengths, it.hashes, strict=True)
        )
        codecs = tuple(c for _, c in got)
        first = codecs[0] if codecs else put.enc.codec
        mixed = any(c != first for c in codecs)
        records[key] = Record(
            blocks_dir(ns),
            0,
            first,
            chunks,
            blocks=tuple(it.ids),
            codecs=codecs if mixed else None,
            **it.facts,
        )
    return records, put.result


def copy_items(
    src: TierView, dst: TierView, step: int, rank: int, records: Mapping[K, Record]
) -> tuple[dict[K, Record], PutResult]:
    """Dedup records of a part on ``src`` into ``dst``'s root: a block ``dst`` holds is
    neither read from ``src`` nor written."""
    items = {}
    for key, rec in records.items():
        assert rec.blocks is not None
        facts = {"rank": rec.rank, "kind": rec.kind, "dtype": rec.dtype, "shape": rec.shape}
        items[key] = BlockedItem(
            [None] * len(rec.chunks),
            [n for _, n, _ in rec.chunks],
            [h for _, _, h in rec.chunks],
            list(rec.blocks),
            facts,
            fetch=lambda i, r=rec: fetch_raw(src.own, r, i),
        )
    return put_items(dst, step, rank, items)
