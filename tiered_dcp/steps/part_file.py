"""Staging straight into the RAM tier: the staged copy of an async save is the step's part file.

When the first tier taking a save is in the host's memory (a local directory on tmpfs or
ramfs, such as ``/dev/shm``), stores chunks raw, does not dedup and has a ``keep`` (so
that its files are recycled: a fresh file per save would be a copy into cold pages, a
stall several times a warm copy's), staging lays the state out in a dirty part file of
the step there, mapped into memory (``TierFile``), rather than
in a buffer of its own. The save then closes the gaps the plan left (pieces another rank
writes: ``close_gaps``), appends the plan's few byte items and renames the file clean
(``finish``): the step is held once, where a staging buffer would hold it a second time.

Part files are recycled. Retention drops a step on a memory tier by moving its part
files to the namespace's ``spare`` directory, each named by its inode (``recycle``); the
next staging claims one with a rename, its own (still mapped, so not even a page fault)
or any other, and its pages are reused rather than freed and zeroed again. Retention never
drops a step a writer process still copies (a pin) or a reader reads (a lease), so no
file is reused under them; a reader without a lease sees its checksums fail and reads
another copy. Spares left unclaimed for a whole save go at the next retention.

Torch-free: the writer process applies retention too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiered_dcp.storage.base import Reservation, Storage
from tiered_dcp.storage.errors import NotAnObject
from tiered_dcp.storage.format import is_part_name, part_key, spare_dir, step_dir
from tiered_dcp.storage.local import DIRTY, LocalStorage, MappedFile, in_memory

from ..config import TieredConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierFile:
    """The part file one save stages into: its dirty name (unique to the save) and the rest."""

    dirty: str
    clean: str
    spares: str  # the namespace's spare directory in this root
    store: LocalStorage  # the root
    directory: str  # the step's directory there (a key of ``store``)

    def spare(self, ino: int) -> str:
        return os.path.join(self.spares, str(ino))


def recycles(config: TieredConfig, store: Storage) -> bool:
    """Whether saves to this tier stage into its part files, and its retention recycles them."""
    return isinstance(store, LocalStorage) and not config.dedup and in_memory(store.root)


def drops_pinned(config: TieredConfig, store: Storage) -> bool:
    """Whether retention drops a step leaving this tier's keep window even while a writer
    process copies it (``on_lagging_tier="skip"`` on a tier saves stage into): host memory
    stays at keep + 1 steps; the copy fails its checksums or finds the step gone, and is
    recorded as skipped."""
    return config.on_lagging_tier == "skip" and recycles(config, store)


def target(config: TieredConfig, tier_index: int, store: Storage, step: int, rank: int) -> TierFile | None:
    """Where this rank's save of ``step`` stages, when its first tier takes staging (else None)."""
    tier = config.tiers[tier_index]
    if tier.keep is None:  # no file is ever a spare: each save would copy into fresh pages
        return None
    if tier.compression or not isinstance(store, LocalStorage) or not recycles(config, store):
        return None
    return part_file(config, store, step, rank)


def part_file(config: TieredConfig, store: LocalStorage, step: int, rank: int) -> TierFile:
    """This rank's part file of ``step`` in ``store``, under a dirty name unique to this save
    (staging fills it on a memory tier, ``ops.import_dcp`` on any local one)."""
    clean = store.path(part_key(config.namespace, step, rank))
    dirty = f"{clean}{DIRTY}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return TierFile(
        dirty, clean, store.path(spare_dir(config.namespace)), store, step_dir(config.namespace, step)
    )


def create(tf: TierFile, size: int, avoid: frozenset[int] = frozenset()) -> int:
    """An open file at ``tf.dirty`` of ``size`` bytes, all claimed: a spare when there is
    one (its pages reused; not those whose inode is in ``avoid``), else a new one. The
    caller owns the descriptor. The step's directory is made with no link on the way (one
    left there fails the save)."""
    os.close(tf.store.make_dir(tf.directory))
    with _opened_dir(tf.spares) as spares:
        for name in _listed(spares):
            if name.isdigit() and int(name) in avoid:
                continue
            with contextlib.suppress(FileNotFoundError):  # another save claimed it first
                os.rename(name, tf.dirty, src_dir_fd=spares)
                break
    fd = _open_regular(tf.dirty)
    try:
        size_to(fd, size)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tf.dirty)
        raise
    return fd


def reserve(
    config: TieredConfig, store: Storage, step: int, rank: int, size: int, avoid: frozenset[int] = frozenset()
) -> Reservation:
    """Where rank's part of ``step`` is received into ``store`` (a clique peer's replica):
    on a tier whose retention recycles part files, a spare's pages (``create``; ``avoid``:
    the inodes staging keeps mapped here, for its own next saves), so that a save every
    step receives into warm pages, not fresh ones claimed and zeroed each time; elsewhere
    the store's own reservation."""
    key = part_key(config.namespace, step, rank)
    if not isinstance(store, LocalStorage) or not recycles(config, store):
        return store.reserve(key, size)
    return _Received(part_file(config, store, step, rank), key, size, avoid)


class _Received(MappedFile):
    """A part file filled in place by bytes from elsewhere: mapped whole, renamed clean on
    ``commit`` (synced as ``finish`` syncs: on a memory file system, not at all)."""

    def __init__(self, tf: TierFile, key: str, size: int, avoid: frozenset[int]) -> None:
        self.tf, self.store, self.key, self.size = tf, tf.store, key, size
        with self.store.errors(key):  # a full tier: the store's error, as its own reservation raises
            fd = create(tf, size, avoid)
            try:
                self._open_map(fd, size)
            except BaseException:
                os.close(fd)
                discard(tf)
                raise

    def commit(self) -> None:
        self._release()
        with self.store.errors(self.key):
            finish(self.tf, self.size, [])

    def discard(self) -> None:
        self._release()
        discard(self.tf)


def _open_regular(path: str) -> int:
    """``path`` opened for writing, never through a link: whoever can write the tier could
    have left a symlink among the spares, and a save must not write where it points."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
    with contextlib.suppress(IsADirectoryError):
        os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def reclaim(fd: int, was: TierFile, tf: TierFile, size: int) -> bool:
    """Put the file open as ``fd`` (staged into last as ``was``) at ``tf.dirty`` for another
    save: where retention left it as a spare, or where a save that never wrote it left it
    (still dirty). False when it is elsewhere (a kept step's part) or gone."""
    ino = os.fstat(fd).st_ino
    for place in (was.spare(ino), was.dirty):
        try:
            if os.lstat(place).st_ino != ino:
                continue
            os.close(tf.store.make_dir(tf.directory))  # no link on the way
            os.rename(place, tf.dirty)
        except FileNotFoundError:
            continue
        size_to(fd, size)
        return True
    return False


def prepare(tf: TierFile, size: int) -> int:
    """An open file of ``size`` bytes, all claimed, with no name yet (``O_TMPFILE`` in the
    spare directory, so on the tier's file system): a part file made ahead of the saves that
    will stage into it (``adopt`` names it). Retention never sees it, and it is gone with
    the process that holds it. The caller owns the descriptor."""
    spares = tf.store.make_dir(os.path.relpath(tf.spares, tf.store.root))
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o644, dir_fd=spares)
    finally:
        os.close(spares)
    try:
        size_to(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unmapped(tf: TierFile, mapped: set[int]) -> int:
    """The part files in ``tf``'s namespace a save of this rank may take that are not among
    ``mapped`` (inodes): its parts of the steps the tier holds (a former process's, at a
    resume) and the spares. ``StagingPool.prepare`` makes fewer by as many, so that the
    tier's files and the prepared ones stay at ``keep + 1`` steps."""
    ns_dir, spare_name = os.path.split(tf.spares)
    part = os.path.basename(tf.clean)
    paths = []
    with _opened_dir(ns_dir) as ns:
        for entry in _listed(ns):
            if entry == spare_name:
                with _opened_dir(tf.spares) as spares:
                    paths += [os.path.join(tf.spares, n) for n in _listed(spares)]
            else:
                paths.append(os.path.join(ns_dir, entry, part))
    count = 0
    for path in paths:
        with contextlib.suppress(OSError):  # not there, or not a directory on the way
            st = os.lstat(path)
            count += stat.S_ISREG(st.st_mode) and st.st_ino not in mapped
    return count


def adopt(fd: int, tf: TierFile, size: int) -> None:
    """Name the prepared file open as ``fd`` (``prepare``) ``tf.dirty``: a save stages into it."""
    directory = tf.store.make_dir(tf.directory)  # no link on the way
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(tf.dirty), dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)
    if os.fstat(fd).st_size != size:
        size_to(fd, size)


def delete_unused(fd: int, was: TierFile) -> None:
    """Delete the file open as ``fd`` where no step holds it: a spare, or never written."""
    ino = os.fstat(fd).st_ino
    for place in (was.spare(ino), was.dirty):
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(place).st_ino == ino:
                os.unlink(place)


def gone(fd: int) -> bool:
    """Whether the file was deleted (only this process's map holds its pages now)."""
    return os.fstat(fd).st_nlink == 0


def size_to(fd: int, size: int) -> None:
    """Exactly ``size`` bytes, every block claimed now: a full tmpfs fails here with ENOSPC,
    not with SIGBUS when the map is written. Only what is not claimed yet is claimed: a
    file with no hole (every page to its end held, as a part file staged into and finished
    is) is cut to ``size`` or claimed from its end on. ``posix_fallocate`` walks every page
    of its range, a cost on the training thread (~0.1 s for 3 GB) for pages already held."""
    st = os.fstat(fd)
    whole = st.st_blocks * 512 >= st.st_size  # no hole: every page up to the end is held
    if st.st_size == size and whole:
        return
    os.ftruncate(fd, size)
    start = min(st.st_size, size) if whole else 0
    if size > start:
        os.posix_fallocate(fd, start, size - start)


def close_gaps(
    base: int, placed: list[tuple[int, int]], before: Callable[[int, int], None] | None = None
) -> list[int]:
    """Close the gaps between the byte ranges ``placed`` (offset, length; ascending, not
    overlapping) of the file mapped at address ``base``: each moves down to follow the one
    before. Their new offsets, in order; the last one's end is where the file ends.
    ``before(address, length)``: called before each move with the bytes it overwrites (a
    reader of what lay there finishes first)."""
    end, out = 0, []
    for off, n in placed:
        if off != end:
            if before is not None:
                before(base + end, n)
            ctypes.memmove(base + end, base + off, n)
        out.append(end)
        end += n
    return out


def finish(tf: TierFile, end: int, tail: list[memoryview]) -> int:
    """The file cut at ``end``, ``tail`` appended, renamed clean; its size. Synced (then its
    directory) as ``LocalStorage`` syncs a write: on a memory file system, not at all."""
    fd = os.open(tf.dirty, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, end)
        pos = end
        for chunk in tail:
            view = memoryview(chunk).cast("B")
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        if tf.store.durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tf.dirty, tf.clean)
    if tf.store.durable:
        with _opened_dir(os.path.dirname(tf.clean)) as directory:
            if directory is not None:
                os.fsync(directory)
    return pos


def discard(tf: TierFile) -> None:
    """A failed save's staged file goes (its staging slot lets its pages go with it)."""
    with contextlib.suppress(OSError):
        os.unlink(tf.dirty)


def recycle(store: Storage, namespace: str, step: int) -> None:
    """Retention's drop of ``step`` on a memory tier: its part files become spares."""
    assert isinstance(store, LocalStorage)
    with contextlib.suppress(NotAnObject):  # a link there: the parts go with the step's directory
        os.close(store.make_dir(spare_dir(namespace)))
    with (
        _opened_dir(store.path(step_dir(namespace, step))) as sdir,
        _opened_dir(store.path(spare_dir(namespace))) as spares,
    ):
        if spares is None:
            return  # not a directory of ours: the parts go with the step's directory
        for name in _listed(sdir):
            if not is_part_name(name):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=sdir, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):  # anything else goes with the directory
                    os.rename(name, str(st.st_ino), src_dir_fd=sdir, dst_dir_fd=spares)


def clear_spares(store: Storage, namespace: str) -> None:
    """Delete the spares no save claimed since the last retention."""
    assert isinstance(store, LocalStorage)
    with _opened_dir(store.path(spare_dir(namespace))) as spares:
        for name in _listed(spares):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=spares)


@contextlib.contextmanager
def _opened_dir(path: str) -> Iterator[int | None]:
    """``path`` opened as a directory, never through a link (None: missing, a link, or no
    directory). Whoever can write the tier could have replaced the spares or a step's
    directory by a link to a directory elsewhere: retention must not empty that one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _listed(directory: int | None) -> list[str]:
    return [] if directory is None else sorted(os.listdir(directory))
