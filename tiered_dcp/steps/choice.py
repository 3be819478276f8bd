"""Step choice: which steps a load may choose from, and which one it picks.

The one owner of the rule, used by ``api.latest_step``, the reader's opening (``load.open_step``)
and the ``tiered-dcp`` command. A *candidate* is a step complete somewhere (every part and
its metadata readable: on a node-local tier, ``TierView.complete``; pooled over the ranks'
own roots, ``peer_exchange.cluster_copies``; on a shared tier only its newest complete good step,
``newest_complete``, so that a bucket is asked little), judged by one save of it
(``same_save``) and its marks. The choice (``choose``) is a pure function of the candidates:
every rank calls it on the same pooled facts (``TieredReader`` gathers them first), so every
rank makes the same choice with no further talk. A step is passed over when it is
*quarantined* (a load found an item of it with no good copy left, ``format.quarantine_key``)
or *non-finite* (its save found NaN/Inf, ``Marker.nonfinite_items``), or its save found
data-parallel replicas that disagree (``Marker.replica_mismatch_items``), or when the caller
excludes it (``load_latest``: it failed to load just now, or cannot be loaded through its
caller, with the reason given). Falling back after a failed load is choosing again.
Torch-free: ``latest_step`` and ``tiered-dcp ls`` start fast.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tiered_dcp.storage.format import Marker, step_dir

from .catalog import StepCopy, TierView


@dataclass(frozen=True)
class StepMarks:
    """What loads must know of one step beyond its being complete somewhere."""

    step: int
    quarantined: str | None = None  # why a load quarantined it (None: it was not)
    nonfinite_items: int = 0  # items its save found holding NaN/Inf
    nonfinite: tuple[str, ...] = ()  # the first of them, by name
    replica_items: int = 0  # items whose data-parallel replicas disagreed when saved
    replicas: tuple[str, ...] = ()  # the first of them, by name
    replica_ranks: tuple[int, ...] = ()  # the ranks whose copies were the odd ones

    @classmethod
    def of(cls, step: int, marker: Marker, quarantined: str | None) -> StepMarks:
        """A step's marks from its marker (non-finite items, replicas that disagreed) and its
        quarantine (why, or None)."""
        return cls(step, quarantined, marker.nonfinite_items, tuple(marker.nonfinite), *replica_marks(marker))

    @property
    def good(self) -> bool:
        return self.quarantined is None and self.nonfinite_items == 0 and self.replica_items == 0

    def why(self) -> str:
        """Why the step is passed over, in a few words ("" when it is good)."""
        reasons = []
        if self.quarantined is not None:
            reasons.append(f"quarantined ({self.quarantined})")
        if self.nonfinite_items:
            more = self.nonfinite_items - len(self.nonfinite)
            names = ", ".join(self.nonfinite) + (f" and {more} more" if more > 0 else "")
            reasons.append(f"non-finite (NaN/Inf in {names})")
        if self.replica_items:
            more = self.replica_items - len(self.replicas)
            names = ", ".join(self.replicas) + (f" and {more} more" if more > 0 else "")
            ranks = ", ".join(map(str, self.replica_ranks))
            reasons.append(f"replicas disagree (in {names}; odd copies on rank(s) {ranks})")
        return "; ".join(reasons)

    def merged(self, other: StepMarks) -> StepMarks:
        """The step as two copies of it say: a mark on either counts."""
        return StepMarks(
            self.step,
            self.quarantined if self.quarantined is not None else other.quarantined,
            max(self.nonfinite_items, other.nonfinite_items),
            self.nonfinite or other.nonfinite,
            max(self.replica_items, other.replica_items),
            self.replicas or other.replicas,
            self.replica_ranks or other.replica_ranks,
        )

    def to_json(self) -> list:
        """Plain data, for the ranks that did not look themselves (``discovery``)."""
        return [
            *(self.step, self.quarantined, self.nonfinite_items, list(self.nonfinite)),
            *(self.replica_items, list(self.replicas), list(self.replica_ranks)),
        ]

    @classmethod
    def from_json(cls, doc: list) -> StepMarks:
        step, why, n, names, *replicas = doc
        r, rnames, ranks = replicas if replicas else (0, [], [])
        return cls(
            int(step),
            None if why is None else str(why),
            int(n),
            tuple(map(str, names)),
            int(r),
            tuple(map(str, rnames)),
            tuple(map(int, ranks)),
        )


def replica_marks(marker: Marker) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """A marker's replica marks, as ``StepMarks`` holds them."""
    return marker.replica_mismatch_items, tuple(marker.replica_mismatch), tuple(marker.replica_ranks)


def pool_marks(marks: Iterable[StepMarks]) -> dict[int, StepMarks]:
    """step -> its marks over every copy seen (every tier, every rank's root)."""
    out: dict[int, StepMarks] = {}
    for m in marks:
        out[m.step] = out[m.step].merged(m) if m.step in out else m
    return out


@dataclass(frozen=True)
class Choice:
    """The step to load (None: no step qualifies) and the newer steps passed over, with why."""

    step: int | None
    skipped: Mapping[int, str]


def choose(
    candidates: Mapping[int, StepMarks],
    requested: int | None = None,
    exclude: Collection[int] | Mapping[int, str] = (),
) -> Choice:
    """``requested`` if it is among the complete ``candidates`` (marked or not: asked for by
    number, it is loaded anyway); else the newest good candidate not in ``exclude`` (a
    mapping gives the reason each is excluded; "" or a plain collection: it failed to load)."""
    if requested is not None:
        return Choice(requested if requested in candidates else None, {})
    skipped: dict[int, str] = {}
    for step in sorted({*candidates, *exclude}, reverse=True):  # an excluded step is named even
        if step in exclude:  # where the look that found the candidates left it out (a shared tier's)
            why = exclude.get(step) if isinstance(exclude, Mapping) else None
            skipped[step] = why or "it failed to load just now"
        elif not candidates[step].good:
            skipped[step] = candidates[step].why()
        else:
            return Choice(step, skipped)
    return Choice(None, skipped)


def describe_skipped(skipped: Mapping[int, str]) -> str:
    """One clause per step passed over, newest first, for warnings and errors."""
    return "; ".join(f"step {s}: {why}" for s, why in sorted(skipped.items(), reverse=True))


def marks_of(view: TierView, copy: StepCopy) -> StepMarks:
    """What a committed copy says of its step: quarantined (in its root), non-finite (its marker)."""
    m = copy.marker
    why = view.quarantined(copy.store, copy.step, m.metadata_xxh3)
    return StepMarks.of(copy.step, m, why)


@dataclass
class Found:
    """Complete copies per step, fastest tier first, with the marks already known of them
    (a shared tier's, read by whoever found it) and of the newer complete steps a shared
    tier passed over (quarantined, non-finite, replicas that disagreed, or excluded: a load
    says why)."""

    copies: dict[int, list[StepCopy]] = field(default_factory=dict)
    marks: dict[tuple[int, int], StepMarks] = field(default_factory=dict)  # (tier, step) -> marks
    passed: list[StepMarks] = field(default_factory=list)

    def add(self, copy: StepCopy, marks: StepMarks | None = None) -> None:
        self.copies.setdefault(copy.step, []).append(copy)
        if marks is not None:
            self.marks[(copy.tier_index, copy.step)] = marks

    def merge(self, other: Found) -> None:
        for copies in other.copies.values():
            for c in copies:
                self.add(c, other.marks.get((c.tier_index, c.step)))
        self.passed += other.passed


def newest_complete(view: TierView, step: int | None = None, exclude: Iterable[int] = ()) -> Found:
    """A shared tier's newest complete good step (or ``step``, if complete, good or not),
    found with few requests however many ranks saved it: the namespace listing, then
    newest first one marker read and one listing of the step's directory (names and
    sizes) per step until a complete one. That listing is kept (``TierView.listings``) for
    the load's reads. Newer complete steps that are marked (``StepMarks.good``) are passed
    over (``Found.passed``, for the load to say why), and so are ``exclude``."""
    return view.answer(lambda: _newest_complete(view, step, set(exclude)), Found())


def _newest_complete(view: TierView, step: int | None, exclude: set[int]) -> Found:
    found, store = Found(), view.own
    steps = view.step_dirs(store)
    for s in sorted(steps, reverse=True) if step is None else [s for s in steps if s == step]:
        if s in exclude:
            continue
        marker = view.read_marker(store, s)
        if marker is None:
            continue
        sizes = store.list_sizes(step_dir(view.config.namespace, s))
        if view.missing(store, marker, sizes):
            continue
        copy = StepCopy(view.index, s, marker, store)
        marks = marks_of(view, copy)
        if step is None and not marks.good:
            found.passed.append(marks)
            continue
        view.listings[(store.url, s)] = sizes
        found.add(copy, marks)
        return found
    return found


def loadable_steps(tier_views: Iterable[TierView], step: int | None, exclude: Iterable[int] = ()) -> Found:
    """What a load chooses from: every complete step of the node-local tiers, and the newest
    complete good step (or ``step``) of each shared one (``newest_complete``: no more is
    needed to choose the newest, and a bucket is asked little), fastest tier first."""
    found = Found()
    for view in tier_views:
        if view.placement.pooled:
            for copy in view.complete().values():
                found.add(copy)
        else:
            found.merge(newest_complete(view, step, exclude))
    return found


def one_save(found: Found, idents: Mapping[int, int] | None = None) -> Found:
    """Per step, only the copies of one save of it: ``idents`` (step -> metadata checksum),
    else that of its fastest tier's copy (the fastest tier takes a step first, so a slower
    tier may still hold an older save of a step number saved again, until its writer copies
    the new one). Copies of two saves are never mixed: not their marks, not their items.
    Formats 1 and 2 kept each tier's records in its metadata, so their checksum differs per
    tier: those copies are all kept, as before."""
    out = Found(marks=found.marks, passed=found.passed)
    for step, copies in found.copies.items():
        current = [c for c in copies if c.marker.has_indexes]
        ident = (idents or {}).get(step, current[0].marker.metadata_xxh3 if current else None)
        kept = [c for c in copies if not c.marker.has_indexes or c.marker.metadata_xxh3 == ident]
        if kept:
            out.copies[step] = kept
    return out


class ClusterSave(Protocol):
    """A step complete in the union of the ranks' own roots of one node-local tier
    (``peer_exchange.ClusterCopy``), as far as the choice needs it: which save, and its marks."""

    tier_index: int
    ident: int  # the save's metadata checksum
    legacy: bool  # format 1/2: ``ident`` differs per tier

    @property
    def step_marks(self) -> StepMarks: ...


Cluster = Mapping[int, Mapping[int, ClusterSave]]  # tier -> step -> its copy in the cluster


def same_save(found: Found, cluster: Cluster) -> tuple[Found, dict[int, dict[int, ClusterSave]]]:
    """Per step, the copies of its fastest tier's save only (``one_save``), in the cluster
    and on the shared tiers alike: what the step is judged by (its marks). Reads may still
    fall back to a copy of another save of the same step number: see docs/user-guide.md,
    "Recovery", for that open case."""
    seen = [
        (c.tier_index, s, c.ident) for copies in cluster.values() for s, c in copies.items() if not c.legacy
    ]
    seen += [
        (c.tier_index, s, c.marker.metadata_xxh3)
        for s, copies in found.copies.items()
        for c in copies
        if c.marker.has_indexes
    ]
    idents: dict[int, int] = {}
    for _, s, ident in sorted(seen):
        idents.setdefault(s, ident)
    kept = {
        t: {s: c for s, c in copies.items() if c.legacy or c.ident == idents.get(s, c.ident)}
        for t, copies in cluster.items()
    }
    return one_save(found, idents), kept


def candidates(
    tier_views: Iterable[TierView], found: Found, cluster: Cluster | None = None
) -> dict[int, StepMarks]:
    """step -> its marks, for every complete step known here (``found`` on the tiers seen
    through ``tier_views``, ``cluster`` pooled over the ranks), each judged by one save of
    it (``same_save``): what ``choose`` chooses from. A step a shared tier passed over is
    judged by the copies of it found elsewhere, if any (a slower tier may hold an older
    save of a step number saved again)."""
    tier_views = list(tier_views)
    judged, judged_cluster = same_save(found, cluster or {})
    in_cluster = [c.step_marks for copies in judged_cluster.values() for c in copies.values()]
    by_index = {v.index: v for v in tier_views}
    marks = [
        judged.marks.get((c.tier_index, c.step)) or marks_of(by_index[c.tier_index], c)
        for copies in judged.copies.values()
        for c in copies
    ]
    held = set(judged.copies) | {m.step for m in in_cluster}
    passed = [m for m in judged.passed if m.step not in held]
    return pool_marks(marks + passed + in_cluster)


def newest_loadable(tier_views: Iterable[TierView]) -> int | None:
    """The newest good step complete on some tier seen through ``tier_views`` (no
    collectives): what ``TieredReader(config)`` alone would load (``api.latest_step``)."""
    tier_views = list(tier_views)
    return choose(candidates(tier_views, loadable_steps(tier_views, None))).step


def newest_committed(tier_views: Iterable[TierView]) -> int | None:
    """The newest step committed on some tier, complete or not: what ``tiered-dcp verify``
    checks by default (a damaged step is what it is for)."""
    return max((s for v in tier_views for s in v.committed()), default=None)
