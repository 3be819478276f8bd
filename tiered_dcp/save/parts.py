"""This rank's part of one save, on the fastest tier taking the step, in the order
``TieredWriter.write_data`` runs the steps: its items resolved and checksummed
(``resolve_items``, ``fingerprint``), placed where staging copied them (``staged_part``,
``place_in_file``), encoded for the tier (``encode_part``), written with its index and,
where the tier holds replicas, swapped with the clique meanwhile (``write_and_swap``);
and what a failed save leaves behind (``abandon``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from tiered_dcp.planners.save import Alias
from tiered_dcp.storage import blocks
from tiered_dcp.storage.blocks import Screen
from tiered_dcp.storage.codec import Encoder, make_record, split
from tiered_dcp.storage.forks import ThreadPool
from tiered_dcp.storage.format import NONFINITE_NAMES, ItemInfo, failed_key, index_key, part_key, pin_key
from tiered_dcp.storage.local import LocalStorage

from ..errors import NonFiniteStateError, TieredCheckpointError
from ..ranks import transport, worlds
from ..ranks.cliques import Layout, by_node, jump_fits, uneven_world
from ..ranks.transport import PeerTimeout
from ..steps import dedup, part_file
from ..steps.catalog import TierView, bounded
from ..steps.leases import owner_record
from ..steps.metadata import Records
from ..steps.part_file import TierFile
from ..tensors import as_cpu_contiguous, byte_view, finite_screen
from .replicate import SavedPart, Swap, write_records_index
from .staging import POOL, staged_file

log = logging.getLogger(__name__)


@dataclass
class RawItem:
    """One resolved write item: its raw chunks and their checksums."""

    index: MetadataIndex
    chunks: list[memoryview]
    hashes: list[int]
    extra: dict[str, Any]  # the rest of its ItemInfo: kind, dtype, shape (nonfinite, once found)
    owner: object  # keeps the tensor / buffer alive while its bytes are written
    ids: list[str] | None = None  # dedup: each chunk is a block, named by these ids
    planned: list[str] | None = None  # dedup: the ids the save planner named already
    screen: Screen | None = None  # the non-finite check of its tensor

    def info(self, rank: int) -> ItemInfo:
        """Its facts once ``fingerprint`` is done (the checksums, the non-finite check)."""
        raw_chunks = tuple(zip(map(len, self.chunks), self.hashes, strict=True))
        return ItemInfo(rank=rank, raw_chunks=raw_chunks, **self.extra)


def resolve_items(
    plan: SavePlan, planner: SavePlanner, as_blocks: bool = False, check_finite: bool = False
) -> list[RawItem]:
    """Each write item's bytes, chunked (with dedup, large tensors cut into blocks); their
    checksums and block ids are ``fingerprint``'s. ``check_finite``: floating tensors get
    the non-finite check (``tensors.finite_screen``)."""
    items: list[RawItem] = []
    planned: dict[MetadataIndex, list[str]] = getattr(planner, "block_ids", None) or {}
    for item in plan.items:
        data = planner.resolve_data(item)
        screen = None
        if item.type == WriteItemType.BYTE_IO:
            owner: object = data.getvalue()
            view = memoryview(owner)
            extra: dict[str, Any] = {"kind": "bytes"}
        else:
            t = as_cpu_contiguous(data)
            owner, view = t, byte_view(t)
            extra = {"kind": "tensor", "dtype": str(t.dtype), "shape": tuple(t.shape)}
            screen = finite_screen(t.dtype) if check_finite else None
        chunks, cut = blocks.chunks(extra["kind"], view, as_blocks)
        ids = planned.get(item.index) if cut else None
        if ids is None or len(ids) != len(chunks):  # ``TieredSavePlanner`` named them, or not
            ids = None
        items.append(RawItem(item.index, chunks, [], extra, owner, [] if cut else None, ids, screen))
    return items


def fingerprint(items: list[RawItem]) -> ConcurrentFuture[None]:
    """Checksums the items' chunks, names their blocks and runs their non-finite checks
    (``blocks.fingerprints``, on its threads) while the caller goes on, e.g. writing the
    very bytes: the future is done once every item has its ``hashes``, ``ids`` and
    ``nonfinite`` fact. Nothing may move the chunks' bytes meanwhile."""
    chunks = [c for it in items for c in it.chunks]
    cuts = [it.ids is not None for it in items for _ in it.chunks]
    known = [n for it in items for n in (it.planned or [None] * len(it.chunks))]
    screens = [it.screen for it in items for _ in it.chunks]

    def run() -> None:
        prints = iter(blocks.fingerprints(chunks, cuts, known, screens))
        for it in items:
            for _ in it.chunks:
                p = next(prints)
                it.hashes.append(p.checksum)
                if it.ids is not None:
                    it.ids.append(p.block)
                if not p.passed:
                    it.extra["nonfinite"] = True

    return _fingerprinting().submit(run)


# The thread that hands a save's chunks to ``blocks``' threads and collects them (not one of
# those threads: a task of that pool waiting on the pool could wait forever).
_fingerprinting = ThreadPool("tiered-dcp-fingerprint", 1)


def plan_bytes(plan: SavePlan) -> int:
    """The tensor bytes a local plan writes (its byte items are small, and not counted)."""
    return sum(
        math.prod(it.tensor_data.chunk.sizes) * it.tensor_data.properties.dtype.itemsize
        for it in plan.items
        if it.tensor_data is not None
    )


@dataclass
class InFile:
    """The part file this save staged into (``part_file``), mapped here as ``arena``."""

    file: TierFile
    arena: torch.Tensor  # uint8, over the whole file
    end: int = 0  # where its items end once ``place_in_file`` ran (the byte items follow)


@dataclass
class Resolved:
    """A save's items on their way into the part: ``hashed`` once ``fingerprint`` is done;
    ``in_file``: the positions of those staged into the part file ``staged`` (``place_in_file``),
    each at its offset there."""

    items: list[RawItem]
    hashed: ConcurrentFuture[None]
    staged: InFile | None = None
    in_file: dict[int, int] = dataclasses.field(default_factory=dict)


def place_in_file(
    staged: InFile, items: list[RawItem], before: Callable[[int, int], None] | None = None
) -> dict[int, int]:
    """The items (by position) whose bytes were staged into the part file, each at its
    offset there once the gaps between them are closed (``part_file.close_gaps``). Their chunks
    are re-pointed at the moved bytes; any other item whose bytes lie in the file (one
    overlapping another) is copied out first, since closing the gaps moves bytes.
    ``before``: told the bytes each move overwrites (``ReplicaCheck.before_moving``)."""
    base, size = staged.arena.data_ptr(), staged.arena.numel()
    inside: list[tuple[int, int, int]] = []
    for i, it in enumerate(items):
        if it.ids is None and isinstance(it.owner, torch.Tensor) and it.owner.numel():
            n = sum(len(c) for c in it.chunks)
            off = it.owner.data_ptr() - base
            if off >= 0 and off + n <= size:
                inside.append((off, n, i))
    inside.sort()
    placed, end = [], 0
    for off, n, i in inside:
        if off < end:  # shares bytes with the one before: it travels in the tail
            items[i].chunks = [memoryview(bytes(c)) for c in items[i].chunks]
        else:
            placed.append((off, n, i))
            end = off + n
    offsets = part_file.close_gaps(base, [(off, n) for off, n, _ in placed], before)
    whole = byte_view(staged.arena)
    out = {}
    for (_, n, i), new in zip(placed, offsets, strict=True):
        items[i].chunks = split(whole[new : new + n])
        out[i] = new
    staged.end = offsets[-1] + placed[-1][1] if placed else 0
    return out


def encode_part(
    view: TierView,
    step: int,
    rank: int,
    resolved: Resolved,
    aliases: Sequence[Alias] = (),
    replicated: bool = False,
) -> SavedPart:
    """This rank's part for one tier, in memory: its stored chunks in file order, and its
    records once the items are ``hashed`` (``SavedPart.seal``: the part's bytes can be
    written while their checksums are computed).

    Zero-copy on a raw tier (the chunks are views of the staged tensors); compressed
    chunks are held until the part and its replicas are written. Items cut into blocks
    (dedup) are put into the root's block store here (``dedup``, once named); the part keeps
    the rest, and, when ``replicated``, the block files written, for the peers that lack them.
    Each of ``aliases`` (the save planner's: items of any rank with the same bytes as one
    of the items) gets a record of its own naming the same blocks. Items staged into the
    part file stay where they are (``Resolved.in_file``); the rest follow them.
    """
    items, hashed, staged, in_file = resolved.items, resolved.hashed, resolved.staged, resolved.in_file
    enc = Encoder(view.tier.compression)
    key = part_key(view.config.namespace, step, rank)
    part = SavedPart(rank, {}, [])
    if any(it.ids is not None for it in items):
        hashed.result()  # the blocks are written by name
        as_blocks = {
            it.index: dedup.BlockedItem(list(it.chunks), it.info(rank), it.ids)
            for it in items
            if it.ids is not None
        }
        kept = part.blocks if replicated else None
        part.records, put = dedup.put_items(view, step, rank, as_blocks, kept=kept)
        part.written_blocks = put.written_bytes
    placed = []  # (item position, offset, stored chunks, codec, per-chunk codecs)
    for i in sorted(in_file, key=in_file.__getitem__):
        placed.append((i, in_file[i], items[i].chunks, "raw", None))
        part.stored += items[i].chunks
    offset = staged.end if staged is not None else 0
    for i, it in enumerate(items):
        if it.ids is not None or i in in_file:
            continue
        stored, codec, codecs = enc.encode_item(it.chunks, it.extra.get("dtype"))
        placed.append((i, offset, stored, codec, codecs))
        part.stored += stored
        part.tail += stored
        offset += sum(memoryview(c).nbytes for c in stored)
    part.in_file = staged

    def records() -> Records:
        hashed.result()
        out = dict(part.records)
        for i, off, stored, codec, codecs in placed:
            it = items[i]
            out[it.index] = make_record(key, off, stored, codec, it.info(rank), codecs)
        for alias in aliases:
            source = out[alias.source]
            if source.blocks is None:
                raise TieredCheckpointError(
                    f"step {step}: item {alias.index.fqn!r} was planned as an alias of {alias.source.fqn!r}, "
                    "which is not stored as blocks here (TieredSavePlanner plans aliases only for them)"
                )
            info = dataclasses.replace(source.info, shape=alias.shape)
            out[alias.index] = dataclasses.replace(source, info=info)
        return out

    part.pending = records
    return part


def write_part(view: TierView, step: int, part: SavedPart) -> None:
    """The part, then its index next to it (a part staged into its file: only the tail).
    The index waits for the records (``SavedPart.seal``), the part's bytes do not."""
    if part.in_file is not None:
        with view.own.errors(part_key(view.config.namespace, step, part.rank)):
            part_file.finish(part.in_file.file, part.in_file.end, part.tail)
    else:
        view.own.write(part_key(view.config.namespace, step, part.rank), part.stored)
    write_records_index(view, step, part.rank, part.seal(), part.written_blocks)


def staged_part(first: TierView, step: int, rank: int, tf: TierFile | None) -> InFile | None:
    """The part file ``stage`` filled, when this save writes that very file (the step and
    rank it was staged for, mapped in this process), or, for a first copy staged in private
    memory, that file with the copy moved in now (``FirstCopies.move``); a staged file it
    cannot use goes."""
    if tf is None:
        return None
    ours = (
        isinstance(first.own, LocalStorage)
        and first.own.path(part_key(first.config.namespace, step, rank)) == tf.clean
    )
    arena = staged_file(tf.dirty)
    if arena is None and ours:
        arena = POOL.first_copies.move(tf)
    POOL.first_copies.give_up(tf)
    if arena is None or not ours:
        part_file.discard(tf)
        return None
    return InFile(tf, arena)


def write_and_swap(
    first: TierView,
    step: int,
    rank: int,
    resolved: Resolved,
    aliases: list[Alias],
    world: list[int],
    op: worlds.Op | None,
    slower: list[int],
    layout: Callable[[list[int]], Layout],
) -> tuple[Records, float, int]:
    """Pin the step for the slower tiers, then write this rank's part and, where the tier
    holds replicas, swap parts with the clique (``replicate``) while it is written. Returns
    its records, the seconds the write took and the bytes sent to the clique."""
    pin(first, step, rank, slower)
    replicated = first.placement.copies(first.config.replication_factor) > 1
    swap = None
    try:
        part = encode_part(first, step, rank, resolved, aliases, replicated)
        if replicated:  # the transfer runs while the part is written
            assert op is not None, "a replicated tier is written by several ranks"
            swap = Swap(first, step, part, world, op, layout(world)).start()
        t0 = time.perf_counter()
        write_part(first, step, part)
        seconds = time.perf_counter() - t0
        records = part.seal()
        if swap is not None:
            swap.finish()
        return records, seconds, swap.sent if swap is not None else 0
    except BaseException as e:
        if swap is not None:
            swap.abort()
        if isinstance(e, PeerTimeout):
            raise transport.lost(step, "the replica exchange", e) from e
        raise


def save_layout(layout: Layout | None, world: list[int], step: int, rank: int) -> Layout:
    """The cliques of a save's ``world`` (rank -> node, from the plan): the jump rule over
    its ranks, laid out by node where the rule does not fit it (a job that goes on with
    fewer ranks: said once per world, by rank 0), or the failure domains' layout, which
    must be of the same ranks."""
    assert layout is not None, "set_up_storage_writer lays the cliques out first"
    if not layout.groups and not layout.domains:
        if jump_fits(len(world), layout.factor, layout.jump):
            return dataclasses.replace(layout, world=len(world))
        placed = by_node(layout.factor, world, layout.jump)
        said = (tuple(world), layout.factor, layout.jump)
        if said not in _UNEVEN_SAID and rank == 0:  # every rank lays it out alike: said once
            _UNEVEN_SAID.add(said)
            log.warning("%s", uneven_world(placed, world, layout.jump))
        return placed
    if layout.world != len(world):
        raise TieredCheckpointError(
            f"step {step}: the failure domains were gathered from {layout.world} rank(s), "
            f"but this save has {len(world)}: save with the job's default process group's ranks"
        )
    return layout


_UNEVEN_SAID: set[tuple] = set()  # the worlds laid out by node that a warning named (``save_layout``)


def pin(first: TierView, step: int, rank: int, slower: list[int]) -> None:
    """Pins first: the first tier's retention must not remove what a writer will copy."""
    for target in slower:
        first.own.write(pin_key(first.config.namespace, step, rank, target), [owner_record()])


def refused_for_nonfinite(step: int, rank: int, items: list[RawItem]) -> NonFiniteStateError | None:
    """The error of a save refused for non-finite state (``on_nonfinite="raise"``), if any."""
    bad = [it.index.fqn for it in items if it.extra.get("nonfinite")]
    if not bad:
        return None
    return NonFiniteStateError(
        f"step {step} was not saved: rank {rank} holds NaN/Inf in {len(bad)} item(s) "
        f"{bad[:NONFINITE_NAMES]} (on_nonfinite='raise'; 'mark' saves it marked, for loads to pass over)"
    )


def abandon(
    first: TierView,
    step: int,
    rank: int,
    slower: list[int],
    error: BaseException,
    staged: TierFile | None = None,
) -> None:
    """A failed save leaves nothing that lives on: this rank's part goes (freeing the space
    a full tier needs), a note says why the step failed (``status`` shows it), and the pins
    go, so the next commit's retention removes the step. Best effort, and bounded by
    ``tier_timeout``: the tier may be down, and the save's error must reach the user."""
    ns, store = first.config.namespace, first.own

    def undo() -> None:
        if staged is not None:
            part_file.discard(staged)
        if first.read_marker(store, step) is not None:
            return  # committed after all (the failure came later): nothing to undo
        for key in (part_key(ns, step, rank), index_key(ns, step, rank)):
            with contextlib.suppress(OSError):
                store.delete(key)
        with contextlib.suppress(OSError):
            store.write(failed_key(ns, step, rank), [f"{type(error).__name__}: {error}".encode()])
        for target in slower:
            with contextlib.suppress(OSError):
                store.delete(pin_key(ns, step, rank, target))

    try:
        bounded(undo, first.config.tier_timeout)
    except Exception as e:  # noqa: BLE001 - the save's own error is what the user needs
        log.warning("step %d: could not clean up after the failed save on %s: %s", step, first.tier.path, e)
