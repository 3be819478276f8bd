"""TieredSavePlanner: DCP's default save planner, plus content hashes for cross-rank dedup.

Each rank names the bytes of every large tensor item it holds (``ContentKey``: the item's
1 MiB blocks, each named by its xxh3-128 as ``storage.blocks`` names them, hashed again
into one digest); the coordinator's pass (``save.dedup_plans``) then keeps one copy of
each distinct content and spreads those writes over the ranks. The hashes are computed
on the state dict the planner is given: with ``dcp.async_save`` that is the staged copy,
in the save's background part, off the training stall. The writer reuses the block ids
(``block_ids``) instead of hashing the bytes again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import xxhash
from tiered_dcp.storage import blocks
from tiered_dcp.storage.codec import split
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from tiered_dcp.tensors import as_cpu_contiguous, byte_view

from .save import ALIASES, CONTENT, ContentKey, dedup_plans


class TieredSavePlanner(DefaultSavePlanner):
    """``dcp.save(state, storage_writer=TieredWriter(cfg, step), planner=TieredSavePlanner())``.

    With a ``TieredWriter`` whose config has ``dedup=True`` (and a first tier storing
    blocks), a tensor item of at least 64 KiB whose bytes another item also holds (any
    rank, any fqn) is written once, by one of the ranks holding it, chosen so that the
    bytes written per rank even out; the other items' records point at the same blocks.
    Otherwise it plans as ``DefaultSavePlanner``. Takes DCP's ``DefaultSavePlanner``
    arguments; with ``enable_plan_caching=True`` a plan whose bytes changed is not reused.
    """

    block_ids: dict[MetadataIndex, list[str]]

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        """DCP's set-up, with no block ids named yet.

        Args:
            state_dict: the state this save plans (the staged copy, with ``async_save``).
            storage_meta: the writer's ``storage_meta()``.
            is_coordinator: whether this rank plans globally.
        """
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.block_ids = {}

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, each large tensor item's content key in its ``storage_data``.

        Returns:
            The plan, or DCP's cached one where neither the items nor their bytes changed.
        """
        plan = super().create_local_plan()  # DCP's, with its plan cache
        full = self.plan
        content = {item.index: key for item in full.items if (key := self._content(item)) is not None}
        full = dataclasses.replace(full, storage_data={**(full.storage_data or {}), CONTENT: content})
        self.plan = full
        if not _caching(self):
            return full
        cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if not plan.usable and cached is not None and (cached.storage_data or {}).get(CONTENT) == content:
            return plan  # the same items and the same bytes: DCP's cached plan holds
        self._pending_local_plan = full  # DCP caches it once the global plan succeeded
        return full

    def _content(self, item: WriteItem) -> ContentKey | None:
        """The item's content key (its block ids kept for the writer); None for small items."""
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            return None
        props = item.tensor_data.properties
        nbytes = math.prod(item.tensor_data.chunk.sizes) * props.dtype.itemsize
        if not blocks.blocked("tensor", nbytes):
            return None
        t = as_cpu_contiguous(self.resolve_data(item))
        view = byte_view(t)
        if len(view) != nbytes:
            return None
        ids = [blocks.block_id(c) for c in split(view, blocks.BLOCK_BYTES)]
        self.block_ids[item.index] = ids
        return ContentKey(xxhash.xxh3_128_hexdigest("".join(ids).encode()), str(t.dtype), nbytes)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan and Metadata (every item), then the content dedup pass."""
        global_plan, metadata = super()._create_global_plan(all_plans)
        return dedup_plans(global_plan), metadata

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan and Metadata, then one writer kept per distinct content.

        Args:
            all_plans: every rank's local plan.

        Returns:
            Each rank's global plan (its aliases named for the writer), and the step's Metadata.
        """
        if not hasattr(DefaultSavePlanner, "_create_global_plan"):  # older torch (untested here)
            plans, metadata = super().create_global_plan(all_plans)
            if not _caching(self):  # its cache would keep the plans before the pass: no dedup then
                self.global_plan = plans = dedup_plans(plans)
            return plans, metadata
        before = SavePlanner._cached_global_plan.get(self._cached_plans_key) if _caching(self) else None
        delta, metadata = super().create_global_plan(all_plans)
        if before is not None:  # DCP compares items only: a plan whose aliases changed is sent again
            delta = [
                new if not d.usable and _aliases(old) != _aliases(new) else d
                for d, old, new in zip(delta, before, self.global_plan, strict=True)
            ]
        return delta, metadata


def _caching(planner: DefaultSavePlanner) -> bool:
    """Whether DCP's plan cache is on (torch versions without one have no such setting)."""
    return bool(getattr(planner, "_enable_plan_caching", False))


def _aliases(plan: SavePlan) -> list:
    return (plan.storage_data or {}).get(ALIASES, []) if isinstance(plan.storage_data, dict) else []
