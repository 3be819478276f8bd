"""Retention: which committed steps a tier's root keeps, and removing a step safely.

A root is pruned by the process that commits to it, after each commit (``apply_retention``,
called by ``commit.commit_root`` and the writer process), and by hand (``api.prune``, by the
same rule, ``kept_and_doomed``; ``api.remove_steps``: ``drop``). Only the own root of a view
is touched. Markers go first, so a half-removed step is never trusted; a step that a writer
process still copies (a pin) or a reader reads (a lease, ``leases``) stays. Torch-free:
the writer process uses it.
"""

from __future__ import annotations

import contextlib

from tiered_dcp.storage import Storage, blocks
from tiered_dcp.storage.format import Marker, is_pin, marker_key, step_dir
from tiered_dcp.storage.records import DamagedRecord, read_marker_bytes

from . import part_file
from .catalog import TierView, abandoned
from .leases import leased
from .placement import WholeRule


def apply_retention(view: TierView, newest: int) -> None:
    """Keep the newest ``keep`` committed steps of the view's own root; drop older ones.

    Runs after ``newest`` is committed, so the last complete step is never removed
    before a newer one exists. Quarantined and marked steps (non-finite, replicas that
    disagreed) take none of the ``keep``
    places (so K bad steps in a row never push out the last good one): they go, with
    their quarantine marks, once older than the oldest kept good step. Only the own root
    is touched: on a node-local tier every
    node prunes its own after its own commit (a marker there means the step was
    complete everywhere when it was committed). Only steps whose share of this root is
    still whole take one of the ``keep`` places. Markers go first, so a half-deleted
    step is never trusted. Failed saves' leftovers older than ``newest`` go too.
    Committed steps that are pinned (a writer process still copies them) or leased (a
    reader reads them, ``leases``) stay; a reader that leases a step just as its marker
    goes finds the marker put back.
    """
    store = view.own
    ns = view.config.namespace
    listed = view.step_dirs(store)  # one listing of the namespace per commit
    committed, bad = committed_and_bad(view, listed)
    doomed: list[int] = []
    if view.tier.keep is not None:
        kept, doomed = kept_and_doomed(view, committed, bad, view.tier.keep, newest)
        oldest = kept[0] if kept else -1
        _drop_marks(view, store, {s for s, _ in view.marks[store.url] if s < oldest and s not in committed})
    recycles = part_file.recycles(view.config, store)
    if recycles and doomed:  # the spares the last retention left went unclaimed for a save
        part_file.clear_spares(store, ns)
    pins_hold = not part_file.drops_pinned(view.config, store)  # on_lagging_tier
    deleted = sum(drop(view, step, pins_hold) for step in sorted(doomed))
    for step in listed:
        if step < newest and step not in committed and abandoned(view.config.namespace, store, step):
            store.delete(step_dir(ns, step))
            deleted += 1
    if deleted:
        blocks.collect(store, ns)  # blocks no remaining step references (dedup)


def committed_and_bad(view: TierView, listed: list[int]) -> tuple[dict[int, Marker], set[int]]:
    """The committed steps among ``listed`` in the view's own root (their markers), and
    which of them are bad: saved non-finite or with replicas that disagreed, or quarantined here."""
    store = view.own
    committed = {}
    for step in listed:
        marker = view.read_marker(store, step)
        if marker is not None:
            committed[step] = marker
    marks = view.marks[store.url]
    bad = {s for s, m in committed.items() if not m.trusted or (s, m.metadata_xxh3) in marks}
    return committed, bad


def kept_and_doomed(
    view: TierView, committed: dict[int, Marker], bad: set[int], keep: int, newest: int
) -> tuple[list[int], list[int]]:
    """The one keep rule (retention after a commit, ``prune`` by hand): the newest ``keep``
    good steps whole in this root are kept; a quarantined or marked step takes no
    place and goes once older than every kept step; nothing at or after ``newest`` goes.
    Returns (kept, oldest first; the steps to drop)."""
    good = (s for s, m in committed.items() if s not in bad and whole_here(view, m))
    kept = sorted(good)[-keep:]
    oldest = kept[0] if kept else -1
    doomed = [s for s in committed if s not in kept and s < newest and (s not in bad or s < oldest)]
    return kept, doomed


def whole_here(view: TierView, marker: Marker) -> bool:
    """Whether the view's own root still holds what it should of the step (what retention
    counts), by its placement's ``whole_rule``."""
    if view.placement.whole_rule is WholeRule.LOADABLE:
        return not view.missing(view.own, marker)  # every part and the metadata
    held_here = view.placement.parts_in_root(view.node, view.rank, marker)
    return all(view.part_present(view.own, marker, r) for r in held_here)  # the metadata is not counted


def drop(view: TierView, step: int, pins_hold: bool = True) -> bool:
    """Remove ``step`` from the view's own root; False (nothing removed) while a writer
    process (a pin, unless not ``pins_hold``) or a reader (a lease) still needs it. The
    marker goes first, so a half-removed step is never trusted; a memory tier keeps its
    part files as spares (``part_file``). The caller collects the blocks no step uses any more (dedup)."""
    store, ns = view.own, view.config.namespace
    if held(view, store, step, pins_hold):
        return False
    try:
        raw = read_marker_bytes(store, marker_key(ns, step))
    except (OSError, DamagedRecord):  # none, or none to trust: nothing to put back
        raw = None
    store.delete(marker_key(ns, step))
    if raw is not None and held(view, store, step, pins_hold):  # leased in the meantime: its reader saw
        store.write(marker_key(ns, step), [raw])  # the marker, so the step stays for it
        return False
    if part_file.recycles(view.config, store):
        part_file.recycle(store, ns, step)
    store.delete(step_dir(ns, step))
    _drop_marks(view, store, {step})
    return True


def _drop_marks(view: TierView, store: Storage, steps: set[int]) -> None:
    """Remove the quarantine marks of ``steps`` (whose directories are gone) in ``store``."""
    for (step, _), names in view.marks.get(store.url, {}).items():
        for name in names if step in steps else []:
            with contextlib.suppress(FileNotFoundError):
                store.delete(f"{view.config.namespace}/{name}")


def held(view: TierView, store: Storage, step: int, pins: bool = True) -> bool:
    """Whether a writer process (a pin; counted when ``pins``) or a reader (a live lease)
    still needs the step."""
    names = store.list(step_dir(view.config.namespace, step))
    return (pins and any(is_pin(n) for n in names)) or leased(store, view.config.namespace, step, names)
