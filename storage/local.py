"""Local files: the RAM tier (tmpfs, /dev/shm) and local SSD alike.

Writes go to a dirty name, are fsynced where the medium needs it (not on tmpfs/ramfs,
where fsync is meaningless and only costs time), then renamed clean and the directory
synced, so a crash leaves either nothing or the whole file under its clean name.

Reads, sizes, listings, deletes and writes follow no link below the root: each directory
on the way is opened from the one above it with ``O_NOFOLLOW`` (a write makes the missing
ones), and only a regular file is an object. Whoever can write the tier could leave a link
there pointing anywhere: it counts as missing (``NotAnObject``), never as what it points
to, and a write's dirty file is created and renamed clean inside the directory it reached.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from . import direct_io
from .base import Buffer, Reservation, Storage
from .errors import NotAnObject
from .registry import register_backend

DIRTY = ".dirty-"
MEMORY_FS = ("tmpfs", "ramfs")  # file systems whose files live in the host's memory


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the file system ``path`` (or its nearest existing
    ancestor) is on, from ``/proc/self/mounts``; ("", "") where that cannot be read."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best = ("", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2])
    except OSError:
        pass
    return best


@functools.lru_cache(maxsize=256)
def in_memory(path: str) -> bool:
    """Whether ``path`` is on a file system whose files live in the host's memory."""
    return mount_of(path)[1] in MEMORY_FS


def missing_root(path: str) -> str | None:
    """Where a tier's root ``path`` that does not exist yet would be made, in words (its
    nearest existing directory's file system), or None when it exists: a mount that is
    missing (``/mnt/nvme`` on a host without the disk) would otherwise fill the disk below."""
    if os.path.isdir(path):
        return None
    mount, fstype = mount_of(path)
    return f"{path} does not exist; the first save makes it on {mount or '?'} ({fstype or 'unknown'})"


def needs_fsync(path: str) -> bool:
    """False for memory-backed file systems (fsync there is meaningless and only costs time),
    True for everything else (and when unknown)."""
    return not in_memory(path)


def _fill(fd: int, chunks: Iterable[Buffer], root: str) -> int:
    """Write the stream to the new file ``fd`` on a disk directly (``direct_io``), so that it
    goes at the device's pace and leaves no page of it in the cache."""
    return direct_io.DirectWrites(fd, root).write(chunks)


def _write_stream(fd: int, chunks: Iterable[Buffer]) -> int:
    """Write the stream to the new file ``fd`` the ordinary way: on a memory file system the
    cache is the tier."""
    total = 0
    for chunk in chunks:
        _write_all(fd, chunk)
        total += memoryview(chunk).nbytes
    return total


def _write_all(fd: int, buf: Buffer) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _within(size: int, offset: int, length: int | None) -> int:
    """The bytes a read of ``length`` (None: the rest) at ``offset`` can return from a file
    of ``size``: what it allocates. A record is read bounded by its kind's limit (64 MiB
    for a blocks list), and its buffer sized by the limit would be zeroed in full."""
    left = max(size - offset, 0)
    return left if length is None else min(length, left)


def _allocate(fd: int, size: int) -> None:
    """Size the file and claim its blocks now: on a full file system this fails with ENOSPC,
    where a sparse file would kill the process with SIGBUS when its map is written."""
    os.ftruncate(fd, size)
    if size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: stay sparse
                raise


def map_whole(fd: int, size: int) -> mmap.mmap:
    """The file's first ``size`` bytes mapped shared, every page entered now (MAP_POPULATE):
    bytes that arrive into it later (a peer's replica, received by gloo's thread) take no
    page fault each. Measured: 256 MiB received into a warm tmpfs file at 0.7 GB/s newly
    mapped, 1.25 GB/s populated (as into a warm anonymous buffer); populating took 0.03 s."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class _Dirty:
    """A new file beside ``key``'s, in its directory (made where missing, reached with no link
    followed: ``LocalStorage.make_dir``), under a dirty name of its own until ``publish``."""

    def __init__(self, store: LocalStorage, key: str, mode: int) -> None:
        parent, _, self.name = key.rpartition("/")
        store.names_of(self.name)
        self.store, self.fsync = store, store.durable
        self.dir = store.make_dir(parent)
        self.tmp = f"{self.name}{DIRTY}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            flags = mode | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            self.fd = os.open(self.tmp, flags, 0o644, dir_fd=self.dir)
        except BaseException:
            os.close(self.dir)
            raise

    def publish(self) -> None:
        """Rename it clean (a link at the clean name is replaced, never followed), synced.
        Its directory is closed whatever fails; a dirty file that could not be renamed goes."""
        try:
            try:
                os.replace(self.tmp, self.name, src_dir_fd=self.dir, dst_dir_fd=self.dir)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(self.tmp, dir_fd=self.dir)
                raise
            if self.fsync:
                os.fsync(self.dir)
        finally:
            self._close_dir()

    def remove(self) -> None:
        """Delete the dirty file, unless it was published (or removed) already."""
        if self.dir < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.dir)
        self._close_dir()

    def _close_dir(self) -> None:
        """Close the directory's descriptor, once: closed again later, its number may be
        another thread's file or socket by then, which would close under its owner."""
        if self.dir >= 0:
            fd, self.dir = self.dir, -1
            os.close(fd)


class MappedFile(Reservation):
    """A reservation over a file open as ``fd``, mapped whole (``map_whole``) as ``view``;
    its kinds say how the file is made, committed and discarded."""

    fd: int
    _map: mmap.mmap | None

    def _open_map(self, fd: int, size: int) -> None:
        self._map = map_whole(fd, size) if size else None
        self.fd = fd
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def _release(self) -> None:
        """Unmap and close, once."""
        with contextlib.suppress(BufferError):
            self.view.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a tensor still wraps it: GC closes it
                self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MappedReservation(MappedFile):
    """A dirty file mapped into memory: filled in place, then synced and renamed clean."""

    def __init__(self, store: LocalStorage, key: str, size: int) -> None:
        self.store, self.key = store, key
        self.dirty = _Dirty(store, key, os.O_RDWR)
        fd = self.dirty.fd
        try:
            _allocate(fd, size)
            self._open_map(fd, size)
        except BaseException:
            os.close(fd)
            self.dirty.remove()
            raise

    committed = False

    def commit(self) -> None:
        with self.store.errors(self.key):
            try:
                if self.dirty.fsync:
                    if self._map is not None:
                        self._map.flush()
                    os.fsync(self.fd)
            finally:
                self._release()
            self.dirty.publish()
        self.committed = True

    def discard(self) -> None:
        """Drop it unless committed: a failure after its commit leaves the object as it is."""
        if self.committed:
            return
        self._release()
        self.dirty.remove()


@register_backend("", "file")
class LocalStorage(Storage):
    """Plain paths and file:// URLs (``storage_options`` has nothing to say here)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = os.path.abspath(root.removeprefix("file://"))
        self.url = self.root

    @functools.cached_property
    def durable(self) -> bool:
        """Whether writes here are fsynced: not on a memory file system (``needs_fsync``)."""
        return needs_fsync(self.root)

    def path(self, key: str) -> str:
        """The file ``key`` names."""
        return os.path.join(self.root, *key.split("/"))

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        with self.errors(key):
            return self._write(key, chunks)

    def _write(self, key: str, chunks: Iterable[Buffer]) -> int:
        dirty = _Dirty(self, key, os.O_WRONLY)
        try:
            try:
                total = (
                    _fill(dirty.fd, chunks, self.root) if self.durable else _write_stream(dirty.fd, chunks)
                )
                if dirty.fsync:
                    os.fsync(dirty.fd)
            finally:
                os.close(dirty.fd)
        except BaseException:
            dirty.remove()
            raise
        dirty.publish()
        return total

    def reserve(self, key: str, size: int) -> Reservation:
        with self.errors(key):
            return MappedReservation(self, key, size)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.errors(key), self._opened(key) as fd:
            length = _within(os.fstat(fd).st_size, offset, length)
            if length >= direct_io.DIRECT_READ_MIN and self.durable:
                out = bytearray(length)  # the large reads of a copy down the tiers: direct when cold
                got = self._read_fd(fd, offset, memoryview(out))
                return out if got == length else out[:got]
            with open(fd, "rb", closefd=False) as f:
                f.seek(offset)
                return f.read(length)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        out = out.cast("B")
        done = self._read_into(key, offset, out)
        if done < len(out):  # a damaged file, not a failing medium: no storage error kind
            raise OSError(errno.EIO, f"{self.describe(key)}: file ends {len(out) - done} bytes early")

    def read_placed(self, key: str, offset: int, length: int, room: memoryview) -> int | None:
        if not self.durable:
            return None
        with self.errors(key), self._opened(key) as fd:
            placed = direct_io.read_placed(fd, offset, length, room.cast("B"), self.root)
        if placed is not None and placed[1] < length:  # damaged, as read_into says
            raise OSError(errno.EIO, f"{self.describe(key)}: file ends {length - placed[1]} bytes early")
        return None if placed is None else placed[0]

    def _read_into(self, key: str, offset: int, out: memoryview) -> int:
        """The bytes of ``key`` from ``offset`` read into ``out``: direct from a disk where the
        range is large and not in the page cache (``direct_io.read_direct``); how many (fewer
        at the end of the file)."""
        with self.errors(key), self._opened(key) as fd:
            return self._read_fd(fd, offset, out)

    def _read_fd(self, fd: int, offset: int, out: memoryview) -> int:
        """``_read_into`` of the file open as ``fd``."""
        done = 0
        if self.durable:
            done = direct_io.read_direct(fd, offset, out, self.root) or 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def size(self, key: str) -> int | None:
        with self.errors(key):
            try:
                st = self._lstat(key)
            except FileNotFoundError:
                return None
            return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str) -> list[str]:
        with self.errors(prefix):
            try:
                fd = self.open_dir(prefix)
            except FileNotFoundError:
                return []
            try:
                return sorted(os.listdir(fd))
            finally:
                os.close(fd)

    def list_pages(self, prefix: str) -> Iterator[dict[str, int]]:
        sizes: dict[str, int] = {}
        with self.errors(prefix):
            try:
                fd = self.open_dir(prefix)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    with os.scandir(fd) as entries:
                        files = [e for e in entries if e.is_file(follow_symlinks=False)]
                        sizes = {e.name: e.stat(follow_symlinks=False).st_size for e in files}
                finally:
                    os.close(fd)
        yield dict(sorted(sizes.items()))

    def delete(self, key: str) -> None:
        """Remove ``key`` (a file, a link, or a directory and all in it). A key whose way
        leads through a link is not in this root: nothing is removed there."""
        with self.errors(key):
            try:
                is_dir = stat.S_ISDIR(self._lstat(key).st_mode)
            except FileNotFoundError:
                return
            if is_dir:  # rmtree follows no link inside, and refuses one at the top
                shutil.rmtree(self.path(key), ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(key))

    # -- the way down from the root, no link followed ------------------------------------

    def open_dir(self, key: str) -> int:
        """A descriptor of the directory ``key`` ("" for the root), each directory on the way
        opened from the one above without following a link; the caller closes it. Raises
        ``NotAnObject`` where the way has a link, a file or a name leaving the root."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)  # the root is the config's: links allowed
        try:
            for name in self.names_of(key) if key else []:
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = below
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOTDIR, errno.ELOOP):  # a link (or a file) where a directory should be
                why = "no directory of this tier on the way (a link, or a file)"
                raise NotAnObject(errno.ENOENT, why, self.describe(key)) from e
            raise
        return fd

    def make_dir(self, key: str) -> int:
        """``open_dir`` for a write: each directory on the way made where it is missing (the
        root too), none reached through a link; the caller closes the descriptor."""
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in self.names_of(key) if key else []:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = below
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOTDIR, errno.ELOOP):
                why = (
                    "no directory of this tier on the way (a link, or a file): nothing written; "
                    "remove what stands there (a tier follows no link below its root)"
                )
                raise NotAnObject(errno.ENOENT, why, self.describe(key)) from e
            raise
        return fd

    def _lstat(self, key: str) -> os.stat_result:
        """``key``'s own status (a link's, not its target's), reached as ``open_dir`` does."""
        parent, _, name = key.rpartition("/")
        self.names_of(name)
        fd = self.open_dir(parent)
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _opened(self, key: str) -> Iterator[int]:
        """``key`` open for reading, when it is a regular file reached with no link followed;
        ``NotAnObject`` otherwise (non-blocking open: a FIFO left there cannot hang a reader)."""
        parent, _, name = key.rpartition("/")
        self.names_of(name)
        dfd = self.open_dir(parent)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotAnObject(errno.ENOENT, "a link, not followed", self.describe(key)) from e
            raise
        finally:
            os.close(dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # (O_NONBLOCK does nothing to a regular file)
                raise NotAnObject(errno.ENOENT, "not a regular file", self.describe(key))
            yield fd
        finally:
            os.close(fd)

    def names_of(self, key: str) -> list[str]:
        """The names on ``key``'s path; ``NotAnObject`` for one that would leave the root or is
        no name ("", ".", "..", a NUL): no key of the layout has one."""
        names = key.split("/")
        if any(n in ("", ".", "..") or "\0" in n for n in names):
            raise NotAnObject(errno.ENOENT, "no key of this tier", self.describe(key))
        return names
