"""What ``status()`` and ``tiered-dcp ls`` say of each step on a tier: its row and its state.

A committed step is ``committed`` (loadable from here) or ``damaged`` (a file missing); a
step directory without a marker is ``writing``, ``clean`` (parts, no marker yet),
``incomplete`` (its save stopped before its commit and left no note) or ``failed``. The
writer processes add ``queued``, ``failed`` and ``skipped`` (``api.status``). Torch-free:
``tiered-dcp ls`` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_dcp.storage import Storage
from tiered_dcp.storage.format import is_failed_note, is_lease, is_pin, step_dir
from tiered_dcp.storage.local import DIRTY

from ..config import StrEnum
from ..ranks.cliques import Layout
from .catalog import StepCopy, TierView, abandoned, failure
from .choice import marks_of


class StepStatus(StrEnum):
    """The state of one step on one tier (a ``StepState`` row; docs/user-guide.md). Printed
    and written to JSON as its plain string, as before it was an enum."""

    QUEUED = "queued"  # waiting in a writer process's queue for this tier
    WRITING = "writing"  # a save is writing it
    CLEAN = "clean"  # written, not committed yet
    COMMITTED = "committed"  # committed and loadable from here
    DAMAGED = "damaged"  # committed, but a file is missing from here
    INCOMPLETE = "incomplete"  # its save stopped before its commit and left no note
    FAILED = "failed"  # its save (or a writer process's copy) recorded a failure
    SKIPPED = "skipped"  # a newer step took its place in the queue of a tier that was down


@dataclass
class StepState:
    """A row of the status table: one step on one tier."""

    tier_index: int
    tier: str
    step: int
    state: StepStatus
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
    # committed, but marked: why loads that choose a step pass it over (non-finite, replicas
    # that disagreed, quarantined: ``choice.StepMarks.why``)
    passed_over: str | None = None

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


def tier_states(view: TierView) -> list[StepState]:
    """One row per step the tier holds anything of (none when a shared tier is down)."""
    return view.answer(lambda: _states(view), [])


def _states(view: TierView) -> list[StepState]:
    rows = {step: _committed_row(view, c) for step, c in view.scan_committed().items()}
    for store in view.scan_roots():
        for step in view.step_dirs(store):
            if step not in rows:
                row = _uncommitted(view, store, step)
                if row is not None:
                    rows[step] = row
    return [rows[s] for s in sorted(rows)]


def _committed_row(view: TierView, c: StepCopy) -> StepState:
    """A committed step's row: committed, or damaged when something is missing from here."""
    missing = view.missing(c.store, c.marker)
    size = sum(p.size for p in c.marker.parts) + c.marker.metadata_size
    row = StepState(
        view.index,
        view.tier.path,
        c.step,
        StepStatus.DAMAGED if missing else StepStatus.COMMITTED,
        size,
        c.marker.created,
        f"committed, but not loadable from here: {'; '.join(missing)}" if missing else None,
    )
    _byte_counts(view, row, c)
    row.passed_over = marks_of(view, c).why() or None
    layout = Layout.of_marker(c.marker)
    if view.placement.pooled and layout.factor > 1:
        row.cliques, row.domains = layout.cliques(), list(layout.domains)
    return row


def _uncommitted(view: TierView, store: Storage, step: int) -> StepState | None:
    """A step directory without a marker: failed (a note says why, or its save is gone
    without writing anything), writing, or clean (parts, no marker yet); None when it
    holds nothing but leases (a reader raced its removal)."""
    sdir = step_dir(view.config.namespace, step)
    names = store.list(sdir)
    data = [n for n in names if not (is_pin(n) or is_lease(n) or is_failed_note(n))]
    size = sum(store.size(f"{sdir}/{n}") or 0 for n in data)
    bad = view.bad_markers.get((store.url, step))
    if bad is not None:  # a marker that fails its checks: committed once, perhaps, but not loadable
        return StepState(view.index, view.tier.path, step, StepStatus.DAMAGED, size, None, bad)
    error = failure(view.config.namespace, store, step)
    if error is None and not data:
        if not any(is_pin(n) for n in names):
            return None
        if abandoned(view.config.namespace, store, step):
            error = "its save ended before it wrote anything"
    if error is not None:
        state = StepStatus.FAILED
    elif data and interrupted(view, store, step, names):
        state, error = StepStatus.INCOMPLETE, leftover(view, store, step)
    else:
        state = StepStatus.WRITING if not data or any(DIRTY in n for n in data) else StepStatus.CLEAN
    return StepState(view.index, view.tier.path, step, state, size, None, error)


def interrupted(view: TierView, store: Storage, step: int, names: list[str] | None = None) -> bool:
    """Whether an uncommitted step's save stopped before its commit and left no note (it
    was killed, or its node lost): it pinned the step, and no pin's process is alive."""
    if names is None:
        names = store.list(step_dir(view.config.namespace, step))
    return any(is_pin(n) for n in names) and abandoned(view.config.namespace, store, step)


def leftover(view: TierView, store: Storage, step: int) -> str:
    """What ``ls`` and ``verify`` say of an interrupted save's files (``interrupted``)."""
    where = store.describe(step_dir(view.config.namespace, step))
    return (
        "never committed: the save that wrote it stopped before its commit (killed, or its "
        f"node lost); nothing reads it, safe to remove: {where}"
    )


def _byte_counts(view: TierView, row: StepState, copy: StepCopy) -> None:
    """Fill a committed row's logical / stored / written bytes from its parts' indexes."""
    for p in copy.marker.parts:
        found = (view.part_index(s, copy.marker, p.rank) for s in view.holders(copy.marker, p.rank))
        index = next((i for i in found if i is not None), None)
        if index is not None:
            row.logical_bytes += index.logical_bytes
            row.stored_bytes += index.stored_bytes
            row.written_bytes += index.written if index.written is not None else index.size
