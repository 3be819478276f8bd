"""Reading a step once from a shared tier and spreading it over the job.

With data parallelism (DDP, HSDP's replicate dimension, a replicated plain tensor) every
replica asks for the same stored items; read by each, a bucket serves the step once per
replica. Instead, when a step is loaded from a shared tier by several ranks, DCP's global
plan (``TieredReader.prepare_global_plan``, on the coordinator, which sees every rank's
plan) gives each stored item that two or more ranks ask for one reader (``plan_spread``):
the asking rank whose node, then itself, has been given the fewest bytes so far (largest
items first), so reads spread over nodes before they double up on one. An item that more
than ``FANOUT`` ranks ask for is read once per group of ``FANOUT`` neighbouring ranks, so
no reader sends to more than ``FANOUT - 1`` ranks and no rank's plan grows with the job.
Every rank learns its part of it in its own plan's ``storage_data`` (a ``SpreadPlan``), so
no collective is added. The reader reads the item as any read (checked, its next source tried on damage),
and sends its raw bytes to the others over gloo groups of two (``transport.Group``, with
``peer_timeout`` as deadline: a dead rank fails the load naming it, never a hang); a rank
that could not read it sends zeros. Each receiver checks what arrived against the
metadata's checksums and reads the item itself when it does not match.

Transfers go in windows of ``WINDOW_BYTES`` in the job's order, so what a receiver holds
beyond its targets is one window; a reader holds the items it read for others until their
window is sent (where its own target is not the stored item's raw bytes).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from tiered_dcp.planners.routing import holds_stored_bytes
from tiered_dcp.storage.format import ItemInfo, ItemKey

from ..ranks import transport, worlds
from ..steps.metadata import item_key
from ..tensors import byte_tensor, dtype_from_name

WINDOW_BYTES = 256 << 20  # raw bytes in flight per window of transfers
FANOUT = 8  # ranks that share one read of an item: a reader sends to FANOUT - 1 at most


@dataclass(frozen=True)
class Transfer:
    """One stored item read by ``reader`` and sent to ``receivers`` (``nbytes`` raw)."""

    key: ItemKey
    reader: int
    receivers: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class SpreadPlan:
    """A rank's part in a load's spread: the transfers it reads for or receives, in the
    job's order (every rank lists the transfers it shares in the same order)."""

    transfers: tuple[Transfer, ...]

    def reads_for_others(self, rank: int) -> set[ItemKey]:
        return {t.key for t in self.transfers if t.reader == rank}

    def receives(self, rank: int) -> set[ItemKey]:
        return {t.key for t in self.transfers if t.reader != rank}


@dataclass(frozen=True)
class RankFacts:
    """What a rank's local plan tells the coordinator beside its items: its global rank (a
    plan's place is its rank in DCP's group, which may be a subgroup) and its node."""

    node: int
    rank: int


def plan_spread(
    plans: list[LoadPlan], nbytes: Callable[[ItemKey], int | None], facts: list[RankFacts]
) -> list[SpreadPlan]:
    """Each plan's ``SpreadPlan``: every stored item that two or more ranks' ``plans`` ask for
    gets one reader among them, the one whose node and then itself hold the fewest bytes
    given so far (largest items first; ties to the lowest rank). Ranks are global ones
    (``facts``, one per plan). A pure function of the plans: the coordinator's choice,
    handed to each rank in its plan."""
    nodes = {f.rank: f.node for f in facts}
    askers: dict[ItemKey, set[int]] = {}
    for plan, f in zip(plans, facts, strict=True):
        for req in plan.items:
            askers.setdefault(item_key(req.storage_index), set()).add(f.rank)
    shared = [
        (k, group)
        for k, r in askers.items()
        if len(r) > 1 and nbytes(k) is not None
        for group in _groups(sorted(r))
    ]
    shared.sort(key=lambda kr: (-(nbytes(kr[0]) or 0), kr[0].fqn, kr[0].offset or ()))
    per_node: dict[int, int] = {}
    per_rank: dict[int, int] = {}
    transfers = []
    for key, ranks in shared:
        n = nbytes(key) or 0
        reader = min(ranks, key=lambda r: (per_node.get(nodes[r], 0), per_rank.get(r, 0), r))
        per_node[nodes[reader]] = per_node.get(nodes[reader], 0) + n
        per_rank[reader] = per_rank.get(reader, 0) + n
        transfers.append(Transfer(key, reader, tuple(r for r in ranks if r != reader), n))
    return [
        SpreadPlan(tuple(t for t in transfers if f.rank == t.reader or f.rank in t.receivers)) for f in facts
    ]


def _groups(ranks: list[int]) -> list[list[int]]:
    """``ranks`` in groups of at most ``FANOUT`` neighbours (a rank alone joins the one before):
    a reader sends to a few ranks, whatever the number of replicas."""
    groups = [ranks[i : i + FANOUT] for i in range(0, len(ranks), FANOUT)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2] += groups.pop()
    return groups


def windows(transfers: Iterable[Transfer]) -> list[list[Transfer]]:
    """``transfers`` in order, cut into windows of about ``WINDOW_BYTES`` (one at least)."""
    out: list[list[Transfer]] = [[]]
    held = 0
    for t in transfers:
        if out[-1] and held + t.nbytes > WINDOW_BYTES:
            out.append([])
            held = 0
        out[-1].append(t)
        held += t.nbytes
    return [w for w in out if w]


def partners(rank: int, transfers: Iterable[Transfer]) -> list[int]:
    """The ranks ``rank`` sends bytes to or receives bytes from in ``transfers``, in order:
    the only ones it opens a group with. Two receivers of one item exchange nothing, nor do
    the ends of an empty item; were they to open a group, the one done first would close it
    while the other might still be connecting (gloo then fails that one's setup: "Connection
    closed by peer"), and with ``FANOUT`` receivers each would open ``FANOUT - 2`` groups for
    nothing."""
    out: set[int] = set()
    for t in transfers:
        if t.nbytes and t.reader == rank:
            out.update(t.receivers)
        elif t.nbytes and rank in t.receivers:
            out.add(t.reader)
    return sorted(out)


def exchange(
    name: str,
    rank: int,
    spread: SpreadPlan,
    timeout: float,
    outgoing: Callable[[Transfer], torch.Tensor],
    landing: Callable[[Transfer], torch.Tensor],
    landed: Callable[[Transfer, torch.Tensor], None],
) -> None:
    """Move this rank's transfers, window by window: ``outgoing(t)`` gives (and lets go of)
    the raw bytes of an item it read (zeros where it could not), ``landing(t)`` the bytes an arriving item
    lands in (its target's own, where they are the stored raw bytes), ``landed(t, buf)``
    takes what arrived (unchecked). Raises ``transport.PeerTimeout`` naming a rank that did
    not answer."""
    worlds.sweep("load")
    groups: dict[int, transport.Group] = {}
    try:
        for peer in partners(rank, spread.transfers):  # one global order of pairs: no two wait on each other
            pair = (min(rank, peer), max(rank, peer))
            group_name = f"{name}/spread/pair{pair[0]}-{pair[1]}"
            worlds.sweep_later("load", transport.group_keys(group_name, pair.index(rank)))
            groups[peer] = transport.Group(group_name, pair, rank, timeout)
        for window in windows(spread.transfers):
            posted, arrived, sending = [], [], []
            for t in window:
                if t.reader == rank:
                    data = outgoing(t)
                    sending.append(data)  # held until its sends are waited for
                    for r in t.receivers if t.nbytes else ():
                        posted.append((groups[r], groups[r].post([(r, data)], [])))
                else:
                    buf = landing(t)
                    if t.nbytes:
                        posted.append((groups[t.reader], groups[t.reader].post([], [(t.reader, buf)])))
                    arrived.append((t, buf))
            for group, works in posted:
                group.wait(works)
            for t, buf in arrived:
                landed(t, buf)
    finally:
        for group in groups.values():
            group.close()


class KeepRaw:
    """The load's planner as seen by the reads of items this rank reads for others: each
    such item is read whole (``whole``), into its target where the target is the stored
    item's raw bytes, else into host memory; its raw bytes are kept (``raw``) to be sent,
    and every request of this rank for the item is served from them."""

    def __init__(
        self,
        planner: LoadPlanner,
        asks: dict[ItemKey, list[ReadItem]],
        info: Callable[[ItemKey], ItemInfo],
        place: Callable[[ReadItem, LoadPlanner, torch.Tensor, torch.Tensor], None],
    ) -> None:
        self.planner, self.asks, self.info, self.place = planner, asks, info, place
        self.raw: dict[ItemKey, torch.Tensor] = {}

    def whole(self, key: ItemKey) -> ReadItem:
        """A request for all of stored item ``key`` (this rank's own request when it is)."""
        req = self.asks[key][0]
        if req.type == LoadItemType.BYTE_IO:
            return req
        shape = list(self.info(key).shape or ())
        zeros = torch.Size([0] * len(shape))
        return dataclasses.replace(req, dest_offsets=zeros, storage_offsets=zeros, lengths=torch.Size(shape))

    def exact(self, key: ItemKey) -> torch.Tensor | None:
        """This rank's target of ``key`` when it alone asks for it, whole, as stored (its
        bytes are the stored item's raw bytes)."""
        info = self.info(key)
        if len(self.asks[key]) != 1 or self.asks[key][0].type != LoadItemType.TENSOR:
            return None
        req = self.asks[key][0]
        target = self.planner.resolve_tensor(req).detach()
        exact = holds_stored_bytes(req, target, dtype_from_name(info.dtype or ""), info.shape or ())
        return target if exact else None

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        key = item_key(req.storage_index)
        info = self.info(key)
        target = self.exact(key)
        return (
            target
            if target is not None
            else torch.empty(list(info.shape or ()), dtype=dtype_from_name(info.dtype or ""))
        )

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        key = item_key(req.storage_index)
        self.raw[key] = byte_tensor(tensor)
        for ask in self.asks[key]:
            target = self.planner.resolve_tensor(ask).detach()
            if target.data_ptr() == tensor.data_ptr() and target.shape == tensor.shape:  # read in place
                self.planner.commit_tensor(ask, target)
            else:
                self.place(ask, self.planner, tensor, target)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        key = item_key(req.storage_index)
        raw = value.getvalue()
        self.raw[key] = transport.as_bytes_tensor(raw)
        for ask in self.asks[key]:
            self.planner.load_bytes(ask, io.BytesIO(raw))
