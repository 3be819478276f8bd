"""TieredReader: the DCP StorageReader that loads a step from the best tier holding it.

The step is chosen when the reader is constructed (so a missing step raises
NoCheckpointError before ``dcp.load``), agreed by every rank when a process group is up.
Every chunk is verified; an item whose copy is damaged is read from the next tier that
holds the step, with a warning naming the bad file.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_dcp.planners.routing import narrow_to_request, whole_item_request
from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, raw_length, read_item, verify_raw

from .catalog import StepCopy, TierView, complete_steps, describe_search, load_metadata, views
from .config import TieredConfig, node_of
from .errors import CheckpointCorruptError, NoCheckpointError, TieredCheckpointError
from .tensors import byte_view, dtype_from_name

log = logging.getLogger("tiered_dcp")


def _dist_rank() -> tuple[int, bool]:
    up = dist.is_available() and dist.is_initialized()
    return (dist.get_rank() if up else 0), up


def _agree(found: dict[int, list[StepCopy]]) -> set[int]:
    """Steps every rank can load (each from its own best tier)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(found))
    common = set(gathered[0])
    for steps in gathered[1:]:
        common &= set(steps)
    return common


class TieredReader(StorageReader):
    """Loads ``step`` (default: the newest complete step on any tier) of ``config``.

    Construct it on every rank, as ``dcp.load`` is called on every rank: the ranks agree
    on the step here. ``no_dist=True`` skips that agreement (one process reading alone).
    """

    def __init__(self, config: TieredConfig, step: int | None = None, *, no_dist: bool = False) -> None:
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredReader: config must be a TieredConfig, got {type(config).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"TieredReader: step must be None or an integer >= 0, got {step!r}")
        self.config = config
        rank, up = _dist_rank()
        self.rank, self.node = rank, node_of(rank)
        found = complete_steps(config, self.node, rank)
        loadable = _agree(found) if up and not no_dist else set(found)
        if step is None:
            if not loadable:
                raise NoCheckpointError(
                    f"no complete checkpoint of namespace {config.namespace!r} on any tier"
                    f"{' loadable by every rank' if found else ''}; searched:\n"
                    + describe_search(config, self.node, rank)
                )
            step = max(loadable)
        elif step not in loadable:
            raise NoCheckpointError(
                f"step {step} of namespace {config.namespace!r} is not complete on any tier"
                f"{' for every rank' if step in found else ''}; searched:\n"
                + describe_search(config, self.node, rank)
            )
        self.step = step
        self._views = {v.index: v for v in views(config, self.node, rank)}
        self._copies: list[StepCopy] = found[step]
        self._metadata: dict[int, Metadata | None] = {}
        self._bad_metadata: dict[int, str] = {}

    @property
    def tiers(self) -> list[int]:
        """Indexes of the tiers holding the chosen step complete, fastest first."""
        return [c.tier_index for c in self._copies]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def _load_metadata(self, copy: StepCopy) -> Metadata | None:
        if copy.tier_index not in self._metadata:
            md = None
            try:
                md = load_metadata(copy)
            except (OSError, ChecksumMismatch) as e:
                self._bad_metadata[copy.tier_index] = str(e)
                log.warning("step %d: metadata unusable (%s); trying the next tier", self.step, e)
            self._metadata[copy.tier_index] = md
        return self._metadata[copy.tier_index]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        for copy in self._copies:
            md = self._load_metadata(copy)
            if md is not None:
                return md
        raise CheckpointCorruptError(
            f"step {self.step}: metadata damaged on every tier holding it: "
            + "; ".join(self._bad_metadata.values())
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _locate(self, copy: StepCopy, req: ReadItem) -> tuple[dict, Storage, str] | None:
        md = self._load_metadata(copy)
        if md is None or req.storage_index not in md.storage_data:
            return None
        rec = md.storage_data[req.storage_index]
        view: TierView = self._views[copy.tier_index]
        return rec, view.part_store(copy.marker, rec["rank"]), view.part_key(self.step, rec["rank"])

    def _read_one(self, req: ReadItem, planner: LoadPlanner, rec: dict, store: Storage, key: str) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raw = bytearray(raw_length(rec))
            read_item(store, key, rec, memoryview(raw))
            planner.load_bytes(req, io.BytesIO(raw))
            return
        target = planner.resolve_tensor(req).detach()
        dtype, shape = dtype_from_name(rec["dtype"]), rec["shape"]
        if (
            rec["codec"] == "raw"
            and whole_item_request(req, shape)
            and target.dtype == dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
            and list(target.shape) == list(shape)
        ):
            out = byte_view(target)
            if len(out):
                store.read_into(key, rec["offset"], out)
            verify_raw(rec, out)
        else:
            full = torch.empty(shape, dtype=dtype)
            read_item(store, key, rec, byte_view(full))
            piece = narrow_to_request(full, req)
            if piece.size() != target.size():
                raise TieredCheckpointError(
                    f"item {req.storage_index.fqn}: stored piece {tuple(piece.size())} does not "
                    f"fit the target {tuple(target.size())}"
                )
            target.copy_(piece)
        planner.commit_tensor(req, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            failures = []
            for copy in self._copies:
                located = self._locate(copy, req)
                if located is None:
                    continue
                rec, store, key = located
                try:
                    self._read_one(req, planner, rec, store, key)
                    break
                except (ChecksumMismatch, OSError) as e:
                    where = store.describe(key)
                    failures.append((where, e))
                    log.warning(
                        "step %d: item %r in %s is damaged (%s); trying the next tier",
                        self.step,
                        req.storage_index.fqn,
                        where,
                        e,
                    )
            else:
                detail = "; ".join(f"{w}: {e}" for w, e in failures) or "no tier holds it"
                raise CheckpointCorruptError(
                    f"step {self.step}: no good copy of item {req.storage_index.fqn!r} "
                    f"(offset {list(req.storage_index.offset or [])}) left: {detail}"
                )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
