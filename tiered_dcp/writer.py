"""TieredWriter: the DCP StorageWriter that writes one step to its tiers.

Each rank writes one part file per tier (its items' chunks back to back, each chunk
checksummed); the coordinator then writes the step's metadata and, last, the commit
marker, and applies retention. ``write_step_to_tier`` is the seam the background writer
process uses for the slower tiers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_dcp.storage.codec import Encoder, checksum, make_record, split

from .catalog import MARKER, METADATA, Marker, PartInfo, TierView, step_dir
from .config import TieredConfig, node_of
from .tensors import as_cpu_contiguous, byte_view

log = logging.getLogger("tiered_dcp")
_warned_replication = False


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
            extra = {"kind": "tensor", "dtype": str(t.dtype), "shape": list(t.shape)}
        chunks = split(view)
        items.append(RawItem(item.index, chunks, [checksum(c) for c in chunks], extra, owner))
    return items


def write_part(view: TierView, step: int, rank: int, items: list[RawItem]) -> dict[MetadataIndex, dict]:
    """Write this rank's part of ``step`` to one tier; return each item's record."""
    enc = Encoder(view.tier.compression)
    key = view.part_key(step, rank)
    records: dict[MetadataIndex, dict] = {}

    def chunks():
        offset = 0
        for it in items:
            stored = [enc.encode(c) for c in it.chunks]
            rec = make_record(
                key.rsplit("/", 1)[1], offset, stored, it.chunks, it.hashes, enc.codec, rank=rank, **it.extra
            )
            records[it.index] = rec
            offset += rec["length"]
            yield from stored

    view.own.write(key, chunks())
    return records


def commit_step(
    view: TierView, step: int, metadata: Metadata, world: list[int], records: dict[MetadataIndex, dict]
) -> None:
    """Write the metadata and then the commit marker of ``step`` on one tier.

    ``world[r]`` is the node of rank r. The marker goes to this process's root and to
    every root that holds a part, after the metadata has landed in all of them.
    """
    ns = view.config.namespace
    tier_md = dataclasses.replace(metadata, storage_data=records)
    blob = pickle.dumps(tier_md, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [0] * len(world)
    for rec in records.values():
        sizes[rec["rank"]] += rec["length"]
    marker = Marker(
        step,
        ns,
        len(world),
        [PartInfo(r, n, sizes[r]) for r, n in enumerate(world)],
        len(blob),
        checksum(blob),
    )
    roots = {view.own.url: view.own}
    for r, n in enumerate(world):
        store = view.store_for(n, r)
        if store.exists(view.part_key(step, r)):
            roots[store.url] = store
    for store in roots.values():
        store.write(f"{step_dir(ns, step)}/{METADATA}", [blob])
    for store in roots.values():
        store.write(f"{step_dir(ns, step)}/{MARKER}", [marker.to_bytes()])


class TieredWriter(StorageWriter):
    """Saves ``step`` to every tier of ``config`` that takes it (``step % every == 0``).

    ``dcp.save`` returns once the step is committed on those tiers on every rank.
    Cheap to pickle (config and step only), so DCP's PROCESS async mode can ship it.
    """

    def __init__(self, config: TieredConfig, step: int) -> None:
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredWriter: config must be a TieredConfig, got {type(config).__name__}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"TieredWriter: step must be an integer >= 0, got {step!r}")
        self.config = config
        self.step = step
        self.tier_indexes = config.tiers_for(step)
        if not self.tier_indexes:
            schedule = ", ".join(f"{t.path} every={t.every}" for t in config.tiers)
            raise ValueError(
                f"TieredWriter: no tier takes step {step} ({schedule}); save a step that one "
                "of these divides, or add a tier with every=1"
            )
        global _warned_replication
        if config.replication_factor > 1 and not _warned_replication:
            _warned_replication = True
            log.warning(
                "replication_factor=%d: clique replication is not implemented yet; "
                "node-local tiers hold a single copy",
                config.replication_factor,
            )
        self.rank = 0
        self.node = node_of(0)
        self.is_coordinator = True
        self._world: list[int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_world": None}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._world = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

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
        return dataclasses.replace(plan, storage_data={"rank": self.rank, "node": self.node})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._world = [p.storage_data["node"] for p in plans]
        ranks = [p.storage_data["rank"] for p in plans]
        if ranks != list(range(len(plans))):
            raise ValueError(f"TieredWriter: unexpected rank order {ranks} in the global plan")
        return plans

    def _views(self) -> list[TierView]:
        return [TierView(self.config, i, self.node, self.rank) for i in self.tier_indexes]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = resolve_items(plan, planner)
        per_tier = {v.index: write_part(v, self.step, self.rank, items) for v in self._views()}
        results = [
            WriteResult(
                index=it.index,
                size_in_bytes=sum(len(c) for c in it.chunks),
                storage_data={ti: recs[it.index] for ti, recs in per_tier.items()},
            )
            for it in items
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        world = self._world if self._world is not None else [self.node]
        flat = [wr for rank_results in results for wr in rank_results]
        for view in self._views():
            records = {wr.index: wr.storage_data[view.index] for wr in flat}
            commit_step(view, self.step, metadata, world, records)
            view.apply_retention(self.step)
