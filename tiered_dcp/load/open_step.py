"""Opening a step for a load: which step, agreed by every rank, where its copies are, leased.

``OpenStep.open`` is what ``TieredReader``'s constructor does before any item is read. With
a process group (collective: every rank opens alike) each rank reads only its own root of
each node-local tier and the ranks pool what they hold (``cluster``, all-gathered as JSON);
rank 0 looks at the shared tiers once for the whole job (``discovery.shared_steps``). The
step is chosen from the complete steps and their marks (``steps.choice``: the step asked
for, else the newest good one not excluded), leased in every root this rank reads it from
(``leases``; on a shared tier one lease for the job, rank 0's), chosen again when retention
removed it meanwhile (up to ``CHOICES`` times), and its metadata is shared: each rank reads
its own root's copy, and when one cannot, it is read where a rank holds it and broadcast as
bytes (``StepMetadata`` keeps it per copy). Without a process group the one reader sees
every root it can reach. The result, an ``OpenStep``, says what
``step_reads`` reads from (``sources``, the load planner's input), quarantines the step when
a read finds it damaged, and gives the leases back.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping

from torch.distributed.checkpoint.metadata import Metadata

from tiered_dcp.planners.load import PooledTier, Sources
from tiered_dcp.storage import forks
from tiered_dcp.storage.codec import ChecksumMismatch
from tiered_dcp.storage.format import IndexCache, metadata_key

from ..config import TieredConfig, node_of
from ..errors import CheckpointCorruptError, NoCheckpointError
from ..ranks import worlds
from ..steps import metadata as md_blob
from ..steps.catalog import StepCopy, bounded, describe_search, read_metadata_blob, views
from ..steps.choice import Found, StepMarks, candidates, choose, describe_skipped, loadable_steps
from ..steps.leases import Leases
from .discovery import all_agree, all_gather_bytes, all_read, broadcast_bytes, shared_steps
from .peer_exchange import (
    ClusterCopy,
    cluster_copies,
    holdings_from_json,
    holdings_to_json,
    marks_from_json,
    marks_to_json,
    own_holdings,
    own_marks,
)
from .step_metadata import StepMetadata

log = logging.getLogger(__name__)

CHOICES = 5  # times a reader chooses the newest step again when retention removed it meanwhile


class OpenStep:
    """One load's opened step: which (``step``), where its copies are, the leases holding it.

    ``copies`` are its copies on shared tiers, ``cluster`` its copies pooled over the ranks'
    own roots of node-local tiers and ``own`` this rank's own root's of those (with a
    process group), ``copy_at`` the copy read on each tier, ``sources`` all of that as the
    load planner routes it (``planners.load``), ``metadata`` the copies' metadata. Made by
    ``open``; ``quarantine``, ``next_choice``, ``release`` and ``read_done`` serve the reads.
    """

    step: int  # the step chosen
    skipped: dict[int, str]  # newer steps passed over, and why
    candidates: dict[int, StepMarks]  # every complete step known here, with its marks
    group_name: str  # with a process group: this load's prefix in the job's store
    leases: Leases  # this rank's, in every root it reads the step from
    job_leases: Leases  # rank 0's, on shared tiers, for the whole load
    metadata: StepMetadata
    copy_at: dict[int, StepCopy]  # tier -> the copy read there
    sources: Sources

    def __init__(
        self, config: TieredConfig, rank: int, with_group: bool, exclude: Iterable[int] | Mapping[int, str]
    ) -> None:
        self.config = config
        self.rank, self.node = rank, node_of(rank)
        self.with_group = with_group  # the ranks agree over a process group
        self.exclude = dict(exclude) if isinstance(exclude, Mapping) else dict.fromkeys(exclude, "")
        self.views = {v.index: v for v in views(config, self.node, rank, IndexCache())}  # one per load
        self.copies: list[StepCopy] = []
        self.cluster: list[ClusterCopy] = []
        self.own: dict[int, StepCopy] = {}
        self.urls: dict[int, dict[int, str]] = {}  # tier -> rank -> its own root
        self.held = False  # the leases outlive each load's reads (``TieredReader.held``)

    @classmethod
    def open(
        cls,
        config: TieredConfig,
        step: int | None,
        *,
        rank: int,
        with_group: bool,
        exclude: Iterable[int] | Mapping[int, str] = (),
    ) -> OpenStep:
        """Choose ``step`` (None: the newest complete good step), lease it and share its
        metadata; ``NoCheckpointError`` when there is none. Collective ``with_group``."""
        opened = cls(config, rank, with_group, exclude)
        own_md: Metadata | None = None
        for attempt in range(CHOICES):
            try:
                found, cluster, lost = opened._choose(step)
            except NoCheckpointError:
                # A scan is not atomic: beside a running job it may read step N's marker just
                # after retention removed it and N+1's just before its commit. Look again, if
                # any rank saw a step at all (a job's first load saw none: it asks no more).
                if step is not None or attempt == CHOICES - 1 or not opened._saw_steps():
                    raise
                continue
            opened.cluster = [c[opened.step] for _, c in sorted(cluster.items()) if opened.step in c]
            leased = opened._lease(found, cluster)
            if opened.with_group:  # one collective: leased everywhere, metadata read everywhere
                opened.own = opened._own_copies()
                own_md = opened._own_metadata()
                leased, everywhere = all_agree(leased, own_md is not None)
                own_md = own_md if everywhere else None
            if leased:
                break
            if step is not None:
                raise NoCheckpointError(
                    f"step {step} of namespace {config.namespace!r} was removed (by its tier's retention) "
                    "just as this reader opened it; ask for a newer step, or keep more steps on the tier"
                )
            log.info("step %d was removed just as it was opened; choosing the newest step again", opened.step)
            opened.release()
        else:
            raise NoCheckpointError(
                f"namespace {config.namespace!r}: the newest step was removed {CHOICES} times in a row just "
                "as it was opened (retention is removing steps faster than they can be opened)"
            )
        opened.copies = found.copies.get(opened.step, [])
        opened.metadata = StepMetadata(opened.step, opened.views)
        if opened.with_group:
            opened._explain(lost)
            if opened.cluster:
                try:
                    md = own_md if own_md is not None else opened._share_metadata(opened.cluster[0])
                    opened.metadata.set_cluster(md, opened.cluster)
                except CheckpointCorruptError as e:  # every rank saw the same bytes: all agree
                    if not opened.copies:
                        raise opened.quarantine(str(e), alike=True) from e
                    log.warning("%s; loading step %d from a shared tier instead", e, opened.step)
                    opened.cluster, opened.own = [], {}
            opened._share_shared_metadata()
            # every rank holds the same bytes now: metadata damaged on every tier raises here,
            # from the constructor, where load_latest chooses again (inside DCP's read_metadata
            # it would come out as DCP's bare AssertionError)
            opened.metadata.first(opened.copies, functools.partial(opened.quarantine, alike=True))
        opened.copy_at = {c.tier_index: c for c in opened.copies} | opened.own
        opened.sources = opened._plan_sources()
        return opened

    def _saw_steps(self) -> bool:
        """Whether this search (any rank's, with a process group: one collective) found a
        step's directory on any tier."""
        saw = any(v.saw_steps for v in self.views.values())
        return not all_agree(not saw)[0] if self.with_group else saw

    def _describe_search(self, cluster: dict, lost: dict) -> str:
        """Where the search looked and what it found, for the error. With a process group a
        shared tier is described by rank 0 alone, which searched it: every rank listing a
        bucket to word an error is 10,000 listings at 10,000 ranks."""
        mine = [v for v in self.views.values() if v.placement.pooled or not self.with_group or self.rank == 0]
        text = describe_search(mine)
        for v in self.views.values():
            if v not in mine:
                roots = ", ".join(f"{s.url}/{self.config.namespace}" for s in v.scan_roots())
                text += f"\n  tier {v.index} [{roots}]: searched by rank 0 (its error says what it holds)"
        return text + _describe_cluster(cluster, lost)

    @property
    def tiers(self) -> list[int]:
        """Indexes of the tiers holding the chosen step complete, fastest first."""
        return sorted({c.tier_index for c in self.cluster} | {c.tier_index for c in self.copies})

    def _choose(self, step: int | None) -> tuple[Found, dict, dict]:
        """Find the step to load (``step``, or the newest complete good one) and its copies:
        what every tier and peer holds, with its marks, handed to ``steps.choice``."""
        lost: dict[int, dict[int, list[int]]] = {}
        if self.with_group:
            found, cluster, lost = self._pool(step)
            self.group_name = worlds.next_name(self.config.namespace, "load")
        else:
            found, cluster = loadable_steps(self.views.values(), step, set(self.exclude)), {}
        self.candidates = candidates(self.views.values(), found, cluster)  # each step by one save's marks
        choice = choose(self.candidates, step, self.exclude)
        self.skipped = dict(choice.skipped)  # newer steps passed over, and why
        ns = self.config.namespace
        searched = lambda: self._describe_search(cluster, lost)  # noqa: E731
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

    def next_choice(self) -> str:
        """What the next reader will load, now that this step failed: for error messages."""
        nxt = choose(self.candidates, None, {**self.exclude, self.step: ""}).step
        if nxt is None and self.with_group:  # shared tiers were asked for their newest alone
            return "the next TieredReader(config) or load_latest looks for an older step"
        if nxt is None:
            return "no older good step is known here: the next load finds none unless another tier holds one"
        return f"the next TieredReader(config) or load_latest loads step {nxt}"

    def quarantine(self, why: str, alike: bool = False) -> CheckpointCorruptError:
        """Mark the chosen step not loadable wherever this rank reaches a copy of it (its own
        root of each node-local tier holding it in the cluster, every shared tier holding
        it; alone, every copy), so that no later reader chooses it; the error to raise.

        ``alike``: every rank of the group found the same (the metadata, whose bytes they all
        hold): a shared tier is then marked by rank 0 alone, not by each of 10,000 ranks
        (each mark an object every later listing of the namespace returns)."""
        ns = self.config.namespace
        targets = [(self.views[c.tier_index], self.views[c.tier_index].own, c.ident) for c in self.cluster]
        by_rank_0 = alike and self.with_group and self.rank != 0
        for copy in [] if by_rank_0 else self.copies:
            targets.append((self.views[copy.tier_index], copy.store, copy.marker.metadata_xxh3))
        marked = [f"{c.store.describe(ns)} (by rank 0)" for c in self.copies] if by_rank_0 else []
        for view, store, ident in {(t[1].url, t[2]): t for t in targets}.values():
            try:
                mark = lambda v=view, st=store, i=ident: v.quarantine(st, self.step, i, self.rank, why)  # noqa: E731
                bounded(mark, self.config.tier_timeout)
                marked.append(store.describe(ns))
            except Exception as e:  # noqa: BLE001 - the load's own error is what matters
                log.warning("step %d: could not quarantine it in %s: %s", self.step, store.describe(ns), e)
        quarantined = f"; quarantined in {', '.join(marked)}" if marked else ""
        return CheckpointCorruptError(f"{why}{quarantined}; {self.next_choice()}", step=self.step)

    def _lease(self, found: Found, cluster: dict[int, dict[int, ClusterCopy]]) -> bool:
        """Lease the chosen step in every root this rank reads it from (``leases``), so that
        retention leaves it alone until the read is done; False when it was removed before
        the leases were in place here (with a process group, ``open`` agrees on it). A shared
        tier gets one lease for the whole load, rank 0's, given back when every rank has read
        (``all_read``)."""
        self.leases = Leases(self.config.namespace, self.step)
        self.job_leases = Leases(self.config.namespace, self.step)  # rank 0's, on shared tiers
        forks.finalize(self, self.leases.release)
        forks.finalize(self, self.job_leases.release)
        ok = True
        for copy in found.copies.get(self.step, []):
            view = self.views[copy.tier_index]
            if not self.with_group:
                ok = self.leases.take(copy.store) and ok
            elif self.rank == 0:
                ok = self.job_leases.take(copy.store) and ok
            for root in [] if self.with_group else view.scan_roots():  # alone, it may read every root
                if root is not copy.store and view.read_marker(root, self.step) is not None:
                    self.leases.take(root)
        for tier_index, copies in cluster.items():
            if self.step in copies and self.rank in {
                r for rs in copies[self.step].holders.values() for r in rs
            }:
                ok = self.leases.take(self.views[tier_index].own) and ok
        return ok

    def release(self) -> None:
        """Give every lease back: the step is not read after all."""
        self.leases.release()
        self.job_leases.release()

    def read_done(self, wait_for_all: bool = True) -> None:
        """This rank's reads are done: its leases go, a shared tier's once every rank has read
        (unless ``held``: one reader's several loads, given back by ``release``); at once
        without ``wait_for_all`` (a rank was lost: the load fails, and it would never read)."""
        if self.held:
            return
        self.leases.release()  # the step may go now, at its tiers' next retention
        if self.with_group and self.copies:  # a shared tier's lease: once every rank has read
            if wait_for_all:
                all_read(self.group_name, self.job_leases.release)
            else:
                self.job_leases.release()

    # -- choosing the step -------------------------------------------------------------

    def _pool(self, step: int | None) -> tuple[Found, dict[int, dict[int, ClusterCopy]], dict]:
        """Every rank's holdings, pooled: node-local steps by union; shared tiers' newest
        complete step as rank 0 found it (``discovery``: the bucket is asked once per load)."""
        found = shared_steps(list(self.views.values()), step, set(self.exclude))
        pooled = [v for v in self.views.values() if v.placement.pooled]
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
            self.urls[v.index] = {r: str(url) for r, (url, _, _) in enumerate(got)}
            marks = {k: why for _, _, m in got for k, why in marks_from_json(m).items()}
            holdings = [holdings_from_json(h) for _, h, _ in got]
            cluster[v.index], lost[v.index] = cluster_copies(v.index, holdings, marks)
        return found, cluster, lost

    def _plan_sources(self) -> Sources:
        """What the load planner needs to route items: the chosen step's copies, as seen here."""
        if not self.with_group:
            kinds = {c.tier_index: self.views[c.tier_index].placement.pooled for c in self.copies}
            return Sources(self.rank, alone={t: "own" if p else "shared" for t, p in kinds.items()})
        return Sources(
            self.rank,
            pooled=tuple(
                PooledTier(cc.tier_index, cc.holders, self.urls[cc.tier_index]) for cc in self.cluster
            ),
            own={t: c.store.url for t, c in self.own.items()},
            shared={c.tier_index: c.store.url for c in self.copies},
        )

    def _own_copies(self) -> dict[int, StepCopy]:
        """This rank's own root's copy of the chosen step on each node-local tier holding it."""
        own = {}
        for cc in self.cluster:
            view = self.views[cc.tier_index]
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
            f"the cluster's copies on tier {self.cluster[0].tier_index}"
            if self.cluster
            else f"shared tier {self.copies[0].tier_index}"
        )
        if self.rank == 0:
            log.info("loading step %d from %s", self.step, where)

    # -- sharing the metadata ----------------------------------------------------------

    def _own_metadata(self) -> Metadata | None:
        """The chosen step's metadata as this rank's own root of its fastest node-local tier
        holds it, when that copy is whole (its marker's checksum) and loads; else None.

        When every rank has it so (``open`` agrees), nothing is broadcast: the bytes are the
        same on every rank (the checksum the ranks agreed on), and at scale a broadcast of
        the metadata to every rank costs far more than each reading its node's copy.
        """
        cc = self.cluster[0] if self.cluster else None
        copy = None if cc is None else self.own.get(cc.tier_index)
        if cc is None or copy is None or self.rank not in cc.metadata_at:
            return None
        try:  # the own marker is the chosen save's (``_own_copies``): its checksum is ``cc.ident``
            return md_blob.loads(read_metadata_blob(copy), copy.marker.world_size)
        except (OSError, ChecksumMismatch):  # missing, damaged or refused: broadcast from a holder
            return None

    def _share_metadata(self, cc: ClusterCopy) -> Metadata:
        """The chosen save's metadata, read where a rank holds it and broadcast to all."""
        key = metadata_key(self.config.namespace, self.step)
        refused = []
        own = self.own.get(cc.tier_index)
        for src in cc.metadata_at:
            blob = None
            if src == self.rank and own is not None:
                try:
                    blob = read_metadata_blob(own)  # its size and checksum: the marker's
                except (OSError, ChecksumMismatch) as e:
                    log.warning("step %d: metadata unusable on rank %d: %s", self.step, src, e)
            flagged = None if src != self.rank else b"\x00" if blob is None else b"\x01" + blob
            got = broadcast_bytes(flagged, src=src)  # bytes, loaded below through the allowlist
            if got[:1] == b"\x01":
                try:
                    return md_blob.loads(got[1:], cc.world_size)
                except ChecksumMismatch as e:  # every rank sees the same bytes: all try the next
                    refused.append(f"{self.urls[cc.tier_index][src].rstrip('/')}/{key}: {e}")
                    log.warning("step %d: %s", self.step, refused[-1])
        raise CheckpointCorruptError(
            f"step {self.step}: its metadata is damaged on every node holding it"
            + "".join(f"; {r}" for r in refused)
        )

    def _share_shared_metadata(self) -> None:
        """The chosen step's metadata on its shared tiers: read by rank 0, broadcast as raw
        bytes, loaded by every rank (allowlisted), first copy that is good; a copy holding
        the metadata already loaded (same checksum) is not read again."""
        for copy in self.copies:
            if self.metadata.known(copy) is not None:
                return  # the cluster's: the same bytes
            blob, why = None, ""
            if self.rank == 0:
                try:
                    blob = b"\x01" + read_metadata_blob(copy)
                except (OSError, ChecksumMismatch) as e:
                    blob = b"\x00" + self.metadata.unusable(copy, e).encode()
            got = broadcast_bytes(blob)
            md = None
            if got[:1] == b"\x01":
                try:
                    md = md_blob.loads(got[1:], copy.marker.world_size)
                except ChecksumMismatch as e:
                    why = f"{copy.store.describe(metadata_key(self.config.namespace, self.step))}: {e}"
            else:
                why = got[1:].decode("utf-8", "replace")
            self.metadata.remember(copy, md, why)
            if md is not None:
                return


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
