"""Tier placement: where a tier keeps a step's parts, replicas, metadata and marker.

A tier is either *shared* (one root for the whole job: a bucket, an NFS mount) or
*node-local* (a root per node, or per rank with ``{rank}``: RAM, a local SSD). That fact
is the config's (``Tier.is_shared``); what follows from it is this module's, and nothing
else asks. Each tier gets one ``Placement`` (``placement_for``), and the rest of the code
asks it the questions whose answers differ:

- where a rank's part and its replicas live (``root``, ``holders``, ``parts_written_by``);
- which roots a process scans for committed steps (``scan_roots``);
- who writes a root's metadata and marker on the save path (``commits_root``,
  ``commits_in_finish``), and when the writer process may commit a root it copied into
  (``copied_marker``);
- whether a step is whole in one root, which decides what retention keeps (``whole``);
- how a load sees the tier (``pooled``: each rank its own root, pooled with the others').

Retention always prunes the own root only, after that root's commit, on both kinds.
Torch-free: the writer process uses it. A new kind of placement (say, one replica on a
peer node plus a bucket) is a new subclass here and a case in ``placement_for``.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tiered_dcp.storage.format import Marker, PartInfo, index_key, marker_key, part_key, step_dir

from .cliques import clique
from .config import Tier

if TYPE_CHECKING:
    from .catalog import StepCopy, TierView

Nodes = Mapping[int, int]  # rank -> node, as in the marker's parts (a save's world)


def nodes_of(marker: Marker) -> dict[int, int]:
    """The save's rank -> node layout, from its marker."""
    return {p.rank: p.node for p in marker.parts}


class Placement(ABC):
    """Where one tier keeps a step, seen as pure layout plus the few checks that read a root."""

    #: The save path commits the tier once, in ``TieredWriter.finish`` on the coordinator
    #: (else each root is committed by its own writer once every rank is clean: ``replicate``).
    commits_in_finish: bool
    #: A load sees only each rank's own root and pools the ranks' holdings, reading what
    #: its root lacks from peers (``cluster``); else every rank sees the whole tier.
    pooled: bool

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    def root(self, node: int, rank: int) -> str:
        """The root (base path or URL) a process on ``node`` with ``rank`` writes into."""
        return self.tier.root(node, rank)

    def _distinct_roots(self, ranks: Sequence[int], nodes: Nodes) -> list[int]:
        """``ranks`` that are in the save, one per root, first one kept."""
        seen: set[str] = set()
        out = []
        for r in ranks:
            if r not in nodes:
                continue
            url = self.root(nodes[r], r)
            if url not in seen:
                seen.add(url)
                out.append(r)
        return out

    @abstractmethod
    def holders(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        """Ranks whose root holds a copy of ``rank``'s part: its own first, one per root."""

    @abstractmethod
    def parts_written_by(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        """The parts whose copy ``rank`` writes into its own root: its own first, then replicas."""

    @abstractmethod
    def scan_roots(self, node: int, rank: int) -> list[tuple[int, int]]:
        """(node, rank) of the roots a process scans for committed steps, own first."""

    @abstractmethod
    def commits_root(self, rank: int, nodes: Nodes) -> bool:
        """Whether ``rank`` writes its root's metadata and marker when a save commits."""

    @abstractmethod
    def parts_in_root(self, node: int, rank: int, marker: Marker) -> list[int]:
        """The parts of the step that the root of (node, rank) holds when it is whole."""

    @abstractmethod
    def whole(self, view: TierView, marker: Marker) -> bool:
        """Whether the view's own root still holds what it should of the step (what
        retention counts)."""

    @abstractmethod
    def copied_marker(self, src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
        """The marker that commits ``dst``'s own root once a writer has copied everything it
        should hold from ``src``; None while something is missing (a later writer commits)."""


class SharedPlacement(Placement):
    """One root for the whole job: every rank writes its part there, the coordinator commits it."""

    commits_in_finish = True
    pooled = False

    def holders(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        return self._distinct_roots([rank], nodes)

    def parts_written_by(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        return [rank]

    def scan_roots(self, node: int, rank: int) -> list[tuple[int, int]]:
        return [(node, rank)]  # the only root

    def commits_root(self, rank: int, nodes: Nodes) -> bool:
        return rank == 0  # the coordinator, in TieredWriter.finish

    def parts_in_root(self, node: int, rank: int, marker: Marker) -> list[int]:
        return [p.rank for p in marker.parts]

    def whole(self, view: TierView, marker: Marker) -> bool:
        return not view.missing(view.own, marker)  # every part and the metadata

    def copied_marker(self, src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
        """Every rank's index is in the root: this writer was the last; the sizes are this tier's.

        Learnt from one listing of the step's directory (names and sizes; an index is written
        after its part, so a listed index means its part is whole at the listed size), read
        page by page in name order and given up at the first page that shows a rank's index
        missing: a writer that is not the last usually stops after one page, the last one
        reads ceil(2N / 1000) pages. No index is read, and nothing is polled.
        """
        ns, step = dst.config.namespace, copy.step
        index, part = (lambda r: _name(index_key(ns, step, r))), (lambda r: _name(part_key(ns, step, r)))
        ranks = sorted((p.rank for p in copy.marker.parts), key=index)  # as the listing orders them
        listed: dict[str, int] = {}
        seen = 0
        for page in dst.own.list_pages(step_dir(ns, step)):
            listed.update(page)
            last = max(page, default="")
            while seen < len(ranks) and index(ranks[seen]) <= last:
                if index(ranks[seen]) not in listed:
                    return None  # that rank's writer is not done: it (or a later one) commits
                seen += 1
        if any(index(r) not in listed or part(r) not in listed for r in ranks):
            return None
        # Writers finishing together may all see every index: one that finds this save
        # committed already leaves the commit (and its retention) to the writer that did it.
        if _name(marker_key(ns, step)) in listed:
            done = dst.read_marker(dst.own, step)
            if done is not None and done.metadata_xxh3 == copy.marker.metadata_xxh3:
                return None
        parts = [PartInfo(p.rank, p.node, listed[part(p.rank)]) for p in copy.marker.parts]
        return dataclasses.replace(copy.marker, parts=parts, created=time.time())


class NodeLocalPlacement(Placement):
    """A root per node (or rank): each holds its ranks' parts, their clique peers' replicas,
    and its own copy of the metadata and marker (the same bytes everywhere)."""

    commits_in_finish = False
    pooled = True

    def holders(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        factor, jump = replication
        members = [rank] + [m for m in clique(rank, len(nodes), factor, jump) if m != rank]
        return self._distinct_roots(members, nodes)

    def parts_written_by(self, rank: int, nodes: Nodes, replication: Sequence[int]) -> list[int]:
        factor, jump = replication
        mine = self.root(nodes[rank], rank)
        peers = clique(rank, len(nodes), factor, jump)
        return [rank] + [q for q in peers if q != rank and self.root(nodes[q], q) != mine]

    def scan_roots(self, node: int, rank: int) -> list[tuple[int, int]]:
        return [(node, rank), (0, 0)]  # own, and the coordinator's usual root where reachable

    def commits_root(self, rank: int, nodes: Nodes) -> bool:
        mine = self.root(nodes[rank], rank)
        return next(r for r in sorted(nodes) if self.root(nodes[r], r) == mine) == rank  # its lowest rank

    def parts_in_root(self, node: int, rank: int, marker: Marker) -> list[int]:
        nodes, root = nodes_of(marker), self.root(node, rank)
        return [
            p.rank
            for p in marker.parts
            if root in (self.root(nodes[h], h) for h in self.holders(p.rank, nodes, marker.replication))
        ]

    def whole(self, view: TierView, marker: Marker) -> bool:
        held = self.parts_in_root(view.node, view.rank, marker)
        return all(view.part_present(view.own, marker, r) for r in held)  # the metadata is not counted

    def copied_marker(self, src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
        """The root holds an index of every part its source root holds whole; the metadata and
        marker are the source's, as on every node. Whichever of its writers is last commits."""
        ns, step = dst.config.namespace, copy.step
        held = [p.rank for p in copy.marker.parts if src.part_present(src.own, copy.marker, p.rank)]
        if not all(dst.own.exists(index_key(ns, step, rank)) for rank in held):
            return None
        return dataclasses.replace(copy.marker, created=time.time())


def _name(key: str) -> str:
    """The last component of a key: the name a listing of its directory gives."""
    return key.rsplit("/", 1)[1]


def placement_for(tier: Tier) -> Placement:
    """The tier's placement, from the config's one fact about it."""
    return SharedPlacement(tier) if tier.is_shared else NodeLocalPlacement(tier)
