"""Re-check every byte of a step, copy by copy, as a load would read it.

For each tier holding the step committed, every root this process can reach is checked:
each part it holds (the rank's own and, on a replicated node-local tier, its clique peers'
replicas) is read through that root's own index (``storage/format.py``) and the codec
that loads use, and every item is checked against its chunk checksums and against the
metadata. A root that holds nothing of the step (a wiped node, or a node this machine does
not see), or only files of it that were never committed there (a save killed before its
commit: "incomplete", safe to remove), is reported, not counted as damage; a part no
reachable root holds whole is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, read_item
from tiered_dcp.storage.format import (
    BadIndex,
    IndexCache,
    ItemInfo,
    ItemKey,
    Marker,
    PartIndex,
    index_key,
    part_key,
    step_dir,
)
from tiered_dcp.storage.records import records_limit

from ..config import TieredConfig
from ..steps.catalog import StepCopy, TierView, views
from ..steps.choice import marks_of
from ..steps.leases import Leases
from ..steps.metadata import item_key, legacy_index, load_metadata
from ..steps.status import interrupted, leftover

SHOWN_ITEMS = 3  # unreadable items named per file; the rest are counted in one line


@dataclass
class RootCheck:
    """One root of a tier: which part copies it holds and what reading them found."""

    url: str
    parts: list[int] = field(default_factory=list)  # ranks whose part was read here
    replicas: list[int] = field(default_factory=list)  # of those, the ones held as replicas
    items: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    present: bool = True  # False: the root holds nothing of the step (wiped, or not reachable)
    incomplete: str | None = None  # files of the step but no commit here: what they are, not damage

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class TierCheck:
    """The outcome of verifying one step on one tier, over every root reached."""

    tier_index: int
    tier: str
    step: int
    roots: list[RootCheck] = field(default_factory=list)
    tier_problems: list[str] = field(default_factory=list)  # the metadata; parts held nowhere
    items: int = 0  # the step's items read in at least one copy (each copy: ``RootCheck.items``)
    passed_over: str | None = None  # why loads pass the step over, if they do (``StepMarks.why``)

    @property
    def problems(self) -> list[str]:
        return self.tier_problems + [p for r in self.roots for p in r.problems]

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.roots)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(config: TieredConfig, step: int, node: int = 0, rank: int = 0) -> list[TierCheck]:
    """Read and check every copy of every part of ``step`` on each tier that committed it."""
    checks = []
    leases = Leases(config.namespace, step)  # retention of a running job leaves it alone meanwhile
    try:
        for view in views(config, node, rank, IndexCache()):
            copy = view.committed().get(step)
            bad = [why for (_, s), why in view.bad_markers.items() if s == step]
            if copy is None:
                if bad:  # a marker there, but none to trust: the copy is damaged
                    checks.append(TierCheck(view.index, view.tier.path, step, tier_problems=bad))
                continue
            for root in view.scan_roots():
                leases.take(root)
            if view.read_marker(copy.store, step) is not None:  # not removed before the lease
                checks.append(_verify_tier(view, copy))
    finally:
        leases.release()
    return checks


def _verify_tier(view: TierView, copy: StepCopy) -> TierCheck:
    marker, step = copy.marker, copy.step
    check = TierCheck(view.index, view.tier.path, step, passed_over=marks_of(view, copy).why() or None)
    try:
        md = load_metadata(copy, plain=True)  # without torch where it can: verify starts fast
    except (OSError, ChecksumMismatch) as e:
        check.tier_problems.append(f"metadata: {e}")
        return check
    items: dict[int, list[tuple[str, ItemKey, ItemInfo]]] = {}
    for index, d in md.storage_data.items():
        info = ItemInfo.from_dict(d)
        items.setdefault(info.rank, []).append((index.fqn, item_key(index), info))
    roots: dict[str, RootCheck] = {}
    whole: set[int] = set()
    for p in marker.parts:
        own = view.store_for(p.node, p.rank).url  # as the holders name it (an absolute path)
        for store in view.holders(marker, p.rank):
            root = roots.get(store.url)
            if root is None:  # one listing per root, not one per part it holds
                root = roots[store.url] = RootCheck(store.url, present=_holds_step(store, view, step))
                if root.present:
                    root.incomplete = _uncommitted(view, store, marker)
            if not root.present or root.incomplete:
                continue
            if _verify_copy(view, store, marker, p.rank, items.get(p.rank, []), root, md):
                whole.add(p.rank)
            if store.url != own:
                root.replicas.append(p.rank)
    for p in marker.parts:
        if p.rank not in whole:
            where = " or ".join(
                s.describe(part_key(view.config.namespace, step, p.rank))
                for s in view.holders(marker, p.rank)
            )
            check.tier_problems.append(f"rank {p.rank}'s part: no good copy in any root reached ({where})")
    check.roots = list(roots.values())
    check.items = sum(len(items.get(r, [])) for r in {p for root in check.roots for p in root.parts})
    return check


def _uncommitted(view: TierView, store: Storage, marker: Marker) -> str | None:
    """Why ``store``'s files of the step are not the committed save's (None when they are):
    it has no marker of that save (a save that stopped before its commit here, or one still
    under way). Such files are never read, so they are not damage."""
    mine = view.read_marker(store, marker.step)
    if mine is not None and mine.metadata_xxh3 == marker.metadata_xxh3:
        return None
    if mine is not None:
        return "holds another save of this step number, committed there: verify it on its own"
    if interrupted(view, store, marker.step):
        return "incomplete: " + leftover(view, store, marker.step)
    return "not committed here (a save or a writer process may still be writing it): not read"


def _holds_step(store: Storage, view: TierView, step: int) -> bool:
    try:
        return bool(store.list(step_dir(view.config.namespace, step)))
    except OSError:
        return False


def _verify_copy(
    view: TierView,
    store: Storage,
    marker: Marker,
    part: int,
    items: list[tuple[str, ItemKey, ItemInfo]],
    root: RootCheck,
    md: object,
) -> bool:
    """Read every item of one copy of rank ``part``'s part in ``store``; True when all good."""
    ns, step = view.config.namespace, marker.step
    which = f"rank {part}'s part" + (
        "" if store.url == view.store_for(marker.part(part).node, part).url else " (replica)"
    )
    key = part_key(ns, step, part)
    root.parts.append(part)
    size = store.size(key)
    if size is None:
        root.problems.append(f"{store.describe(key)}: {which} is missing")
        return False
    try:
        index: PartIndex | None = view.indexes.get(store, ns, step, part, records_limit(marker.metadata_size))
        if index is None and not marker.has_indexes:  # format 1/2: the metadata's records
            index = legacy_index(md, ns, step, part)
    except (BadIndex, OSError) as e:  # BadIndex: damaged, or naming what is no object of the layout
        root.problems.append(f"{store.describe(key)}: {which} has no usable index: {e}")
        return False
    if index is None:
        root.problems.append(f"{store.describe(key)}: {which} has no readable index next to it")
        return False
    good = True
    if size != index.size:
        root.problems.append(f"{store.describe(key)}: {which} is {size} bytes, its index says {index.size}")
        good = False
    found = [(fqn, info, index.records.get(k)) for fqn, k, info in items]
    unreadable: dict[str, list[str]] = {}  # file -> the items of it that could not be read
    for fqn, info, rec in sorted(found, key=lambda f: (f[2].file, f[2].offset) if f[2] else ("", 0)):
        if rec is None:
            root.problems.append(f"{store.describe(key)}: item {fqn!r} of {which} is not in its index")
            good = False
            continue
        if not rec.info.same_item(info):  # nothing is read (nor allocated) for it
            root.problems.append(
                f"{store.describe(index_key(ns, step, part))}: item {fqn!r} of {which}: "
                "its index and the metadata disagree on the item (its chunks, dtype or shape)"
            )
            good = False
            continue
        try:
            read_item(store, rec, memoryview(bytearray(rec.info.raw_length)))
        except (OSError, ChecksumMismatch) as e:
            bad = unreadable.setdefault(rec.file, [])
            if len(bad) < SHOWN_ITEMS:
                why = str(e.args[1] if isinstance(e, OSError) and len(e.args) == 2 else e)
                why = why.removeprefix(f"{store.describe(rec.file)}: ")  # named at the start already
                root.problems.append(f"{store.describe(rec.file)}: item {fqn!r} of {which}: {why}")
            bad.append(fqn)
            good = False
        root.items += 1
        root.bytes_read += rec.length
    for file, bad in unreadable.items():  # the rest of a file's items, one line
        if len(bad) > SHOWN_ITEMS:
            more = len(bad) - SHOWN_ITEMS
            root.problems.append(f"{store.describe(file)}: {more} more item(s) of {which} unreadable")
    return good
