"""The save's clique layout, found once per process: failure domains gathered from every rank.

With ``TieredConfig(failure_domain=...)`` each rank reads its own domain (an environment
variable, or the config's function of its rank), and the job gathers every rank's (node,
domain) in one collective: a gloo group of our own over every rank (``transport.Group``,
so it works whatever backend the training uses), in the set-up of the first save of the
config (``TieredWriter.set_up_storage_writer``, which DCP runs on every rank: bad
configuration fails there, before any byte is written; constructors run no collective).
Every rank then lays
out the same cliques (``cliques.by_domain``) or raises the same ValueError, before any byte of
the save is written. The layout is kept for the process group's life (``LAYOUTS``): a
node's rack does not change under a running job, but a job restarted in its processes may
have other ranks on other nodes.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..config import TieredConfig, node_of
from . import transport, worlds
from .cliques import Layout, by_domain, check_cliques, uneven_domains

log = logging.getLogger(__name__)


class Layouts:
    """The failure domains' layouts this process gathered: a process-wide cache on purpose
    (a node's rack does not change under a running job, and every writer of the config would
    otherwise gather again), keyed by what a layout depends on: the config's namespace and
    domain source, the world size, the replication factor and jump; only for the process
    group it was gathered in (``worlds.generation``)."""

    def __init__(self) -> None:
        self._found: dict[tuple[Any, ...], Layout] = {}
        self._generation = 0

    def get(self, config: TieredConfig, world: int, rank: int) -> Layout:
        """The layout, gathered from every rank the first time (a collective)."""
        fd = config.failure_domain
        factor, jump = config.replication_factor, config.replication_jump
        key = (config.namespace, fd if isinstance(fd, str) else id(fd), world, factor, jump)
        if worlds.generation() != self._generation:
            self._found.clear()
            self._generation = worlds.generation()
        if key not in self._found:
            found = _gather(config, world, rank)
            errors = [f["error"] for f in found if f["error"]]
            if errors:
                raise ValueError("; ".join(errors))
            nodes = [int(f["node"]) for f in found]
            layout = by_domain(factor, nodes, [f["domain"] for f in found], source(config), jump)
            said = uneven_domains(layout)
            if said and rank == 0:  # every rank lays out the same: the job's log says it once
                log.warning("%s", said)
            self._found[key] = layout
        return self._found[key]


LAYOUTS = Layouts()


def layout_unless_gathered(config: TieredConfig, world: int, rank: int = 0) -> Layout | None:
    """The jump rule's cliques (warned about here when a clique lies on one node), or None
    when the layout comes from failure domains, which only every rank together can gather.
    A world the rule does not fit is laid out by node at the save (``parts.save_layout``)."""
    factor, jump = config.replication_factor, config.replication_jump
    if config.failure_domain is not None and factor > 1:
        return None
    if rank == 0:  # every rank lays out the same cliques: the job's log says it once
        check_cliques(world, factor, jump)
    return Layout(world, factor, jump)


def source(config: TieredConfig) -> str:
    """The config's failure_domain as messages name it."""
    fd = config.failure_domain
    return repr(fd) if isinstance(fd, str) else getattr(fd, "__qualname__", repr(fd))


def own_domain(config: TieredConfig, rank: int) -> tuple[str | None, str | None]:
    """(this rank's domain, None), or (None, why it has none)."""
    fd = config.failure_domain
    try:
        value = os.environ.get(fd) if isinstance(fd, str) else fd(rank)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 - told to every rank, with its cause
        return None, f"rank {rank}: failure_domain={source(config)} raised {type(e).__name__}: {e}"
    if isinstance(value, str) and value:
        return value, None
    unset = value is None and isinstance(fd, str)
    what = "is not set" if unset else f"gave {value!r}, not a non-empty string"
    where = f"the environment variable {fd}" if isinstance(fd, str) else f"failure_domain={source(config)}"
    return None, f"rank {rank}: {where} {what} (every rank must state its failure domain)"


def _gather(config: TieredConfig, world: int, rank: int) -> list[dict[str, Any]]:
    """Every rank's {node, domain, error}, in rank order (one rank alone: its own)."""
    domain, error = own_domain(config, rank)
    mine = {"node": node_of(rank), "domain": domain, "error": error}
    if world == 1 or not worlds.dist_up():
        return [mine]
    name = worlds.next_name(config.namespace, "domains")
    group = transport.Group(name, list(range(world)), rank, config.peer_timeout)
    try:
        blobs = group.allgather(json.dumps(mine).encode())
    finally:
        group.close()
    for key in transport.group_keys(name, rank):  # every member joined: its address is not read again
        worlds.store().delete_key(key)
    return [json.loads(b) for b in blobs]
