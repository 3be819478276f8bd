"""What is on each tier: committed steps, completeness, the commit, retention and status.

How a tier root is laid out is ``storage.format``'s business (docs/format.md); where a
tier keeps a step's parts, replicas, metadata and marker (one shared root, or a root per
node holding its ranks' parts and their clique peers' replicas) is ``placement``'s. This
module sees a tier through both. Torch-free: the writer process uses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tiered_dcp.storage import Storage, blocks, open_storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum
from tiered_dcp.storage.format import (
    BadIndex,
    IndexCache,
    Marker,
    PartIndex,
    index_key,
    marker_key,
    metadata_key,
    parse_step_dir,
    part_key,
    step_dir,
)
from tiered_dcp.storage.format import is_pin as _is_pin
from tiered_dcp.storage.local import DIRTY

from .config import Tier, TieredConfig
from .placement import Placement, nodes_of, placement_for

log = logging.getLogger("tiered_dcp")


@dataclass
class StepCopy:
    """One committed copy of a step on one tier: where its marker was found."""

    tier_index: int
    step: int
    marker: Marker
    store: Storage  # the root holding marker and metadata


@dataclass
class StepState:
    """A row of the status table: one step on one tier."""

    tier_index: int
    tier: str
    step: int
    state: str  # queued | writing | clean (parts, no marker yet) | committed | incomplete | failed
    size_bytes: int
    created: float | None
    error: str | None = None  # why a writer process could not write it (state "failed")
    logical_bytes: int = 0  # committed: the raw bytes of the step's items held in this tier
    stored_bytes: int = 0  # what its records name (after compression, before dedup)
    written_bytes: int = 0  # what its writers wrote for it here (without the blocks it reused)

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
        steps = (parse_step_dir(name) for name in store.list(self.config.namespace))
        return sorted(s for s in steps if s is not None)

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
        return marker if marker.step == step else None

    def holders(self, marker: Marker, rank: int) -> list[Storage]:
        """The roots that hold (a copy of) rank's part: its own first, then its clique's."""
        nodes = nodes_of(marker)
        ranks = self.placement.holders(rank, nodes, marker.replication)
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
        """Whether this process's root still holds every part it should hold of the step."""
        return self.placement.whole(self, marker)

    def part_store(self, marker: Marker, rank: int) -> Storage:
        """The first root (own copy first) holding rank's part whole; the own root if none."""
        stores = self.holders(marker, rank)
        return next((s for s in stores if self.part_present(s, marker, rank)), stores[0])

    def missing(self, store: Storage, marker: Marker) -> list[str]:
        """What a committed copy lacks to be loadable from here (empty when complete)."""
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

    def committed(self) -> dict[int, StepCopy]:
        """Every step with a commit marker visible from here (complete or not)."""
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
        return {s: c for s, c in self.committed().items() if not self.missing(c.store, c.marker)}

    def states(self) -> list[StepState]:
        rows: dict[int, StepState] = {}
        committed = self.committed()
        for step, c in committed.items():
            missing = self.missing(c.store, c.marker)
            size = sum(p.size for p in c.marker.parts) + c.marker.metadata_size
            rows[step] = StepState(
                self.index,
                self.tier.path,
                step,
                "incomplete" if missing else "committed",
                size,
                c.marker.created,
            )
            self._byte_counts(rows[step], c)
        for store in self.scan_roots():
            for step in self.step_dirs(store):
                if step not in rows:
                    sdir = step_dir(self.config.namespace, step)
                    names = store.list(sdir)
                    size = sum(store.size(f"{sdir}/{n}") or 0 for n in names)
                    state = "writing" if any(DIRTY in n for n in names) else "clean"
                    rows[step] = StepState(self.index, self.tier.path, step, state, size, None)
        return [rows[s] for s in sorted(rows)]

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
        before a newer one exists. Only the own root is touched: on a node-local tier every
        node prunes its own after its own commit (a marker there means the step was
        complete everywhere when it was committed). Only steps whose share of this root is
        still whole take one of the ``keep`` places. Markers go first, so a half-deleted
        step is never trusted. Failed saves' leftovers older than ``newest`` go too; pinned
        steps wait for their writer.
        """
        store = self.own
        ns = self.config.namespace
        committed = {}
        for step in self.step_dirs(store):
            marker = self.read_marker(store, step)
            if marker is not None:
                committed[step] = marker
        doomed: list[int] = []
        if self.tier.keep is not None:
            kept = sorted(s for s, m in committed.items() if self.whole_here(m))[-self.tier.keep :]
            doomed = [s for s in committed if s not in kept and s < newest]
        doomed += [s for s in self.step_dirs(store) if s < newest and s not in committed]
        deleted = 0
        for step in sorted(doomed):
            if self.pinned(store, step):
                continue  # a writer process still copies it to a slower tier
            store.delete(marker_key(ns, step))
            store.delete(step_dir(ns, step))
            deleted += 1
        if deleted:
            blocks.collect(store, ns)  # blocks no remaining step references (dedup)

    def pinned(self, store: Storage, step: int) -> bool:
        return any(_is_pin(n) for n in store.list(step_dir(self.config.namespace, step)))

    def commit(self, step: int, blob: bytes, marker: Marker) -> None:
        """Commit this process's root's copy of ``step`` and prune the root.

        The one commit path (the save path, replication and the writer process all call
        it): the metadata first, the marker last (the step's durability point in this
        root), then this tier's retention.
        """
        ns = self.config.namespace
        self.own.write(metadata_key(ns, step), [blob])
        self.own.write(marker_key(ns, step), [marker.to_bytes()])
        self.apply_retention(step)


def views(config: TieredConfig, node: int, rank: int, indexes: IndexCache | None = None) -> list[TierView]:
    """Every tier seen from (node, rank), sharing ``indexes`` (one operation's) if given."""
    indexes = indexes if indexes is not None else IndexCache()
    return [TierView(config, i, node, rank, indexes) for i in range(len(config.tiers))]


def complete_steps(config: TieredConfig, node: int, rank: int) -> dict[int, list[StepCopy]]:
    """step -> its complete copies (as seen from here), fastest tier first."""
    out: dict[int, list[StepCopy]] = {}
    for view in views(config, node, rank):
        for step, copy in view.complete().items():
            out.setdefault(step, []).append(copy)
    return out


def describe_search(config: TieredConfig, node: int, rank: int) -> str:
    """One line per tier: where it was searched and what it holds, for error messages."""
    lines = []
    for view in views(config, node, rank):
        committed = view.committed()
        complete = sorted(s for s, c in committed.items() if not view.missing(c.store, c.marker))
        roots = ", ".join(f"{s.url}/{config.namespace}" for s in view.scan_roots())
        broken = sorted(set(committed) - set(complete))
        extra = f"; committed but incomplete: {broken}" if broken else ""
        lines.append(f"  tier {view.index} [{roots}]: complete steps {complete or 'none'}{extra}")
    return "\n".join(lines)
