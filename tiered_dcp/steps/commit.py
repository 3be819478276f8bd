"""The commit protocol, its only owner: who commits a step in which root, and how.

The marker is what makes a step exist in a root (``format.Marker``): written last, after
the metadata and every part it names. This module builds it, writes it (``commit_root``:
the metadata, then the marker, the step's durability point in that root, then the
tier's retention) and runs the protocol that decides when:

- the save path (``for_save``): the tier's placement names its ``SaveProtocol``. One root
  (``CoordinatorCommit``): every rank writes its part, DCP's finish on the coordinator
  commits it. A root per node (``AgreedCommit``): every rank says through the job's store
  whether its part and the replicas it took are clean; the coordinator publishes the
  metadata and marker (or why not), and the lowest rank of each root commits it there.
  ``TieredWriter`` calls the same two hooks on either;
- the writer process (``commit_copy``): a root it copied a step into, once the rule the
  tier's placement names (``Placement.copy_commit``) says the copy there is whole.

Torch-free at import (the writer process commits here); the save path's pieces import
the torch side of the format and the job's store when a save calls them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import (
    NONFINITE_NAMES,
    Marker,
    PartInfo,
    index_key,
    marker_key,
    metadata_key,
    part_key,
    step_dir,
)

from ..errors import NonFiniteStateError, PeerLostError, ReplicaMismatchError, TieredCheckpointError
from . import replicas
from .catalog import StepCopy, TierView, read_metadata_blob
from .placement import CopyCommit, SaveProtocol
from .replicas import POLICIES, Disagreement, ReplicaDigests
from .retention import apply_retention

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..ranks.cliques import Layout
    from ..ranks.worlds import Op
    from .metadata import Records

log = logging.getLogger(__name__)


def commit_root(view: TierView, step: int, blob: bytes, marker: Marker) -> None:
    """Commit this process's root's copy of ``step``, then prune the root.

    Every commit (either save protocol, and the writer process) ends here: the metadata
    first, the marker last (the step's durability point in this root), then retention."""
    ns = view.config.namespace
    view.own.write(metadata_key(ns, step), [blob])
    view.own.write(marker_key(ns, step), [marker.to_bytes()])
    apply_retention(view, step)


def build_commit(
    view: TierView,
    step: int,
    metadata: Metadata,
    world: list[int],
    records: Records,
    layout: Layout,
    found: list[Disagreement] | None = None,
) -> tuple[bytes, Marker]:
    """The metadata blob (every rank's items) and the marker naming it, for every root.

    The marker records the save's clique ``layout``: loads, the writer process and ``ls``
    find every copy of a part by it, whatever their own config says.

    Items saved holding NaN/Inf (``on_nonfinite="mark"``) are counted and named in the
    marker, so that loads pass the step over; the committer says so once for the job. So
    are items whose replicas disagreed (``found``), as ``on_replica_mismatch`` says."""
    from .metadata import build_blob  # torch: the save path only

    blob = build_blob(metadata, records)
    sizes = [0] * len(world)
    for rec in records.values():
        sizes[rec.info.rank] += rec.part_length
    cfg = view.config
    bad = sorted(f"{index.fqn}" for index, rec in records.items() if rec.info.nonfinite)
    marker = Marker(
        step,
        cfg.namespace,
        len(world),
        [PartInfo(r, n, sizes[r]) for r, n in enumerate(world)],
        len(blob),
        checksum(blob),
        **layout.marker_fields(),
        nonfinite_items=len(bad),
        nonfinite=bad[:NONFINITE_NAMES],
        **POLICIES[cfg.on_replica_mismatch].marker_fields(found or []),
    )
    if bad:
        log.warning(
            "step %d holds NaN/Inf in %d item(s) %s: saved and marked non-finite; load_latest and "
            "TieredReader(config) pass it over (TieredReader(config, step=%d) loads it anyway)",
            step,
            len(bad),
            bad[:NONFINITE_NAMES],
            step,
        )
    return blob, marker


# -- the save path ------------------------------------------------------------------------


@dataclass
class SaveCommit(ABC):
    """One save's commit on its first tier, by the protocol its placement names
    (``for_save``). ``TieredWriter`` calls ``write`` in ``write_data`` on every rank and
    ``finish`` in DCP's finish on the coordinator, whichever protocol applies."""

    view: TierView
    step: int
    rank: int
    is_coordinator: bool
    layout: Callable[[list[int]], Layout]  # the save's cliques, for its world (rank -> node)
    replicas: ReplicaDigests | None = None  # this rank's replica digests, when the save compares them

    @abstractmethod
    def write(
        self,
        write_part: Callable[[], Records],
        refused: BaseException | None,
        world: list[int],
        op: Op | None,
        metadata: Callable[[], Metadata],
    ) -> Records:
        """This rank's part written by ``write_part``: its records. ``refused``: the save
        must not commit (non-finite state under ``on_nonfinite="raise"``); ``op``: the save
        in the job's store (None: a process alone); ``metadata``: DCP's global Metadata."""

    @abstractmethod
    def finish(self, metadata: Metadata, records: Records, world: list[int]) -> None:
        """DCP's finish on the coordinator, with every rank's ``records``."""


class CoordinatorCommit(SaveCommit):
    """One root: every rank writes its part; DCP's finish on the coordinator commits the
    root with the records DCP gathered. A failure is raised at once: DCP tells every rank.
    Replicas are compared in a round of their own once the parts are written
    (``replicas.standalone``); the coordinator keeps what it found for the commit."""

    def write(
        self,
        write_part: Callable[[], Records],
        refused: BaseException | None,
        world: list[int],
        op: Op | None,
        metadata: Callable[[], Metadata],
    ) -> Records:
        records: Records = {}
        error: BaseException | None = refused  # refused: nothing of the step is written
        if error is None:
            try:
                with _tier_failed(self.view, self.step):
                    records = write_part()
            except Exception as e:  # said in the replicas' round first: no rank waits for this one
                error = e
        if self.replicas is not None and op is not None and len(world) > 1:
            found = replicas.standalone(
                op, self.rank, world, self.replicas, error is not None, self.is_coordinator
            )
            refusal = POLICIES[self.view.config.on_replica_mismatch].refusal(
                self.step, self.view.tier.path, found
            )
            if error is None and refusal is not None:  # DCP tells every rank
                error = _refused(refusal, self.step)
        if error is not None:
            raise error
        return records

    def finish(self, metadata: Metadata, records: Records, world: list[int]) -> None:
        found = self.replicas.found if self.replicas is not None else []
        with _tier_failed(self.view, self.step):
            blob, marker = build_commit(
                self.view, self.step, metadata, world, records, self.layout(world), found
            )
            commit_root(self.view, self.step, blob, marker)


class AgreedCommit(SaveCommit):
    """A root per node: the step commits in ``write``, in every root, once every rank said
    through the job's store that its part (and the replicas it took) is clean. A failure
    is told the same way, so that no rank waits for one that will not come."""

    def write(
        self,
        write_part: Callable[[], Records],
        refused: BaseException | None,
        world: list[int],
        op: Op | None,
        metadata: Callable[[], Metadata],
    ) -> Records:
        from ..ranks import transport  # torch: the save path only

        records: Records = {}
        error: BaseException | None = None
        try:
            records = write_part()
        except Exception as e:  # told to every rank, so that none waits for this one
            error = e
        agreement = _Agreement(self, world, op, metadata)
        with transport.watching_peers(self.step, "the commit agreement"):  # the store may be gone
            agreement.run(records, error or refused)
        return records

    def finish(self, metadata: Metadata, records: Records, world: list[int]) -> None:
        """Nothing: every root committed in ``write``."""


_SAVE_COMMITS: dict[SaveProtocol, type[SaveCommit]] = {
    SaveProtocol.COORDINATOR: CoordinatorCommit,
    SaveProtocol.AGREED: AgreedCommit,
}


def for_save(
    view: TierView,
    step: int,
    rank: int,
    is_coordinator: bool,
    layout: Callable[[list[int]], Layout],
    replicas: ReplicaDigests | None = None,
) -> SaveCommit:
    """The commit of a save of ``step`` on its first tier ``view``, by its placement's protocol;
    ``replicas``: this rank's replica digests, compared at the commit (None: nothing is)."""
    return _SAVE_COMMITS[view.placement.save_protocol](view, step, rank, is_coordinator, layout, replicas)


@contextlib.contextmanager
def _tier_failed(view: TierView, step: int) -> Iterator[None]:
    """A shared first tier that fails (down, full, forbidden) fails the save, saying which.

    Its backend bounds every call (retries within a time limit), so this comes in bounded time.
    """
    try:
        yield
    except OSError as e:
        raise TieredCheckpointError(
            f"step {step} was not saved: tier {view.tier.path}, the fastest tier taking it, failed: {e}"
        ) from e


class Failure(Enum):
    """What kind of failure a rank reports to the agreement, and every rank then raises."""

    NONFINITE = "nonfinite"  # NonFiniteStateError: the user asked for it
    REPLICAS = "replica mismatch"  # ReplicaMismatchError: so did they (``on_replica_mismatch``)
    PEER_LOST = "peer lost"  # PeerLostError, with the ranks lost
    OTHER = "other"  # TieredCheckpointError

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        if isinstance(error, PeerLostError):
            return cls.PEER_LOST
        if isinstance(error, ReplicaMismatchError):
            return cls.REPLICAS
        return cls.NONFINITE if isinstance(error, NonFiniteStateError) else cls.OTHER

    def error(
        self, message: str, step: int, ranks: list[int], items: Sequence[str] = ()
    ) -> TieredCheckpointError:
        """The error of this kind that a refused commit raises on every rank."""
        if self is Failure.PEER_LOST:
            return PeerLostError(message, step, "the commit agreement", tuple(ranks))
        if self is Failure.REPLICAS:
            return ReplicaMismatchError(message, step, tuple(items), tuple(ranks))
        return NonFiniteStateError(message) if self is Failure.NONFINITE else TieredCheckpointError(message)


@dataclass
class _Agreement:
    """``AgreedCommit``'s round through the job's store, under the save's ``op``.

    Every rank publishes whether its part is clean, with its records, and counts itself in;
    the last sets a flag the coordinator waits for. The coordinator publishes the metadata
    and marker, or the failures; the lowest rank of each root (``Placement.commits_root``)
    writes them there. A verdict is set once (``compare_set``): a rank that left the world
    first (``worlds.leave_world``) marked it, and then no root commits."""

    save: SaveCommit
    world: list[int]
    op: Op | None
    metadata: Callable[[], Metadata]

    def run(self, records: Records, error: BaseException | None) -> None:
        save, world, op = self.save, self.world, self.op
        if op is None or len(world) == 1:
            if error is not None:
                raise error
            if op is not None:  # a world of one left by abort: nothing of it commits
                op.check("the commit")
            blob, marker = build_commit(
                save.view, save.step, self.metadata(), world, records, save.layout(world)
            )
            commit_root(save.view, save.step, blob, marker)
            return
        op.check("the commit agreement")
        digests = self._publish(op, records, error)
        if digests and not save.is_coordinator:  # a replica group's rank: the coordinator may ask
            assert save.replicas is not None, "digests come from this rank's replica check"
            replicas.Round(op, save.step).answer(save.rank, save.replicas)
        if save.is_coordinator:
            self._decide_or_say(op)
        if save.view.placement.commits_root(save.rank, dict(enumerate(world))):
            self._apply(op)

    def _publish(self, op: Op, records: Records, error: BaseException | None) -> dict[str, str]:
        """This rank's word: clean, with its records and its replica digests, or why not
        (then raised here). Its replica digests (empty: it holds no replica)."""
        from .metadata import records_to_json

        save, store = self.save, op.store
        done, count, verdict = op.key(f"done/{save.rank}"), op.key("done/count"), op.key("commit")
        if error is None and save.replicas is not None:
            try:
                digests = save.replicas.digests()
            except Exception as e:  # told as any failure of this rank's part
                digests, error = {}, e
        else:
            digests = {}
        word = {**_outcome(error, save.rank), "replicas": digests}
        store.set(done, json.dumps(word).encode() + b"\n" + records_to_json(records))
        op.sweep_later([done])
        if save.is_coordinator and error is not None:  # it cannot commit: said now, not at the timeout
            refusal = _refusal(save.step, save.view, [_outcome(error, save.rank)])
            store.compare_set(verdict, b"", json.dumps(refusal))
            replicas.Round(op, save.step).ask({})  # nor will it ask the replica groups' ranks
        if store.add(count, 1) == len(self.world):
            store.set(op.key("done/all"), b"1")
        if error is not None:
            raise error
        return digests

    def _decide_or_say(self, op: Op) -> None:
        """``_decide``; whatever fails there is the verdict too, so that no root waits for one
        that will not come (a rank lost: ``PEER_LOST``, naming it)."""
        try:
            self._decide(op)
        except Exception as e:
            lost = isinstance(e, PeerLostError)
            refusal = {
                "error": str(e) if lost else f"step {self.save.step}: {type(e).__name__}: {e}",
                "kind": (Failure.PEER_LOST if lost else Failure.OTHER).value,
                "ranks": list(e.ranks) if isinstance(e, PeerLostError) else [],
            }
            with contextlib.suppress(Exception):  # a store gone too: the verdict's own error is raised
                op.store.compare_set(op.key("commit"), b"", json.dumps(refusal))
                replicas.Round(op, self.save.step).release()  # the group ranks wait for no question
            raise

    def _decide(self, op: Op) -> None:
        """The coordinator's verdict once every rank spoke: the metadata and marker, or the
        failures (raised here too)."""
        from ..ranks import transport
        from .metadata import records_from_json

        save, step, store, verdict = self.save, self.save.step, op.store, op.key("commit")
        op.sweep_later([op.key("done/count"), op.key("done/all"), verdict, f"{verdict}/metadata"])
        keys = [op.key(f"done/{r}") for r in range(len(self.world))]
        try:
            op.wait(op.key("done/all"), "the commit agreement")
        except PeerLostError:
            replicas.Round(op, step).ask({})  # no rank waits on a question that will not come
            raise
        except Exception as e:
            replicas.Round(op, step).ask({})
            late = [r for r, k in enumerate(keys) if not store.check([k])]
            waited = f"no word from them within peer_timeout={op.timeout:g} s"
            err = transport.lost(step, "the commit agreement", e, late, waited)
            store.compare_set(
                verdict, b"", json.dumps({"error": str(err), "kind": Failure.PEER_LOST.value, "ranks": late})
            )
            raise err from e
        merged: Records = {}
        failed, words = [], {}
        for r, key in enumerate(keys):
            head, recs = store.get(key).split(b"\n", 1)
            word = json.loads(head)
            if word["error"] is not None:
                failed.append(word)
            words[r] = word.get("replicas") or {}
            merged.update(records_from_json(recs))
        found = self._compare(op, words if not failed else {})
        refusal = (
            _refusal(step, save.view, failed)
            if failed
            else self._policy.refusal(step, save.view.tier.path, found)
        )
        if refusal is not None:
            store.compare_set(verdict, b"", json.dumps(refusal))
            raise _refused(refusal, step)
        blob, marker = build_commit(
            save.view, step, self.metadata(), self.world, merged, save.layout(self.world), found
        )
        op.check("the commit agreement")
        store.set(f"{verdict}/metadata", blob)  # before the verdict, which says it is there
        store.compare_set(verdict, b"", json.dumps({"error": None, "marker": marker.to_bytes().decode()}))

    @property
    def _policy(self) -> replicas.Policy:
        return POLICIES[self.save.view.config.on_replica_mismatch]

    def _compare(self, op: Op, words: dict[int, dict[str, str]]) -> list[Disagreement]:
        """The replica digests compared (``replicas.compare``); the question is asked even
        when nothing is compared, since the group ranks wait for it."""
        round_ = replicas.Round(op, self.save.step)
        if self.save.replicas is None or not any(words.values()):
            round_.ask({})
            return []
        return replicas.compare(round_, words, self.save.rank, self.save.replicas, self.world)

    def _apply(self, op: Op) -> None:
        """A root's lowest rank: the verdict written in its root, or raised."""
        from ..ranks import transport

        step, verdict = self.save.step, op.key("commit")
        try:  # the coordinator waits ``timeout`` for the slowest rank first: this wait is longer
            outcome = json.loads(op.wait(verdict, "the commit agreement", [0], 2 * op.timeout))
        except PeerLostError:
            raise
        except Exception as e:
            waited = f"no decision from the coordinator within {2 * op.timeout:g} s"
            raise transport.lost(step, "the commit agreement", e, [0], waited) from e
        if outcome["error"] is not None:
            raise _refused(outcome, step)
        marker = Marker.from_bytes(outcome["marker"].encode())
        commit_root(self.save.view, step, op.store.get(f"{verdict}/metadata"), marker)


def _outcome(error: BaseException | None, rank: int) -> dict:
    """What a rank tells the coordinator about its part: clean (no error), or why not."""
    if error is None:
        return {"error": None}
    ranks = list(error.ranks) if isinstance(error, PeerLostError) else []
    return {
        "error": f"rank {rank}: {type(error).__name__}: {error}",
        "kind": Failure.of(error).value,
        "ranks": ranks,
    }


def _refusal(step: int, view: TierView, failed: list[dict]) -> dict:
    """The coordinator's verdict on a step some rank could not write: every reason, and the
    kind every rank raises for it: ``NONFINITE`` when that is all that failed (the user
    asked for it), ``PEER_LOST`` (with the lost ranks) when a peer was lost."""
    kinds = {Failure(f["kind"]) for f in failed}
    if Failure.PEER_LOST in kinds:
        kind = Failure.PEER_LOST
    else:
        kind = next(iter(kinds)) if len(kinds) == 1 else Failure.OTHER
    ranks = sorted({r for f in failed for r in f["ranks"]})
    msg = f"step {step} not committed on {view.tier.path}: " + "; ".join(f["error"] for f in failed)
    return {"error": msg, "kind": kind.value, "ranks": ranks}


def _refused(outcome: dict, step: int) -> TieredCheckpointError:
    """The error a refused commit raises on every rank (``_refusal``, ``replicas.Refuse``)."""
    return Failure(outcome["kind"]).error(
        outcome["error"], step, outcome.get("ranks", []), outcome.get("items", [])
    )


# -- the writer process -------------------------------------------------------------------


def commit_copy(src: TierView, dst: TierView, copy: StepCopy) -> bool:
    """Commit ``dst``'s own root once a writer has copied everything it should hold from
    ``src`` (``copied_marker``), with the source's metadata blob as opaque bytes; False
    while something is missing (a later writer commits)."""
    marker = copied_marker(src, dst, copy)
    if marker is None:
        return False
    commit_root(dst, copy.step, read_metadata_blob(copy), marker)
    return True


def copied_marker(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
    """The marker that commits ``dst``'s own root once a writer has copied everything it
    should hold from ``src``; None while something is missing (a later writer commits)."""
    return _COPY_COMMITS[dst.placement.copy_commit](src, dst, copy)


def _every_index(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
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


def _source_parts(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
    """The root holds an index of every part its source root holds whole; the metadata and
    marker are the source's, as on every node. Whichever of its writers is last commits."""
    ns, step = dst.config.namespace, copy.step
    held = [p.rank for p in copy.marker.parts if src.part_present(src.own, copy.marker, p.rank)]
    if not all(dst.own.exists(index_key(ns, step, rank)) for rank in held):
        return None
    return dataclasses.replace(copy.marker, created=time.time())


_COPY_COMMITS: dict[CopyCommit, Callable[[TierView, TierView, StepCopy], Marker | None]] = {
    CopyCommit.EVERY_INDEX: _every_index,
    CopyCommit.SOURCE_PARTS: _source_parts,
}


def _name(key: str) -> str:
    """The last component of a key: the name a listing of its directory gives."""
    return key.rsplit("/", 1)[1]
