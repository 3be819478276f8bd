"""Clique replication layout: which ranks hold copies of each other's parts.

As in NVIDIA's CliqueReplicationStrategy: with ``replication_factor`` F and
``replication_jump`` J, ranks n, n+J, ..., n+(F-1)J form a clique (within blocks of F*J
consecutive ranks). J is typically the number of ranks per node, so that a clique's members
sit on different nodes and the loss of one node leaves a copy of every part.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tiered_dcp")
_warned: set[tuple[int, int, int]] = set()


def clique(rank: int, world: int, factor: int, jump: int) -> list[int]:
    """The ranks of ``rank``'s clique, itself included, in rank order."""
    block = factor * jump
    base = rank // block * block + rank % jump
    return [base + k * jump for k in range(factor)]


def peer_node(rank: int) -> int:
    """The node of another rank, as far as this process can tell (rank // LOCAL_WORLD_SIZE)."""
    lws = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank // lws if lws > 0 else 0


def check_cliques(world: int, factor: int, jump: int) -> None:
    """Refuse a layout that cannot be built; warn when a clique cannot survive a node loss."""
    if factor == 1:
        return
    block = factor * jump
    if world % block:
        works = [j for j in range(1, world // factor + 1) if world % (factor * j) == 0]
        hint = (
            f"with {world} rank(s), replication_jump={' or '.join(map(str, works))} would work"
            if works
            else f"replication needs at least replication_factor={factor} ranks"
        )
        raise ValueError(
            f"replication_factor={factor} with replication_jump={jump} needs a world size divisible "
            f"by {factor}*{jump}={block}, but this job has {world} rank(s): {hint}, "
            "or set replication_factor=1 to turn replication off"
        )
    key = (world, factor, jump)
    if key in _warned:
        return
    for r in range(world):
        members = clique(r, world, factor, jump)
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
