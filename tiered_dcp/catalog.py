"""What is on each tier: step directories, commit markers, completeness, retention.

On-storage layout of one tier root (see docs/format.md)::

    <root>/<namespace>/step_<12-digit step>/
        rank_<5-digit rank>.part   one per rank: its items' chunks back to back
        metadata                   DCP Metadata (pickled), storage_data = per-item records
        COMMITTED                  JSON marker, written last; readers trust nothing without it

A step's marker and metadata are written to the coordinator's root and to every root
that holds a part of the step; each part lives in the root of the rank that wrote it.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from dataclasses import asdict, dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from tiered_dcp.storage import Storage, open_storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum
from tiered_dcp.storage.local import DIRTY

from .config import Tier, TieredConfig

log = logging.getLogger("tiered_dcp")

FORMAT_VERSION = 1
MARKER = "COMMITTED"
METADATA = "metadata"
STEP_PREFIX = "step_"
PIN_PREFIX = "pin."


def step_dir(namespace: str, step: int) -> str:
    return f"{namespace}/{STEP_PREFIX}{step:012d}"


def part_name(rank: int) -> str:
    return f"rank_{rank:05d}.part"


def index_key(namespace: str, step: int, rank: int) -> str:
    """Rank's records on a tier the writer process filled: what its commit is built from."""
    return f"{step_dir(namespace, step)}/rank_{rank:05d}.index"


def pin_key(namespace: str, step: int, rank: int, target: int) -> str:
    """A pin: rank's writer still has to copy this step to tier ``target``; retention waits."""
    return f"{step_dir(namespace, step)}/{PIN_PREFIX}rank_{rank:05d}.t{target:02d}"


@dataclass
class PartInfo:
    rank: int
    node: int
    size: int


@dataclass
class Marker:
    """The commit marker: what a complete copy of the step consists of."""

    step: int
    namespace: str
    world_size: int
    parts: list[PartInfo]
    metadata_size: int
    metadata_xxh3: int
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        d = json.loads(data)
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"unsupported marker format {d.get('format')!r}")
        d["parts"] = [PartInfo(**p) for p in d["parts"]]
        return cls(**d)


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


def load_metadata(copy: StepCopy) -> Metadata:
    """The step's metadata from this copy, checked against the marker's checksum.

    Raises OSError when it cannot be read and ChecksumMismatch when it is damaged.
    """
    key = f"{step_dir(copy.marker.namespace, copy.step)}/{METADATA}"
    blob = copy.store.read(key)
    if checksum(blob) != copy.marker.metadata_xxh3:
        raise ChecksumMismatch(f"{copy.store.describe(key)}: checksum differs from the commit marker's")
    try:
        return pickle.loads(blob)
    except (pickle.UnpicklingError, EOFError, AttributeError) as e:
        raise ChecksumMismatch(f"{copy.store.describe(key)}: {e}") from e


class TierView:
    """One tier as seen from a process on (node, rank)."""

    def __init__(self, config: TieredConfig, index: int, node: int, rank: int) -> None:
        self.config = config
        self.index = index
        self.tier: Tier = config.tiers[index]
        self.node, self.rank = node, rank
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
        """This process's root and the coordinator's usual root (node 0, rank 0)."""
        roots = [self.own, self.store_for(0, 0)]
        return list({s.url: s for s in roots}.values())

    def step_dirs(self, store: Storage) -> list[int]:
        steps = []
        for name in store.list(self.config.namespace):
            if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
                steps.append(int(name[len(STEP_PREFIX) :]))
        return sorted(steps)

    def read_marker(self, store: Storage, step: int) -> Marker | None:
        key = f"{step_dir(self.config.namespace, step)}/{MARKER}"
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

    def part_store(self, marker: Marker, rank: int) -> Storage:
        info = next(p for p in marker.parts if p.rank == rank)
        return self.store_for(info.node, info.rank)

    def part_key(self, step: int, rank: int) -> str:
        return f"{step_dir(self.config.namespace, step)}/{part_name(rank)}"

    def missing(self, store: Storage, marker: Marker) -> list[str]:
        """What a committed copy lacks to be loadable from here (empty when complete)."""
        step = marker.step
        problems = []
        md_key = f"{step_dir(self.config.namespace, step)}/{METADATA}"
        if store.size(md_key) != marker.metadata_size:
            problems.append(f"{store.describe(md_key)} missing or wrong size")
        for p in marker.parts:
            ps = self.store_for(p.node, p.rank)
            key = self.part_key(step, p.rank)
            if ps.size(key) != p.size:
                problems.append(f"{ps.describe(key)} missing or wrong size")
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
        for store in self.scan_roots():
            for step in self.step_dirs(store):
                if step not in rows:
                    sdir = step_dir(self.config.namespace, step)
                    names = store.list(sdir)
                    size = sum(store.size(f"{sdir}/{n}") or 0 for n in names)
                    state = "writing" if any(DIRTY in n for n in names) else "clean"
                    rows[step] = StepState(self.index, self.tier.path, step, state, size, None)
        return [rows[s] for s in sorted(rows)]

    def apply_retention(self, newest: int) -> None:
        """Keep the newest ``keep`` complete steps; drop older ones and failed saves' leftovers.

        Runs after ``newest`` is committed, so the last complete step is never removed
        before a newer one exists. Markers go first: a half-deleted step is never trusted.
        """
        committed = self.committed()
        doomed: list[int] = []
        if self.tier.keep is not None:
            complete = [s for s, c in committed.items() if not self.missing(c.store, c.marker)]
            kept = sorted(complete)[-self.tier.keep :]
            doomed = [s for s in committed if s not in kept and s < newest]
        for step in doomed:
            marker = committed[step].marker
            roots = {s.url: s for s in self.scan_roots()}
            for p in marker.parts:
                ps = self.store_for(p.node, p.rank)
                roots[ps.url] = ps
            if any(self.pinned(store, step) for store in roots.values()):
                continue  # a writer process still copies it to a slower tier
            for store in roots.values():
                store.delete(f"{step_dir(self.config.namespace, step)}/{MARKER}")
            for store in roots.values():
                store.delete(step_dir(self.config.namespace, step))
        for store in self.scan_roots():
            for step in self.step_dirs(store):
                if step < newest and step not in committed and not self.pinned(store, step):
                    store.delete(step_dir(self.config.namespace, step))

    def pinned(self, store: Storage, step: int) -> bool:
        return any(n.startswith(PIN_PREFIX) for n in store.list(step_dir(self.config.namespace, step)))


def views(config: TieredConfig, node: int, rank: int) -> list[TierView]:
    return [TierView(config, i, node, rank) for i in range(len(config.tiers))]


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
