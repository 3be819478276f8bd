"""This rank's copies of the save's replicated items, checksummed for the comparison.

DCP keeps one copy of an item several ranks hold and drops the others unread; this is where
the dropped ones are looked at. Every item of this rank's replica groups
(``planners.replicas``) gets an *item digest*, one per copy, the same function on every
rank: the xxh3-64 over its chunks' checksums, chunked as the writer chunks it (so the chunk
checksums ``parts.fingerprint`` computes for the items this rank writes are reused, not
computed twice). The copies this rank does not write are hashed where they lie in host
memory: an async save staged the whole state, so they are there, and they are hashed on the
hashing threads (``blocks.hashing``) while the part is written. A tensor on a device (a
synchronous save of GPU state, which never copies the dropped replicas to the host) gets a
device-side digest instead (``device_digest``): a weighted sum over its 32-bit words that
any one flipped bit changes, computed where the tensor lies. Each group's digest is then
the hash of its items' digests in one order (by fqn, then offset).

What goes over the wire is one digest per group (``digests``); item digests only when the
coordinator asks (``item_digests``: a group whose copies differ). What the coordinator
found comes back through ``record_findings``: each disagreement a line of the job's records, and a
rank named in disagreements at two steps or more a suspect node (``metrics.scores``).
"""

from __future__ import annotations

import contextlib
import logging
from array import array
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from tiered_dcp.planners.replicas import groups_of, tensor_items
from tiered_dcp.steps.replicas import Disagreement
from tiered_dcp.storage import blocks
from tiered_dcp.storage.codec import checksum

from ..config import TieredConfig
from ..metrics import scores
from ..tensors import as_cpu_contiguous, byte_view
from ..writer_process.timings import Kind, record

log = logging.getLogger(__name__)

SLAB = 1 << 20  # 32-bit words a device digest reduces at once (8 MiB of 64-bit scratch on the device)
RECORDED = 64  # disagreements of one step written to the records (every one is counted)
RECORDED_RANKS = 64  # ranks a record names (holders, odd ones): a line stays small at any world size
HOST = {"cpu"}  # device types whose tensors are hashed on the host; any other: ``device_digest``


def device_digest(t: torch.Tensor) -> int:
    """A digest of a tensor's bytes computed on its device, with one transfer of a few
    words: per ``SLAB`` of its 32-bit words w_i (as signed values, widened to 64 bits),
    sum(w_i * (2i + 1)) and sum(w_i), wrapping (mod 2^64); then the xxh3-64 of those sums
    and of the bytes past the last whole word, brought to the host together. Flipping bit k
    of w_i moves the first sum by 2^k (k < 32) times an odd number, never 0 mod 2^64, and
    the second by 2^k: every single-bit flip is seen, and two flips never cancel out."""
    flat = t.detach().contiguous().reshape(-1)
    try:
        raw = flat.view(torch.uint8)
    except RuntimeError:  # a view at an offset its dtype cannot be read from as bytes
        raw = flat.clone().view(torch.uint8)
    whole = raw.numel() // 4 * 4
    try:
        words = raw[:whole].view(torch.int32)
    except RuntimeError:  # bytes not aligned to 4 where they start
        words = raw[:whole].clone().view(torch.int32)
    weights, n = _weights(raw.device), whole // 4
    sums = []
    for i in range(0, n, SLAB):
        w = words[i : i + SLAB].to(torch.int64)
        sums.append(torch.stack([(w * weights[: w.numel()]).sum(), w.sum()]))
    tail = raw[whole:].to(torch.int64)  # the last bytes, fewer than 4
    h = xxhash.xxh3_64()
    h.update(torch.cat([*(x.reshape(-1) for x in sums), tail]).cpu().numpy().tobytes())  # one transfer
    h.update(str(raw.numel()).encode())
    return h.intdigest()


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.arange(SLAB, dtype=torch.int64, device=device) * 2 + 1
    return _WEIGHTS[device]


@dataclass
class _Copy:
    """One copy of a replicated item on this rank, on its way to its digest."""

    index: MetadataIndex
    hashes: list[Future[int]] | None = None  # its chunks' checksums, hashed here
    owner: object = None  # keeps the hashed tensor alive
    span: tuple[int, int] = (0, 0)  # where its bytes lie (address, length): ``before_moving``
    digest: str | None = None  # set at once: a device digest, or the writer's checksums reused
    written: Any = None  # the writer's ``RawItem`` of it, whose checksums are reused


@dataclass
class ReplicaCheck:
    """This rank's side of one save's comparison (``steps.replicas.ReplicaDigests``)."""

    config: TieredConfig
    step: int
    rank: int
    groups: dict[int, list[_Copy]]
    hashed: Future[None] | None = None  # the writer's ``fingerprint``: the written items' checksums
    found: list[Disagreement] = field(default_factory=list)
    _items: dict[int, list[str]] | None = None

    def before_moving(self, start: int, length: int) -> None:
        """Wait for the hashes of the copies whose bytes meet ``[start, start + length)``:
        the writer is about to move other bytes there (``parts.place_in_file``)."""
        for copies in self.groups.values():
            for c in copies:
                address, n = c.span
                if c.hashes and n and address < start + length and start < address + n:
                    for f in c.hashes:
                        f.result()

    def written(self, hashed: Future[None], arena: torch.Tensor | None) -> None:
        """The writer's ``fingerprint`` (the checksums of the copies it writes, reused), and
        the part file the state was staged into (None: none), which the writer cuts short
        next: every copy that lay in it is hashed before this returns."""
        self.hashed = hashed
        if arena is not None:
            self.before_moving(arena.data_ptr(), arena.numel())

    def _item_digests(self) -> dict[int, list[str]]:
        if self._items is None:
            if self.hashed is not None:
                self.hashed.result()
            self._items = {g: [_digest_of(c) for c in copies] for g, copies in self.groups.items()}
            for copies in self.groups.values():  # the digests are all it needs now: no staged bytes kept
                for c in copies:
                    c.hashes, c.owner, c.written = None, None, None
        return self._items

    def drain(self) -> None:
        """Wait for every hash in flight (their errors aside): a failed save's staged bytes
        may be reused or cut once it is given up."""
        for copies in self.groups.values():
            for c in copies:
                for f in c.hashes or []:
                    with contextlib.suppress(Exception):
                        f.result()

    def digests(self) -> dict[str, str]:
        return {
            f"{g:016x}": f"{xxhash.xxh3_64_intdigest(''.join(ds).encode()):016x}"
            for g, ds in self._item_digests().items()
        }

    def item_digests(self, groups: Collection[str]) -> dict[str, list[list]]:
        items = self._item_digests()
        out = {}
        for g in groups:
            copies = self.groups.get(int(g, 16), [])
            out[g] = [
                [c.index.fqn, list(c.index.offset or ()), d]
                for c, d in zip(copies, items.get(int(g, 16), []), strict=True)
            ]
        return out

    def record_findings(self, found: list[Disagreement]) -> None:
        """The coordinator's findings: a line each in the job's records, then the suspects."""
        for d in found[:RECORDED]:
            record(
                self.config,
                Kind.REPLICAS,
                self.rank,
                self.step,
                item=d.item,
                holders=sorted(r for v in d.values for r in v)[:RECORDED_RANKS],
                odd=list(d.odd[:RECORDED_RANKS]),
                odd_nodes=[d.nodes.get(r, -1) for r in d.odd[:RECORDED_RANKS]],
            )
        scores.warn_suspects(self.config, {r for d in found for r in d.odd})


def _digest_of(c: _Copy) -> str:
    if c.digest is not None:
        return c.digest
    sums = c.written.hashes if c.written is not None else [f.result() for f in c.hashes or []]
    return f"x{xxhash.xxh3_64_intdigest(array('Q', sums).tobytes()):016x}"


def start(
    config: TieredConfig,
    step: int,
    rank: int,
    plan: SavePlan,
    planner: SavePlanner,
    written: list[Any],
    local: SavePlan | None,
    stage_seconds: float | None,
) -> ReplicaCheck | None:
    """This rank's check of the save's global ``plan`` (None: nothing is compared), its
    hashing begun: ``written`` are the writer's items (``RawItem``) whose checksums are
    reused, ``local`` this rank's local plan as grouped (else the planner's own: DCP's plan
    cache sent none), ``stage_seconds`` set for an async save (every copy was staged in
    host memory). Before the writer moves or cuts bytes where copies lie, it calls
    ``before_moving`` and ``written``."""
    groups = groups_of(plan)
    if config.on_replica_mismatch == "ignore" or groups is None or not groups.world:
        return None
    if local is None or not local.items:
        local = getattr(planner, "plan", None)
    members = groups.members(tensor_items(local)) if isinstance(local, SavePlan) else {}
    mine = {it.index: it for it in written if it.extra.get("kind") == "tensor"}
    staged = stage_seconds is not None
    out = {
        g: [_copy(it, planner, mine.get(it.index), staged, config.dedup) for it in items]
        for g, items in members.items()
    }
    return ReplicaCheck(config, step, rank, out)


def _copy(item: WriteItem, planner: SavePlanner, written: Any, staged: bool, as_blocks: bool) -> _Copy:
    """One copy: the writer's checksums where it writes it from host memory, else hashed
    here (a device digest on a device)."""
    if written is not None and staged:
        return _Copy(item.index, written=written)
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        return _Copy(item.index, digest="-")  # not a tensor after all: compared by nothing
    if data.device.type not in HOST:
        return _Copy(item.index, digest=f"d{device_digest(data):016x}")
    if written is not None:
        return _Copy(item.index, written=written)
    t = as_cpu_contiguous(data)
    view = byte_view(t)
    chunks, _ = blocks.chunks("tensor", view, as_blocks)  # cut as the writer cuts it
    pool = blocks.hashing()
    hashes = [pool.submit(checksum, c) for c in chunks]
    span = (t.data_ptr(), len(view)) if len(view) else (0, 0)
    return _Copy(item.index, hashes=hashes, owner=t, span=span)
