"""TieredWriter: the DCP StorageWriter (and async stager) that saves one step.

On the save's path each rank writes its part to the fastest tier taking the step (its
items' chunks back to back, each checksummed); the step is then committed there by the
protocol the tier's placement names (``commit.for_save``: the step's metadata and, last,
its marker, then retention): that commit is the step's durability point. Each rank then
hands the step to its writer process (``writer_process.process``), which fills in the slower tiers taking it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_dcp.planners.replicas import KNOWN_KEYS, with_keys
from tiered_dcp.planners.save import ALIASES, KNOWN_WORLDS, Alias, save_rank, tag_local_plan
from tiered_dcp.storage import blocks
from tiered_dcp.storage.blocks import Screen
from tiered_dcp.storage.codec import CHUNK_BYTES, Encoder, make_record, split
from tiered_dcp.storage.forks import ThreadPool
from tiered_dcp.storage.format import NONFINITE_NAMES, ItemInfo, failed_key, index_key, part_key, pin_key
from tiered_dcp.storage.local import LocalStorage, missing_root

from ..config import TieredConfig, node_of
from ..errors import NonFiniteStateError, PeerLostError, TieredCheckpointError
from ..metrics import scores
from ..ranks import domains, transport, worlds
from ..ranks.cliques import Layout, by_node, jump_fits, uneven_world
from ..ranks.transport import PeerTimeout
from ..steps import commit, dedup, part_file
from ..steps.catalog import TierView, bounded
from ..steps.checkpoint_id import new_id, step_id, step_of
from ..steps.leases import owner_record
from ..steps.metadata import Records
from ..steps.part_file import TierFile
from ..tensors import as_cpu_contiguous, byte_view, finite_screen
from ..writer_process.client import MAX_PENDING, writer_handle
from ..writer_process.run_dir import Job
from ..writer_process.timings import SaveCall, record_save
from . import dcp_call, host_memory, preemption, replica_check
from .handoff import Handoff
from .replica_check import ReplicaCheck
from .replicate import SavedPart, Swap, write_records_index
from .staging import POOL, Examined, InFlight, examine, staged_file

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
        cut = as_blocks and blocks.blocked(extra["kind"], len(view))
        chunks = split(view, blocks.BLOCK_BYTES if cut else CHUNK_BYTES)
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


class TieredWriter(StorageWriter, AsyncStager):
    """Saves ``step``: committed on the fastest tier that takes it, then the slower ones.

    ``dcp.save`` (and an ``async_save`` future) completes once the step is committed on the
    fastest tier taking it, on every rank. The slower tiers taking it are written by this
    rank's long-lived writer process (see ``writer_process.process``), off the training path.

    As DCP's stager for ``async_save``, it copies the state into reusable shared-memory
    buffers (``staging``): that copy is the loop's only stall. ``background_staging=True``
    makes even that copy run in a thread; wait on the response's ``staging_completion``
    before changing the state. ``handle_sigterm`` finishes in-flight async saves when the
    process is told to stop (``preemption``). ``staging_slots`` bounds the staged copies in
    memory; ``max_pending`` bounds how far a rank's writer may fall behind per tier before a
    save waits for it. ``emergency=True`` (the last save before a preemption) sends the step
    to every tier, whatever their ``every``: committed on the fastest, then the writer
    process copies it down, also after the trainer exited. DCP's ``checkpoint_id`` names a
    step (``checkpoint_id``). Cheap to pickle, so DCP's PROCESS async mode can ship it.
    """

    _synchronize_after_execute = True  # DCP's last call on the loop's thread: the end of ``call``

    def __init__(
        self,
        config: TieredConfig,
        step: int,
        *,
        background_staging: bool = False,
        handle_sigterm: bool = True,
        staging_slots: int = 2,
        max_pending: int = MAX_PENDING,
        emergency: bool = False,
    ) -> None:
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredWriter: config must be a TieredConfig, got {type(config).__name__}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"TieredWriter: step must be an integer >= 0, got {step!r}")
        for name, value in (("staging_slots", staging_slots), ("max_pending", max_pending)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TieredWriter: {name}={value!r} must be an integer >= 1")
        self.config = config
        self.emergency = bool(emergency)
        self._target(step)
        self.save_id = new_id()
        # the jump rule's cliques now (local); a layout of failure domains, which every rank
        # gathers together (a collective), in the save's set-up, before any byte is written
        # (``set_up_storage_writer``; once per process group: ``domains.LAYOUTS``)
        self.layout: Layout | None = domains.layout_unless_gathered(config, _world_size(), _current_rank())
        self.background_staging = background_staging
        self.handle_sigterm = handle_sigterm
        self.staging_slots = staging_slots
        self.max_pending = max_pending
        self.owner_pid: int | None = None  # the trainer's pid, set when it stages
        self.generation = 0  # the trainer's world when it staged (``worlds.generation``)
        self.handoff_wait = 0.0  # seconds this save waited for a writer that fell behind
        self.stage_seconds: float | None = None  # the copy async_save waited for (None: a sync save)
        self.call: SaveCall | None = None  # the async_save call as the loop sees it (None: a sync save)
        self.slot_wait: float | None = None  # of the staging, the wait for a slot earlier saves held
        self.staging_bytes: int | None = None  # the trainer's staging buffers once it staged
        self._write_seconds = 0.0  # this rank's part written to the first tier (``records``)
        # bytes this rank sent its clique's peers for their replicas (also in ``records``; in
        # DCP's PROCESS async mode, set on the copy of the writer that process saves with)
        self.sent_bytes = 0
        self._waited = False
        self._handoff_later = False  # ``stage`` left the writer's start and checks to write_data
        self.shipped = False  # ``stage``: DCP's PROCESS mode sends the staged copy to its process
        self.staged_file: TierFile | None = None  # the RAM tier's part file ``stage`` filled
        self._next_files: ConcurrentFuture[int] | None = None  # the next saves' files (``_prepare_next``)
        self.rank = 0
        self.node = node_of(0)
        self.is_coordinator = True
        self._world: list[int] | None = None
        self._op: worlds.Op | None = None  # this save in the job's store (``set_up_storage_writer``)
        self._stager: int | None = None  # the thread that staged this save (``stage``)
        self._local_plan: SavePlan | None = None  # this rank's local plan, as its replicas were keyed
        self._replicas: ReplicaCheck | None = None  # this save's replica check (``replica_check``)

    def _target(self, step: int) -> None:
        """Save ``step``: on the tiers that take it (every tier for an emergency save)."""
        tiers = list(range(len(self.config.tiers))) if self.emergency else self.config.tiers_for(step)
        if not tiers:
            schedule = ", ".join(f"{t.path} every={t.every}" for t in self.config.tiers)
            raise ValueError(
                f"TieredWriter: no tier takes step {step} ({schedule}); save a step that one "
                "of these divides, add a tier with every=1, or pass emergency=True for a last "
                "save before a preemption"
            )
        self.step = step
        self.tier_indexes = tiers

    @property
    def checkpoint_id(self) -> str:
        """The step's id (``<namespace>/step_<12 digits>``, its directory in every tier)."""
        return step_id(self.config.namespace, self.step)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_world": None, "_next_files": None, "_op": None, "_replicas": None}

    # -- AsyncStager: the copy the training loop waits for --------------------------------

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | ConcurrentFuture[STATE_DICT_TYPE]:
        self.call = SaveCall()
        self.owner_pid = os.getpid()
        self.generation = worlds.generation()
        self.handoff_wait = 0.0  # this save's: DCP's reset(checkpoint_id) comes after stage
        self._stager = threading.get_ident()
        dcp_call.prepare()
        if self.handle_sigterm:
            preemption.install()
        rank = _current_rank()
        first = TierView(self.config, self.tier_indexes[0], node_of(rank), rank)
        if part_file.drops_pinned(self.config, first.own):  # no wait: the hand-off's checks
            self._handoff_later = True  # run in write_data, off the training thread
        else:
            self._wait_for_writer(rank)
        started = time.perf_counter()
        examined = examine(state_dict)  # a value of a kind that cannot be copied fails here, at once
        examined.mark_written()  # on CUDA: the copies wait for this thread's stream, wherever they run
        self.shipped = dcp_call.ships_to_a_process()
        staged_now = POOL.info()["bytes"]
        self.staged_file = part_file.target(self.config, first.index, first.own, self.step, rank)
        # in the tier's part file the newest in-flight save is the tier's step; the others are more
        copies = self.staging_slots - 1 if self.staged_file is not None else self.staging_slots
        host_memory.guard(self.config, examined.nbytes, copies, self.tier_indexes[0], staged_now)
        if not self.background_staging:
            staged = self._stage(examined)
            self.stage_seconds = time.perf_counter() - started
            self.staging_bytes = POOL.info()["bytes"]
            self._prepare_next(examined)
            self.call.staged(self.handoff_wait, hooked=dcp_call.calls_back(self.shipped))
            return staged
        future = _staging_thread().submit(self._stage_then_prepare, examined, POOL.reserve())
        self.stage_seconds = time.perf_counter() - started
        self.call.staged(self.handoff_wait, hooked=False)
        return future

    def _stage(self, examined: Examined, reserved: InFlight | None = None) -> STATE_DICT_TYPE:
        """The copy into the staging slot, this rank's writer process paused during the copy
        alone (``run_dir.StagingLock``: it does not share the cores and memory bandwidth then)."""
        try:
            quiet = (
                writer_handle(self.config, _current_rank()).rd.writer.staging.hold
                if len(self.config.tiers) > 1
                else contextlib.nullcontext
            )
            staged = POOL.stage(examined, reserved, self.staged_file, self.staging_slots, quiet, self.shipped)
            self.slot_wait = staged.slot_wait
            return staged
        finally:
            if reserved is not None:  # whatever failed before the pool took it
                reserved.release()

    def _stage_then_prepare(self, examined: Examined, reserved: InFlight) -> STATE_DICT_TYPE:
        """Background staging: the copy, then the next saves' files (``_prepare_next``)."""
        staged = self._stage(examined, reserved)
        self._prepare_next(examined)
        return staged

    def _prepare_next(self, examined: Examined) -> None:
        """After a save staged into the RAM tier: the part files its next ``keep`` saves stage
        into are made in the background (``StagingPool.prepare``), so none faults a page in.
        For the first save of a layout (no ``prepare()`` call before it) its upload waits for
        them before its future completes: a save that follows at once would otherwise
        overtake that work and fault its own file in on the training thread."""
        if self.staged_file is not None:
            keep = self.config.tiers[self.tier_indexes[0]].keep or 0
            first = not POOL.files_ahead(examined)
            made = POOL.prepare_soon(examined, self.staged_file, keep + 1)
            self._next_files = made if first else None

    def prepare(self, state_dict: STATE_DICT_TYPE) -> None:
        """Make ready, before the first save, what saves of ``state_dict`` stage into: the
        RAM tier's part files for its ``keep + 1`` steps (or a staging buffer when the first
        tier is not in memory), sized, every page touched and, on CUDA, registered. Checked
        against the host's memory first (``host_memory.guard``). With slower tiers, this rank's
        writer process is started too, so its start (an interpreter and its imports) does not
        share the cores with the first saves. Optional: without it the first save claims its
        own, and later saves find theirs made in the background."""
        rank = _current_rank()
        examined = examine(state_dict)
        first = TierView(self.config, self.tier_indexes[0], node_of(rank), rank)
        where = part_file.target(self.config, first.index, first.own, self.step, rank)
        copies = self.staging_slots - 1 if where is not None else self.staging_slots
        host_memory.guard(self.config, examined.nbytes, copies, first.index, POOL.info()["bytes"])
        keep = self.config.tiers[first.index].keep or 0
        POOL.prepare(examined, where, keep + 1)
        if len(self.config.tiers) > 1:  # its writer process too: started now, not during the saves
            writer_handle(self.config, rank).ensure(os.getpid())

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a finished copy or a future for it. DCP
        calls it last, on the loop's thread, once its upload has the copy: the call's end."""
        if self.call is not None:
            self.call.end()

    def close(self) -> None:
        """Free this process's staging buffers (busy ones once their uploads end)."""
        POOL.close()

    # -- StorageWriter ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save: ``checkpoint_id`` (from ``dcp.save``), if given, names its step.

        It may only be a step (``checkpoint_id.step_of``): an int, its digits, or this
        writer's ``checkpoint_id`` form; anything else (a directory) raises ValueError.
        """
        self._world = None
        self.save_id = new_id()
        if checkpoint_id is not None:
            self._target(step_of(self.config.namespace, checkpoint_id, "TieredWriter"))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: a step is placed by a TieredConfig, which no checkpoint_id alone carries."""
        return False

    def storage_meta(self) -> StorageMeta:
        """What DCP records of this save (in its Metadata): the step's id and a fresh save id."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError(
                "TieredWriter needs use_collectives=True: a step is committed "
                "only when every rank's part is written"
            )
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        self.node = node_of(self.rank)
        self.is_coordinator = is_coordinator
        if self.owner_pid == os.getpid() and threading.get_ident() != self._stager:
            dcp_call.move()  # an async save's own thread: its collectives off the training's group
        self._op = None
        if worlds.dist_up():
            self._op = worlds.Op(self.config.namespace, "save", self.step, self.config.peer_timeout)
            if _world_size() > 1:  # every rank here before DCP's first collective of the save
                self._op.arrive("the save's start")
        _say_missing_roots(self.config, self.node, self.rank)
        if self.layout is None:  # failure domains: every rank is here, in DCP's set-up
            self.layout = domains.LAYOUTS.get(self.config, _world_size(), self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # with dedup, large items are stored as blocks (replicas too: a peer gets only the blocks it lacks)
        plan = tag_local_plan(plan, self.rank, self.node, self.config.dedup)
        if self.config.on_replica_mismatch != "ignore":  # its items keyed, for the replica groups
            plan = self._local_plan = with_keys(plan)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The save's world in every plan (``planners.save``); with DCP's plan cache, the
        world of this process's last full plan (DCP's cache is per process too). Each
        plan's replica groups (``planners.replicas``)."""
        plans, world = KNOWN_WORLDS.plan_global(plans, worlds.generation())
        if world is not None:
            self._world = world
        return KNOWN_KEYS.assign_groups(plans, worlds.generation())

    def _first(self) -> TierView:
        return TierView(self.config, self.tier_indexes[0], self.node, self.rank)

    def _wait_for_writer(self, rank: int) -> None:
        """Before this step is staged or written: wait if the writer fell too far behind."""
        handoff = Handoff(self.config, self.step, self.tier_indexes, rank, self.owner_pid, self.max_pending)
        self.handoff_wait += handoff.wait_for_room()
        self._waited = True

    @worlds.working()  # ``tiered_dcp.abort`` waits for it
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.owner_pid == os.getpid() and self.generation != worlds.generation():
            raise TieredCheckpointError(
                f"step {self.step}: this save was staged in a world that is gone (its process "
                "group was torn down, tiered_dcp.abort); it is abandoned, never committed: save "
                "again in the new world (load_latest first, on every rank)"
            )
        if self._handoff_later:  # an async save that waits for no writer (``stage``)
            self._handoff_later = False
            self._wait_for_writer(self.rank)
        elif not self._waited:  # a sync save: nothing was staged
            self.handoff_wait = 0.0
            self.call = None
            host_memory.guard(self.config, plan_bytes(plan), 0, self.tier_indexes[0])
            self._wait_for_writer(self.rank)
        self._waited = False  # the hand-off is this save's: the next one waits afresh
        started = time.perf_counter()
        self.sent_bytes = 0
        first = self._first()
        staged = self._in_file(first)
        policy = self.config.on_nonfinite
        items = resolve_items(plan, planner, self.config.dedup, check_finite=policy != "ignore")
        check = self._replicas = replica_check.start(  # hashing while the part is written
            self.config, self.step, self.rank, plan, planner, items, self._local_plan, self.stage_seconds
        )
        moving = check.before_moving if check is not None else None  # a copy there: hashed first
        in_file = place_in_file(staged, items, moving) if staged is not None else {}  # first: it moves bytes
        resolved = Resolved(items, fingerprint(items), staged, in_file)  # hashed while written
        if check is not None:
            check.written(resolved.hashed, staged.arena if staged is not None else None)
        refused = None
        if policy == "raise":  # nothing of a refused step is written
            resolved.hashed.result()
            refused = _refused(self.step, self.rank, items)
        aliases = (plan.storage_data or {}).get(ALIASES, [])
        slower = self.tier_indexes[1:]
        where = save_rank(plan)
        world = (where.nodes() if where is not None else None) or [self.node]
        op = self._op
        try:
            committer = commit.for_save(first, self.step, self.rank, self.is_coordinator, self._layout, check)
            records = committer.write(
                lambda: self._write_part(first, resolved, aliases, world, op, slower),
                refused,
                world,
                op,
                _metadata_of(planner, self.storage_meta()),
            )
        except BaseException as e:
            if check is not None:
                check.drain()  # no hashing thread reads staged bytes once the save is given up
            _abandon(first, self.step, self.rank, slower, e, self.staged_file)
            if isinstance(e, PeerLostError):  # DCP's next collective raises torch's error instead
                log.error("%s", e)
            raise
        self._record(first, items, time.perf_counter() - started)
        if slower:
            handle = writer_handle(self.config, self.rank)
            for target in slower:
                handle.enqueue(Job(self.step, first.index, target, self.rank, self.node, time.time()))
            handle.ensure(self.owner_pid or os.getpid())  # after: a writer is there for these jobs
        if self._next_files is not None:  # the first save's upload: the next saves' files made
            self._next_files.result()
            self._next_files = None
        results = [  # the plan's items, and the aliases the planner gave this rank
            WriteResult(index=index, size_in_bytes=rec.info.raw_length, storage_data=rec)
            for index, rec in records.items()
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_part(
        self,
        first: TierView,
        resolved: Resolved,
        aliases: list[Alias],
        world: list[int],
        op: worlds.Op | None,
        slower: list[int],
    ) -> Records:
        """Pin the step for the slower tiers, then write this rank's part and, where the tier
        holds replicas, swap parts with the clique (``replicate``) while it is written."""
        _pin(first, self.step, self.rank, slower)
        replicated = first.placement.copies(self.config.replication_factor) > 1
        swap = None
        try:
            part = encode_part(first, self.step, self.rank, resolved, aliases, replicated)
            if replicated:  # the transfer runs while the part is written
                assert op is not None, "a replicated tier is written by several ranks"
                swap = Swap(first, self.step, part, world, op, self._layout(world)).start()
            t0 = time.perf_counter()
            write_part(first, self.step, part)
            self._write_seconds = time.perf_counter() - t0
            records = part.seal()
            if swap is not None:
                swap.finish()
                self.sent_bytes = swap.sent
            return records
        except BaseException as e:
            if swap is not None:
                swap.abort()
            if isinstance(e, PeerTimeout):
                raise transport.lost(self.step, "the replica exchange", e) from e
            raise

    def _layout(self, world: list[int]) -> Layout:
        """The cliques of this save's ``world`` (rank -> node, from the plan): the jump rule
        over its ranks, laid out by node where the rule does not fit it (a job that goes on
        with fewer ranks: said once per world), or the failure domains' layout, which must
        be of the same ranks."""
        layout = self.layout
        assert layout is not None, "set_up_storage_writer lays the cliques out first"
        if not layout.groups and not layout.domains:
            if jump_fits(len(world), layout.factor, layout.jump):
                return dataclasses.replace(layout, world=len(world))
            placed = by_node(layout.factor, world, layout.jump)
            said = (tuple(world), layout.factor, layout.jump)
            if said not in _UNEVEN_SAID and self.rank == 0:  # every rank lays it out alike: said once
                _UNEVEN_SAID.add(said)
                log.warning("%s", uneven_world(placed, world, layout.jump))
            return placed
        if layout.world != len(world):
            raise TieredCheckpointError(
                f"step {self.step}: the failure domains were gathered from {layout.world} rank(s), "
                f"but this save has {len(world)}: save with the job's default process group's ranks"
            )
        return layout

    def _in_file(self, first: TierView) -> InFile | None:
        """The part file ``stage`` filled, when this save writes that very file (the step and
        rank it was staged for, mapped in this process), or, for a first copy staged in
        private memory, that file with the copy moved in now (``FirstCopies.move``); a
        staged file it cannot use goes."""
        tf = self.staged_file
        if tf is None:
            return None
        ours = (
            isinstance(first.own, LocalStorage)
            and first.own.path(part_key(self.config.namespace, self.step, self.rank)) == tf.clean
        )
        arena = staged_file(tf.dirty)
        if arena is None and ours:
            arena = POOL.first_copies.move(tf)
        POOL.first_copies.give_up(tf)
        if arena is None or not ours:
            part_file.discard(tf)
            return None
        return InFile(tf, arena)

    def _record(self, first: TierView, items: list[RawItem], commit_seconds: float) -> None:
        """This save's measured costs, for ``goodput --from-job`` and the save-time scores."""
        fields = {
            "tier": first.index,
            "bytes": sum(len(c) for it in items for c in it.chunks),
            "write_s": round(self._write_seconds, 6),
            "commit_s": round(commit_seconds, 6),
            "handoff_s": round(self.handoff_wait, 6),
            "sent": self.sent_bytes,
        }
        if self.stage_seconds is not None:
            fields["stage_s"] = round(self.stage_seconds, 6)
        if self.slot_wait is not None:
            fields["slot_wait_s"] = round(self.slot_wait, 6)
        here = self.owner_pid in (None, os.getpid())  # prepared files: in memory, in no listing
        staging = POOL.info()["bytes"] + POOL.prepared_bytes() if here else self.staging_bytes
        if staging is not None:  # not known in DCP's background process after background staging
            fields["staged"] = staging
        record_save(self.config, self.rank, self.step, fields, self.call)
        scores.watch_soon(self.config, self.rank)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish, on the coordinator: the step commits here where the first tier's
        protocol says so (``commit.for_save``: a shared tier; a node-local one committed
        in ``write_data``)."""
        metadata.storage_meta = self.storage_meta()
        first = self._first()
        world = self._world if self._world is not None else [self.node]
        records = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        try:
            with worlds.working():
                commit.for_save(
                    first, self.step, self.rank, self.is_coordinator, self._layout, self._replicas
                ).finish(metadata, records, world)
        except BaseException as e:
            _abandon(first, self.step, self.rank, [], e)
            raise


def _metadata_of(planner: SavePlanner, storage_meta: StorageMeta) -> Callable[[], Metadata]:
    """DCP's global Metadata, as the planner keeps it, for the commit that needs it."""

    def metadata() -> Metadata:
        md = getattr(planner, "metadata", None)
        if not isinstance(md, Metadata):
            raise TieredCheckpointError(
                f"TieredWriter needs a SavePlanner that keeps its global Metadata in .metadata "
                f"(DefaultSavePlanner and its subclasses do); {type(planner).__name__} does not"
            )
        md.storage_meta = storage_meta
        return md

    return metadata


def _refused(step: int, rank: int, items: list[RawItem]) -> NonFiniteStateError | None:
    """The error of a save refused for non-finite state (``on_nonfinite="raise"``), if any."""
    bad = [it.index.fqn for it in items if it.extra.get("nonfinite")]
    if not bad:
        return None
    return NonFiniteStateError(
        f"step {step} was not saved: rank {rank} holds NaN/Inf in {len(bad)} item(s) "
        f"{bad[:NONFINITE_NAMES]} (on_nonfinite='raise'; 'mark' saves it marked, for loads to pass over)"
    )


def _pin(first: TierView, step: int, rank: int, slower: list[int]) -> None:
    """Pins first: the first tier's retention must not remove what a writer will copy."""
    for target in slower:
        first.own.write(pin_key(first.config.namespace, step, rank, target), [owner_record()])


def _abandon(
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


_ROOTS_SEEN: set[str] = set()  # node-local tier roots this process looked for (``_say_missing_roots``)


def _say_missing_roots(config: TieredConfig, node: int, rank: int) -> None:
    """Warn, once per root, that a node-local tier's directory is made by this save, naming
    the file system it lands on: a mount missing on this host must not pass silently."""
    for tier in config.tiers:
        if tier.is_shared or not tier.is_local_fs:
            continue
        root = os.path.abspath(tier.root(node, rank).removeprefix("file://"))
        if root not in _ROOTS_SEEN:
            _ROOTS_SEEN.add(root)
            where = missing_root(root)
            if where is not None:
                log.warning("tier %s: %s; if that is not the disk you meant, fix the path", tier.path, where)


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_staging_thread = ThreadPool("tiered-dcp-staging", 1)  # background staging's copies
_UNEVEN_SAID: set[tuple] = set()  # the worlds laid out by node that a warning named (``_layout``)
