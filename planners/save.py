"""The save plan passes: pure functions over DCP's SavePlans, as torch's ``_dedup_save_plans``.

``TieredWriter.prepare_local_plan`` tags each rank's plan with where it runs
(``tag_local_plan``); ``prepare_global_plan`` (coordinator) runs ``plan_global`` over every
rank's plan. Nothing here reads or writes storage: a pass sees plans, returns plans.

Where content-hash dedup plugs in: ``dedup_plans``, today the identity. The dedup issue
fills it: with each write item's content hash in its plan (computed in
``prepare_local_plan`` from the staged bytes and carried in the plan's ``storage_data``),
it drops from every plan the items whose bytes an earlier committed step (or another rank
of this one) already stored, and tells the writing rank the ``Record`` to reuse: a record
names its file (``storage.format.Record.file``), so it may point into that step's part or
a shared block file. The layout of block files belongs to ``storage/format.py``, not here.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.planner import SavePlan


def tag_local_plan(plan: SavePlan, rank: int, node: int) -> SavePlan:
    """This rank's plan, telling the coordinator which rank and node it comes from."""
    return dataclasses.replace(plan, storage_data={"rank": rank, "node": node})


def world_of(plans: list[SavePlan]) -> list[int]:
    """The save's rank -> node layout (index: rank), checked to come in rank order."""
    ranks = [p.storage_data["rank"] for p in plans]
    if ranks != list(range(len(plans))):
        raise ValueError(f"TieredWriter: unexpected rank order {ranks} in the global plan")
    return [p.storage_data["node"] for p in plans]


def dedup_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """The dedup pass (see the module's docstring); the identity until dedup lands."""
    return plans


def plan_global(plans: list[SavePlan]) -> tuple[list[SavePlan], list[int] | None]:
    """Every rank's plan with the save's world in it, after the dedup pass; and that world.

    Plans without ``storage_data`` are DCP's cached plans (unchanged since the last save):
    they are returned as they are, with no world.
    """
    if any(p.storage_data is None for p in plans):
        return plans, None
    world = world_of(plans)
    tagged = [dataclasses.replace(p, storage_data={**p.storage_data, "world": world}) for p in plans]
    return dedup_plans(tagged), world
