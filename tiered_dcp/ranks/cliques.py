"""Clique replication layout: which ranks hold copies of each other's parts.

Two rules, one ``Layout`` that every caller asks (``Layout.clique``): the writer, the
replica exchange, the writer process, the loader pooling replicas, ``ls`` and ``status``.

- The jump rule (no failure domain given), as in NVIDIA's CliqueReplicationStrategy: with
  ``replication_factor`` F and ``replication_jump`` J, ranks n, n+J, ..., n+(F-1)J form a
  clique (within blocks of F*J consecutive ranks). J is typically the number of ranks per
  node, so that a clique's members sit on different nodes and the loss of one node leaves
  a copy of every part.
- Failure domains (``TieredConfig(failure_domain=...)``): every rank's (node, domain) is
  gathered once (``domains.gather_layout``) and the cliques are laid out explicitly, each
  member in another domain (``by_domain``), so that losing a whole rack loses no part.
- A world the jump rule does not fit (a job that lost ranks and goes on with fewer, nodes
  of unequal size): the cliques are laid out by node from the save's own world
  (``by_node``), each spanning as many nodes as it can; a save never refuses for it.

A save records its layout in the step's marker (``Layout.marker_fields``), so a load, the
writer process, ``ls`` and another job's reader use the layout the step was saved with
(``Layout.of_marker``), never their own config's. Torch-free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_dcp.storage.format import Marker

log = logging.getLogger(__name__)
_warned: set[tuple[int, int, int]] = set()


@dataclass(frozen=True)
class Layout:
    """A save's cliques: the jump rule, or explicit ``groups`` placed by failure domain.

    ``domains`` (rank -> its failure domain) is kept when one was stated, for display.
    """

    world: int
    factor: int = 1
    jump: int = 1
    groups: tuple[tuple[int, ...], ...] = ()
    domains: tuple[str, ...] = ()

    def clique(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s clique, itself included, in rank order: THE clique rule."""
        if self.groups:
            return list(next(g for g in self.groups if rank in g))
        return jump_clique(rank, self.world, self.factor, self.jump)

    def cliques(self) -> list[list[int]]:
        """Every clique once, by its lowest rank."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world):
            members = self.clique(r)
            seen.setdefault(members[0], members)
        return [seen[k] for k in sorted(seen)]

    def describe(self) -> list[str]:
        """Each clique as ``[0, 2] in rack-a, rack-b`` (its members' domains where stated)."""
        out = []
        for members in self.cliques():
            where = f" in {', '.join(self.domains[m] for m in members)}" if self.domains else ""
            out.append(f"{members}{where}")
        return out

    def marker_fields(self) -> dict:
        """What a marker records of this layout (``format.Marker``): ``cliques`` and
        ``domains`` only when a failure domain placed them, so other markers read as before."""
        fields: dict = {"replication": [self.factor, self.jump]}
        if self.groups:
            fields["cliques"] = [list(g) for g in self.groups]
        if self.domains:
            fields["domains"] = list(self.domains)
        return fields

    @classmethod
    def of_marker(cls, marker: Marker) -> Layout:
        """The layout a step was saved with (format 1: no replication)."""
        factor, jump = marker.replication
        groups = tuple(tuple(g) for g in marker.cliques or ())
        return cls(marker.world_size, factor, jump, groups, tuple(marker.domains or ()))


def jump_clique(rank: int, world: int, factor: int, jump: int) -> list[int]:
    """The jump rule's clique of ``rank`` (``Layout.clique`` is what callers ask)."""
    block = factor * jump
    base = rank // block * block + rank % jump
    return [base + k * jump for k in range(factor)]


def by_node(factor: int, nodes: Sequence[int], jump: int = 1) -> Layout:
    """Cliques for a world of ranks on ``nodes`` (rank -> node) that the jump rule does not
    fit: the ranks, node by node (the most populous first), dealt round-robin into
    ``max(1, world // factor)`` cliques of ``factor`` to ``2 * factor - 1`` members (a world
    smaller than ``factor``: one clique of all), so that each clique spans as many nodes as
    there are, up to its size. ``jump`` (the config's, unused here) is only recorded."""
    world = len(nodes)
    count = max(1, world // factor)
    on: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        on.setdefault(n, []).append(r)
    order = [r for _, rs in sorted(on.items(), key=lambda kv: (-len(kv[1]), kv[0])) for r in rs]
    dealt: list[list[int]] = [[] for _ in range(count)]
    for i, r in enumerate(order):
        dealt[i % count].append(r)
    return Layout(world, factor, jump, tuple(sorted(tuple(sorted(g)) for g in dealt)))


def jump_fits(world: int, factor: int, jump: int) -> bool:
    """Whether the jump rule places ``world`` ranks (else ``by_node`` does)."""
    return factor == 1 or world % (factor * jump) == 0


def by_domain(
    factor: int, nodes: Sequence[int], domains: Sequence[str], source: str, jump: int = 1
) -> Layout:
    """Cliques of ranks each spanning failure domains (hence nodes), spread as evenly as the
    domains allow.

    Ranks are listed domain by domain (largest domain first, each by node then rank) and
    dealt round-robin into ``max(1, world // factor)`` cliques. In a world of a multiple of
    ``factor`` ranks every clique has ``factor`` members, each in another domain, and a
    domain holding more than world/factor ranks is refused (ValueError: no layout keeps the
    copies apart; the job's configuration is to change). A world that is not a multiple (a
    job that went on with fewer ranks after a fault) is never refused: its cliques have
    ``factor`` to ``2 * factor - 1`` members, as ``by_node`` deals them, and
    ``uneven_domains`` says once what each part keeps. ``source`` names the config's
    failure_domain in messages; ``jump`` (the config's, unused here) is only recorded.
    """
    world = len(nodes)
    members: dict[str, list[int]] = {}
    for r, d in enumerate(domains):
        members.setdefault(d, []).append(r)
    _one_domain_per_node(nodes, domains, source)
    if factor == 1:
        return Layout(world, 1, jump, (), tuple(domains))
    count = max(1, world // factor)
    order = sorted(members.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    dealt: list[list[int]] = [[] for _ in range(count)]
    for i, r in enumerate(r for _, rs in order for r in sorted(rs, key=lambda r: (nodes[r], r))):
        dealt[i % count].append(r)
    if world % factor == 0 and max(len(rs) for rs in members.values()) > count:
        found = ", ".join(
            f"{d!r}: {len(rs)} rank(s) on {len({nodes[r] for r in rs})} node(s)" for d, rs in order
        )
        need = (
            f"{factor} distinct domains per clique, so no domain may hold more than "
            f"{world}/{factor}={count} of the {world} ranks"
        )
        raise ValueError(
            f"replication_factor={factor} with failure_domain={source} needs {need}; the domains found "
            f"are {found}. State a finer domain (a rack rather than a zone), spread the job over more "
            f"domains, or lower replication_factor"
        )
    groups = tuple(sorted(tuple(sorted(g)) for g in dealt))
    return Layout(world, factor, jump, groups, tuple(domains))


def uneven_domains(layout: Layout) -> str | None:
    """What a save says once when its failure domains were dealt into cliques of uneven
    size (``by_domain``, a world that is not a multiple of the factor); None otherwise."""
    if all(len(g) == layout.factor for g in layout.groups):
        return None
    head = (
        f"replication_factor={layout.factor}: this world of {layout.world} rank(s) does not split into "
        f"cliques of {layout.factor}; by failure domain they are {[list(g) for g in layout.groups]}"
    )
    return head + _parts_keep(layout, layout.domains, "in one domain", "in another domain")


def _parts_keep(layout: Layout, places: Sequence[object], one: str, another: str) -> str:
    """What each part keeps under ``layout``, its ranks at ``places`` (their nodes or domains)."""
    if all(len(g) == 1 for g in layout.groups):
        return "; no replica can be placed: steps are saved without"
    if any(len({places[r] for r in g}) == 1 and len(g) > 1 for g in layout.groups):
        return f"; some cliques lie {one}: a part of theirs does not survive its loss"
    return f"; every part keeps a copy {another}"


def _one_domain_per_node(nodes: Sequence[int], domains: Sequence[str], source: str) -> None:
    """A node sits in one failure domain: ranks of one node naming two are a misstatement."""
    seen: dict[int, tuple[int, str]] = {}
    for r, (n, d) in enumerate(zip(nodes, domains, strict=True)):
        first = seen.setdefault(n, (r, d))
        if first[1] != d:
            raise ValueError(
                f"failure_domain={source}: node {n} has rank {first[0]} in domain {first[1]!r} and "
                f"rank {r} in {d!r}; a node sits in one failure domain: give all its ranks the same one"
            )


def uneven_world(layout: Layout, nodes: Sequence[int], jump: int) -> str:
    """What a save laid out by node (``by_node``) says once: why, and what each part keeps."""
    factor, world = layout.factor, len(nodes)
    works = [j for j in range(1, world // factor + 1) if world % (factor * j) == 0]
    hint = f" (replication_jump={' or '.join(map(str, works))} would fit it)" if works else ""
    head = (
        f"replication_factor={factor} with replication_jump={jump} does not fit this world of "
        f"{world} rank(s) on {len(set(nodes))} node(s){hint}: the cliques are laid out by node "
        f"instead, {[list(g) for g in layout.groups]}"
    )
    return head + _parts_keep(layout, nodes, "on one node", "on another node")


def peer_node(rank: int) -> int:
    """The node of another rank, as far as this process can tell (rank // LOCAL_WORLD_SIZE)."""
    lws = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank // lws if lws > 0 else 0


def check_cliques(world: int, factor: int, jump: int) -> None:
    """Warn when a clique of the jump rule cannot survive a node loss. A world the rule does
    not fit is laid out by node at each save (``by_node``, with its own warning)."""
    if not jump_fits(world, factor, jump):
        return
    key = (world, factor, jump)
    if key in _warned:
        return
    for r in range(world):
        members = jump_clique(r, world, factor, jump)
        nodes = [peer_node(m) for m in members]
        if len(set(nodes)) < len(nodes):
            _warned.add(key)
            log.warning(
                "replication_factor=%d, replication_jump=%d: the clique %s has members on the same "
                "node (nodes %s), so losing that node loses every copy of their parts; set "
                "replication_jump to the number of ranks per node (LOCAL_WORLD_SIZE=%s)",
                factor,
                jump,
                members,
                nodes,
                os.environ.get("LOCAL_WORLD_SIZE", "unset"),
            )
            return
