"""TieredReader: the DCP StorageReader that loads a step from the best tier holding it.

This module is the DCP glue only. ``open`` opens the step (``open_step.OpenStep``: chosen,
leased, its metadata shared). With a process group up (and not ``no_dist``) that is a
collective over the default group: rank 0 broadcasts what the shared tiers hold, the ranks
all-gather what their node-local roots hold and all-reduce whether each leased the step
and read its metadata (broadcast from a holder to a rank that could not). It runs where
every rank is anyway: ``open()`` (``load_latest`` calls it on every rank) or DCP's
``read_metadata`` inside ``dcp.load``; the constructor runs no collective, so one rank may
construct a reader alone. Without a process group, or with ``no_dist=True``, the
constructor opens the step itself (local), so a missing step raises NoCheckpointError
before ``dcp.load``.
``read_data`` executes DCP's load plan (``step_reads.StepReads``): each item from its sources
in fallback order (``planners.load``), every chunk verified, an item whose copy is damaged
read from its next source with a warning naming the bad file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_dcp.storage import direct_io
from tiered_dcp.storage.format import ItemKey

from ..config import TieredConfig, node_of
from ..errors import PeerLostError
from ..ranks import transport, worlds
from ..steps import metadata as md_blob
from ..steps.checkpoint_id import new_id, step_id, step_of
from ..writer_process.timings import Kind, record
from .open_step import OpenStep
from .spread import RankFacts, SpreadPlan, plan_spread
from .step_reads import StepReads

log = logging.getLogger(__name__)


class TieredReader(StorageReader):
    """Loads ``step`` (default: the newest complete step anywhere) of ``config``.

    Use it on every rank, as ``dcp.load`` is called on every rank. With a process group the
    step is opened by ``open()`` or by ``dcp.load`` (its ``read_metadata``), a collective
    over the default group in which the ranks agree on the step; the constructor runs none
    (one rank may construct a reader alone; ``step`` and ``skipped`` open it, so ask them on
    every rank). Without one the constructor opens it. With a process
    group, each rank reads only its own root of each node-local tier and the ranks pool what
    they hold (``cluster``): a step counts when every part survives on some node, and items
    this rank's root lacks come from a peer holding them, else from a shared tier. The
    newest step complete in the cluster is compared with the newest on a shared tier and the
    newer is loaded (the cluster's on a tie). ``no_dist=True`` skips the agreement (one
    process reading alone, seeing every path it can reach): constructing it is then local,
    as it is without a process group.

    Without ``step``, steps that are quarantined (an earlier load found an item with no good
    copy left) or non-finite (saved holding NaN/Inf) are passed over (``steps.choice``),
    and so are ``exclude`` (``load_latest``'s steps that just failed; a mapping gives each
    one's reason); ``skipped`` says which
    newer steps were, and why. A load that finds an item with no good copy left quarantines
    the step where this rank reaches it, and its error names the step the next reader
    will choose.

    ``spread`` (default True): a step read from a shared tier alone by several ranks is read
    once and spread over the job (``spread.py``): each stored item two or more ranks ask for
    is read by one of them and sent to the others. False: every rank reads all it needs.
    """

    def __init__(
        self,
        config: TieredConfig,
        step: int | None = None,
        *,
        no_dist: bool = False,
        exclude: Iterable[int] | Mapping[int, str] = (),
        spread: bool = True,
    ) -> None:
        """Args:
            config: the job's configuration.
            step: the step to load; None: the newest good step complete anywhere.
            no_dist: read alone, without the ranks' agreement (one process, every path it
                can reach), as ``dcp.load(no_dist=True)``.
            exclude: steps not to choose (a mapping gives each one's reason, for ``skipped``).
            spread: read a step held on a shared tier alone once for the whole job.

        Raises:
            ValueError: bad arguments (a config that is not a ``TieredConfig``, a negative step).
            NoCheckpointError: without a process group (or with ``no_dist``), no such step
                complete on any tier (with one, ``open`` raises it).
        """
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredReader: config must be a TieredConfig, got {type(config).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"TieredReader: step must be None or an integer >= 0, got {step!r}")
        if not isinstance(spread, bool):
            raise ValueError(f"TieredReader: spread must be True or False, got {spread!r}")
        self.config = config
        self.spread = spread
        self._asked = step  # the step asked for (None: the newest good one)
        self._exclude = exclude
        self._started = time.perf_counter()  # a load's duration is recorded (``records``)
        self.load_id = new_id()  # DCP's StorageMeta.load_id of the metadata it reads
        self.rank = worlds.rank()
        self.node = node_of(self.rank)
        self._dist = worlds.dist_up() and not no_dist
        self._opened: OpenStep | None = None  # ``open``'s
        self._step_reads: StepReads | None = None
        self._open_failed: BaseException | None = None  # ``read_metadata``'s, raised in set-up
        self._open_s = 0.0  # seconds from construction (or ``reset``) to the step opened
        if not self._dist:  # one process: a missing step fails here, not in dcp.load
            self.open()  # (with a group it is a collective: at ``open`` or DCP's read_metadata)

    def open(self) -> TieredReader:
        """Choose the step, agreed by every rank with a process group (a collective over the
        default group: ``dcp.load`` (``reset``, ``read_metadata``) and ``load_latest`` call it
        on every rank; without one the constructor calls it; once a step is
        open, later calls return at once).

        Returns:
            self.

        Raises:
            NoCheckpointError: no such step complete anywhere (naming every tier searched).
            CheckpointCorruptError: without a process group, the step's metadata is refused
                on every tier holding it.
            PeerLostError: a rank stopped answering while the ranks agreed.
        """
        if self._opened is None:
            # a lost rank: PeerLostError
            with transport.watching_peers(self._asked, "opening a step to load"):
                opened = OpenStep.open(
                    self.config, self._asked, rank=self.rank, with_group=self._dist, exclude=self._exclude
                )
            self._opened, self._step_reads = opened, self._new_reads(opened)
            self._open_s = round(time.perf_counter() - self._started, 6)  # the agreement's share
            if not self._dist:  # metadata refused on every tier: say so here, not as DCP's AssertionError
                opened.metadata.first(opened.copies, opened.quarantine)
        return self

    def _new_reads(self, opened: OpenStep) -> StepReads:
        """What executes this reader's load plans (a subclass may time or stall it)."""
        return StepReads(opened)

    def _open_step(self) -> OpenStep:
        opened = self.open()._opened
        assert opened is not None
        return opened

    @property
    def step(self) -> int:
        """The chosen step (``open``: with a process group a collective, on first use)."""
        return self._open_step().step

    @property
    def skipped(self) -> dict[int, str]:
        """The newer steps passed over, and why (``steps.choice``)."""
        return self._open_step().skipped

    @property
    def tiers(self) -> list[int]:
        """Indexes of the tiers holding the chosen step complete, fastest first."""
        return self._open_step().tiers

    @property
    def _reads(self) -> StepReads:
        self.open()
        assert self._step_reads is not None
        return self._step_reads

    @property
    def checkpoint_id(self) -> str:
        """The chosen step's id (``<namespace>/step_<12 digits>``)."""
        return step_id(self.config.namespace, self.step)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load; ``checkpoint_id`` (from ``dcp.load``), if given, names the step to load.

        Another step than the one chosen is chosen again as ``open`` does (agreed by every
        rank: with a process group a collective, as ``dcp.load`` calls it on every rank;
        ``NoCheckpointError`` if it is not complete anywhere). Anything but a step
        (``checkpoint_id.step_of``) raises ValueError.

        Args:
            checkpoint_id: a step (an int, its digits, or ``checkpoint_id``'s form), or None.

        Raises:
            ValueError: ``checkpoint_id`` names no step.
            NoCheckpointError: the step named is not complete anywhere.
        """
        self.load_id = new_id()
        if checkpoint_id is None:
            return
        step = step_of(self.config.namespace, checkpoint_id, "TieredReader")
        opened = self._opened
        if opened is not None and step == opened.step:
            return
        if opened is not None:
            opened.release()  # the step chosen before is not read after all
            self._exclude = opened.exclude  # error messages' next choice passes them over still
        self._asked, self._opened, self._step_reads, self._open_failed = step, None, None, None
        self._started = time.perf_counter()
        self.open()

    @contextlib.contextmanager
    def held(self) -> Iterator[TieredReader]:
        """Keep the step leased over several ``dcp.load`` calls of this reader (an export
        reading it file by file, one process): otherwise each load's end gives the leases
        back, and retention beside may remove the step before the next. They go when the
        block ends."""
        opened = self._open_step()
        opened.held = True
        try:
            yield self
        finally:
            opened.held = False
            opened.release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: a step is found through a TieredConfig, which no checkpoint_id alone carries."""
        return False

    def _with_load_id(self, md: Metadata) -> Metadata:
        """DCP's convention (FileSystemReader): the metadata read carries this load's id."""
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's metadata, opening the step first if no use opened it yet. An error
        opening it is raised by ``set_up_storage_reader`` (DCP would turn it into a bare
        AssertionError here, losing its class, and ask again: a second collective)."""
        if self._open_failed is not None:
            return Metadata(state_dict_metadata={})
        try:
            opened = self._open_step()
            md = opened.metadata.first(opened.copies, opened.quarantine)
        except Exception as e:  # noqa: BLE001 - raised, with its class, by set_up_storage_reader
            self._open_failed = e
            return Metadata(state_dict_metadata={})
        return self._with_load_id(md)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """DCP's set-up: raises the error ``read_metadata`` met opening the step, with its class.

        Raises:
            NoCheckpointError, CheckpointCorruptError, PeerLostError: as ``open``.
        """
        failed, self._open_failed = self._open_failed, None
        if failed is not None:  # DCP wraps it in its CheckpointException, keeping it whole
            raise failed
        self.is_coordinator = is_coordinator
        self._metadata = metadata

    def needs_global_plan(self) -> bool:
        """Whether a load of the chosen step needs DCP's global plan: only a spread one
        (``spread.py``: the coordinator gives each shared item one reader); otherwise each
        rank's plan is its own, and ``load_latest`` plans alone (``resume.load_planned_alone``)."""
        return self._spreads()

    def _spreads(self) -> bool:
        """Whether this load is spread over the job (``spread.py``): a step read from a
        shared tier alone (no node-local copy pooled), by more than one rank."""
        opened = self._open_step()
        return (
            self.spread
            and self._dist
            and dist.get_world_size() > 1
            and not opened.cluster
            and bool(opened.copies)
        )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tell the coordinator this rank's node, where the load is spread."""
        return (
            dataclasses.replace(plan, storage_data=RankFacts(self.node, self.rank))
            if self._spreads()
            else plan
        )

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Give each stored item that several ranks ask for one reader (``spread.plan_spread``),
        each rank its part in its plan; unchanged unless every rank spreads."""
        facts = [p.storage_data for p in plans]
        if len(plans) < 2 or not all(isinstance(f, RankFacts) for f in facts):
            return plans

        def nbytes(key: ItemKey) -> int | None:
            info = md_blob.item_info(self._metadata, md_blob.index_of(key))
            return None if info is None else info.raw_length

        spreads = plan_spread(plans, nbytes, facts)  # type: ignore[arg-type]
        return [dataclasses.replace(p, storage_data=s) for p, s in zip(plans, spreads, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Execute the load plan (``step_reads.StepReads.read_all``: each item from its route's
        sources, in order; collective with a process group) and record the load; the
        step's leases go whatever happened (a shared tier's once every rank has read, or at
        once when a rank was lost: it will not read).

        Returns:
            A done future (the reads are over when it returns).

        Raises:
            CheckpointCorruptError: an item has no good copy on any tier or peer (the step is
                quarantined where this rank reaches it).
            PeerLostError: a peer stopped answering.
        """
        everyone = True
        try:
            with transport.watching_peers(self.step, "the load's reads"):
                spread = plan.storage_data if isinstance(plan.storage_data, SpreadPlan) else None
                self._reads.read_all(plan, planner, spread)
            seconds = round(time.perf_counter() - self._started, 6)
            read = {f"read_{k}": self._reads.read_from.get(k, 0) for k in ("own", "peer", "shared")}
            opened = self._open_s
            record(
                self.config,
                Kind.LOAD,
                self.rank,
                self.step,
                tiers=self.tiers,
                seconds=seconds,
                open_s=opened,
                **read,
            )
            log.info(
                "rank %d loaded step %d in %.2f s (%.2f s choosing it): %.1f MiB from its own tiers, "
                "%.1f MiB from peers, %.1f MiB from shared tiers",
                self.rank,
                self.step,
                seconds,
                opened,
                *(n / 2**20 for n in read.values()),
            )
        except PeerLostError as e:  # DCP's next collective fails on the same rank with torch's error
            log.error("%s", e)
            everyone = False
            raise
        finally:
            self._open_step().read_done(wait_for_all=everyone)
            direct_io.release_idle()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
