"""The load plan: for each item, where it is read from, in fallback order.

Plans are plain frozen dataclasses, as DCP's own ``LoadPlan``/``ReadItem``, and planning is
a pure function of what the reader learned while choosing the step (``Sources``): which
tiers this rank's own roots hold it on, which ranks' roots hold which parts (pooled), and
which shared tiers hold it complete. ``TieredReader.read_data`` executes the routes; a
new read policy (prefer a shared tier for cold items, skip a slow peer...) is a change
here, not in the reader. Torch-free.

Fallback order with a process group: this rank's own root on each node-local tier
(fastest tier first), then peers holding the item's part (per tier, fastest first; the
holders rotated by the item, so that every rank asking for an item asks the same holder
first, which reads it once for all of them, and different items spread over the holders;
roots this rank reads itself skipped), then shared tiers (fastest first). A process alone (no group) pools
nothing: it reads every tier holding the step complete itself, fastest first.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

SourceKind = Literal["own", "peer", "shared"]


@dataclass(frozen=True)
class ReadSource:
    """One place an item can be read from.

    ``own``: a root this process reads itself: its own root of a node-local tier (``root``
    its URL), or, for a process alone, whichever root of the tier holds the part whole
    (``root`` None). ``peer``: the own root of rank ``holder`` on node-local tier ``tier``,
    over the peer exchange. ``shared``: a shared tier's one root.
    """

    kind: SourceKind
    tier: int
    holder: int | None = None
    root: str | None = None


@dataclass(frozen=True)
class ItemRoute:
    """Where one read item (``index``: its DCP storage index) is read from, first source first."""

    index: Hashable
    sources: tuple[ReadSource, ...]

    def split_at_exchange(self) -> tuple[tuple[ReadSource, ...], tuple[ReadSource, ...]]:
        """(the leading own-root sources, the other non-peer sources in order).

        The peer exchange is collective (every rank serves while it asks), so the reader
        runs it once for all items between the two: every rank joins it after reading only
        its own roots, and a slow shared read never holds the others up.
        """
        n = next((i for i, s in enumerate(self.sources) if s.kind != "own"), len(self.sources))
        return self.sources[:n], tuple(s for s in self.sources[n:] if s.kind != "peer")

    @property
    def peers(self) -> tuple[ReadSource, ...]:
        return tuple(s for s in self.sources if s.kind == "peer")


@dataclass(frozen=True)
class PooledTier:
    """A node-local tier whose ranks' own roots hold the step complete between them."""

    tier: int
    holders: Mapping[int, list[int]]  # part rank -> ranks whose own root holds it whole
    roots: Mapping[int, str]  # rank -> its own root's URL on this tier


@dataclass(frozen=True)
class Sources:
    """What the reader knows of the chosen step's copies, as seen by rank ``me``."""

    me: int
    pooled: tuple[PooledTier, ...] = ()  # node-local tiers complete in the cluster, fastest first
    own: Mapping[int, str] = field(default_factory=dict)  # tier -> own root URL holding the step
    shared: Mapping[int, str] = field(default_factory=dict)  # tier -> the shared root holding it
    alone: Mapping[int, SourceKind] = field(default_factory=dict)  # no group: tier -> kind, all read here


def _own(src: Sources, part: int) -> list[ReadSource]:
    out = []
    for pt in sorted(src.pooled, key=lambda p: p.tier):
        if pt.tier in src.own and src.me in pt.holders.get(part, []):
            out.append(ReadSource("own", pt.tier, root=src.own[pt.tier]))
    return out


def _spot(index: Hashable) -> int:
    """A number of the item alone, the same in every process (``hash`` of a str is not)."""
    key = (index.fqn, tuple(index.offset or ())) if hasattr(index, "fqn") else index
    return zlib.crc32(repr(key).encode())


def _peers(src: Sources, index: Hashable, part: int) -> list[ReadSource]:
    out = []
    for pt in sorted(src.pooled, key=lambda p: p.tier):
        holders = list(pt.holders.get(part, []))
        start = _spot(index) % len(holders) if holders else 0
        for holder in holders[start:] + holders[:start]:
            if pt.roots.get(holder) != pt.roots.get(src.me):
                out.append(ReadSource("peer", pt.tier, holder=holder))
    return out


def route(src: Sources, index: Hashable, part: int | None) -> ItemRoute:
    """The sources of one item of ``part``.

    ``part`` None: the pooled metadata does not place the item (no node-local tier holds
    the step, or the item is unknown), so only shared tiers can serve it.
    """
    if src.alone:
        return ItemRoute(index, tuple(ReadSource(kind, t) for t, kind in sorted(src.alone.items())))
    sources: list[ReadSource] = []
    if part is not None:
        sources += _own(src, part) + _peers(src, index, part)
    sources += [ReadSource("shared", t, root=url) for t, url in sorted(src.shared.items())]
    return ItemRoute(index, tuple(sources))


def plan_routes(src: Sources, items: Iterable[tuple[Hashable, int | None]]) -> list[ItemRoute]:
    """One route per (item index, its part's rank), in the items' order."""
    return [route(src, index, part) for index, part in items]
