"""TieredReader: the DCP StorageReader that loads a step from the best tier holding it.

The step is chosen when the reader is constructed (so a missing step raises
NoCheckpointError before ``dcp.load``), agreed by every rank when a process group is up.
Where each item is read from, in fallback order, is the load plan's (``planners.load``);
this class pools what the ranks hold, executes that plan and stays DCP glue. Every chunk
is verified; an item whose copy is damaged is read from its next source, with a warning
naming the bad file.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiered_dcp.planners.choice import choose, describe_skipped, pool_marks
from tiered_dcp.planners.load import ItemRoute, PooledTier, ReadSource, Sources, plan_routes
from tiered_dcp.planners.routing import narrow_to_request, whole_item_request
from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, checksum, read_item, verify_raw
from tiered_dcp.storage.format import IndexCache, ItemInfo, PartIndex, Record, metadata_key, part_key

from . import metadata as md_blob
from . import transport, user_values
from .catalog import (
    StepCopy,
    TierView,
    bounded,
    copies_marks,
    describe_search,
    loadable_steps,
    one_save,
    read_metadata_blob,
    views,
)
from .checkpoint_id import new_id, step_id, step_of
from .cluster import (
    ClusterCopy,
    PeerExchange,
    PeerRequest,
    check_raw,
    cluster_copies,
    holdings_from_json,
    holdings_to_json,
    marks_from_json,
    marks_to_json,
    own_holdings,
    own_marks,
    read_raw,
)
from .config import TieredConfig, node_of
from .discovery import all_gather_bytes, all_read, broadcast_bytes, shared_steps
from .errors import CheckpointCorruptError, NoCheckpointError, TieredCheckpointError
from .leases import Leases
from .records import record
from .tensors import byte_view, dtype_from_name
from .transport import PeerTimeout

log = logging.getLogger("tiered_dcp")

CHOICES = 5  # times a reader chooses the newest step again when retention removed it meanwhile


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

    Without ``step``, steps that are quarantined (an earlier load found an item with no good
    copy left) or non-finite (saved holding NaN/Inf) are passed over (``planners.choice``),
    and so are ``exclude`` (``load_latest``'s steps that just failed; a mapping gives each
    one's reason); ``skipped`` says which newer steps were, and why. A load that finds an
    item with no good copy left quarantines the step where this rank reaches it, and its
    error names the step the next reader will choose.
    """

    def __init__(
        self,
        config: TieredConfig,
        step: int | None = None,
        *,
        no_dist: bool = False,
        exclude: Iterable[int] | Mapping[int, str] = (),
    ) -> None:
        if not isinstance(config, TieredConfig):
            raise ValueError(f"TieredReader: config must be a TieredConfig, got {type(config).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"TieredReader: step must be None or an integer >= 0, got {step!r}")
        self.config = config
        self._started = time.perf_counter()  # a load's duration is recorded (``records``)
        self.load_id = new_id()  # DCP's StorageMeta.load_id of the metadata it reads
        rank, up = _dist_rank()
        self.rank, self.node = rank, node_of(rank)
        self._dist = up and not no_dist
        self._views = {v.index: v for v in views(config, self.node, rank, IndexCache())}  # one per load
        self._metadata: dict[int, Metadata | None] = {}
        self._bad_metadata: dict[int, str] = {}
        self._by_ident: dict[int, Metadata] = {}  # metadata checksum -> the metadata loaded from it
        self._held: dict[tuple[str, int, int], PartIndex | None] = {}  # (root, tier, part) -> index
        self._cluster: list[ClusterCopy] = []
        self._cluster_md: Metadata | None = None
        self._urls: dict[int, dict[int, str]] = {}  # tier -> rank -> its own root
        self._exclude = dict(exclude) if isinstance(exclude, Mapping) else dict.fromkeys(exclude, "")
        for attempt in range(CHOICES):
            try:
                found, cluster, lost = self._choose(step)
            except NoCheckpointError:
                # A scan is not atomic: beside a running job it may read step N's marker just
                # after retention removed it and N+1's just before its commit. Look again.
                if step is not None or attempt == CHOICES - 1:
                    raise
                continue
            if self._lease(found, cluster):
                break
            if step is not None:
                raise NoCheckpointError(
                    f"step {step} of namespace {config.namespace!r} was removed (by its tier's retention) "
                    "just as this reader opened it; ask for a newer step, or keep more steps on the tier"
                )
            log.info("step %d was removed just as it was opened; choosing the newest step again", self.step)
            self._release()
        else:
            raise NoCheckpointError(
                f"namespace {config.namespace!r}: the newest step was removed {CHOICES} times in a row just "
                "as it was opened (retention is removing steps faster than they can be opened)"
            )
        self._cluster = [copies[self.step] for _, copies in sorted(cluster.items()) if self.step in copies]
        self._copies: list[StepCopy] = found.get(self.step, [])
        if self._dist:
            self._own = self._own_copies()
            self._explain(lost)
            if self._cluster:
                try:
                    self._cluster_md = self._share_metadata(self._cluster[0])
                except CheckpointCorruptError as e:  # every rank saw the same bytes: all agree
                    if not self._copies:
                        raise self._quarantine(str(e)) from e
                    log.warning("%s; loading step %d from a shared tier instead", e, self.step)
                    self._cluster, self._own = [], {}
            self._share_shared_metadata()
        own = self._own if self._dist else {}
        self._copy_at = {c.tier_index: c for c in self._copies} | own  # tier -> the copy read there
        self._sources = self._plan_sources()
        if not self._dist:  # metadata refused on every tier: say so here, not as DCP's AssertionError
            self.read_metadata()

    def _choose(self, step: int | None) -> tuple[dict[int, list[StepCopy]], dict, dict]:
        """Find the step to load (``step``, or the newest complete good one) and its copies:
        what every tier and peer holds, with its marks, handed to ``planners.choice``."""
        lost: dict[int, dict[int, list[int]]] = {}
        if self._dist:
            found, cluster, lost = self._pool(step)
            self._group_name = transport.next_name(self.config.namespace, "load")
        else:
            found, cluster = loadable_steps(self._views.values(), step, set(self._exclude)), {}
        judged, judged_cluster = _one_save(found, cluster)  # each step by one save's marks
        in_cluster = [c.step_marks for copies in judged_cluster.values() for c in copies.values()]
        held = {m.step for m in in_cluster}
        self._candidates = pool_marks(copies_marks(judged, self._views.values(), held) + in_cluster)
        choice = choose(self._candidates, step, self._exclude)
        self.skipped = dict(choice.skipped)  # newer steps passed over, and why
        ns = self.config.namespace
        searched = lambda: describe_search(self._views.values()) + _describe_cluster(cluster, lost)  # noqa: E731
        if choice.step is None and step is None:
            passed = f" that loads (passed over: {describe_skipped(self.skipped)})" if self.skipped else ""
            raise NoCheckpointError(
                f"no complete checkpoint of namespace {ns!r} on any tier{passed}; searched:\n" + searched()
            )
        if choice.step is None:
            raise NoCheckpointError(
                f"step {step} of namespace {ns!r} is not complete on any tier; searched:\n" + searched()
            )
        self.step = choice.step
        return found, cluster, lost

    def _next_choice(self) -> str:
        """What the next reader will load, now that this step failed: for error messages."""
        nxt = choose(self._candidates, None, {**self._exclude, self.step: ""}).step
        if nxt is None:
            return "no older good step is known here: the next load finds none unless another tier holds one"
        return f"the next TieredReader(config) or load_latest loads step {nxt}"

    def _quarantine(self, why: str) -> CheckpointCorruptError:
        """Mark the chosen step not loadable wherever this rank reaches a copy of it (its own
        root of each node-local tier holding it in the cluster, every shared tier holding
        it; alone, every copy), so that no later reader chooses it; the error to raise."""
        ns = self.config.namespace
        targets = [(self._views[c.tier_index], self._views[c.tier_index].own, c.ident) for c in self._cluster]
        for copy in self._copies:
            targets.append((self._views[copy.tier_index], copy.store, copy.marker.metadata_xxh3))
        marked = []
        for view, store, ident in {(t[1].url, t[2]): t for t in targets}.values():
            try:
                mark = lambda v=view, st=store, i=ident: v.quarantine(st, self.step, i, self.rank, why)  # noqa: E731
                bounded(mark, self.config.tier_timeout)
                marked.append(store.describe(ns))
            except Exception as e:  # noqa: BLE001 - the load's own error is what matters
                log.warning("step %d: could not quarantine it in %s: %s", self.step, store.describe(ns), e)
        quarantined = f"; quarantined in {', '.join(marked)}" if marked else ""
        return CheckpointCorruptError(f"{why}{quarantined}; {self._next_choice()}", step=self.step)

    def _lease(self, found: dict[int, list[StepCopy]], cluster: dict[int, dict[int, ClusterCopy]]) -> bool:
        """Lease the chosen step in every root this rank reads it from (``leases``), so that
        retention leaves it alone until the read is done; False (on every rank) when it was
        removed before the leases were in place. With a process group, a shared tier gets one
        lease for the whole load, rank 0's, given back when every rank has read (``all_read``).
        """
        self._leases = Leases(self.config.namespace, self.step)
        self._job_leases = Leases(self.config.namespace, self.step)  # rank 0's, on shared tiers
        weakref.finalize(self, self._leases.release)
        weakref.finalize(self, self._job_leases.release)
        ok = True
        for copy in found.get(self.step, []):
            view = self._views[copy.tier_index]
            if not self._dist:
                ok = self._leases.take(copy.store) and ok
            elif self.rank == 0:
                ok = self._job_leases.take(copy.store) and ok
            for root in [] if self._dist else view.scan_roots():  # alone, it may read every root
                if root is not copy.store and view.read_marker(root, self.step) is not None:
                    self._leases.take(root)
        for tier_index, copies in cluster.items():
            if self.step in copies and self.rank in {
                r for rs in copies[self.step].holders.values() for r in rs
            }:
                ok = self._leases.take(self._views[tier_index].own) and ok
        if self._dist:
            flag = torch.tensor([int(ok)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        return ok

    # -- choosing the step -------------------------------------------------------------

    def _pool(
        self, step: int | None
    ) -> tuple[dict[int, list[StepCopy]], dict[int, dict[int, ClusterCopy]], dict]:
        """Every rank's holdings, pooled: node-local steps by union; shared tiers' newest
        complete step as rank 0 found it (``discovery``: the bucket is asked once per load)."""
        found = shared_steps(list(self._views.values()), step, set(self._exclude))
        pooled = [v for v in self._views.values() if v.placement.pooled]
        cluster: dict[int, dict[int, ClusterCopy]] = {}
        lost: dict[int, dict[int, list[int]]] = {}
        if not pooled:
            return found, cluster, lost
        mine = {
            str(v.index): [v.own.url, holdings_to_json(own_holdings(v)), marks_to_json(own_marks(v))]
            for v in pooled
        }
        gathered = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode())]  # JSON, no pickle
        for v in pooled:
            got = [g[str(v.index)] for g in gathered]
            self._urls[v.index] = {r: str(url) for r, (url, _, _) in enumerate(got)}
            marks = {k: why for _, _, m in got for k, why in marks_from_json(m).items()}
            holdings = [holdings_from_json(h) for _, h, _ in got]
            cluster[v.index], lost[v.index] = cluster_copies(v.index, holdings, marks)
        return found, cluster, lost

    def _release(self) -> None:
        self._leases.release()
        self._job_leases.release()

    def _plan_sources(self) -> Sources:
        """What the load planner needs to route items: the chosen step's copies, as seen here."""
        if not self._dist:
            kinds = {c.tier_index: self._views[c.tier_index].placement.pooled for c in self._copies}
            return Sources(self.rank, alone={t: "own" if p else "shared" for t, p in kinds.items()})
        return Sources(
            self.rank,
            pooled=tuple(
                PooledTier(cc.tier_index, cc.holders, self._urls[cc.tier_index]) for cc in self._cluster
            ),
            own={t: c.store.url for t, c in self._own.items()},
            shared={c.tier_index: c.store.url for c in self._copies},
        )

    def _routes(self, plan: LoadPlan) -> list[ItemRoute]:
        """The load plan (``planners.load``): every item's sources in fallback order."""
        md = self._cluster_md

        def part(req: ReadItem) -> int | None:
            info = None if md is None else md_blob.item_info(md, req.storage_index)
            return None if info is None else info.rank

        return plan_routes(self._sources, ((req.storage_index, part(req)) for req in plan.items))

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
        key = metadata_key(self.config.namespace, self.step)
        refused = []
        for src in cc.metadata_at:
            blob = None
            if src == self.rank:
                try:
                    blob = view.own.read(key)
                except OSError as e:
                    log.warning("step %d: metadata unreadable on rank %d: %s", self.step, src, e)
                if blob is not None and checksum(blob) != cc.ident:
                    log.warning(
                        "step %d: metadata on rank %d differs from its marker's checksum", self.step, src
                    )
                    blob = None
            flagged = None if src != self.rank else b"\x00" if blob is None else b"\x01" + blob
            got = broadcast_bytes(flagged, src=src)  # bytes, loaded below through the allowlist
            if got[:1] == b"\x01":
                try:
                    return md_blob.loads(got[1:])
                except ChecksumMismatch as e:  # every rank sees the same bytes: all try the next
                    refused.append(f"{self._urls[cc.tier_index][src].rstrip('/')}/{key}: {e}")
                    log.warning("step %d: %s", self.step, refused[-1])
        raise CheckpointCorruptError(
            f"step {self.step}: its metadata is damaged on every node holding it"
            + "".join(f"; {r}" for r in refused)
        )

    def _share_shared_metadata(self) -> None:
        """The chosen step's metadata on its shared tiers: read by rank 0, broadcast as raw
        bytes, loaded by every rank (allowlisted), first copy that is good; a copy holding
        the metadata already loaded (same checksum) is not read again."""
        for copy in self._copies:
            if self._known_metadata(copy) is not None:
                return  # the cluster's: the same bytes
            blob, why = None, ""
            if self.rank == 0:
                try:
                    blob = b"\x01" + read_metadata_blob(copy)
                except (OSError, ChecksumMismatch) as e:
                    blob = b"\x00" + self._unusable(copy, e).encode()
            got = broadcast_bytes(blob)
            md = None
            if got[:1] == b"\x01":
                try:
                    md = md_blob.loads(got[1:])
                except ChecksumMismatch as e:
                    why = f"{copy.store.describe(metadata_key(self.config.namespace, self.step))}: {e}"
            else:
                why = got[1:].decode("utf-8", "replace")
            if md is None:
                self._bad_metadata[copy.tier_index] = why
                log.warning("step %d: metadata unusable (%s); trying the next tier", self.step, why)
            self._metadata[copy.tier_index] = md
            if md is not None:
                self._by_ident[copy.marker.metadata_xxh3] = md
                return

    def _known_metadata(self, copy: StepCopy) -> Metadata | None:
        """Metadata already loaded from bytes with this copy's checksum (the same on every tier)."""
        ident = copy.marker.metadata_xxh3
        if self._cluster_md is not None and self._cluster and self._cluster[0].ident == ident:
            return self._cluster_md
        return self._by_ident.get(ident)

    def _unusable(self, copy: StepCopy, e: Exception) -> str:
        view = self._views[copy.tier_index]
        removed = isinstance(e, FileNotFoundError) and view.read_marker(copy.store, self.step) is None
        return f"removed from tier {copy.tier_index} (no longer committed there)" if removed else str(e)

    @property
    def tiers(self) -> list[int]:
        """Indexes of the tiers holding the chosen step complete, fastest first."""
        return sorted({c.tier_index for c in self._cluster} | {c.tier_index for c in self._copies})

    @property
    def checkpoint_id(self) -> str:
        """The chosen step's id (``<namespace>/step_<12 digits>``)."""
        return step_id(self.config.namespace, self.step)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load; ``checkpoint_id`` (from ``dcp.load``), if given, names the step to load.

        Another step than the one chosen is chosen again as the constructor does (agreed by
        every rank; ``NoCheckpointError`` if it is not complete anywhere). Anything but a
        step (``checkpoint_id.step_of``) raises ValueError.
        """
        self.load_id = new_id()
        if checkpoint_id is not None:
            step = step_of(self.config.namespace, checkpoint_id, "TieredReader")
            if step != self.step:
                self._release()  # the step chosen before is not read after all
                self.__init__(self.config, step, no_dist=not self._dist)  # type: ignore[misc]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """False: a step is found through a TieredConfig, which no checkpoint_id alone carries."""
        return False

    def _with_load_id(self, md: Metadata) -> Metadata:
        """DCP's convention (FileSystemReader): the metadata read carries this load's id."""
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _load_metadata(self, copy: StepCopy) -> Metadata | None:
        if self._cluster_md is not None and copy.tier_index in {cc.tier_index for cc in self._cluster}:
            return self._cluster_md  # the same bytes on every node and node-local tier
        if copy.tier_index not in self._metadata:
            md = self._known_metadata(copy)
            try:
                md = md or md_blob.load_metadata(copy)
            except (OSError, ChecksumMismatch) as e:
                why = self._unusable(copy, e)
                self._bad_metadata[copy.tier_index] = why
                log.warning("step %d: metadata unusable (%s); trying the next tier", self.step, why)
            if md is not None:
                self._by_ident[copy.marker.metadata_xxh3] = md
            self._metadata[copy.tier_index] = md
        return self._metadata[copy.tier_index]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cluster_md is not None:
            return self._with_load_id(self._cluster_md)
        for copy in self._copies:
            md = self._load_metadata(copy)
            if md is not None:
                return self._with_load_id(md)
        why = "; ".join(self._bad_metadata.values())
        if all(w.startswith("removed") for w in self._bad_metadata.values()):
            raise NoCheckpointError(
                f"step {self.step} was removed from every tier holding it while it was opened: {why}"
            )
        raise self._quarantine(f"step {self.step}: metadata damaged on every tier holding it: {why}")

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _part_index(
        self, view: TierView, store: Storage, copy: StepCopy, part: int, md: Metadata
    ) -> PartIndex | None:
        """Part's records in ``store``, or None when the root lacks it whole."""
        key = (store.url, view.index, part)
        if key not in self._held:
            index = None
            if view.part_present(store, copy.marker, part):
                index = view.part_index(store, copy.marker, part)
                if index is None and not copy.marker.has_indexes:  # format 1/2: the metadata's records
                    index = md_blob.legacy_index(md, self.config.namespace, self.step, part)
            self._held[key] = index
        return self._held[key]

    def _locate(self, src: ReadSource, req: ReadItem) -> tuple[Record, Storage] | None:
        copy = self._copy_at[src.tier]
        md = self._load_metadata(copy)
        info = None if md is None else md_blob.item_info(md, req.storage_index)
        if md is None or info is None:
            return None
        view: TierView = self._views[copy.tier_index]
        # own root named: only it (peers serve what it lacks); else the root holding the part
        own_only = src.kind == "own" and src.root is not None
        store = view.own if own_only else view.part_store(copy.marker, info.rank)
        index = self._part_index(view, store, copy, info.rank, md)
        rec = None if index is None else index.records.get(md_blob.item_key(req.storage_index))
        return None if rec is None else (rec, store)

    def _read_one(self, req: ReadItem, planner: LoadPlanner, rec: Record, store: Storage) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raw = bytearray(rec.raw_length)
            read_item(store, rec, memoryview(raw))
            planner.load_bytes(req, user_values.checked(raw))
            return
        target = planner.resolve_tensor(req).detach()
        dtype, shape = dtype_from_name(rec.dtype or ""), list(rec.shape or ())
        if (
            whole_item_request(req, shape)
            and target.dtype == dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
            and list(target.shape) == shape
        ):
            out = byte_view(target)
            if rec.codec == "raw" and rec.codecs is None and rec.blocks is None:
                if len(out):
                    store.read_into(rec.file, rec.offset, out)
                verify_raw(rec, out)
            else:  # compressed or in blocks: decoded straight into the target, in parallel
                read_item(store, rec, out)
            planner.commit_tensor(req, target)
            return
        full = torch.empty(shape, dtype=dtype)
        read_item(store, rec, byte_view(full))
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

    def _read_direct(self, req: ReadItem, planner: LoadPlanner, sources: tuple[ReadSource, ...]) -> bool:
        """Read ``req`` from the first of its route's ``sources`` (none a peer) that is good."""
        for src in sources:
            located = self._locate(src, req)
            if located is None:
                continue
            rec, store = located
            try:
                self._read_one(req, planner, rec, store)
                return True
            except (ChecksumMismatch, OSError) as e:
                where = store.describe(rec.file)
                view = self._views[src.tier]
                if isinstance(e, FileNotFoundError) and view.read_marker(store, self.step) is None:
                    what = "was removed (the step is no longer committed there: another job's retention?)"
                    self._unproven.add(id(req))
                elif isinstance(e, ChecksumMismatch | FileNotFoundError):  # missing from a committed copy
                    what = "is damaged"
                else:  # a tier that failed to answer proves nothing about the bytes
                    what = "could not be read"
                    self._unproven.add(id(req))
                self._failures.setdefault(id(req), []).append(f"{where} {what}: {e}")
                log.warning(
                    "step %d: item %r in %s %s (%s); trying another copy",
                    self.step,
                    req.storage_index.fqn,
                    where,
                    what,
                    e,
                )
        return False

    # -- peers --------------------------------------------------------------------------

    def _next_peer(self, req: ReadItem, peers: Iterator[ReadSource]) -> tuple[int, PeerRequest] | None:
        """The next holder of ``req`` in its route's order (``planners.load``), as a request."""
        assert self._cluster_md is not None
        info = md_blob.item_info(self._cluster_md, req.storage_index)
        src = next(peers, None)
        if info is None or src is None or src.holder is None:
            return None
        return src.holder, PeerRequest(src.tier, info.rank, req.storage_index, info.raw_length)

    def _serve(self, req: PeerRequest) -> bytearray | None:
        view = self._views[req.tier_index]
        try:
            own = self._own[req.tier_index]  # asked only of ranks whose own root holds the part
            md = self._load_metadata(own)
            index = None if md is None else self._part_index(view, view.own, own, req.part, md)
            if index is None:
                raise KeyError("its part is not whole here")
            return read_raw(view.own, index.records[md_blob.item_key(req.index)])
        except (ChecksumMismatch, OSError, KeyError) as e:
            log.warning(
                "step %d: cannot serve item %r of rank %d's part from %s to a peer: %s",
                self.step,
                req.index.fqn,
                req.part,
                view.own.describe(part_key(self.config.namespace, self.step, req.part)),
                e,
            )
            return None

    def _read_from_peers(
        self, pending: list[ReadItem], planner: LoadPlanner, routes: dict[int, ItemRoute]
    ) -> list[ReadItem]:
        """Fetch items from peers that hold them, round by round; return those still missing.

        Every rank takes part (it may have to serve) until no rank wants anything; an
        intact load ends after one round of store operations, no group opened. A peer
        that does not answer within ``peer_timeout`` ends the exchange for this rank: what
        is left is read from a shared tier holding the step.
        """
        assert self._cluster_md is not None
        peers = {id(r): iter(routes[id(r)].peers) for r in pending}  # each tried once, in order
        exchange = PeerExchange(self._group_name, self.rank, dist.get_world_size(), self.config.peer_timeout)
        try:
            while True:
                wanted: dict[int, list[PeerRequest]] = {}
                order: dict[int, list[ReadItem]] = {}
                for req in pending:
                    found = self._next_peer(req, peers[id(req)])
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
                    info = md_blob.item_info(self._cluster_md, req.storage_index)
                    assert info is not None  # asked for only when the metadata knows it
                    try:
                        check_raw(info, buf)
                        self._deliver(req, planner, info, buf)
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
                    done.add(id(req))
                pending = [r for r in pending if id(r) not in done]
        except PeerTimeout as e:
            self._unproven.update(id(r) for r in pending)  # a peer that did not answer may hold them
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

    def _deliver(self, req: ReadItem, planner: LoadPlanner, info: ItemInfo, buf: torch.Tensor) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, user_values.checked(buf.numpy().tobytes()))
            return
        target = planner.resolve_tensor(req).detach()
        full = buf.view(dtype_from_name(info.dtype or "")).reshape(info.shape or ())
        self._place(req, planner, full, target)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Execute the load plan: each item from its route's sources, in order.

        Its own roots first; then every rank takes part in the peer exchange (collective, so
        once for all items, whenever a node-local tier is pooled; it picks each item's
        holders in the route's order itself) with what is still missing; then the rest.
        """
        try:
            self._read_all(plan, planner)
        finally:
            self._leases.release()  # the step may go now, at its tiers' next retention
            if self._dist and self._copies:  # a shared tier's lease: once every rank has read
                all_read(self._group_name, self._job_leases.release)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        self._failures: dict[int, list[str]] = {}
        self._unproven: set[int] = set()  # items a failure other than damage kept from a source
        routes = {id(req): r for req, r in zip(plan.items, self._routes(plan), strict=True)}
        split = {key: r.split_at_exchange() for key, r in routes.items()}
        pending = [req for req in plan.items if not self._read_direct(req, planner, split[id(req)][0])]
        if self._cluster:
            pending = self._read_from_peers(pending, planner, routes)
        pending = [req for req in pending if not self._read_direct(req, planner, split[id(req)][1])]
        if pending:
            req = pending[0]
            failures = self._failures.get(id(req), [])
            detail = "; ".join(failures) or "no tier or peer holds it"
            if failures and all(" was removed " in f for f in failures):
                raise NoCheckpointError(
                    f"step {self.step} was removed from every tier it was being read from (a lease that "
                    f"expired, or another job's retention on a shared tier): {detail}"
                )
            why = (
                f"step {self.step}: no good copy of item {req.storage_index.fqn!r} "
                f"(offset {list(req.storage_index.offset or [])}) left"
                f"{f' (and {len(pending) - 1} more)' if len(pending) > 1 else ''}: {detail}"
            )
            if failures and not self._unproven.intersection(id(r) for r in pending):
                raise self._quarantine(why)
            # a tier or peer that did not answer is no proof of damage: nothing is quarantined
            raise CheckpointCorruptError(f"{why}; {self._next_choice()}", step=self.step)
        seconds = round(time.perf_counter() - self._started, 6)
        record(self.config, "load", self.rank, self.step, tiers=self.tiers, seconds=seconds)


def _one_save(
    found: dict[int, list[StepCopy]], cluster: dict[int, dict[int, ClusterCopy]]
) -> tuple[dict[int, list[StepCopy]], dict[int, dict[int, ClusterCopy]]]:
    """Per step, the copies of its fastest tier's save only (``catalog.one_save``), in the
    cluster and on the shared tiers alike: what the step is judged by (its marks). Reads
    may still fall back to a copy of another save of the same step number: see
    docs/user-guide.md, "Recovery", for that open case."""
    seen = [
        (c.tier_index, s, c.ident) for copies in cluster.values() for s, c in copies.items() if not c.legacy
    ]
    seen += [
        (c.tier_index, s, c.marker.metadata_xxh3)
        for s, copies in found.items()
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
