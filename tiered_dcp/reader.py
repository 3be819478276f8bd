"""TieredReader: the DCP StorageReader that loads a step from the best tier holding it.

The step is chosen when the reader is constructed (so a missing step raises
NoCheckpointError before ``dcp.load``), agreed by every rank when a process group is up.
Every chunk is verified; an item whose copy is damaged is read from the next tier that
holds the step, with a warning naming the bad file.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_dcp.planners.routing import narrow_to_request, whole_item_request
from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum, raw_length, read_item, verify_raw

from . import transport
from .catalog import (
    METADATA,
    StepCopy,
    TierView,
    complete_steps,
    describe_search,
    index_key,
    load_metadata,
    step_dir,
    views,
)
from .cluster import (
    ClusterCopy,
    PeerExchange,
    PeerRequest,
    check_raw,
    cluster_copies,
    own_holdings,
    read_raw,
)
from .config import TieredConfig, node_of
from .errors import CheckpointCorruptError, NoCheckpointError, TieredCheckpointError
from .tensors import byte_view, dtype_from_name
from .transport import PeerTimeout

log = logging.getLogger("tiered_dcp")


def _dist_rank() -> tuple[int, bool]:
    up = transport.dist_up()
    return (dist.get_rank() if up else 0), up


class TieredReader(StorageReader):
    """Loads ``step`` (default: the newest complete step anywhere) of ``config``.

    Construct it on every rank, as ``dcp.load`` is called on every rank: the ranks agree
    on the step here. With a process group, each rank reads only its own root of each
    node-local tier and the ranks pool what they hold (``cluster``): a step counts when
    every part survives on some node, and items this rank's root lacks come from a peer
    holding them, else from a shared tier. The newest step complete in the cluster is
    compared with the newest on a shared tier and the newer is loaded (the cluster's on a
    tie). ``no_dist=True`` skips the agreement (one process reading alone, seeing every
    path it can reach).
    """

    def __init__(self, config: TieredConfig, step: int | None = None, *, no_dist: bool = False) -> None:
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredReader: config must be a TieredConfig, got {type(config).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"TieredReader: step must be None or an integer >= 0, got {step!r}")
        self.config = config
        rank, up = _dist_rank()
        self.rank, self.node = rank, node_of(rank)
        self._dist = up and not no_dist
        self._views = {v.index: v for v in views(config, self.node, rank)}
        self._metadata: dict[int, Metadata | None] = {}
        self._bad_metadata: dict[int, str] = {}
        self._held: dict[tuple[str, int, int], dict | None] = {}  # (root, tier, part) -> records
        self._cluster: list[ClusterCopy] = []
        self._cluster_md: Metadata | None = None
        self._urls: dict[int, dict[int, str]] = {}  # tier -> rank -> its own root
        lost: dict[int, dict[int, list[int]]] = {}
        if self._dist:
            found, cluster, lost = self._pool()
            self._group_name = transport.next_name(config.namespace, "load")
        else:
            found, cluster = complete_steps(config, self.node, rank), {}
        in_cluster = {s for copies in cluster.values() for s in copies}
        loadable = set(found) | in_cluster
        searched = lambda: describe_search(config, self.node, rank) + _describe_cluster(cluster, lost)  # noqa: E731
        if step is None:
            if not loadable:
                raise NoCheckpointError(
                    f"no complete checkpoint of namespace {config.namespace!r} on any tier; searched:\n"
                    + searched()
                )
            step = max(loadable)
        elif step not in loadable:
            raise NoCheckpointError(
                f"step {step} of namespace {config.namespace!r} is not complete on any tier; searched:\n"
                + searched()
            )
        self.step = step
        self._cluster = [copies[step] for _, copies in sorted(cluster.items()) if step in copies]
        self._copies: list[StepCopy] = found.get(step, [])
        if self._dist:
            self._copies = [c for c in self._copies if self._views[c.tier_index].tier.is_shared]
            self._own = self._own_copies()
            self._explain(lost)
            if self._cluster:
                self._cluster_md = self._share_metadata(self._cluster[0])

    # -- choosing the step -------------------------------------------------------------

    def _pool(self) -> tuple[dict[int, list[StepCopy]], dict[int, dict[int, ClusterCopy]], dict]:
        """Every rank's holdings, pooled: shared steps all agree on, node-local steps by union."""
        mine: dict[int, Any] = {}
        shared = {v.index: v.complete() for v in self._views.values() if v.tier.is_shared}
        for v in self._views.values():
            mine[v.index] = sorted(shared[v.index]) if v.tier.is_shared else (v.own.url, own_holdings(v))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        found: dict[int, list[StepCopy]] = {}
        cluster: dict[int, dict[int, ClusterCopy]] = {}
        lost: dict[int, dict[int, list[int]]] = {}
        for v in self._views.values():
            if v.tier.is_shared:
                common = set.intersection(*(set(g[v.index]) for g in gathered))
                for s, copy in shared[v.index].items():
                    if s in common:
                        found.setdefault(s, []).append(copy)
            else:
                self._urls[v.index] = {r: g[v.index][0] for r, g in enumerate(gathered)}
                cluster[v.index], lost[v.index] = cluster_copies(v.index, [g[v.index][1] for g in gathered])
        for s in found:
            found[s].sort(key=lambda c: c.tier_index)
        return found, cluster, lost

    def _own_copies(self) -> dict[int, StepCopy]:
        """This rank's own root's copy of the chosen step on each node-local tier holding it."""
        own = {}
        for cc in self._cluster:
            view = self._views[cc.tier_index]
            marker = view.read_marker(view.own, self.step)
            if marker is not None and marker.metadata_xxh3 == cc.ident:
                own[cc.tier_index] = StepCopy(cc.tier_index, self.step, marker, view.own)
        return own

    def _explain(self, lost: dict[int, dict[int, list[int]]]) -> None:
        """Say where the step comes from, and why a newer one could not be used."""
        for tier_index, steps in sorted(lost.items()):
            for s, ranks in sorted(steps.items()):
                if s > self.step and self.rank == 0:
                    log.warning(
                        "step %d on tier %s cannot be loaded: no node holds the part of rank(s) %s any "
                        "more (every member of their clique lost it); loading step %d instead",
                        s,
                        self.config.tiers[tier_index].path,
                        ranks,
                        self.step,
                    )
        where = (
            f"the cluster's copies on tier {self._cluster[0].tier_index}"
            if self._cluster
            else f"shared tier {self._copies[0].tier_index}"
        )
        if self.rank == 0:
            log.info("loading step %d from %s", self.step, where)

    def _share_metadata(self, cc: ClusterCopy) -> Metadata:
        """The chosen save's metadata, read where a rank holds it and broadcast to all."""
        view = self._views[cc.tier_index]
        for src in cc.metadata_at:
            blob = None
            if src == self.rank:
                try:
                    blob = view.own.read(f"{step_dir(self.config.namespace, self.step)}/{METADATA}")
                except OSError as e:
                    log.warning("step %d: metadata unreadable on rank %d: %s", self.step, src, e)
                if blob is not None and checksum(blob) != cc.ident:
                    log.warning(
                        "step %d: metadata on rank %d differs from its marker's checksum", self.step, src
                    )
                    blob = None
            box = [blob]
            dist.broadcast_object_list(box, src=src)
            if box[0] is not None:
                return pickle.loads(box[0])
        raise CheckpointCorruptError(f"step {self.step}: its metadata is damaged on every node holding it")

    @property
    def tiers(self) -> list[int]:
        """Indexes of the tiers holding the chosen step complete, fastest first."""
        return sorted({c.tier_index for c in self._cluster} | {c.tier_index for c in self._copies})

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def _load_metadata(self, copy: StepCopy) -> Metadata | None:
        if self._cluster_md is not None and not self._views[copy.tier_index].tier.is_shared:
            return self._cluster_md  # the same bytes on every node and node-local tier
        if copy.tier_index not in self._metadata:
            md = None
            try:
                md = load_metadata(copy)
            except (OSError, ChecksumMismatch) as e:
                self._bad_metadata[copy.tier_index] = str(e)
                log.warning("step %d: metadata unusable (%s); trying the next tier", self.step, e)
            self._metadata[copy.tier_index] = md
        return self._metadata[copy.tier_index]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cluster_md is not None:
            return self._cluster_md
        for copy in self._copies:
            md = self._load_metadata(copy)
            if md is not None:
                return md
        raise CheckpointCorruptError(
            f"step {self.step}: metadata damaged on every tier holding it: "
            + "; ".join(self._bad_metadata.values())
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _part_records(self, view: TierView, store: Storage, marker: Any, part: int) -> dict | None:
        """Part's records in ``store`` (its index), or None when the root lacks it whole."""
        key = (store.url, view.index, part)
        if key not in self._held:
            records = None
            if view.part_present(store, marker, part):
                try:
                    records = pickle.loads(store.read(index_key(self.config.namespace, self.step, part)))
                except FileNotFoundError:
                    records = {}  # written before indexes existed: the metadata's records hold
                except (OSError, pickle.UnpicklingError, EOFError) as e:
                    log.warning(
                        "step %d: index of rank %d's part in %s unreadable: %s", self.step, part, store.url, e
                    )
            self._held[key] = records
        return self._held[key]

    def _locate(self, copy: StepCopy, req: ReadItem) -> tuple[dict, Storage, str] | None:
        md = self._load_metadata(copy)
        if md is None or req.storage_index not in md.storage_data:
            return None
        rec = md.storage_data[req.storage_index]
        part = rec["rank"]
        view: TierView = self._views[copy.tier_index]
        key = view.part_key(self.step, part)
        if view.tier.is_shared:
            return rec, view.part_store(copy.marker, part), key
        store = view.own if self._dist else view.part_store(copy.marker, part)
        records = self._part_records(view, store, copy.marker, part)
        if records is None:
            return None
        return records.get(req.storage_index, rec), store, key

    def _read_one(self, req: ReadItem, planner: LoadPlanner, rec: dict, store: Storage, key: str) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raw = bytearray(raw_length(rec))
            read_item(store, key, rec, memoryview(raw))
            planner.load_bytes(req, io.BytesIO(raw))
            return
        target = planner.resolve_tensor(req).detach()
        dtype, shape = dtype_from_name(rec["dtype"]), rec["shape"]
        if (
            rec["codec"] == "raw"
            and whole_item_request(req, shape)
            and target.dtype == dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
            and list(target.shape) == list(shape)
        ):
            out = byte_view(target)
            if len(out):
                store.read_into(key, rec["offset"], out)
            verify_raw(rec, out)
            planner.commit_tensor(req, target)
            return
        full = torch.empty(shape, dtype=dtype)
        read_item(store, key, rec, byte_view(full))
        self._place(req, planner, full, target)

    def _place(self, req: ReadItem, planner: LoadPlanner, full: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the requested piece of a whole stored item into the target and commit it."""
        piece = narrow_to_request(full, req)
        if piece.size() != target.size():
            raise TieredCheckpointError(
                f"item {req.storage_index.fqn}: stored piece {tuple(piece.size())} does not "
                f"fit the target {tuple(target.size())}"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)

    def _read_direct(self, req: ReadItem, planner: LoadPlanner, copies: list[StepCopy]) -> bool:
        """Read ``req`` from the first of ``copies`` this process can reach that is good."""
        for copy in copies:
            located = self._locate(copy, req)
            if located is None:
                continue
            rec, store, key = located
            try:
                self._read_one(req, planner, rec, store, key)
                return True
            except (ChecksumMismatch, OSError) as e:
                where = store.describe(key)
                self._failures.setdefault(id(req), []).append(f"{where}: {e}")
                log.warning(
                    "step %d: item %r in %s is damaged (%s); trying another copy",
                    self.step,
                    req.storage_index.fqn,
                    where,
                    e,
                )
        return False

    # -- peers --------------------------------------------------------------------------

    def _next_peer(self, req: ReadItem, tried: set[tuple[int, int]]) -> tuple[int, PeerRequest] | None:
        """The next (tier, holder) not tried yet for ``req``, skipping roots this rank reads."""
        assert self._cluster_md is not None
        rec = self._cluster_md.storage_data.get(req.storage_index)
        if rec is None:
            return None
        for cc in self._cluster:
            urls = self._urls[cc.tier_index]
            holders = cc.holders.get(rec["rank"], [])
            start = self.rank % len(holders) if holders else 0
            for holder in holders[start:] + holders[:start]:  # spread the requesters over the holders
                if urls[holder] == urls[self.rank] or (cc.tier_index, holder) in tried:
                    continue
                tried.add((cc.tier_index, holder))
                return holder, PeerRequest(cc.tier_index, rec["rank"], req.storage_index, raw_length(rec))
        return None

    def _serve(self, req: PeerRequest) -> bytearray | None:
        view = self._views[req.tier_index]
        try:
            own = self._own[req.tier_index]  # asked only of ranks whose own root holds the part
            records = self._part_records(view, view.own, own.marker, req.part) or {}
            rec = records.get(req.index) or self._load_metadata(own).storage_data[req.index]
            return read_raw(view, self.step, req.part, rec)
        except (ChecksumMismatch, OSError, KeyError) as e:
            log.warning(
                "step %d: cannot serve item %r of rank %d's part from %s to a peer: %s",
                self.step,
                req.index.fqn,
                req.part,
                view.own.describe(view.part_key(self.step, req.part)),
                e,
            )
            return None

    def _read_from_peers(self, pending: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Fetch items from peers that hold them, round by round; return those still missing.

        Every rank takes part (it may have to serve) until no rank wants anything; an
        intact load ends after one round of store operations, no group opened. A peer
        that does not answer within ``peer_timeout`` ends the exchange for this rank: what
        is left is read from a shared tier holding the step.
        """
        assert self._cluster_md is not None
        tried: dict[int, set[tuple[int, int]]] = {id(r): set() for r in pending}
        exchange = PeerExchange(self._group_name, self.rank, dist.get_world_size(), self.config.peer_timeout)
        try:
            while True:
                wanted: dict[int, list[PeerRequest]] = {}
                order: dict[int, list[ReadItem]] = {}
                for req in pending:
                    found = self._next_peer(req, tried[id(req)])
                    if found is not None:
                        holder, peer_req = found
                        wanted.setdefault(holder, []).append(peer_req)
                        order.setdefault(holder, []).append(req)
                arrived = exchange.round(wanted, self._serve)
                if arrived is None:
                    return pending
                reqs = [r for holder in wanted for r in order[holder]]
                done = set()
                for (holder, _, buf), req in zip(arrived, reqs, strict=True):
                    rec = self._cluster_md.storage_data[req.storage_index]
                    try:
                        check_raw(rec, buf)
                    except ChecksumMismatch as e:
                        self._failures.setdefault(id(req), []).append(f"from rank {holder}: {e}")
                        log.warning(
                            "step %d: item %r from rank %d arrived damaged (%s)",
                            self.step,
                            req.storage_index.fqn,
                            holder,
                            e,
                        )
                        continue
                    self._deliver(req, planner, rec, buf)
                    done.add(id(req))
                pending = [r for r in pending if id(r) not in done]
        except PeerTimeout as e:
            if pending:
                log.warning(
                    "step %d: a peer did not answer within %.0f s (%s); reading the %d item(s) "
                    "still missing from a shared tier",
                    self.step,
                    self.config.peer_timeout,
                    e,
                    len(pending),
                )
            return pending

    def _deliver(self, req: ReadItem, planner: LoadPlanner, rec: dict, buf: torch.Tensor) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(buf.numpy().tobytes()))
            return
        target = planner.resolve_tensor(req).detach()
        full = buf.view(dtype_from_name(rec["dtype"])).reshape(rec["shape"])
        self._place(req, planner, full, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._failures: dict[int, list[str]] = {}
        own = (
            [self._own[cc.tier_index] for cc in self._cluster if cc.tier_index in self._own]
            if self._dist
            else []
        )
        direct = own if self._dist else self._copies
        pending = [req for req in plan.items if not self._read_direct(req, planner, direct)]
        if self._dist and self._cluster:
            pending = self._read_from_peers(pending, planner)
        if self._dist:
            pending = [req for req in pending if not self._read_direct(req, planner, self._copies)]
        if pending:
            req = pending[0]
            detail = "; ".join(self._failures.get(id(req), [])) or "no tier or peer holds it"
            raise CheckpointCorruptError(
                f"step {self.step}: no good copy of item {req.storage_index.fqn!r} "
                f"(offset {list(req.storage_index.offset or [])}) left"
                f"{f' (and {len(pending) - 1} more)' if len(pending) > 1 else ''}: {detail}"
            )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _describe_cluster(
    cluster: dict[int, dict[int, ClusterCopy]], lost: dict[int, dict[int, list[int]]]
) -> str:
    """Extra lines for errors: what the ranks' own roots hold together."""
    lines = []
    for tier_index in sorted(set(cluster) | set(lost)):
        complete = sorted(cluster.get(tier_index, {}))
        broken = ", ".join(f"step {s} lacks rank(s) {r}" for s, r in sorted(lost.get(tier_index, {}).items()))
        lines.append(
            f"\n  tier {tier_index} pooled over every rank: complete steps {complete or 'none'}"
            + (f"; {broken}" if broken else "")
        )
    return "".join(lines)
