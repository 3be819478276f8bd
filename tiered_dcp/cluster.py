"""The load side of node-local tiers: what the cluster still holds, and reads from peers.

Each rank looks only at its own root of each node-local tier (a real node sees no other
node's disks) and tells the others which parts of which steps it holds. A step is
complete *in the cluster* when the union of those holdings covers every part of one
save (same metadata checksum) and someone still has its metadata. Items a rank's own root
lacks (its node was wiped or replaced, or its copy is damaged) are read from a peer that
holds them, over a gloo group of the load's own, round by round until none is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, read_item, verify_raw
from tiered_dcp.storage.format import ItemInfo, Record, metadata_key

from .catalog import TierView
from .transport import Group, as_bytes_tensor


@dataclass
class Holding:
    """What one rank's own root of one node-local tier holds of one committed step."""

    ident: int  # the metadata's checksum: the same on every node for one save
    world_size: int
    parts: set[int]
    metadata: bool


@dataclass
class ClusterCopy:
    """A step complete in the union of the ranks' own roots of one node-local tier."""

    tier_index: int
    step: int
    ident: int
    holders: dict[int, list[int]]  # part rank -> current ranks whose own root holds it
    metadata_at: list[int] = field(default_factory=list)  # ranks whose root has the metadata


def own_holdings(view: TierView) -> dict[int, Holding]:
    store = view.own
    out = {}
    for step in view.step_dirs(store):
        marker = view.read_marker(store, step)
        if marker is None:
            continue
        md_ok = store.size(metadata_key(view.config.namespace, step)) == marker.metadata_size
        parts = {p.rank for p in marker.parts if view.part_present(store, marker, p.rank)}
        out[step] = Holding(marker.metadata_xxh3, marker.world_size, parts, md_ok)
    return out


def cluster_copies(
    tier_index: int, gathered: list[dict[int, Holding]]
) -> tuple[dict[int, ClusterCopy], dict]:
    """Steps complete in the union of every rank's holdings; for the rest, the parts lost."""
    saves: dict[tuple[int, int], ClusterCopy] = {}
    sizes: dict[tuple[int, int], int] = {}
    for rank, holdings in enumerate(gathered):
        for step, h in holdings.items():
            c = saves.setdefault((step, h.ident), ClusterCopy(tier_index, step, h.ident, {}))
            sizes[(step, h.ident)] = h.world_size
            for p in sorted(h.parts):
                c.holders.setdefault(p, []).append(rank)
            if h.metadata:
                c.metadata_at.append(rank)
    complete: dict[int, ClusterCopy] = {}
    lost: dict[int, list[int]] = {}
    for key, c in saves.items():
        missing = sorted(set(range(sizes[key])) - set(c.holders))
        if not missing and c.metadata_at:
            complete[c.step] = c
        else:
            lost[c.step] = missing
    return complete, {s: m for s, m in lost.items() if s not in complete}


@dataclass
class PeerRequest:
    """One item this rank wants from a peer: where it is and how long its raw bytes are."""

    tier_index: int
    part: int
    index: MetadataIndex
    length: int


def read_raw(store: Storage, rec: Record) -> bytearray:
    """An item's raw bytes from this rank's own root, verified (for a peer that asked)."""
    out = bytearray(rec.raw_length)
    read_item(store, rec, memoryview(out))
    return out


def anyone_wants(asked: list[dict[int, list[PeerRequest]]]) -> bool:
    return any(reqs for wanted in asked for reqs in wanted.values())


def peer_round(
    group: Group,
    asked: list[dict[int, list[PeerRequest]]],
    serve: Callable[[PeerRequest], bytearray | None],
) -> list[tuple[int, PeerRequest, torch.Tensor]]:
    """Serve what others asked of this rank and receive what it asked for (unverified).

    ``asked[i]`` is member i's wish list by holder. An item a holder cannot read is sent
    as zeros, so that it fails the requester's check. Raises PeerTimeout.
    """
    me = group.members[group.me]
    sends = []
    for requester, theirs in enumerate(asked):
        for req in theirs.get(me, []):
            data = serve(req)
            if data is None or len(data) != req.length:
                data = bytearray(req.length)
            sends.append((group.members[requester], as_bytes_tensor(data)))
    arrived, recvs = [], []
    for holder, reqs in asked[group.me].items():
        for req in reqs:
            buf = torch.empty(req.length, dtype=torch.uint8)
            arrived.append((holder, req, buf))
            recvs.append((holder, buf))
    group.exchange(sends, recvs)
    return arrived


def check_raw(info: ItemInfo, buf: torch.Tensor) -> None:
    """Verify bytes a peer sent against the metadata's chunk checksums."""
    view = memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")
    if len(view) != info.raw_length:
        raise ChecksumMismatch(f"{len(view)} bytes where {info.raw_length} were expected")
    verify_raw(info, view)
