"""What is on each tier: committed steps, completeness, retention and status.

How a tier root is laid out is ``storage.format``'s business (docs/format.md); where a
tier keeps a step's parts, replicas, metadata and marker (one shared root, or a root per
node holding its ranks' parts and their clique peers' replicas) is ``placement``'s. This
module sees a tier through both. Torch-free: the writer process uses it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from tiered_dcp.storage import Storage, blocks, open_storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum
from tiered_dcp.storage.format import (
    METADATA,
    BadIndex,
    IndexCache,
    Marker,
    PartIndex,
    index_key,
    is_failed_note,
    is_lease,
    marker_key,
    metadata_key,
    parse_quarantine,
    parse_step_dir,
    part_key,
    part_name,
    quarantine_key,
    step_dir,
)
from tiered_dcp.storage.format import is_pin as _is_pin
from tiered_dcp.storage.local import DIRTY

from . import tierfile
from .cliques import Layout
from .config import Tier, TieredConfig
from .leases import leased, owner_alive
from .placement import Placement, WholeRule, nodes_of, placement_for
from .planners.choice import StepMarks

log = logging.getLogger("tiered_dcp")

T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout: float) -> T:
    """``fn()``, or ``TimeoutError`` once it has run ``timeout`` seconds.

    It runs in a daemon thread, which is left behind on a timeout (the backend's own
    timeouts end it later) and never keeps the process from exiting.
    """
    box: dict[str, object] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name="tiered-dcp-query").start()
    if not done.wait(timeout):
        raise TimeoutError(f"no answer within {timeout:g} s (tier_timeout)")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@dataclass
class StepCopy:
    """One committed copy of a step on one tier: where its marker was found."""

    tier_index: int
    step: int
    marker: Marker
    store: Storage  # the root holding marker and metadata
    marks: StepMarks | None = None  # quarantined / non-finite, where already known


@dataclass
class StepState:
    """A row of the status table: one step on one tier."""

    tier_index: int
    tier: str
    step: int
    state: str  # queued | writing | clean | committed | damaged | incomplete | failed | skipped (user guide)
    size_bytes: int
    created: float | None
    error: str | None = None  # why it is not usable (failed, skipped, damaged, incomplete)
    logical_bytes: int = 0  # committed: the raw bytes of the step's items held in this tier
    stored_bytes: int = 0  # what its records name (after compression, before dedup)
    written_bytes: int = 0  # what its writers wrote for it here (without the blocks it reused)
    # committed on a replicated node-local tier: its cliques (the ranks holding copies of each
    # other's parts), and each rank's failure domain where one was stated (its marker's)
    cliques: list[list[int]] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)

    @property
    def clique_domains(self) -> list[list[str]]:
        """Each clique's members' failure domains (empty when none was stated)."""
        return [[self.domains[r] for r in c] for c in self.cliques] if self.domains else []

    @property
    def compression_ratio(self) -> float | None:
        """Stored / logical bytes (1.0: raw)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else None

    @property
    def dedup_ratio(self) -> float | None:
        """Written / stored bytes: the share of the step this tier had to write (1.0: no dedup)."""
        return self.written_bytes / self.stored_bytes if self.stored_bytes else None


def read_metadata_blob(copy: StepCopy) -> bytes:
    """The step's metadata bytes from this copy, checked against the marker's checksum.

    Raises OSError when it cannot be read and ChecksumMismatch when it is damaged.
    """
    key = metadata_key(copy.marker.namespace, copy.step)
    blob = copy.store.read(key)
    if len(blob) != copy.marker.metadata_size or checksum(blob) != copy.marker.metadata_xxh3:
        raise ChecksumMismatch(f"{copy.store.describe(key)}: checksum differs from the commit marker's")
    return blob


class TierView:
    """One tier as seen from a process on (node, rank)."""

    def __init__(
        self, config: TieredConfig, index: int, node: int, rank: int, indexes: IndexCache | None = None
    ) -> None:
        self.config = config
        self.index = index
        self.tier: Tier = config.tiers[index]
        self.placement: Placement = placement_for(self.tier)
        self.node, self.rank = node, rank
        self.indexes = indexes if indexes is not None else IndexCache()  # scoped like the view
        self._stores: dict[str, Storage] = {}
        self.unreachable: str | None = None  # why a shared tier is skipped by this view's queries
        self._listed: dict[str, list[str]] = {}  # a shared tier's first listing, until used
        self._answered = False  # the shared tier answered this view's first question in time
        # (root url, step) -> the step directory's objects and sizes, as listed when the step
        # was found (``newest_complete``) or handed over by the rank that found it: a load
        # asks a shared tier for no object's size
        self.listings: dict[tuple[str, int], dict[str, int]] = {}
        # root url -> (step, ident) -> the names of the quarantine marks its last listing showed
        self.marks: dict[str, dict[tuple[int, int], list[str]]] = {}
        self.passed_over: dict[int, StepMarks] = {}  # newer complete steps ``newest_complete`` skipped

    def answer(self, fn: Callable[[], T], empty: T) -> T:
        """``fn()``; on a shared tier, ``empty`` when it does not answer.

        Loads and queries go on without a bucket that is down or stalled. The view's first
        question to a shared tier (listing the namespace) must be answered within
        ``tier_timeout``; what follows is bounded by the backend's own timeouts (a tier that
        answered may hold many steps: their scan is not cut short). The first failure is
        logged and remembered, and the view asks that tier nothing more. Node-local tiers
        are this machine's own files: their errors are raised (``Placement.skips_unanswered``).
        """
        if not self.placement.skips_unanswered:
            return fn()
        try:
            if self.unreachable is None and not self._answered:
                self._listed = bounded(self._probe, self.config.tier_timeout)
                self._answered = True
            if self.unreachable is None:
                return fn()
        except (TimeoutError, OSError) as e:
            self.unreachable = f"{type(e).__name__}: {e}"
            log.warning(
                "tier %d (%s) did not answer: %s; skipping it (a step only it holds cannot be "
                "found until it answers)",
                self.index,
                self.tier.path,
                self.unreachable,
            )
        return empty

    def _probe(self) -> dict[str, list[str]]:
        """The namespace listing of every root scanned (kept for the next ``step_dirs``)."""
        return {s.url: s.list(self.config.namespace) for s in self.scan_roots()}

    def store_for(self, node: int, rank: int) -> Storage:
        url = self.tier.root(node, rank)
        if url not in self._stores:
            self._stores[url] = open_storage(url, self.tier.storage_options)
        return self._stores[url]

    @property
    def own(self) -> Storage:
        return self.store_for(self.node, self.rank)

    def scan_roots(self) -> list[Storage]:
        """The roots this process scans for committed steps (the placement's), own first."""
        roots = [self.store_for(n, r) for n, r in self.placement.scan_roots(self.node, self.rank)]
        return list({s.url: s for s in roots}.values())

    def step_dirs(self, store: Storage) -> list[int]:
        """The steps with a directory in ``store``; the same listing's quarantine marks are
        kept in ``marks`` (so knowing them costs no request)."""
        listed = self._listed.pop(store.url, None)  # the probe's, used once
        names = listed if listed is not None else store.list(self.config.namespace)
        marks: dict[tuple[int, int], list[str]] = {}
        for name in names:
            mark = parse_quarantine(name)
            if mark is not None:
                marks.setdefault(mark, []).append(name)
        self.marks[store.url] = marks
        steps = (parse_step_dir(name) for name in names)
        return sorted(s for s in steps if s is not None)

    def quarantined(self, store: Storage, step: int, ident: int) -> str | None:
        """Why the save of ``step`` named ``ident`` is quarantined in ``store`` (None: it is not),
        as the root's last listing (``step_dirs``) shows it; the why is read from one mark."""
        names = self.marks.get(store.url, {}).get((step, ident))
        if not names:
            return None
        with contextlib.suppress(OSError):
            return store.read(f"{self.config.namespace}/{names[0]}")[:400].decode("utf-8", "replace")
        return "a load found it damaged with no good copy left"

    def step_marks(self, copy: StepCopy) -> StepMarks:
        """What a committed copy says of its step: quarantined (here), non-finite (its marker)."""
        m = copy.marker
        why = self.quarantined(copy.store, copy.step, m.metadata_xxh3)
        return StepMarks(copy.step, why, m.nonfinite_items, tuple(m.nonfinite))

    def quarantine(self, store: Storage, step: int, ident: int, rank: int, why: str) -> None:
        """Mark the save of ``step`` named ``ident`` in ``store`` as not loadable (``why``)."""
        store.write(quarantine_key(self.config.namespace, step, ident, rank), [why.encode()])

    def read_marker(self, store: Storage, step: int) -> Marker | None:
        key = marker_key(self.config.namespace, step)
        try:
            data = store.read(key)
        except (FileNotFoundError, OSError):
            return None
        try:
            marker = Marker.from_bytes(data)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring unreadable commit marker %s: %s", store.describe(key), e)
            return None
        if marker.namespace != self.config.namespace:  # its namespace names the metadata's key
            log.warning("ignoring commit marker %s of namespace %r", store.describe(key), marker.namespace)
            return None
        return marker if marker.step == step else None

    def holders(self, marker: Marker, rank: int) -> list[Storage]:
        """The roots that hold (a copy of) rank's part: its own first, then its clique's."""
        nodes = nodes_of(marker)
        ranks = self.placement.holders(rank, nodes, Layout.of_marker(marker))
        stores = [self.store_for(nodes[h], h) for h in ranks]
        return list({s.url: s for s in stores}.values())

    def part_index(self, store: Storage, marker: Marker, rank: int) -> PartIndex | None:
        """Rank's index in ``store`` (read once per view), None where it is missing or damaged."""
        try:
            return self.indexes.get(store, self.config.namespace, marker.step, rank)
        except (BadIndex, OSError) as e:
            log.debug("step %d: rank %d's index in %s unreadable: %s", marker.step, rank, store.url, e)
            return None

    def part_present(self, store: Storage, marker: Marker, rank: int) -> bool:
        """Whether ``store`` holds rank's part whole: the size its index (else the marker) says.

        Formats 1 and 2 wrote no index next to some parts: the marker's size holds there.
        """
        listed = self.listings.get((store.url, marker.step))
        if listed is not None:
            size = listed.get(part_name(rank))
        else:
            size = store.size(part_key(self.config.namespace, marker.step, rank))
        if size is None:
            return False
        index = self.part_index(store, marker, rank)
        if index is not None:
            return size == index.size
        if marker.has_indexes or store.exists(index_key(self.config.namespace, marker.step, rank)):
            return False  # no index, or a damaged one
        info = marker.part(rank)
        return info is not None and size == info.size

    def whole_here(self, marker: Marker) -> bool:
        """Whether this process's root still holds what it should of the step (what retention
        counts), by its placement's ``whole_rule``."""
        if self.placement.whole_rule is WholeRule.LOADABLE:
            return not self.missing(self.own, marker)  # every part and the metadata
        held = self.placement.parts_in_root(self.node, self.rank, marker)
        return all(self.part_present(self.own, marker, r) for r in held)  # the metadata is not counted

    def part_store(self, marker: Marker, rank: int) -> Storage:
        """The first root (own copy first) holding rank's part whole; the own root if none."""
        stores = self.holders(marker, rank)
        return next((s for s in stores if self.part_present(s, marker, rank)), stores[0])

    def missing(self, store: Storage, marker: Marker, sizes: dict[str, int] | None = None) -> list[str]:
        """What a committed copy lacks to be loadable from here (empty when complete).

        On a shared tier (format 3), from one listing of the step's directory (``sizes``, else
        listed here): every part the size its marker says, with its index beside it; the
        index itself is read (and checked against the part) by the rank that reads the part.
        """
        if not self.placement.pooled and marker.has_indexes:
            if sizes is None:
                sizes = store.list_sizes(step_dir(self.config.namespace, marker.step))
            return self._missing_listed(store, marker, sizes)
        step = marker.step
        problems = []
        md_key = metadata_key(self.config.namespace, step)
        if store.size(md_key) != marker.metadata_size:
            problems.append(f"{store.describe(md_key)} missing or wrong size")
        for p in marker.parts:
            stores = self.holders(marker, p.rank)
            if not any(self.part_present(s, marker, p.rank) for s in stores):
                where = " or ".join(s.describe(part_key(self.config.namespace, step, p.rank)) for s in stores)
                problems.append(f"{where} missing or wrong size")
        return problems

    def _missing_listed(self, store: Storage, marker: Marker, sizes: dict[str, int]) -> list[str]:
        ns, step = self.config.namespace, marker.step
        problems = []
        if sizes.get(METADATA) != marker.metadata_size:
            problems.append(f"{store.describe(metadata_key(ns, step))} missing or wrong size")
        for p in marker.parts:
            index = index_key(ns, step, p.rank).rsplit("/", 1)[1]
            if sizes.get(part_name(p.rank)) != p.size or index not in sizes:
                problems.append(f"{store.describe(part_key(ns, step, p.rank))} missing or wrong size")
        return problems

    def newest_complete(self, step: int | None = None, exclude: Iterable[int] = ()) -> dict[int, StepCopy]:
        """A shared tier's newest complete good step (or ``step``, if complete, good or not),
        found with few requests however many ranks saved it: the namespace listing, then
        newest first one marker read and one listing of the step's directory (names and
        sizes) per step until a complete one. That listing is kept (``listings``) for the
        load's reads. Newer complete steps that are quarantined or non-finite are passed
        over (kept in ``passed_over``, for the load to say why), and so are ``exclude``."""
        return self.answer(lambda: self._newest_complete(step, set(exclude)), {})

    def _newest_complete(self, step: int | None, exclude: set[int]) -> dict[int, StepCopy]:
        store = self.own
        steps = self.step_dirs(store)
        for s in sorted(steps, reverse=True) if step is None else [s for s in steps if s == step]:
            if s in exclude:
                continue
            marker = self.read_marker(store, s)
            if marker is None:
                continue
            sizes = store.list_sizes(step_dir(self.config.namespace, s))
            if self.missing(store, marker, sizes):
                continue
            copy = StepCopy(self.index, s, marker, store)
            copy.marks = self.step_marks(copy)
            if step is None and not copy.marks.good:
                self.passed_over[s] = copy.marks
                continue
            self.listings[(store.url, s)] = sizes
            return {s: copy}
        return {}

    def committed(self) -> dict[int, StepCopy]:
        """Every step with a commit marker visible from here (complete or not)."""
        return self.answer(self._committed, {})

    def _committed(self) -> dict[int, StepCopy]:
        found: dict[int, StepCopy] = {}
        for store in self.scan_roots():
            for step in self.step_dirs(store):
                if step in found:
                    continue
                marker = self.read_marker(store, step)
                if marker is not None:
                    found[step] = StepCopy(self.index, step, marker, store)
        return found

    def complete(self) -> dict[int, StepCopy]:
        """Committed steps whose every part and metadata can be read from here."""
        return self.answer(
            lambda: {s: c for s, c in self._committed().items() if not self.missing(c.store, c.marker)}, {}
        )

    def states(self) -> list[StepState]:
        """One row per step this tier holds anything of (none when a shared tier is down)."""
        return self.answer(self._states, [])

    def _states(self) -> list[StepState]:
        rows: dict[int, StepState] = {}
        committed = self._committed()
        for step, c in committed.items():
            missing = self.missing(c.store, c.marker)
            size = sum(p.size for p in c.marker.parts) + c.marker.metadata_size
            rows[step] = StepState(
                self.index,
                self.tier.path,
                step,
                "damaged" if missing else "committed",
                size,
                c.marker.created,
                f"committed, but not loadable from here: {'; '.join(missing)}" if missing else None,
            )
            self._byte_counts(rows[step], c)
            layout = Layout.of_marker(c.marker)
            if self.placement.pooled and layout.factor > 1:
                rows[step].cliques, rows[step].domains = layout.cliques(), list(layout.domains)
        for store in self.scan_roots():
            for step in self.step_dirs(store):
                if step not in rows:
                    row = self._uncommitted(store, step)
                    if row is not None:
                        rows[step] = row
        return [rows[s] for s in sorted(rows)]

    def _uncommitted(self, store: Storage, step: int) -> StepState | None:
        """A step directory without a marker: failed (a note says why, or its save is gone
        without writing anything), writing, or clean (parts, no marker yet); None when it
        holds nothing but leases (a reader raced its removal)."""
        sdir = step_dir(self.config.namespace, step)
        names = store.list(sdir)
        data = [n for n in names if not (_is_pin(n) or is_lease(n) or is_failed_note(n))]
        size = sum(store.size(f"{sdir}/{n}") or 0 for n in data)
        error = self.failure(store, step)
        if error is None and not data:
            if not any(_is_pin(n) for n in names):
                return None
            if self.abandoned(store, step):
                error = "its save ended before it wrote anything"
        if error is not None:
            state = "failed"
        elif data and self.interrupted(store, step, names):
            state, error = "incomplete", self.leftover(store, step)
        else:
            state = "writing" if not data or any(DIRTY in n for n in data) else "clean"
        return StepState(self.index, self.tier.path, step, state, size, None, error)

    def interrupted(self, store: Storage, step: int, names: list[str] | None = None) -> bool:
        """Whether an uncommitted step's save stopped before its commit and left no note (it
        was killed, or its node lost): it pinned the step, and no pin's process is alive."""
        if names is None:
            names = store.list(step_dir(self.config.namespace, step))
        return any(_is_pin(n) for n in names) and self.abandoned(store, step)

    def leftover(self, store: Storage, step: int) -> str:
        """What ``ls`` and ``verify`` say of an interrupted save's files (``interrupted``)."""
        where = store.describe(step_dir(self.config.namespace, step))
        return (
            "never committed: the save that wrote it stopped before its commit (killed, or its "
            f"node lost); nothing reads it, safe to remove: {where}"
        )

    def _byte_counts(self, row: StepState, copy: StepCopy) -> None:
        """Fill a committed row's logical / stored / written bytes from its parts' indexes."""
        for p in copy.marker.parts:
            found = (self.part_index(s, copy.marker, p.rank) for s in self.holders(copy.marker, p.rank))
            index = next((i for i in found if i is not None), None)
            if index is not None:
                row.logical_bytes += index.logical_bytes
                row.stored_bytes += index.stored_bytes
                row.written_bytes += index.written if index.written is not None else index.size

    def apply_retention(self, newest: int) -> None:
        """Keep the newest ``keep`` committed steps of this process's root; drop older ones.

        Runs after ``newest`` is committed, so the last complete step is never removed
        before a newer one exists. Quarantined and non-finite steps take none of the ``keep``
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
        store = self.own
        ns = self.config.namespace
        committed = {}
        listed = self.step_dirs(store)  # one listing of the namespace per commit
        for step in listed:
            marker = self.read_marker(store, step)
            if marker is not None:
                committed[step] = marker
        marks = self.marks[store.url]
        bad = {s for s, m in committed.items() if not m.finite or (s, m.metadata_xxh3) in marks}
        doomed: list[int] = []
        if self.tier.keep is not None:
            good = (s for s, m in committed.items() if s not in bad and self.whole_here(m))
            kept = sorted(good)[-self.tier.keep :]
            # a quarantined or non-finite step takes no place; it goes once older than every kept step
            oldest = kept[0] if kept else -1
            doomed = [s for s in committed if s not in kept and s < newest and (s not in bad or s < oldest)]
            self._drop_marks(store, {s for s, _ in marks if s < oldest and s not in committed})
        recycles = tierfile.recycles(self.config, store)
        if recycles and doomed:  # the spares the last retention left went unclaimed for a save
            tierfile.clear_spares(store, ns)
        pins_hold = not tierfile.drops_pinned(self.config, store)  # on_lagging_tier
        deleted = sum(self.drop(step, pins_hold) for step in sorted(doomed))
        for step in listed:
            if step < newest and step not in committed and self.abandoned(store, step):
                store.delete(step_dir(ns, step))
                deleted += 1
        if deleted:
            blocks.collect(store, ns)  # blocks no remaining step references (dedup)

    def drop(self, step: int, pins_hold: bool = True) -> bool:
        """Remove ``step`` from this view's own root; False (nothing removed) while a writer
        process (a pin, unless not ``pins_hold``) or a reader (a lease) still needs it. The
        marker goes first, so a half-removed step is never trusted; a memory tier keeps its
        part files as spares (``tierfile``). The caller collects the blocks no step uses any more (dedup)."""
        store, ns = self.own, self.config.namespace
        if self.held(store, step, pins_hold):
            return False
        try:
            raw = store.read(marker_key(ns, step))
        except FileNotFoundError:
            raw = None
        store.delete(marker_key(ns, step))
        if raw is not None and self.held(store, step, pins_hold):  # leased in the meantime: its reader saw
            store.write(marker_key(ns, step), [raw])  # the marker, so the step stays for it
            return False
        if tierfile.recycles(self.config, store):
            tierfile.recycle(store, ns, step)
        store.delete(step_dir(ns, step))
        self._drop_marks(store, {step})
        return True

    def _drop_marks(self, store: Storage, steps: set[int]) -> None:
        """Remove the quarantine marks of ``steps`` (whose directories are gone) in ``store``."""
        for (step, _), names in self.marks.get(store.url, {}).items():
            for name in names if step in steps else []:
                with contextlib.suppress(FileNotFoundError):
                    store.delete(f"{self.config.namespace}/{name}")

    def held(self, store: Storage, step: int, pins: bool = True) -> bool:
        """Whether a writer process (a pin; counted when ``pins``) or a reader (a live lease)
        still needs the step."""
        names = store.list(step_dir(self.config.namespace, step))
        return (pins and any(_is_pin(n) for n in names)) or leased(store, self.config.namespace, step, names)

    def abandoned(self, store: Storage, step: int) -> bool:
        """Whether an uncommitted step will never be committed: its save recorded a failure,
        or nothing in it belongs to a running save (every pin's process is gone)."""
        sdir = step_dir(self.config.namespace, step)
        names = store.list(sdir)
        if any(is_failed_note(n) for n in names):
            return True
        for name in names:
            if _is_pin(name):
                try:
                    if owner_alive(store.read(f"{sdir}/{name}")):
                        return False  # its save may still commit it (an async save in flight)
                except FileNotFoundError:
                    continue
        return True

    def failure(self, store: Storage, step: int) -> str | None:
        """The errors a failed save of ``step`` recorded in ``store``, if any."""
        sdir = step_dir(self.config.namespace, step)
        notes = []
        for name in sorted(n for n in store.list(sdir) if is_failed_note(n)):
            with contextlib.suppress(FileNotFoundError):
                notes.append(store.read(f"{sdir}/{name}").decode("utf-8", "replace"))
        return "; ".join(notes) or None


def views(config: TieredConfig, node: int, rank: int, indexes: IndexCache | None = None) -> list[TierView]:
    """Every tier seen from (node, rank), sharing ``indexes`` (one operation's) if given."""
    indexes = indexes if indexes is not None else IndexCache()
    return [TierView(config, i, node, rank, indexes) for i in range(len(config.tiers))]


def loadable_steps(
    tier_views: Iterable[TierView], step: int | None, exclude: Iterable[int] = ()
) -> dict[int, list[StepCopy]]:
    """What a load chooses from: every complete step of the node-local tiers, and the newest
    complete good step (or ``step``) of each shared one (``newest_complete``: no more is
    needed to choose the newest, and a bucket is asked little), fastest tier first."""
    out: dict[int, list[StepCopy]] = {}
    for view in tier_views:
        copies = view.complete() if view.placement.pooled else view.newest_complete(step, exclude)
        for s, copy in copies.items():
            out.setdefault(s, []).append(copy)
    return out


def complete_steps(tier_views: Iterable[TierView]) -> dict[int, list[StepCopy]]:
    """step -> its complete copies (as seen through ``tier_views``), fastest tier first."""
    out: dict[int, list[StepCopy]] = {}
    for view in tier_views:
        for step, copy in view.complete().items():
            out.setdefault(step, []).append(copy)
    return out


def describe_search(tier_views: Iterable[TierView]) -> str:
    """One line per tier: where it was searched and what it holds, for error messages."""
    lines = []
    for view in tier_views:
        committed = view.committed()
        complete = sorted(view.complete())
        roots = ", ".join(f"{s.url}/{view.config.namespace}" for s in view.scan_roots())
        if view.unreachable is not None:
            lines.append(
                f"  tier {view.index} [{roots}]: NOT SEARCHED, it did not answer ({view.unreachable}); "
                "a step only it holds cannot be loaded until it does"
            )
            continue
        broken = sorted(set(committed) - set(complete))
        extra = f"; committed but damaged (a file missing): {broken}" if broken else ""
        lines.append(f"  tier {view.index} [{roots}]: complete steps {complete or 'none'}{extra}")
    return "\n".join(lines)


def one_save(
    found: dict[int, list[StepCopy]], idents: dict[int, int] | None = None
) -> dict[int, list[StepCopy]]:
    """Per step, only the copies of one save of it: ``idents`` (step -> metadata checksum),
    else that of its fastest tier's copy (the fastest tier takes a step first, so a slower
    tier may still hold an older save of a step number saved again, until its writer copies
    the new one). Copies of two saves are never mixed: not their marks, not their items.
    Formats 1 and 2 kept each tier's records in its metadata, so their checksum differs per
    tier: those copies are all kept, as before."""
    out = {}
    for step, copies in found.items():
        current = [c for c in copies if c.marker.has_indexes]
        ident = (idents or {}).get(step, current[0].marker.metadata_xxh3 if current else None)
        kept = [c for c in copies if not c.marker.has_indexes or c.marker.metadata_xxh3 == ident]
        if kept:
            out[step] = kept
    return out


def copies_marks(
    found: dict[int, list[StepCopy]], tier_views: Iterable[TierView], elsewhere: Iterable[int] = ()
) -> list[StepMarks]:
    """The marks of every copy in ``found`` (``loadable_steps``), and of the newer steps the
    shared tiers passed over: what ``planners.choice.choose`` chooses from. A step passed
    over that ``found`` or ``elsewhere`` (the cluster) holds is judged by those copies: a
    slower tier may hold an older save of a step number saved again (``one_save``)."""
    by_index = {v.index: v for v in tier_views}
    marks = [c.marks or by_index[c.tier_index].step_marks(c) for copies in found.values() for c in copies]
    held = set(found) | set(elsewhere)
    return marks + [m for v in by_index.values() for m in v.passed_over.values() if m.step not in held]
