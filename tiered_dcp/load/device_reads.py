"""Items loaded onto an accelerator: through a bounded ring of pinned host buffers.

A tensor whose load target is on a device is read chunk by chunk (``codec.CHUNK_BYTES``)
into a pinned host slot (from a cold disk tier by the device itself: ``read_chunk_placed``),
each chunk checked against its checksum on a worker thread, then
copied to the device by a non-blocking copy on a side stream; the slot is taken again only
once its copy has run. Reads, checks and copies of different chunks and items overlap, and
the host memory a load holds is the ring's (``RING_SLOTS`` slots of ``SLOT_BYTES`` and the
room a direct read's aligned span needs, one pinned block: torch rounds a pinned allocation up
to a power of two, so slots of 8 MiB + 12 KiB each would take 16 MiB), whatever the state's
size. Only the rows of the stored item that a target asks for cross to the device.

An item is handed to the planner only when every chunk held and its copies ran
(``DeviceRead.finish``), so a damaged copy falls back to the next source as a host load does.
An item that arrived whole in host memory (from a peer, or spread from another rank's read)
crosses the same ring once checked (``from_host``).
The device copy is a ``Copier``: CUDA's (``CudaCopier``), or a host copy (``HostCopier``),
which runs the same ring on a machine without a GPU (the tests).
"""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.planner import ReadItem

from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import CHUNK_BYTES, chunk_spans, read_chunk_into, read_chunk_placed
from tiered_dcp.storage.direct_io import PLACE_SPARE
from tiered_dcp.storage.forks import ThreadPool
from tiered_dcp.storage.format import Record

from ..errors import TieredCheckpointError
from ..tensors import byte_tensor, byte_view

SLOT_BYTES = CHUNK_BYTES  # one chunk as the writer cuts them
RING_SLOTS = 7  # carved from one 64 MiB pinned block per device, whatever the state
WORKERS = min(8, os.cpu_count() or 1)  # reads and checks release the GIL
LOOKAHEAD_BYTES = 256 << 20  # raw bytes of items in flight at once (device scratch included)


class Copier(Protocol):
    """The copy from a host slot to the target's memory, and waiting for it."""

    def slot(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes the copies can start from (pinned for a GPU)."""

    def begin(self) -> None:
        """Order the copies after the work queued so far on the target's device."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying ``src`` (host bytes) to ``dst``; a token that ``wait`` takes."""

    def wait(self, token: Any) -> None:
        """Return once the copy behind ``token`` has run (``src`` may then be reused)."""


class CudaCopier:
    """Non-blocking host-to-device copies on a side stream, each followed by an event: the
    training stream is not queued behind them, and a slot is reused once its event ran."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, token: torch.cuda.Event | None) -> None:
        if token is not None:
            token.synchronize()


class HostCopier:
    """The ring's copy into host memory: the same flow as a device's, without a GPU."""

    def slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def begin(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait(self, token: None) -> None:
        pass


class Ring:
    """``slots`` host buffers of ``slot_bytes``, taken by the chunk reads in turn.

    ``take`` blocks while every slot is held or its copy has not yet run, which bounds the
    host memory of a load; ``peak`` is the most slots held at once (the tests read it).
    """

    def __init__(self, copier: Copier, slots: int = RING_SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.copier, self.slot_bytes = copier, slot_bytes
        self._free: queue.SimpleQueue[tuple[torch.Tensor, Any]] = queue.SimpleQueue()
        stride = slot_bytes + PLACE_SPARE  # room for a chunk's aligned span, read straight in
        block = copier.slot(slots * stride)
        for i in range(slots):
            self._free.put((block[i * stride : (i + 1) * stride], None))
        self._lock = threading.Lock()
        self.held = self.peak = 0

    def take(self) -> torch.Tensor:
        buf, token = self._free.get()
        self.copier.wait(token)
        with self._lock:
            self.held += 1
            self.peak = max(self.peak, self.held)
        return buf

    def give(self, buf: torch.Tensor, token: Any) -> None:
        with self._lock:
            self.held -= 1
        self._free.put((buf, token))


_pool = ThreadPool("tdcp-load", WORKERS)


@functools.cache
def ring_for(device: torch.device) -> Ring:
    """The process's ring for ``device``: made once, its pinned slots kept for later loads."""
    return Ring(CudaCopier(device))


@dataclass(frozen=True)
class Landing:
    """Where a stored item's bytes go: rows ``rows`` (of its dim 0) of the item land in
    ``dst`` (device bytes); ``then`` runs after they all landed (a narrowing copy into the
    target), or None when ``dst`` is the target's own memory."""

    rows: tuple[int, int]
    dst: torch.Tensor
    then: Callable[[], None] | None


def rows_asked(req: ReadItem, shape: list[int]) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The rows (of dim 0) of a stored item that ``req`` asks for, and the (offset, length)
    it asks of every later dim; a scalar is one row."""
    if not shape:
        return (0, 1), []
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    return (offsets[0], offsets[0] + lengths[0]), list(zip(offsets[1:], lengths[1:], strict=True))


def rows_shape(rows: tuple[int, int], shape: list[int]) -> list[int]:
    """The shape of the rows ``rows`` of a stored item of ``shape`` (a scalar's own)."""
    return [rows[1] - rows[0], *shape[1:]] if shape else []


def narrowed(rows: torch.Tensor, inner: list[tuple[int, int]], target: torch.Tensor) -> torch.Tensor:
    """The piece of ``rows`` (the rows asked, as a tensor) that ``inner`` asks for, checked
    to fit ``target``."""
    piece = rows
    for dim, (o, n) in enumerate(inner, start=1):
        piece = piece.narrow(dim, o, n)
    if piece.size() != target.size():
        raise TieredCheckpointError(
            f"stored piece {tuple(piece.size())} does not fit the target {tuple(target.size())}"
        )
    return piece


def landing(req: ReadItem, target: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> Landing:
    """The landing for ``target``, the piece ``req`` asks of a stored item: the target itself
    when the piece is whole rows of it in the target's dtype and layout; else a scratch
    tensor on the target's device holding those rows, narrowed and copied (converted) there."""
    rows, inner = rows_asked(req, shape)
    whole_rows = all(o == 0 and n == s for (o, n), s in zip(inner, shape[1:], strict=True))
    if (
        whole_rows
        and target.dtype == dtype
        and target.is_contiguous()
        and target.numel() == (rows[1] - rows[0]) * math.prod(shape[1:])
    ):
        return Landing(rows, byte_tensor(target), None)
    scratch = torch.empty(rows_shape(rows, shape), dtype=dtype, device=target.device)
    piece = narrowed(scratch, inner, target)
    return Landing(rows, byte_tensor(scratch), functools.partial(target.copy_, piece))


def from_host(ring: Ring, raw: torch.Tensor, land: Landing, row_bytes: int) -> None:
    """Land the rows ``land`` wants of a stored item whose raw bytes are already in host
    memory, checked (an item a peer sent, or another rank's read of a spread load): slot by
    slot through ``ring`` (a copy into a pinned slot, then a non-blocking copy to the device
    on the ring's stream, as a chunk read from a tier goes); returns once they landed and
    ``then`` ran."""
    ring.copier.begin()
    lo, hi = land.rows[0] * row_bytes, land.rows[1] * row_bytes
    tokens = []
    for at in range(lo, hi, ring.slot_bytes):
        n = min(ring.slot_bytes, hi - at)
        slot = ring.take()  # waits for the copy that last left it
        token = None
        try:
            slot[:n].copy_(raw[at : at + n])
            token = ring.copier.copy(land.dst[at - lo : at - lo + n], slot[:n])
        finally:
            ring.give(slot, token)
        tokens.append(token)
    for token in tokens:
        ring.copier.wait(token)
    if land.then is not None:
        land.then()


class DeviceRead:
    """One item's read from one source onto the device, started at construction.

    Each chunk overlapping the landing's rows is read into a ring slot and checked on a
    worker thread, and the bytes of it that the landing wants are copied to the device.
    ``finish`` waits for every chunk (a failed one after the others ended, so that no stray
    copy lands after the next source's), then for their copies, then runs ``then``.
    """

    def __init__(self, ring: Ring, store: Storage, rec: Record, land: Landing, row_bytes: int) -> None:
        self.ring, self.store, self.rec, self.land = ring, store, rec, land
        ring.copier.begin()  # after the target's (and the scratch's) earlier work on its stream
        lo, hi = land.rows[0] * row_bytes, land.rows[1] * row_bytes
        self.nbytes = hi - lo
        self._chunks: list[Future[Any]] = [
            _pool().submit(self._chunk, i, max(lo, at) - at, min(hi, at + n) - at, max(lo, at) - lo)
            for i, (at, n, _) in enumerate(chunk_spans(rec))
            if at < hi and at + n > lo or (n == 0 and lo == hi == 0)
        ]

    def _chunk(self, i: int, a: int, b: int, dst_at: int) -> Any:
        """Chunk ``i`` read into a slot and checked; its bytes ``a:b`` copied to the landing."""
        n = self.rec.info.raw_chunks[i][0]
        ring = self.ring
        if n > ring.slot_bytes:  # a chunk larger than the writer cuts (an old or foreign layout)
            buf = ring.copier.slot(n)
            read_chunk_into(self.store, self.rec, i, byte_view(buf))
            token = ring.copier.copy(self.land.dst[dst_at : dst_at + b - a], buf[a:b])
            ring.copier.wait(token)  # the one-off buffer goes when this returns
            return None
        buf = ring.take()
        token = None
        try:
            at = read_chunk_placed(self.store, self.rec, i, byte_view(buf[: n + PLACE_SPARE]))
            if b > a:
                token = ring.copier.copy(self.land.dst[dst_at : dst_at + b - a], buf[at + a : at + b])
        finally:
            ring.give(buf, token)
        return token

    def drain(self) -> None:
        """Wait for every chunk, whatever became of it (the load is failing: nothing lands
        in the target after this)."""
        for f in self._chunks:
            if f.exception() is None:
                self.ring.copier.wait(f.result())

    def finish(self) -> None:
        """Wait for the chunks and their copies; raise the first chunk's failure."""
        errors = [f.exception() for f in self._chunks]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        for f in self._chunks:
            self.ring.copier.wait(f.result())
        if self.land.then is not None:
            self.land.then()
