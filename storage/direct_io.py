"""Direct I/O for local disk tiers: bytes go from aligned buffers to the device, several at once,
with no copy in the page cache.

Through the page cache a disk tier ran at about a third of the disk here: each write copies
into the cache, the kernel writes it back at its own pace, and the final fsync waits on all of
it; meanwhile every step leaves its size in dirty pages, host memory a container is charged
for. ``DirectWrites`` copies the stream into aligned buffers (made once per process and
reused), hands each full buffer to a thread that writes it with ``O_DIRECT`` (``os.pwrite``
releases the GIL: threads give the queue depth with no new dependency; io_uring would need a
binding no maintained package offers for this Python), and writes the unaligned tail the
ordinary way. Durability is the caller's as before: it fsyncs the file (the tail, the size and
the extents are metadata direct writes do not cover) before the rename that commits it.

Reads of a large range that is not in the page cache (a load after a reboot) go direct as
well, through the same buffers; a range the cache holds is read from it as before.

Where a file system refuses ``O_DIRECT`` the flow is the same with buffered writes, said once
per root in the log.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future

from .forks import ThreadPool, renew_in_child

log = logging.getLogger(__name__)

ALIGN = 4096  # offsets, lengths and addresses of direct transfers (the largest logical block in use)
BUFFER_BYTES = 8 << 20  # one transfer (the writer's chunk size: one chunk fills one buffer)
IN_FLIGHT = 4  # writes queued per file: measured here 0.75-0.88 GB/s at 2-8, as dd oflag=direct
READS_IN_FLIGHT = 8  # reads queued per range: 1.4 GB/s here where 4 gave 1.2-1.3 and dd iflag=direct 1.3-1.6
DIRECT_READ_MIN = 1 << 20  # smaller reads stay buffered (a direct read costs a bounce copy)
PLACE_SPARE = 3 * ALIGN  # what a buffer needs beyond a range to take its aligned span (read_placed)
RESIDENT_ENOUGH = 0.9  # a range with this share of its pages cached is read from the cache


class _Buffers:
    """Aligned buffers (anonymous maps are page-aligned), made once and reused: a transfer
    takes one when it starts and gives it back when done, so the memory held is what the
    most transfers at once ever needed (``IN_FLIGHT + 1`` per file being written,
    ``READS_IN_FLIGHT`` per range being read), not a set per caller. ``release_idle``
    hands their pages back to the kernel between bursts of work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._out = 0

    def take(self) -> mmap.mmap:
        with self._lock:
            self._out += 1
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, BUFFER_BYTES)

    def give(self, bufs: list[mmap.mmap]) -> None:
        with self._lock:
            self._out -= len(bufs)
            self._free.extend(bufs)

    def release_idle(self) -> None:
        with self._lock:
            if self._out == 0:
                for buf in self._free:
                    buf.madvise(mmap.MADV_DONTNEED)  # the mapping stays; its pages go (zero when touched)


_BUFFERS = _Buffers()
_pool = ThreadPool("tiered-dcp-direct-io", 2 * READS_IN_FLIGHT)
_REFUSED: set[str] = set()  # roots whose file system refused O_DIRECT (said once each)


@renew_in_child
def _renew_buffers() -> None:
    """The parent's buffers may be out to its transfers: a child takes its own."""
    global _BUFFERS
    _BUFFERS = _Buffers()


def release_idle() -> None:
    """Give the buffers' pages back to the kernel when no transfer is using them: called by
    whoever knows a burst of work is over (the writer process with its queue empty, a load
    once read), so an idle writer holds no more than before (its RSS target) and a trainer
    keeps nothing after a load."""
    _BUFFERS.release_idle()


def set_direct(fd: int, on: bool, root: str) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the file system refuses it (said
    once per ``root``)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        refused(root, e)
        return False
    return True


def refused(root: str, why: OSError) -> None:
    """Note that ``root``'s file system takes no direct I/O; warn the first time."""
    if root not in _REFUSED:
        _REFUSED.add(root)
        log.warning("%s: the file system refuses O_DIRECT (%s); writing through the page cache", root, why)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class DirectWrites:
    """The concatenation of a stream of chunks written to an open, empty file: whole buffers
    with ``O_DIRECT``, ``IN_FLIGHT`` of them in flight, the tail past the last aligned byte
    buffered (and a file smaller than one buffer: an index, a marker). The caller syncs and
    publishes the file."""

    def __init__(self, fd: int, root: str) -> None:
        self.fd, self.root = fd, root
        self.direct: bool | None = None  # asked at the first full buffer: small files stay buffered
        self.pending: collections.deque[tuple[Future[None], mmap.mmap]] = collections.deque()

    def write(self, chunks: Iterable[memoryview | bytes | bytearray]) -> int:
        held: list[mmap.mmap] = []
        try:
            buf, fill, offset, total = _take(held), 0, 0, 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                total += len(view)
                while view:
                    n = min(len(view), BUFFER_BYTES - fill)
                    buf[fill : fill + n] = view[:n]
                    fill, view = fill + n, view[n:]
                    if fill == BUFFER_BYTES:
                        self._submit(buf, BUFFER_BYTES, offset)
                        offset, fill = offset + BUFFER_BYTES, 0
                        buf = self._oldest_done() if len(held) > IN_FLIGHT else _take(held)
            whole = fill - fill % ALIGN if offset else 0  # smaller than a buffer: all buffered
            if whole:
                self._submit(buf, whole, offset)
            while self.pending:
                self._oldest_done()
            if fill > whole:
                if self.direct:
                    set_direct(self.fd, False, self.root)
                _pwrite_all(self.fd, memoryview(buf)[whole:fill], offset + whole)
            return total
        finally:
            self._drain()
            _BUFFERS.give(held)

    def _submit(self, buf: mmap.mmap, length: int, offset: int) -> None:
        if self.direct is None:
            self.direct = self.root not in _REFUSED and set_direct(self.fd, True, self.root)
        view = memoryview(buf)[:length]
        self.pending.append((_pool().submit(_pwrite_all, self.fd, view, offset), buf))

    def _oldest_done(self) -> mmap.mmap:
        """Wait for the oldest transfer; its buffer is free again (an error is raised)."""
        future, buf = self.pending.popleft()
        future.result()
        return buf

    def _drain(self) -> None:
        """Wait for every transfer still queued, so no buffer is reused while written from."""
        while self.pending:
            future, _ = self.pending.popleft()
            future.exception()


def _take(held: list[mmap.mmap]) -> mmap.mmap:
    """A buffer from the process's, kept in ``held`` until given back."""
    held.append(_BUFFERS.take())
    return held[-1]


def read_direct(fd: int, offset: int, out: memoryview, root: str) -> int | None:
    """Fill ``out`` from ``fd`` at ``offset`` with direct reads, ``READS_IN_FLIGHT`` at once,
    through aligned buffers; the bytes read (short at the end of the file). None, with nothing
    read, where the range is small or mostly in the page cache (reading it there is faster),
    or where direct I/O is refused: the caller reads it the ordinary way."""
    if not _goes_direct(fd, offset, len(out), root):
        return None
    start, end = offset - offset % ALIGN, offset + len(out)
    target = _address(out)
    held: list[mmap.mmap] = []
    pending: collections.deque[tuple[Future[int], mmap.mmap]] = collections.deque()

    def land(buf: mmap.mmap, at: int) -> tuple[int, bool]:
        """Read the buffer at file offset ``at`` and copy its part of the range into ``out``
        (ctypes' memmove lets go of the GIL: the copies run in parallel too): that part's
        size, and whether the file ended there."""
        got = os.preadv(fd, [memoryview(buf)], at)
        lo, hi = max(at, offset), min(at + got, end)
        if hi > lo:
            ctypes.memmove(target + lo - offset, _address(buf) + lo - at, hi - lo)
        return max(hi - lo, 0), got < BUFFER_BYTES

    done, ended, at, free = 0, False, start, []
    try:
        while pending or (at < end and not ended):
            if at < end and not ended and len(pending) < READS_IN_FLIGHT:
                buf = free.pop() if free else _take(held)
                pending.append((_pool().submit(land, buf, at), buf))
                at += BUFFER_BYTES
                continue
            future, buf = pending.popleft()
            copied, last = future.result()
            done, ended = done + copied, ended or last
            free.append(buf)
    finally:
        for future, _ in pending:
            future.exception()
        set_direct(fd, False, root)
        _BUFFERS.give(held)
    return done


def read_placed(fd: int, offset: int, length: int, room: memoryview, root: str) -> tuple[int, int] | None:
    """Read ``length`` bytes at ``offset`` with one ``O_DIRECT`` read straight into ``room`` (a
    buffer with ``PLACE_SPARE`` bytes to spare): the aligned span around the range lands at
    the first aligned address in ``room``. (Where the range starts in ``room``, how much of it
    the file held.) None, with nothing read, where ``read_direct`` would not read direct, or
    ``room`` is too small. A pinned ring slot is filled by the device this way, no host copy."""
    base = -_address(room) % ALIGN
    start = offset - offset % ALIGN
    span = -(-(offset + length - start) // ALIGN) * ALIGN
    if base + span > len(room) or not _goes_direct(fd, offset, length, root):
        return None
    try:
        got = os.preadv(fd, [room[base : base + span]], start)  # short at the end of the file
    finally:
        set_direct(fd, False, root)
    return base + offset - start, min(max(got - (offset - start), 0), length)


def _goes_direct(fd: int, offset: int, length: int, root: str) -> bool:
    """Whether a read of the range goes direct, ``O_DIRECT`` then set on ``fd``: it is large, its
    pages are mostly not in the page cache, and the file system takes direct I/O."""
    if length < DIRECT_READ_MIN or root in _REFUSED:
        return False
    return resident_share(fd, offset, length) < RESIDENT_ENOUGH and set_direct(fd, True, root)


def _address(buf: memoryview | mmap.mmap) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(fd: int, offset: int = 0, length: int | None = None) -> tuple[int, int]:
    """(pages of the range in the page cache, pages in the range), asked of the kernel with
    ``mincore`` on a read-only map (no page is read in to answer)."""
    size = os.fstat(fd).st_size
    length = size - offset if length is None else min(length, size - offset)
    start = offset - offset % mmap.PAGESIZE
    span = length + offset - start
    pages = -(-span // mmap.PAGESIZE)
    if length <= 0:
        return 0, 0
    addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return 0, pages  # unknown: taken as not cached
    try:
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, span, vec) != 0:
            return 0, pages
        return pages - vec.raw.count(0), pages  # a page's byte is 1 when resident (other bits unused)
    finally:
        _libc.munmap(addr, span)


def resident_share(fd: int, offset: int, length: int) -> float:
    cached, pages = resident_pages(fd, offset, length)
    return cached / pages if pages else 1.0
