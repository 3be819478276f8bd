"""What is on each tier: committed steps and their completeness.

How a tier root is laid out is ``storage.format``'s business (docs/format.md); where a
tier keeps a step's parts, replicas, metadata and marker (one shared root, or a root per
node holding its ranks' parts and their clique peers' replicas) is ``placement``'s. This
module sees a tier through both. Which step a load picks is ``steps.choice``'s; what
``status()`` says of each step ``steps.status``'s; what a root keeps ``retention``'s.
Torch-free: the writer process uses it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from tiered_dcp.storage import Storage, open_storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum
from tiered_dcp.storage.format import (
    METADATA,
    BadIndex,
    IndexCache,
    Marker,
    PartIndex,
    index_key,
    is_failed_note,
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
from tiered_dcp.storage.records import NOTE_LIMIT, DamagedRecord, read_marker_bytes, records_limit

from ..config import Tier, TieredConfig
from ..ranks.cliques import Layout
from .leases import owner_alive
from .placement import Placement, nodes_of, placement_for

log = logging.getLogger(__name__)

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


def read_metadata_blob(copy: StepCopy) -> bytes:
    """The step's metadata bytes from this copy, checked against the marker's checksum.

    Raises OSError when it cannot be read and ChecksumMismatch when it is damaged.
    """
    key = metadata_key(copy.marker.namespace, copy.step)
    blob = copy.store.read(key, 0, copy.marker.metadata_size + 1)  # never more than the marker says
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
        self._last_listed: dict[str, list[str]] = {}  # each root's latest namespace listing
        self._answered = False  # the shared tier answered this view's first question in time
        self.saw_steps = False  # a listing by this view found a step's directory (committed or not)
        # (root url, step) -> the step directory's objects and sizes, as listed when the step
        # was found (``choice.newest_complete``) or handed over by the rank that found it: a load
        # asks a shared tier for no object's size
        self.listings: dict[tuple[str, int], dict[str, int]] = {}
        # root url -> (step, ident) -> the names of the quarantine marks its last listing showed
        self.marks: dict[str, dict[tuple[int, int], list[str]]] = {}
        # (root url, step) -> why the step's marker there is not trusted (the file and the
        # check it failed): ``status`` and ``verify`` report such a copy as damaged
        self.bad_markers: dict[tuple[str, int], str] = {}
        # (root url, step, rank) -> why rank's index there is not trusted (its file and check)
        self.bad_indexes: dict[tuple[str, int, int], str] = {}

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

    def reuse_listings(self) -> None:
        """The next scan of each root reads this view's latest listing of it instead of
        asking again: an error says what the search saw, at no further request."""
        self._listed.update(self._last_listed)

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
        self._last_listed[store.url] = names
        marks: dict[tuple[int, int], list[str]] = {}
        for name in names:
            mark = parse_quarantine(name)
            if mark is not None:
                marks.setdefault(mark, []).append(name)
        self.marks[store.url] = marks
        steps = sorted(s for s in (parse_step_dir(name) for name in names) if s is not None)
        self.saw_steps = self.saw_steps or bool(steps)
        return steps

    def quarantined(self, store: Storage, step: int, ident: int) -> str | None:
        """Why the save of ``step`` named ``ident`` is quarantined in ``store`` (None: it is not),
        as the root's last listing (``step_dirs``) shows it; the why is read from one mark."""
        names = self.marks.get(store.url, {}).get((step, ident))
        if not names:
            return None
        with contextlib.suppress(OSError):
            why = store.read(f"{self.config.namespace}/{names[0]}", 0, 400).decode("utf-8", "replace")
            line = (why.splitlines() or [""])[0]  # anyone who writes the tier wrote it: one printable line
            return "".join(c if c.isprintable() else "?" for c in line)
        return "a load found it damaged with no good copy left"

    def quarantine(self, store: Storage, step: int, ident: int, rank: int, why: str) -> None:
        """Mark the save of ``step`` named ``ident`` in ``store`` as not loadable (``why``)."""
        store.write(quarantine_key(self.config.namespace, step, ident, rank), [why.encode()])

    def read_marker(self, store: Storage, step: int) -> Marker | None:
        key = marker_key(self.config.namespace, step)
        try:
            marker = Marker.from_bytes(read_marker_bytes(store, key))
        except FileNotFoundError:
            return None
        except (OSError, DamagedRecord) as e:  # OSError: no file to read (a FIFO, a directory...)
            why = str(e) if str(e).startswith(store.describe(key)) else f"{store.describe(key)}: {e}"
        else:
            if marker.namespace == self.config.namespace and marker.step == step:
                self.bad_markers.pop((store.url, step), None)
                return marker
            why = f"{store.describe(key)}: the marker of step {marker.step} of {marker.namespace!r}"
        log.warning("ignoring commit marker (the step is not whole there): %s", why)
        self.bad_markers[(store.url, step)] = why
        return None

    def holders(self, marker: Marker, rank: int) -> list[Storage]:
        """The roots that hold (a copy of) rank's part: its own first, then its clique's."""
        nodes = nodes_of(marker)
        ranks = self.placement.holders(rank, nodes, Layout.of_marker(marker))
        stores = [self.store_for(nodes[h], h) for h in ranks]
        return list({s.url: s for s in stores}.values())

    def part_index(self, store: Storage, marker: Marker, rank: int) -> PartIndex | None:
        """Rank's index in ``store`` (read once per view), None where it is missing or damaged."""
        try:
            limit = records_limit(marker.metadata_size)
            return self.indexes.get(store, self.config.namespace, marker.step, rank, limit)
        except (BadIndex, OSError) as e:
            log.debug("step %d: rank %d's index in %s unreadable: %s", marker.step, rank, store.url, e)
            if isinstance(e, BadIndex):
                self.bad_indexes[(store.url, marker.step, rank)] = str(e)
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
            return _missing_listed(self.config.namespace, store, marker, sizes)
        step = marker.step
        problems = []
        md_key = metadata_key(self.config.namespace, step)
        if store.size(md_key) != marker.metadata_size:
            problems.append(f"{store.describe(md_key)} missing or wrong size")
        for p in marker.parts:
            stores = self.holders(marker, p.rank)
            if not any(self.part_present(s, marker, p.rank) for s in stores):
                bad = [self.bad_indexes.get((s.url, step, p.rank)) for s in stores]
                where = " or ".join(s.describe(part_key(self.config.namespace, step, p.rank)) for s in stores)
                problems += [b for b in bad if b] or [f"{where} missing or wrong size"]
        return problems

    def committed(self) -> dict[int, StepCopy]:
        """Every step with a commit marker visible from here (complete or not)."""
        return self.answer(self.scan_committed, {})

    def scan_committed(self) -> dict[int, StepCopy]:
        """``committed``, unbounded: for a caller already inside ``answer``."""
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
        return self.answer(lambda: self.complete_of(self.scan_committed()), {})

    def complete_of(self, committed: dict[int, StepCopy]) -> dict[int, StepCopy]:
        """Those of ``committed`` that are complete (unbounded: for a caller inside ``answer``)."""
        return {s: c for s, c in committed.items() if not self.missing(c.store, c.marker)}


def views(config: TieredConfig, node: int, rank: int, indexes: IndexCache | None = None) -> list[TierView]:
    """Every tier seen from (node, rank), sharing ``indexes`` (one operation's) if given."""
    indexes = indexes if indexes is not None else IndexCache()
    return [TierView(config, i, node, rank, indexes) for i in range(len(config.tiers))]


def describe_search(tier_views: Iterable[TierView]) -> str:
    """One line per tier: where it was searched and what it holds, for error messages (from
    the listings the search made; each step's completeness is checked again)."""
    lines = []
    for view in tier_views:
        view.reuse_listings()  # what the search saw
        committed = view.committed()
        complete = sorted(view.answer(lambda v=view, c=committed: v.complete_of(c), []))
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


def abandoned(namespace: str, store: Storage, step: int) -> bool:
    """Whether an uncommitted step will never be committed: its save recorded a failure,
    or nothing in it belongs to a running save (every pin's process is gone)."""
    sdir = step_dir(namespace, step)
    names = store.list(sdir)
    if any(is_failed_note(n) for n in names):
        return True
    for name in names:
        if _is_pin(name):
            try:
                if owner_alive(store.read(f"{sdir}/{name}", 0, NOTE_LIMIT)):
                    return False  # its save may still commit it (an async save in flight)
            except OSError:  # gone, or no file to read (a pin is never that)
                continue
    return True


def failure(namespace: str, store: Storage, step: int) -> str | None:
    """The errors a failed save of ``step`` recorded in ``store``, if any."""
    sdir = step_dir(namespace, step)
    notes = []
    for name in sorted(n for n in store.list(sdir) if is_failed_note(n)):
        with contextlib.suppress(OSError):  # gone, or no file to read
            notes.append(store.read(f"{sdir}/{name}", 0, NOTE_LIMIT).decode("utf-8", "replace"))
    return "; ".join(notes) or None


def _missing_listed(ns: str, store: Storage, marker: Marker, sizes: dict[str, int]) -> list[str]:
    """What a listing of a committed step's directory (names and sizes) shows missing."""
    step = marker.step
    problems = []
    if sizes.get(METADATA) != marker.metadata_size:
        problems.append(f"{store.describe(metadata_key(ns, step))} missing or wrong size")
    for p in marker.parts:
        index = index_key(ns, step, p.rank).rsplit("/", 1)[1]
        if sizes.get(part_name(p.rank)) != p.size or index not in sizes:
            problems.append(f"{store.describe(part_key(ns, step, p.rank))} missing or wrong size")
    return problems
