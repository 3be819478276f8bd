"""Tier placement: where a tier keeps a step's parts, replicas, metadata and marker.

A tier is either *shared* (one root for the whole job: a bucket, an NFS mount) or
*node-local* (a root per node, or per rank with ``{rank}``: RAM, a local SSD). That fact
is the config's (``Tier.is_shared``); ``placement_for`` is the only code in the library
that reads it, and what follows from it is this module's. Each tier gets one
``Placement``, and the rest of the code asks it the questions whose answers differ:

- where a rank's part and its replicas live (``root``, ``holders``, ``parts_written_by``,
  ``copies``: how many copies of a part the tier holds, which the host memory guard counts);
- which roots a process scans for committed steps (``scan_roots``), and whether a query
  that gets no answer skips the tier (``skips_unanswered``: a remote root) or raises;
- which protocol commits a save (``save_protocol``: the coordinator in DCP's finish, or
  every root after the store agreement; carried out by ``commit.for_save``), who writes a
  root's metadata and marker (``commits_root``), and by which rule the writer process may
  commit a root it copied into (``copy_commit``, carried out by ``commit.commit_copy``);
- whether the save path may start a root's block GC epoch (``starts_block_epoch``);
- what counts as a step whole in one root, which decides what retention keeps
  (``whole_rule``, checked by ``retention.whole_here``);
- how a load sees the tier (``pooled``: each rank its own root, pooled with the others'),
  and whether each root is a node's own (``node_owned``: the demo and the drill wipe it
  when they simulate losing the node).

Retention always prunes the own root only, after that root's commit, on both kinds.
A pure decision: no I/O, nothing imported from the modules that read roots. Torch-free:
the writer process uses it. A new kind of placement (say, one replica on a
peer node plus a bucket) is a new subclass here, a case in ``placement_for`` and the
config's way to name it; it picks its protocols from the enums below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import Enum

from tiered_dcp.storage.format import Marker

from ..config import Tier
from ..ranks.cliques import Layout

Nodes = Mapping[int, int]  # rank -> node, as in the marker's parts (a save's world)


class WholeRule(Enum):
    """What retention counts as a step whole in one root (``retention.whole_here``)."""

    LOADABLE = "loadable"  # the metadata and every part, as a load from this root needs
    OWN_PARTS = "own parts"  # every part the root should hold (``parts_in_root``), not the metadata


class SaveProtocol(Enum):
    """How the save path commits a step on its first tier (``commit.for_save``)."""

    COORDINATOR = "coordinator"  # one root: the coordinator commits it in DCP's finish
    AGREED = "agreed"  # every root, by its lowest rank, once every rank said its part is clean


class CopyCommit(Enum):
    """When a writer process commits a root it copied a step into (``commit.copied_marker``)."""

    EVERY_INDEX = "every index"  # every rank's index is in the root: this writer was the last
    SOURCE_PARTS = "source parts"  # an index of every part its source root holds whole


def nodes_of(marker: Marker) -> dict[int, int]:
    """The save's rank -> node layout, from its marker."""
    return {p.rank: p.node for p in marker.parts}


class Placement(ABC):
    """Where one tier keeps a step: pure layout, no I/O (the checks that read a root are
    ``catalog.TierView``'s and ``commit``'s, by the rules named here)."""

    #: How the save path commits the tier (``commit.for_save`` carries it out).
    save_protocol: SaveProtocol
    #: A load sees only each rank's own root and pools the ranks' holdings, reading what
    #: its root lacks from peers (``load.peer_exchange``); else every rank sees the whole tier.
    pooled: bool
    #: What retention counts as whole in one root.
    whole_rule: WholeRule
    #: When a writer process that copied a step into a root commits it.
    copy_commit: CopyCommit
    #: A query that gets no answer in time skips the tier (a remote root: a load goes on
    #: without it), else its error is raised (this machine's own files).
    skips_unanswered: bool
    #: The save path may start a root's block GC epoch (few writers per root); else only a
    #: GC does, as every rank of the job must not write one object at once.
    starts_block_epoch: bool
    #: Each root is a node's own (its RAM, its disk): a lost node loses it.
    node_owned: bool
    #: What the demo calls it.
    kind: str

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
    def copies(self, replication_factor: int) -> int:
        """How many copies of a rank's part the tier holds (its own and its replicas)."""

    @abstractmethod
    def holders(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
        """Ranks whose root holds a copy of ``rank``'s part: its own first, one per root."""

    @abstractmethod
    def parts_written_by(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
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


class SharedPlacement(Placement):
    """One root for the whole job: every rank writes its part there, the coordinator commits it."""

    save_protocol = SaveProtocol.COORDINATOR
    pooled = False
    whole_rule = WholeRule.LOADABLE
    copy_commit = CopyCommit.EVERY_INDEX
    skips_unanswered = True
    starts_block_epoch = False
    node_owned = False
    kind = "shared"

    def copies(self, replication_factor: int) -> int:
        return 1  # replication does not apply: one copy

    def holders(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
        return self._distinct_roots([rank], nodes)

    def parts_written_by(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
        return [rank]

    def scan_roots(self, node: int, rank: int) -> list[tuple[int, int]]:
        return [(node, rank)]  # the only root

    def commits_root(self, rank: int, nodes: Nodes) -> bool:
        return rank == 0  # the coordinator, in DCP's finish

    def parts_in_root(self, node: int, rank: int, marker: Marker) -> list[int]:
        return [p.rank for p in marker.parts]


class NodeLocalPlacement(Placement):
    """A root per node (or rank): each holds its ranks' parts, their clique peers' replicas,
    and its own copy of the metadata and marker (the same bytes everywhere)."""

    save_protocol = SaveProtocol.AGREED
    pooled = True
    whole_rule = WholeRule.OWN_PARTS
    copy_commit = CopyCommit.SOURCE_PARTS
    skips_unanswered = False
    starts_block_epoch = True
    node_owned = True
    kind = "node-local"

    def copies(self, replication_factor: int) -> int:
        return replication_factor  # its own, and its clique peers' replicas

    def holders(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
        members = [rank] + [m for m in layout.clique(rank) if m != rank]
        return self._distinct_roots(members, nodes)

    def parts_written_by(self, rank: int, nodes: Nodes, layout: Layout) -> list[int]:
        mine = self.root(nodes[rank], rank)
        peers = layout.clique(rank)
        return [rank] + [q for q in peers if q != rank and self.root(nodes[q], q) != mine]

    def scan_roots(self, node: int, rank: int) -> list[tuple[int, int]]:
        return [(node, rank), (0, 0)]  # own, and the coordinator's usual root where reachable

    def commits_root(self, rank: int, nodes: Nodes) -> bool:
        mine = self.root(nodes[rank], rank)
        return next(r for r in sorted(nodes) if self.root(nodes[r], r) == mine) == rank  # its lowest rank

    def parts_in_root(self, node: int, rank: int, marker: Marker) -> list[int]:
        nodes, root, layout = nodes_of(marker), self.root(node, rank), Layout.of_marker(marker)
        return [
            p.rank
            for p in marker.parts
            if root in (self.root(nodes[h], h) for h in self.holders(p.rank, nodes, layout))
        ]


def placement_for(tier: Tier) -> Placement:
    """The tier's placement, from the config's one fact about it."""
    return SharedPlacement(tier) if tier.is_shared else NodeLocalPlacement(tier)
