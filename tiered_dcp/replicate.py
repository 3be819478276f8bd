"""The save side of clique replication and of committing a node-local tier on every node.

After a rank writes its part to a node-local tier it swaps parts with its clique peers
(``cliques``) over a gloo group of their own (``transport``): each peer's part lands,
verified, in this rank's own root, with its index. Then the ranks agree through the job's
store that every part and replica is clean; the coordinator publishes the step's metadata
and marker, and one rank per root writes both there and prunes that root. Every node thus
holds the metadata, and a marker on any node means the step was complete everywhere.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from tiered_dcp.storage.base import Buffer, Reservation
from tiered_dcp.storage.codec import ChecksumMismatch, checksum, verify_stored
from tiered_dcp.storage.format import Marker, PartInfo, part_key
from tiered_dcp.storage.format import write_index as write_part_index

from . import transport
from .catalog import TierView
from .cliques import clique
from .errors import TieredCheckpointError
from .metadata import Records, build_blob, part_index, records_from_json, records_to_json
from .transport import Group, PeerTimeout, as_bytes_tensor

_OWN_KEYS: list[str] = []  # store keys this process set in its previous save, deleted in the next
_GROUP_KEYS: list[str] = []  # the rendezvous keys its previous save's clique group left (raw store)


@dataclass
class SavedPart:
    """This rank's part as just written: its records and its stored chunks, in file order."""

    rank: int
    records: Records
    stored: list[Buffer]
    written_blocks: int = 0  # bytes of new blocks written for it (dedup)


def write_index(view: TierView, step: int, rank: int, records: Records, written: int | None = None) -> None:
    """Rank's index next to its part (or replica) in this rank's own root."""
    index = part_index(rank, records)
    if written is not None:
        index = dataclasses.replace(index, written=index.size + written)
    write_part_index(view.own, view.config.namespace, step, index)


def stored_chunk_sizes(records: Records) -> list[int]:
    """The stored length of every chunk of a part, in file order."""
    return [c[0] for rec in sorted(records.values(), key=lambda r: r.offset) for c in rec.chunks]


class Swap:
    """This rank's part swapped with its clique's members on other roots, theirs landing here.

    ``start`` posts the transfers (they run in gloo's threads while the rank writes its own
    part); ``finish`` waits, verifies every replica against its checksums and renames it
    clean with its index. Any failure discards the landed replicas.
    """

    def __init__(self, view: TierView, step: int, part: SavedPart, world: list[int], name: str) -> None:
        cfg = view.config
        self.view, self.step, self.part = view, step, part
        self.members = clique(part.rank, len(world), cfg.replication_factor, cfg.replication_jump)
        self.world, self.name = world, name
        replication = (cfg.replication_factor, cfg.replication_jump)
        self.takes = view.placement.parts_written_by(part.rank, dict(enumerate(world)), replication)[1:]
        self.landed: list[tuple[int, Records, Reservation]] = []
        self.group: Group | None = None
        self.works: list[Any] = []

    def start(self) -> Swap:
        view, part = self.view, self.part
        raw = transport.raw_store()
        for key in _GROUP_KEYS:  # the previous save ended on every rank: its group is gone
            raw.delete_key(key)
        _GROUP_KEYS.clear()
        name = f"{self.name}/clique{self.members[0]}"
        _GROUP_KEYS.extend(transport.group_keys(name, self.members.index(part.rank)))
        try:
            self.group = Group(name, self.members, part.rank, view.config.peer_timeout)
            infos = [records_from_json(b) for b in self.group.allgather(records_to_json(part.records))]
            sends, recvs = [], []
            for q, records in zip(self.members, infos, strict=True):
                if q not in self.takes:
                    continue  # this rank, or a member writing into this same root
                sends += [(q, as_bytes_tensor(c)) for c in part.stored]
                size = sum(r.length for r in records.values())
                res = view.own.reserve(part_key(view.config.namespace, self.step, q), size)
                self.landed.append((q, records, res))
                pos = 0
                for n in stored_chunk_sizes(records):
                    recvs.append((q, as_bytes_tensor(res.view[pos : pos + n])))
                    pos += n
            self.works = self.group.post(sends, recvs)
        except BaseException:
            self.abort()
            raise
        return self

    def finish(self) -> None:
        try:
            assert self.group is not None
            self.group.wait(self.works)
            self.works = []
            for q, records, res in self.landed:
                for rec in records.values():
                    try:
                        verify_stored(rec, res.view[rec.offset : rec.offset + rec.length])
                    except ChecksumMismatch as e:
                        raise TieredCheckpointError(
                            f"step {self.step}: the replica of rank {q}'s part arrived damaged: {e}"
                        ) from e
            for q, records, res in self.landed:
                res.commit()
                write_index(self.view, self.step, q, records)
            self.landed.clear()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the group (peers see it close) and any replica not committed yet."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.works = []
        for _, _, res in self.landed:
            res.discard()
        self.landed.clear()


def build_commit(
    view: TierView, step: int, metadata: Metadata, world: list[int], records: Records
) -> tuple[bytes, Marker]:
    """The metadata blob (every rank's items) and the marker naming it, for every root."""
    blob = build_blob(metadata, records)
    sizes = [0] * len(world)
    for rec in records.values():
        sizes[rec.rank] += rec.part_length
    cfg = view.config
    marker = Marker(
        step,
        cfg.namespace,
        len(world),
        [PartInfo(r, n, sizes[r]) for r, n in enumerate(world)],
        len(blob),
        checksum(blob),
        replication=[cfg.replication_factor, cfg.replication_jump],
    )
    return blob, marker


def commit_everywhere(
    view: TierView,
    step: int,
    rank: int,
    world: list[int],
    is_coordinator: bool,
    metadata: Callable[[], Metadata],
    records: Records,
    error: BaseException | None,
    name: str,
) -> None:
    """Commit ``step`` on this node-local tier: in every root, once every rank is clean.

    Every rank publishes whether its part (and the replicas it took) are clean, with its
    records; the coordinator waits for all of them and publishes the metadata and marker,
    or the failures; the lowest rank of each root writes them there and prunes the root.
    """
    writes_root = view.placement.commits_root(rank, dict(enumerate(world)))
    if not transport.dist_up() or len(world) == 1:
        if error is not None:
            raise error
        blob, marker = build_commit(view, step, metadata(), world, records)
        view.commit(step, blob, marker)
        return
    store = transport.store()
    timeout = datetime.timedelta(seconds=view.config.peer_timeout)
    for key in _OWN_KEYS:  # the previous save ended on every rank: nobody reads these any more
        store.delete_key(key)
    _OWN_KEYS.clear()
    done = f"{name}/done/{rank}"
    why = None if error is None else f"{type(error).__name__}: {error}"
    store.set(done, json.dumps({"error": why}).encode() + b"\n" + records_to_json(records))
    _OWN_KEYS.append(done)
    if error is not None:
        raise error
    verdict = f"{name}/commit"
    if is_coordinator:
        _OWN_KEYS.append(verdict)
        keys = [f"{name}/done/{r}" for r in range(len(world))]
        try:
            store.wait(keys, timeout)
        except Exception as e:
            late = [r for r, k in enumerate(keys) if not store.check([k])]
            msg = f"step {step}: rank(s) {late} did not finish writing within {timeout.total_seconds():.0f} s"
            store.set(verdict, json.dumps({"error": msg}))
            raise PeerTimeout(msg) from e
        merged: Records = {}
        failed = []
        for r, key in enumerate(keys):
            head, recs = store.get(key).split(b"\n", 1)
            err = json.loads(head)["error"]
            if err is not None:
                failed.append(f"rank {r}: {err}")
            merged.update(records_from_json(recs))
        if failed:
            msg = f"step {step} not committed on {view.tier.path}: " + "; ".join(failed)
            store.set(verdict, json.dumps({"error": msg}))
            raise TieredCheckpointError(msg)
        blob, marker = build_commit(view, step, metadata(), world, merged)
        _OWN_KEYS.append(f"{verdict}/metadata")
        store.set(f"{verdict}/metadata", blob)  # before the verdict, which says it is there
        store.set(verdict, json.dumps({"error": None, "marker": marker.to_bytes().decode()}))
    if not writes_root:
        return
    try:
        store.wait([verdict], timeout)
    except Exception as e:
        raise PeerTimeout(
            f"step {step}: no commit decision from the coordinator within {timeout.total_seconds():.0f} s"
        ) from e
    outcome = json.loads(store.get(verdict))
    if outcome["error"] is not None:
        raise TieredCheckpointError(outcome["error"])
    view.commit(step, store.get(f"{verdict}/metadata"), Marker.from_bytes(outcome["marker"].encode()))
