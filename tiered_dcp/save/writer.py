"""TieredWriter: the DCP StorageWriter (and async stager) that saves one step.

On the save's path each rank writes its part to the fastest tier taking the step (its
items' chunks back to back, each checksummed); the step is then committed there by the
protocol the tier's placement names (``commit.for_save``: the step's metadata and, last,
its marker, then retention): that commit is the step's durability point. Each rank then
hands the step to its writer process (``writer_process.process``), which fills in the slower tiers taking it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_dcp.planners.replicas import KNOWN_KEYS, with_keys
from tiered_dcp.planners.save import ALIASES, KNOWN_WORLDS, Alias, save_rank, tag_local_plan
from tiered_dcp.storage.local import missing_root

from ..config import TieredConfig, node_of
from ..errors import PeerLostError, TieredCheckpointError
from ..metrics import scores
from ..ranks import domains, worlds
from ..ranks.cliques import Layout
from ..steps import commit
from ..steps.catalog import TierView
from ..steps.checkpoint_id import new_id, step_id, step_of
from ..steps.metadata import Records
from ..writer_process.client import MAX_PENDING, writer_handle
from ..writer_process.run_dir import Job
from ..writer_process.timings import record_save
from . import dcp_call, host_memory, replica_check
from .parts import (
    RawItem,
    Resolved,
    abandon,
    fingerprint,
    place_in_file,
    plan_bytes,
    refused_for_nonfinite,
    resolve_items,
    save_layout,
    staged_part,
    write_and_swap,
)
from .replica_check import ReplicaCheck
from .stager import TieredStager
from .staging import POOL

log = logging.getLogger(__name__)


class TieredWriter(StorageWriter, TieredStager):
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
        """Args:
            config: the job's configuration.
            step: the step this save is (its ``every`` decides the tiers that take it).
            background_staging: ``async_save`` returns at once and the copy runs in a
                thread; wait for the response's ``staging_completion`` before changing the
                state.
            handle_sigterm: install the SIGTERM handler (``save.preemption``) at the first
                async save from the main thread.
            staging_slots: staged copies this save lets the process hold; a save beyond
                waits for the oldest upload.
            max_pending: steps a rank's writer may have queued per slower tier before a
                save waits for it.
            emergency: a last save before a preemption: every tier takes it.

        Raises:
            ValueError: a bad argument, or a step no tier takes (said before any byte).
        """
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
        self.layout: Layout | None = domains.layout_unless_gathered(config, worlds.size(), worlds.rank())
        self.background_staging = background_staging
        self.handle_sigterm = handle_sigterm
        self.staging_slots = staging_slots
        self.max_pending = max_pending
        self._init_staging()
        self._write_seconds = 0.0  # this rank's part written to the first tier (``records``)
        # bytes this rank sent its clique's peers for their replicas (also in ``records``; in
        # DCP's PROCESS async mode, set on the copy of the writer that process saves with)
        self.sent_bytes = 0
        self.rank = 0
        self.node = node_of(0)
        self.is_coordinator = True
        self._world: list[int] | None = None
        self._op: worlds.Op | None = None  # this save in the job's store (``set_up_storage_writer``)
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
        """DCP's set-up, on every rank before its first collective of the save: an async
        save's collectives moved off the training's group (``dcp_call``), every rank's
        arrival waited for (``worlds.Op.arrive``), the cliques' layout.

        Raises:
            ValueError: ``use_collectives=False`` (a step commits only once every rank's
                part is in), or failure domains that cannot hold the copies apart.
            PeerLostError: a rank did not arrive within ``peer_timeout``.
            AbortedError: this process left its world meanwhile (``tiered_dcp.abort``).
        """
        if kwargs.get("use_collectives") is False:
            raise ValueError(
                "TieredWriter needs use_collectives=True: a step is committed "
                "only when every rank's part is written"
            )
        rank = kwargs.get("rank")
        if rank is None:
            rank = worlds.rank()
        self.rank = int(rank)
        self.node = node_of(self.rank)
        self.is_coordinator = is_coordinator
        if self.owner_pid == os.getpid() and threading.get_ident() != self._stager:
            dcp_call.move()  # an async save's own thread: its collectives off the training's group
        self._op = None
        if worlds.dist_up():
            self._op = worlds.Op(self.config.namespace, "save", self.step, self.config.peer_timeout)
            if worlds.size() > 1:  # every rank here before DCP's first collective of the save
                self._op.arrive("the save's start")
        _say_missing_roots(self.config, self.node, self.rank)
        if self.layout is None:  # failure domains: every rank is here, in DCP's set-up
            self.layout = domains.LAYOUTS.get(self.config, worlds.size(), self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """This rank's plan tagged with where it runs (and, for the replica check, its items'
        keys): what the coordinator needs to place parts and find replica groups."""
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

    @worlds.working()  # ``tiered_dcp.abort`` waits for it
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's part to the fastest tier taking the step and commit it there
        (a node-local tier: every root, once every rank agreed; a shared one: in ``finish``),
        then hand the slower tiers to this rank's writer process.

        Returns:
            A done future of the plan's ``WriteResult`` (each item's record).

        Raises:
            PeerLostError: a peer stopped answering (the exchange, the agreement).
            AbortedError: this process left its world (``tiered_dcp.abort``).
            NonFiniteStateError: NaN/Inf with ``on_nonfinite="raise"``.
            TieredCheckpointError: anything else that keeps the step from committing; this
                rank's part is removed and a note says why (``status`` shows it).
        """
        self._ready_to_write(plan)
        started = time.perf_counter()
        self.sent_bytes = 0
        first = self._first()
        staged = staged_part(first, self.step, self.rank, self.staged_file)
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
            refused = refused_for_nonfinite(self.step, self.rank, items)
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
            abandon(first, self.step, self.rank, slower, e, self.staged_file)
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

    def _ready_to_write(self, plan: SavePlan) -> None:
        """Refuse a save staged in a world that is gone; wait for this rank's writer process
        where the staging did not (a sync save, an async one whose stager waited for none)."""
        if self.owner_pid == os.getpid() and self.generation != worlds.generation():
            raise TieredCheckpointError(
                f"step {self.step}: this save was staged in a world that is gone (its process "
                "group was torn down, tiered_dcp.abort); it is abandoned, never committed: save "
                "again in the new world (load_latest first, on every rank)"
            )
        if self._handoff_later:  # an async save that waits for no writer (``stage``)
            self._handoff_later = False
            self.wait_for_writer(self.rank)
        elif not self._waited:  # a sync save: nothing was staged
            self.handoff_wait = 0.0
            self.call = None
            host_memory.guard(self.config, plan_bytes(plan), 0, self.tier_indexes[0])
            self.wait_for_writer(self.rank)
        self._waited = False  # the hand-off is this save's: the next one waits afresh

    def _write_part(
        self,
        first: TierView,
        resolved: Resolved,
        aliases: list[Alias],
        world: list[int],
        op: worlds.Op | None,
        slower: list[int],
    ) -> Records:
        """``parts.write_and_swap``, its write time and the bytes it sent kept for the record."""
        records, self._write_seconds, self.sent_bytes = write_and_swap(
            first, self.step, self.rank, resolved, aliases, world, op, slower, self._layout
        )
        return records

    def _layout(self, world: list[int]) -> Layout:
        return save_layout(self.layout, world, self.step, self.rank)

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
            abandon(first, self.step, self.rank, [], e)
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


_ROOTS_SEEN: set[str] = set()  # node-local tier roots this process looked for (``_say_missing_roots``)


def _say_missing_roots(config: TieredConfig, node: int, rank: int) -> None:
    """Warn, once per root, that a node-local tier's directory is made by this save, naming
    the file system it lands on: a mount missing on this host must not pass silently. A
    node's root is said by its first local rank only (``LOCAL_RANK``): its ranks share it; a
    root per rank (``{rank}`` in the path) by its own rank."""
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    for tier in config.tiers:
        if tier.is_shared or not tier.is_local_fs or not (first or "{rank}" in tier.path):
            continue
        root = os.path.abspath(tier.root(node, rank).removeprefix("file://"))
        if root not in _ROOTS_SEEN:
            _ROOTS_SEEN.add(root)
            where = missing_root(root)
            if where is not None:
                log.warning("tier %s: %s; if that is not the disk you meant, fix the path", tier.path, where)
