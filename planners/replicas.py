"""Replica groups: which ranks hold copies of which items, found while a save is planned.

DCP's planning keeps one copy of an item several ranks hold (one ``MetadataIndex``: a DDP
parameter, an HSDP shard along a ``Replicate()`` mesh dimension, a plain tensor every rank
holds) and drops the others unread: a copy that diverged is never looked at. To compare
them, each rank's local plan names its tensor items by 64-bit keys (``with_keys``: 8
bytes an item, in plan order, under ``storage_data[KEYS]``). The coordinator's pass
(``assign_groups``) finds the items more than one rank holds and groups them by the set of
ranks holding them: a *replica group* (DDP: one group of every rank; HSDP: one group per
shard, of the ranks along its ``Replicate()`` dimension). Each rank's global plan gets its
own items' groups back (``ReplicaGroups``, under ``storage_data[GROUPS]``): O(its items),
never the other ranks'.

Ranks with the same items send the same bytes, and the pass works on the distinct ones
(DDP at any scale: one), so what it costs beyond DCP's own pass over every item is small.
Pure functions over plans, as ``save``'s passes; DCP's plan cache is met with the keys of
each rank's last full plan (``KnownKeys``).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable

import numpy as np
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

KEYS = "replica_keys"  # local plans: the keys of the rank's tensor items (``local_keys``)
GROUPS = "replica_groups"  # global plans: the rank's ``ReplicaGroups``


def item_key(index: MetadataIndex) -> int:
    """An item's 64-bit key: equal for the copies DCP takes for one (same fqn and offset)."""
    offset = tuple(index.offset) if index.offset is not None else ()
    return xxhash.xxh3_64_intdigest(f"{index.fqn}\0{offset}".encode())


def tensor_items(plan: SavePlan) -> list[WriteItem]:
    """The plan's tensor items, in plan order: what the comparison covers (a byte item is
    a pickle, whose bytes may differ for equal values)."""
    return [it for it in plan.items if it.type != WriteItemType.BYTE_IO]


def with_keys(plan: SavePlan) -> SavePlan:
    """``plan`` with its tensor items' keys for the coordinator's pass. DCP's cached plan
    (unusable, empty: unchanged since the last save) gets none: its last keys stand."""
    if not getattr(plan, "usable", True):
        return plan
    keys = array("Q", (item_key(it.index) for it in tensor_items(plan))).tobytes()
    return dataclasses.replace(plan, storage_data={**(plan.storage_data or {}), KEYS: keys})


@dataclasses.dataclass(frozen=True)
class ReplicaGroups:
    """A rank's replica groups, in its global plan.

    ``ids``: the id of each group the rank is in (a hash of the group's item keys, so that
    the same group has the same id on every rank, and in every save planned alike);
    ``of_item``: one entry per tensor item of the rank's local plan, in plan order, the
    position of its group in ``ids``, or -1 where no other rank holds the item. ``world``:
    whether any rank of the save is in a group (every rank then takes part in the
    comparison's round on a shared first tier, ``steps.replicas``)."""

    ids: tuple[int, ...]
    of_item: bytes  # array("i")
    world: bool = True

    def members(self, items: list[WriteItem]) -> dict[int, list[WriteItem]]:
        """Group id -> the items of ``items`` (the local plan's tensor items) in it, in the
        order every rank hashes them (by fqn, then offset)."""
        where = array("i")
        where.frombytes(self.of_item)
        if len(where) != len(items):
            return {}  # another plan than the one grouped (a custom planner's): nothing to compare
        out: dict[int, list[WriteItem]] = {}
        for it, g in zip(items, where, strict=True):
            if g >= 0:
                out.setdefault(self.ids[g], []).append(it)
        for members in out.values():
            members.sort(key=lambda it: (it.index.fqn, tuple(it.index.offset or ())))
        return out


NO_GROUPS = ReplicaGroups((), b"", world=False)


def _keys_of(plan: SavePlan) -> bytes | None:
    data = plan.storage_data
    return data.get(KEYS) if isinstance(data, dict) else None


def _group_id(keys: Iterable[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("Q", sorted(keys)).tobytes())


def find_groups(keys: list[bytes]) -> list[ReplicaGroups]:
    """Each rank's ``ReplicaGroups`` from every rank's keys (index: rank).

    Ranks that sent the same bytes hold the same items: they are one *kind* here, and the
    work is over the kinds' keys (numpy over all of them, Python over the replicated ones)."""
    kinds: dict[bytes, list[int]] = {}
    for rank, blob in enumerate(keys):
        kinds.setdefault(blob, []).append(rank)
    blobs = list(kinds)
    arrays = [np.frombuffer(b, dtype=np.uint64) for b in blobs]
    if not any(len(a) for a in arrays):
        return [NO_GROUPS] * len(keys)
    flat = np.concatenate(arrays)
    kind_of = np.repeat(np.arange(len(blobs)), [len(a) for a in arrays])
    weight = np.array([len(kinds[b]) for b in blobs])[kind_of]
    unique, inverse = np.unique(flat, return_inverse=True)
    holders = np.bincount(inverse, weights=weight, minlength=len(unique))
    shared = holders[inverse] > 1
    if not shared.any():  # a sharded state: no plan carries anything back
        return [NO_GROUPS] * len(keys)
    kinds_of_key: dict[int, set[int]] = {}
    for key, kind in zip(flat[shared].tolist(), kind_of[shared].tolist(), strict=True):
        kinds_of_key.setdefault(key, set()).add(kind)
    by_holders: dict[frozenset[int], list[int]] = {}
    for key, held in kinds_of_key.items():
        by_holders.setdefault(frozenset(held), []).append(key)
    gid = {key: _group_id(members) for members in by_holders.values() for key in members}
    out = {blob: _groups_of(arrays[i], gid) for i, blob in enumerate(blobs)}
    return [out[blob] for blob in keys]


def _groups_of(keys: np.ndarray, gid: dict[int, int]) -> ReplicaGroups:
    ids: dict[int, int] = {}
    where = array("i", (ids.setdefault(gid[k], len(ids)) if k in gid else -1 for k in keys.tolist()))
    return ReplicaGroups(tuple(ids), where.tobytes(), world=bool(gid))


class KnownKeys:
    """Each rank's keys from its last full local plan, per world size: with DCP's plan
    cache a rank whose plan did not change sends none, and its last keys stand. Process-
    wide, as DCP's cache and ``save.KNOWN_WORLDS`` are; for one world (``generation``)."""

    def __init__(self) -> None:
        self._keys: dict[int, list[bytes | None]] = {}
        self._generation = 0

    def assign_groups(self, plans: list[SavePlan], generation: int = 0) -> list[SavePlan]:
        """``plans`` with each keyed plan's ``ReplicaGroups`` (its keys taken out); plans
        without keys (DCP's cached ones, or a writer that sent none) as they are."""
        if generation != self._generation:
            self._keys.clear()
            self._generation = generation
        known = self._keys.setdefault(len(plans), [None] * len(plans))
        for rank, p in enumerate(plans):
            if (k := _keys_of(p)) is not None:
                known[rank] = k
        if not any(_keys_of(p) is not None for p in plans):
            return plans
        groups = find_groups([k if k is not None else b"" for k in known])
        return [_with_groups(p, g) for p, g in zip(plans, groups, strict=True)]


def _with_groups(plan: SavePlan, groups: ReplicaGroups) -> SavePlan:
    if _keys_of(plan) is None:
        return plan
    data = {k: v for k, v in plan.storage_data.items() if k != KEYS}
    return dataclasses.replace(plan, storage_data={**data, GROUPS: groups})


def groups_of(plan: SavePlan) -> ReplicaGroups | None:
    """The plan's ``ReplicaGroups`` (None: a plan the pass did not see)."""
    data = plan.storage_data
    found = data.get(GROUPS) if isinstance(data, dict) else None
    return found if isinstance(found, ReplicaGroups) else None


KNOWN_KEYS = KnownKeys()
