"""The async stager half of ``TieredWriter``: the copy the training loop waits for.

DCP splits a writer in two (``StorageWriter`` for the save, ``AsyncStager`` for the copy
``async_save`` makes first): ``TieredStager`` is the second. It copies the state into the
staging pool's reusable buffers (``staging``: the RAM tier's very part file where it can),
with this rank's writer process paused during the copy alone, waits first when that writer
fell too far behind (``Handoff``), times what the loop saw (``SaveCall``), and makes the
next saves' files ready in the background. ``TieredWriter`` holds the settings it reads
(``config``, ``step``, ``tier_indexes``, ``staging_slots``, ``background_staging``,
``handle_sigterm``, ``max_pending``) and the facts it leaves for the save (``staged_file``,
``stage_seconds``, ``slot_wait``, ``handoff_wait``...).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future as ConcurrentFuture

from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager

from tiered_dcp.storage.forks import ThreadPool

from ..config import TieredConfig, node_of
from ..ranks import worlds
from ..steps import part_file
from ..steps.catalog import TierView
from ..steps.part_file import TierFile
from ..writer_process.client import writer_handle
from ..writer_process.timings import SaveCall
from . import dcp_call, host_memory, preemption
from .handoff import Handoff
from .staging import POOL, Examined, InFlight, examine


class TieredStager(AsyncStager):
    """``async_save``'s copy of the state (see the module docstring); ``TieredWriter``'s base."""

    config: TieredConfig
    step: int
    tier_indexes: list[int]
    staging_slots: int
    background_staging: bool
    handle_sigterm: bool
    max_pending: int

    def _init_staging(self) -> None:
        """The facts a stage leaves for its save, none yet."""
        self.owner_pid: int | None = None  # the trainer's pid, set when it stages
        self.generation = 0  # the trainer's world when it staged (``worlds.generation``)
        self.handoff_wait = 0.0  # seconds this save waited for a writer that fell behind
        self.stage_seconds: float | None = None  # the copy async_save waited for (None: a sync save)
        self.call: SaveCall | None = None  # the async_save call as the loop sees it (None: a sync save)
        self.slot_wait: float | None = None  # of the staging, the wait for a slot earlier saves held
        self.staging_bytes: int | None = None  # the trainer's staging buffers once it staged
        self._waited = False  # the hand-off's wait ran for this save (``wait_for_writer``)
        self._handoff_later = False  # ``stage`` left the writer's start and checks to write_data
        self.shipped = False  # ``stage``: DCP's PROCESS mode sends the staged copy to its process
        self.staged_file: TierFile | None = None  # the RAM tier's part file ``stage`` filled
        self._next_files: ConcurrentFuture[int] | None = None  # the next saves' files (``_prepare_next``)
        self._stager: int | None = None  # the thread that staged this save (``stage``)

    # -- AsyncStager: the copy the training loop waits for --------------------------------

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | ConcurrentFuture[STATE_DICT_TYPE]:
        """DCP's stager: a copy of ``state_dict`` in the staging pool's buffers (the RAM
        tier's part file where it can), the only part of an async save the loop waits for.

        Returns:
            The staged copy, or (``background_staging``) a future of it.

        Raises:
            SnapshotError: a value of a kind that cannot be copied (its key and type named).
            ValueError: the configuration would not fit in the host's memory (both figures named).
        """
        self.call = SaveCall()
        self.owner_pid = os.getpid()
        self.generation = worlds.generation()
        self.handoff_wait = 0.0  # this save's: DCP's reset(checkpoint_id) comes after stage
        self._stager = threading.get_ident()
        dcp_call.prepare()
        if self.handle_sigterm:
            preemption.install()
        rank = worlds.rank()
        first = TierView(self.config, self.tier_indexes[0], node_of(rank), rank)
        if part_file.drops_pinned(self.config, first.own):  # no wait: the hand-off's checks
            self._handoff_later = True  # run in write_data, off the training thread
        else:
            self.wait_for_writer(rank)
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
                writer_handle(self.config, worlds.rank()).rd.writer.staging.hold
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
        rank = worlds.rank()
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

    def wait_for_writer(self, rank: int) -> None:
        """Before this step is staged or written: wait if the writer fell too far behind."""
        handoff = Handoff(self.config, self.step, self.tier_indexes, rank, self.owner_pid, self.max_pending)
        self.handoff_wait += handoff.wait_for_room()
        self._waited = True


_staging_thread = ThreadPool("tiered-dcp-staging", 1)  # background staging's copies
