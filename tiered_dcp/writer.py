"""TieredWriter: the DCP StorageWriter (and async stager) that saves one step.

On the save's path each rank writes its part to the fastest tier taking the step (its
items' chunks back to back, each checksummed); the coordinator then writes the step's
metadata and, last, the commit marker, and applies retention: that commit is the step's
durability point. Each rank then hands the step to its writer process (``persist``),
which fills in the slower tiers taking it.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_dcp.planners.save import plan_global, tag_local_plan
from tiered_dcp.storage.codec import Encoder, checksum, make_record, split
from tiered_dcp.storage.format import part_key, pin_key

from . import preemption, transport
from .catalog import TierView
from .checkpoint_id import new_id, step_id, step_of
from .cliques import check_cliques
from .config import TieredConfig, node_of
from .errors import TieredCheckpointError
from .metadata import Records
from .replicate import SavedPart, Swap, build_commit, commit_everywhere, write_index
from .runtime import MAX_PENDING, Job, writer_handle
from .staging import POOL, examine
from .tensors import as_cpu_contiguous, byte_view

log = logging.getLogger("tiered_dcp")


@dataclass
class RawItem:
    """One resolved write item: its raw chunks and their checksums."""

    index: MetadataIndex
    chunks: list[memoryview]
    hashes: list[int]
    extra: dict[str, Any]
    owner: object  # keeps the tensor / buffer alive while its bytes are written


def resolve_items(plan: SavePlan, planner: SavePlanner) -> list[RawItem]:
    items = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            owner: object = data.getvalue()
            view = memoryview(owner)
            extra: dict[str, Any] = {"kind": "bytes"}
        else:
            t = as_cpu_contiguous(data)
            owner, view = t, byte_view(t)
            extra = {"kind": "tensor", "dtype": str(t.dtype), "shape": tuple(t.shape)}
        chunks = split(view)
        items.append(RawItem(item.index, chunks, [checksum(c) for c in chunks], extra, owner))
    return items


def encode_part(view: TierView, step: int, rank: int, items: list[RawItem]) -> SavedPart:
    """This rank's part for one tier, in memory: its records and stored chunks in file order.

    Zero-copy on a raw tier (the chunks are views of the staged tensors); compressed
    chunks are held until the part and its replicas are written.
    """
    enc = Encoder(view.tier.compression)
    key = part_key(view.config.namespace, step, rank)
    part = SavedPart(rank, {}, [])
    offset = 0
    for it in items:
        stored = [enc.encode(c) for c in it.chunks]
        rec = make_record(key, offset, stored, it.chunks, it.hashes, enc.codec, rank=rank, **it.extra)
        part.records[it.index] = rec
        part.stored += stored
        offset += rec.length
    return part


def write_part(view: TierView, step: int, part: SavedPart) -> None:
    """The part, then its index next to it."""
    view.own.write(part_key(view.config.namespace, step, part.rank), part.stored)
    write_index(view, step, part.rank, part.records)


class TieredWriter(StorageWriter, AsyncStager):
    """Saves ``step``: committed on the fastest tier that takes it, then the slower ones.

    ``dcp.save`` (and an ``async_save`` future) completes once the step is committed on the
    fastest tier taking it, on every rank. The slower tiers taking it are written by this
    rank's long-lived writer process (see ``persist``), off the training path.

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

    _synchronize_after_execute = False

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
        check_cliques(_world_size(), config.replication_factor, config.replication_jump)
        self.background_staging = background_staging
        self.handle_sigterm = handle_sigterm
        self.staging_slots = staging_slots
        self.max_pending = max_pending
        self.owner_pid: int | None = None  # the trainer's pid, set when it stages
        self.handoff_wait = 0.0  # seconds this save waited for a writer that fell behind
        self._waited = False
        self.rank = 0
        self.node = node_of(0)
        self.is_coordinator = True
        self._world: list[int] | None = None

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
        return {**self.__dict__, "_world": None}

    # -- AsyncStager: the copy the training loop waits for --------------------------------

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | ConcurrentFuture[STATE_DICT_TYPE]:
        self.owner_pid = os.getpid()
        if self.handle_sigterm:
            preemption.install()
        self._wait_for_writer(_current_rank())
        POOL.slots = self.staging_slots
        if not self.background_staging:
            return POOL.stage(state_dict)
        examined = examine(state_dict)  # a value of a kind that cannot be copied fails here, at once
        return _staging_thread().submit(POOL.stage, examined, POOL.reserve())

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage`` returns a finished copy or a future for it."""

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
            self._waited = False  # a new save: it waits for a writer that fell behind afresh
            self.handoff_wait = 0.0

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

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return tag_local_plan(plan, self.rank, self.node)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The save plan passes (``planners.save``: the world, then dedup's hook)."""
        plans, world = plan_global(plans)
        if world is not None:  # else DCP's plan cache: unchanged since last time
            self._world = world
        return plans

    def _first(self) -> TierView:
        return TierView(self.config, self.tier_indexes[0], self.node, self.rank)

    def _wait_for_writer(self, rank: int) -> None:
        """Before this step is staged or written: wait if the writer fell too far behind."""
        slower = self.tier_indexes[1:]
        if len(self.config.tiers) > 1:
            handle = writer_handle(self.config, rank)
            handle.ensure(self.owner_pid or os.getpid())  # started early, ready by the hand-off
            handle.report_failures()
            if slower:
                owner = self.owner_pid or os.getpid()
                self.handoff_wait += handle.wait_for_room(self.step, slower, owner, self.max_pending)
        self._waited = True

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not self._waited:  # a sync save: nothing was staged
            self._wait_for_writer(self.rank)
        items = resolve_items(plan, planner)
        first = self._first()
        slower = self.tier_indexes[1:]
        ns = self.config.namespace
        world = (plan.storage_data or {}).get("world") or [self.node]
        name = transport.next_name(ns, "save") if transport.dist_up() else ""
        for target in slower:  # pins first: retention must not remove what a writer will copy
            first.own.write(pin_key(ns, self.step, self.rank, target), [b""])
        if first.placement.commits_in_finish:  # one root: the coordinator commits it in finish()
            part = encode_part(first, self.step, self.rank, items)
            write_part(first, self.step, part)
            records = part.records
        else:
            records = self._write_node_local(first, items, world, planner, name)
        if slower:
            handle = writer_handle(self.config, self.rank)
            for target in slower:
                handle.enqueue(Job(self.step, first.index, target, self.rank, self.node, time.time()))
            handle.ensure(self.owner_pid or os.getpid())  # after: a writer is there for these jobs
        results = [
            WriteResult(
                index=it.index,
                size_in_bytes=sum(len(c) for c in it.chunks),
                storage_data=records[it.index],
            )
            for it in items
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_node_local(
        self, first: TierView, items: list[RawItem], world: list[int], planner: SavePlanner, name: str
    ) -> Records:
        """Write the part and its replicas, then commit the step in every root (``replicate``)."""
        records: Records = {}
        error: BaseException | None = None
        swap = None
        try:
            part = encode_part(first, self.step, self.rank, items)
            records = part.records
            if self.config.replication_factor > 1:  # the transfer runs while the part is written
                swap = Swap(first, self.step, part, world, name).start()
            write_part(first, self.step, part)
            if swap is not None:
                swap.finish()
            del part
        except Exception as e:  # told to every rank, so that none waits for this one
            error = e
            if swap is not None:
                swap.abort()

        def metadata() -> Metadata:
            md = getattr(planner, "metadata", None)
            if not isinstance(md, Metadata):
                raise TieredCheckpointError(
                    f"TieredWriter needs a SavePlanner that keeps its global Metadata in .metadata "
                    f"(DefaultSavePlanner and its subclasses do); {type(planner).__name__} does not"
                )
            md.storage_meta = self.storage_meta()
            return md

        commit_everywhere(
            first, self.step, self.rank, world, self.is_coordinator, metadata, records, error, name
        )
        return records

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit a shared first tier (node-local ones are committed in ``write_data``)."""
        metadata.storage_meta = self.storage_meta()
        first = self._first()
        if not first.placement.commits_in_finish:
            return
        world = self._world if self._world is not None else [self.node]
        records = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        first.commit(self.step, *build_commit(first, self.step, metadata, world, records))


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_STAGING_THREAD: ThreadPoolExecutor | None = None


def _staging_thread() -> ThreadPoolExecutor:
    global _STAGING_THREAD
    if _STAGING_THREAD is None:
        _STAGING_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-dcp-staging")
    return _STAGING_THREAD
