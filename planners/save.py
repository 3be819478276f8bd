"""The save plan passes: pure functions over DCP's SavePlans, as torch's ``_dedup_save_plans``.

``TieredWriter.prepare_local_plan`` tags each rank's plan with where it runs
(``tag_local_plan``: a ``SaveRank`` under ``storage_data[WHERE]``); ``prepare_global_plan``
(coordinator) runs ``plan_global`` over every rank's plan, which puts the save's world in
each ``SaveRank``. Nothing here reads or writes storage: a pass sees plans, returns plans.

Content-hash dedup across ranks (``dedup_plans``) runs in ``TieredSavePlanner``'s global
plan, after DCP built the step's Metadata from every item: each local plan carries, in
``storage_data[CONTENT]``, a content key of each large tensor item its rank holds
(``ContentKey``: xxh3-128 over its blocks, dtype, byte length); the writer says in
``storage_data[DEDUP]`` that it stores such items as blocks and can write aliases. The
pass keeps one item per distinct content, on the holder with the fewest bytes planned so
far (largest first: the writes are spread), removes the others from every plan, and tells
the writing rank their ``ALIASES``: each becomes a record of its own pointing at the same
blocks (``TieredWriter.write_data``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

CONTENT = "content"  # local plans: {MetadataIndex: ContentKey} of every large tensor item the rank holds
DEDUP = "dedup"  # the writer stores large tensor items as blocks and writes ``ALIASES``
ALIASES = "aliases"  # global plans: [Alias] whose bytes this rank writes under another item
WHERE = "where"  # every plan: the rank's ``SaveRank``


@dataclasses.dataclass(frozen=True)
class EvenNodes:
    """A save's world as torchrun and SLURM lay it out: ``per_node`` ranks to a node in rank
    order (node = rank // per_node; the last node may have fewer). Every rank's global plan
    carries the world, and the coordinator pickles each plan on its own: in this form that
    is a few bytes a plan at any scale, where the whole tuple is one int per rank in each
    of N plans (10,000 ranks: 280 MB pickled by the coordinator for one save)."""

    ranks: int
    per_node: int

    def nodes(self) -> list[int]:
        return [r // self.per_node for r in range(self.ranks)]


def compact(world: list[int]) -> EvenNodes | tuple[int, ...]:
    """``world`` (rank -> node) as ``EvenNodes`` when it is laid out so, else as it is."""
    per = next((i for i, node in enumerate(world) if node != 0), len(world))
    if per and world == [r // per for r in range(len(world))]:
        return EvenNodes(len(world), per)
    return tuple(world)


@dataclasses.dataclass(frozen=True)
class SaveRank:
    """Where a rank's plan comes from, as the writer tells the coordinator (local plans), and
    the save's rank -> node layout the coordinator hands back (global plans: ``world``)."""

    rank: int
    node: int
    world: EvenNodes | tuple[int, ...] | None = None  # set by ``plan_global`` (``compact``)

    def nodes(self) -> list[int] | None:
        """The save's rank -> node layout (index: rank); None in a local plan."""
        if self.world is None:
            return None
        return self.world.nodes() if isinstance(self.world, EvenNodes) else list(self.world)


def save_rank(plan: SavePlan) -> SaveRank | None:
    """The plan's ``SaveRank`` (None: a plan ``tag_local_plan`` did not tag, e.g. DCP's cached one)."""
    where = (plan.storage_data or {}).get(WHERE) if isinstance(plan.storage_data, dict) else None
    return where if isinstance(where, SaveRank) else None


class ContentKey(NamedTuple):
    """An item's bytes: equal keys, equal bytes (128-bit hashes), equal dtype and length."""

    digest: str  # xxh3-128 of the item's block ids (``storage.blocks``), 32 hex digits
    dtype: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Alias:
    """An item whose bytes this rank writes under ``source``: its record points at them."""

    index: MetadataIndex
    shape: tuple[int, ...]
    source: MetadataIndex


def tag_local_plan(plan: SavePlan, rank: int, node: int, dedup: bool = False) -> SavePlan:
    """This rank's plan, telling the coordinator which rank and node it comes from, and
    whether its writer can write aliases (``dedup``); the planner's content keys stay."""
    data = {k: v for k, v in (plan.storage_data or {}).items() if k == CONTENT}  # the planner's
    return dataclasses.replace(
        plan, storage_data={**data, WHERE: SaveRank(rank, node), **({DEDUP: True} if dedup else {})}
    )


def world_of(plans: list[SavePlan]) -> list[int]:
    """The save's rank -> node layout (index: rank), checked to come in rank order."""
    where = [save_rank(p) for p in plans]
    ranks = [w.rank if w is not None else None for w in where]
    if ranks != list(range(len(plans))):
        raise ValueError(f"TieredWriter: unexpected rank order {ranks} in the global plan")
    return [w.node for w in where]  # type: ignore[union-attr] - every one is there: checked above


def dedup_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """The content dedup pass (see the module's docstring): the identity unless every plan
    has content keys and a writer that writes aliases.

    ``plans`` are DCP's global plans (replicated items of one fqn already kept on one rank
    by DCP); their ``CONTENT`` still names every large item each rank holds, so an item
    may move to any rank holding its bytes. The result has no ``CONTENT`` (the ranks do
    not need it back) and, on each rank writing some, its ``ALIASES``.
    """
    if not plans or not all(
        p.storage_data and p.storage_data.get(DEDUP) and CONTENT in p.storage_data for p in plans
    ):
        return plans
    contents: list[dict[MetadataIndex, ContentKey]] = [p.storage_data[CONTENT] for p in plans]
    items: dict[MetadataIndex, WriteItem] = {}  # every planned item, as DCP's global plan has it
    for p in plans:
        for item in p.items:
            items.setdefault(item.index, item)
    # the bytes of each content, and who holds which item of it
    groups: dict[ContentKey, dict[MetadataIndex, list[int]]] = {}
    for rank, content in enumerate(contents):
        for index, key in content.items():
            if index in items:
                groups.setdefault(key, {}).setdefault(index, []).append(rank)
    grouped = {index for members in groups.values() for index in members}
    load = [0] * len(plans)
    kept: list[list[WriteItem]] = []
    for rank, p in enumerate(plans):
        kept.append([item for item in p.items if item.index not in grouped])
        load[rank] += sum(item.tensor_storage_size() or 1 for item in kept[rank])
    aliases: list[list[Alias]] = [[] for _ in plans]
    holders_of = {
        key: sorted({r for ranks in members.values() for r in ranks}) for key, members in groups.items()
    }
    # content one rank alone holds first (it has no choice), then the largest first: the spread evens out
    order = sorted(groups.items(), key=lambda kv: (len(holders_of[kv[0]]) > 1, -kv[0].nbytes))
    for key, members in order:
        holders = holders_of[key]
        writer = min(holders, key=lambda r: (load[r], r))
        source = next(index for index, ranks in members.items() if writer in ranks)
        load[writer] += key.nbytes
        kept[writer].append(items[source])
        aliases[writer] += [
            Alias(index, tuple(items[index].tensor_data.chunk.sizes), source)
            for index in members
            if index != source
        ]
    out = []
    for p, mine, alias in zip(plans, kept, aliases, strict=True):
        data = {k: v for k, v in p.storage_data.items() if k != CONTENT}
        out.append(dataclasses.replace(p, items=mine, storage_data={**data, ALIASES: alias}))
    return out


def plan_global(
    plans: list[SavePlan], known_world: list[int] | None = None
) -> tuple[list[SavePlan], list[int] | None]:
    """Every rank's plan with the save's world in it; and that world.

    Plans without ``storage_data`` are DCP's cached plans (unchanged since the last save):
    they are returned as they are; the others get ``known_world`` (the world of the last
    full plan), if given, which is then the world returned.
    """
    if any(p.storage_data is None for p in plans):
        if known_world is None:
            return plans, None
        return [_with_world(p, known_world) if p.storage_data is not None else p for p in plans], known_world
    world = world_of(plans)
    return [_with_world(p, world) for p in plans], world


def _with_world(plan: SavePlan, world: list[int]) -> SavePlan:
    where = save_rank(plan)
    if where is None:
        raise ValueError("TieredWriter: a plan in the global plan lacks its SaveRank (prepare_local_plan)")
    tagged = dataclasses.replace(where, world=compact(world))
    return dataclasses.replace(plan, storage_data={**plan.storage_data, WHERE: tagged})


class KnownWorlds:
    """The world (rank -> node) of the last full global plan, per world size.

    A process-wide cache on purpose, as DCP's own plan cache is (``SavePlanner._cached_*``,
    class attributes): a save whose plans DCP took from its cache brings no ``SaveRank``,
    and each save has a writer of its own, so its world is the one remembered here. Only
    for the process group it was planned in (``generation``, ``worlds.generation``): a
    job restarted in its processes may place its ranks on other nodes.
    """

    def __init__(self) -> None:
        self._worlds: dict[int, list[int]] = {}
        self._generation = 0

    def plan_global(
        self, plans: list[SavePlan], generation: int = 0
    ) -> tuple[list[SavePlan], list[int] | None]:
        """``plan_global`` with the world of this process's last full plan of this size."""
        if generation != self._generation:
            self._worlds.clear()
            self._generation = generation
        plans, world = plan_global(plans, self._worlds.get(len(plans)))
        if world is not None:
            self._worlds[len(plans)] = world
        return plans, world


KNOWN_WORLDS = KnownWorlds()
