"""Importing a stock DCP checkpoint as a step (``tiered_dcp.import_dcp``).

One flow: the stock metadata is read admitting only DCP's records (``metadata.loads``),
each item is taken one of two ways, and the state is saved with a ``TieredWriter`` like
any save of one process (checksummed, committed, copied down by the writer process).

- **Copied by the kernel.** A tensor chunk lying in a local stock file as a plain
  ``torch.save`` record (stored uncompressed, contiguous, in this machine's byte order, with
  no DCP transform: what ``FileSystemWriter`` writes) is copied with ``os.sendfile`` from the
  stock file's page cache straight into the step's part file on the first tier, and checked
  there against the CRC-32 its zip record carries (torch's reader checks none). The save
  then finds those bytes in place (``part_file``: the path an async save's staging into the
  RAM tier takes) and checksums them from the page cache. Nothing passes through this
  process's memory: reading into fresh memory and writing back took 3-5x the time of
  copying the files (``benchmarks/bench_import.py``), and held the whole state.
- **Read by torch's reader.** Everything else: non-tensor values (each loaded with
  ``weights_only=True`` first, ``export.read_whole``), tensors of another form, every
  item of a URL source, and all items when the first tier compresses, dedups or is no local
  directory. Read on ``IMPORT_READ_THREADS`` threads and held in memory until saved.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import io
import math
import os
import sys
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tiered_dcp.storage.codec import ChecksumMismatch
from tiered_dcp.storage.local import LocalStorage

from ..config import TieredConfig, node_of
from ..errors import CheckpointCorruptError, NoCheckpointError
from ..load.resume import failures_of
from ..save import staging
from ..save.snapshot import SnapshotTensor
from ..save.writer import TieredWriter
from ..steps import part_file
from ..steps.catalog import TierView
from ..steps.part_file import TierFile
from ..tensors import byte_view
from .export import one_process, read_whole

IMPORT_READ_THREADS = 4  # items torch's reader reads at once (its own reader: one at a time)
CRC_THREADS = 2  # copied records checked at once, while the next ones are copied
SENDFILE_MAX = 1 << 30  # bytes per sendfile call (the kernel moves at most ~2 GiB per call)
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


@dataclass(frozen=True, eq=False)  # it holds a tensor: compared by identity
class StockRecord:
    """One tensor chunk of a local stock file that the kernel can copy as it lies."""

    index: MetadataIndex
    file: str  # the stock file, relative to the checkpoint directory
    offset: int  # where the chunk's bytes start in that file
    crc: int  # the CRC-32 its zip record gives those bytes (0: torch.save wrote none)
    meta: torch.Tensor  # on the meta device: its dtype and shape

    @property
    def nbytes(self) -> int:
        return self.meta.numel() * self.meta.element_size()


def run_import(config: TieredConfig, source: str, step: int, storage_options: dict[str, Any]) -> int:
    """``tiered_dcp.import_dcp`` (see there); the step imported."""
    md, reader = _stock_reader(source, storage_options)
    alone = dataclasses.replace(config, replication_factor=1, failure_domain=None)
    writer = TieredWriter(alone, step=step)
    part = _part_file(writer)
    records = _plain_records(source, md) if part is not None and _is_local(source) else {}
    copied = {
        fqn: [records[MetadataIndex(fqn, c.offsets)] for c in tmd.chunks]
        for fqn, tmd in md.state_dict_metadata.items()
        if isinstance(tmd, TensorStorageMetadata)
        and all(MetadataIndex(fqn, c.offsets) in records for c in tmd.chunks)
    }
    copied = {fqn: recs for fqn, recs in copied.items() if any(r.nbytes for r in recs)}
    rest = set(md.state_dict_metadata) - set(copied)
    with one_process():
        state = _read(source, reader, rest) if rest else {}
        records_copied = [r for recs in copied.values() for r in recs]
        into = _copied_into(part, source, records_copied) if copied else contextlib.nullcontext({})
        with into as shards:
            for fqn, recs in copied.items():
                stock = _stock_tensor(md.state_dict_metadata[fqn], recs, shards)
                set_element(state, (md.planner_data or {}).get(fqn, (fqn,)), stock)
            if copied:
                writer.staged_file = part  # the save writes the part file in place, as a staged one
            dcp.save(state, storage_writer=writer, no_dist=True)
    return step


def _stock_tensor(
    tmd: Any, recs: list[StockRecord], shards: dict[MetadataIndex, torch.Tensor]
) -> SnapshotTensor:
    """The value DCP saves for a copied tensor: its stock chunks as write items, each over its
    bytes in the part file (so the step keeps the stock checkpoint's sharding)."""
    items = [
        WriteItem(
            index=r.index,
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=c, properties=tmd.properties, size=tmd.size),
        )
        for r, c in zip(recs, tmd.chunks, strict=True)
    ]
    values = [shards[r.index] for r in recs]
    return SnapshotTensor(items, values, tmd.size, tmd.properties.dtype, "stock checkpoint")


def _read(source: str, reader: Any, keys: set[str]) -> dict:
    """The items ``keys`` by torch's reader (nested as saved); a failed read names ``source``."""
    try:
        return read_whole(reader, keys)
    except CheckpointException as e:  # DCP's wrapping of a read that failed
        cause = failures_of(e)[0]
        raise CheckpointCorruptError(
            f"{source} cannot be imported: {type(cause).__name__}: {cause}"
        ) from None


def _part_file(writer: TieredWriter) -> TierFile | None:
    """The part file the import fills, when the writer's first tier stores a part as it lies
    in memory: a local directory, chunks raw, no dedup (else None: torch's reader)."""
    config = writer.config
    first = writer.tier_indexes[0]
    store = TierView(config, first, node_of(0), 0).own
    if not isinstance(store, LocalStorage) or config.tiers[first].compression or config.dedup:
        return None
    return part_file.part_file(config, store, writer.step, 0)


def _is_local(source: str) -> bool:
    return "://" not in source or source.startswith("file://")


def _plain_records(source: str, md: Metadata) -> dict[MetadataIndex, StockRecord]:
    """The tensor chunks of ``source`` that lie as plain records (``StockRecord``), in file
    order. A chunk reaching past its file's end is refused here; a record of another form is
    left to torch's reader, which reads it or says why not."""
    directory = source.removeprefix("file://")
    out: dict[MetadataIndex, StockRecord] = {}
    fds: dict[str, int] = {}
    try:
        for index, info in sorted(
            md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
        ):
            tmd = md.state_dict_metadata.get(index.fqn)
            if not isinstance(tmd, TensorStorageMetadata) or getattr(info, "transform_descriptors", None):
                continue
            if info.relative_path not in fds:
                try:
                    fds[info.relative_path] = os.open(
                        os.path.join(directory, info.relative_path), os.O_RDONLY
                    )
                except OSError:
                    continue  # torch's reader names it
            fd = fds[info.relative_path]
            end = os.fstat(fd).st_size
            if info.offset + info.length > end:
                raise CheckpointCorruptError(
                    f"{source} cannot be imported: {info.relative_path} is cut short (it ends at byte {end}; "
                    f"item {index.fqn!r} lies in bytes {info.offset}..{info.offset + info.length}); "
                    "copy it again from its source"
                )
            chunk = next((c for c in tmd.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
            rec = _plain_record(fd, info, index, tmd, chunk.sizes) if chunk is not None else None
            if rec is not None:
                out[index] = rec
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _plain_record(
    fd: int, info: Any, index: MetadataIndex, tmd: TensorStorageMetadata, sizes: torch.Size
) -> StockRecord | None:
    """The chunk at ``info`` as a ``StockRecord``, when its zip record holds exactly its bytes
    (one storage, stored, contiguous, this byte order); else None. Reads only the record's
    directory and pickle: torch loads it on the meta device, which locates the data."""
    window = _Window(fd, info.offset, info.length)
    try:
        with zipfile.ZipFile(window) as z:
            if any(i.compress_type != zipfile.ZIP_STORED for i in z.infolist()):
                return None  # torch.save stores; nothing here inflates what a crafted file packed
            names = z.namelist()
            data = [z.getinfo(n) for n in names if n.endswith("/data/0")]
            storages = [n for n in names if "/data/" in n and not n.endswith(".pkl")]
            order = [z.read(n) for n in names if n.endswith("/byteorder")]
        window.seek(0)
        meta = torch.load(window, map_location="meta", weights_only=True)
        data_at = meta.untyped_storage()._checkpoint_offset
    except Exception:  # not a record torch.save wrote as FileSystemWriter does: torch's reader
        return None
    plain = (
        type(meta) is torch.Tensor
        and meta.dtype == tmd.properties.dtype
        and tuple(meta.shape) == tuple(sizes)
        and meta.is_contiguous()
        and meta.storage_offset() == 0
        and meta.untyped_storage().nbytes() == meta.numel() * meta.element_size()
        and len(data) == 1
        and storages == [data[0].filename]
        and data[0].file_size == meta.untyped_storage().nbytes()
        and order in ([], [sys.byteorder.encode()])
        and isinstance(data_at, int)
        and 0 <= data_at <= info.length - meta.untyped_storage().nbytes()  # inside the item's bytes
    )
    if not plain:
        return None
    return StockRecord(index, info.relative_path, info.offset + data_at, data[0].CRC, meta)


class _Window(io.RawIOBase):
    """Bytes ``offset``..``offset + length`` of the open file ``fd``, as a file of their own."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: max(0, self.length - self.pos)]
        n = os.preadv(self.fd, [view], self.offset + self.pos) if len(view) else 0
        self.pos += n
        return n


@contextlib.contextmanager
def _copied_into(
    part: TierFile, source: str, records: list[StockRecord]
) -> Iterator[dict[MetadataIndex, torch.Tensor]]:
    """``records`` copied into ``part`` (laid out as staging lays a part file out) and checked;
    each record's tensor over the mapped file, registered for the save (``staging.registered``).
    The file goes on any failure before the save renames it clean."""
    directory = source.removeprefix("file://")
    spans = staging.arena_layout([r.meta for r in records])
    total = sum(r.nbytes for r in records)
    fd = part_file.create(part, total)
    try:
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, total)  # maps it (a dup of fd)
            arena = torch.empty(0, dtype=torch.uint8).set_(storage)
            _copy(fd, directory, source, records, [s[0] for s in spans], arena, part.store.durable)
        finally:
            os.close(fd)
        views = staging.arena_views(storage, spans)
        with staging.registered(part.dirty, arena):
            yield {r.index: v for r, v in zip(records, views, strict=True)}
    except BaseException:
        part_file.discard(part)
        with contextlib.suppress(OSError):  # the step's directory, when this made it
            os.rmdir(os.path.dirname(part.dirty))
        raise


def _copy(
    fd: int,
    directory: str,
    source: str,
    records: list[StockRecord],
    at: list[int],
    arena: torch.Tensor,
    durable: bool,
) -> None:
    """Each record's bytes into the file ``fd`` at its offset ``at``, by the kernel; each
    checked against its CRC-32 in the mapped ``arena`` while the next ones are copied."""
    checks = []
    with ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="tiered-dcp-import-crc") as pool:
        opened: dict[str, int] = {}
        try:
            for rec, off in sorted(zip(records, at, strict=True), key=lambda ra: (ra[0].file, ra[0].offset)):
                if rec.file not in opened:
                    opened[rec.file] = os.open(os.path.join(directory, rec.file), os.O_RDONLY)
                _kernel_copy(opened[rec.file], rec.offset, fd, off, rec.nbytes)
                if durable:  # its write-back starts now, while the next ones are copied
                    _start_write_back(fd, off, rec.nbytes)
                if rec.crc:
                    checks.append((rec, pool.submit(zlib.crc32, byte_view(arena[off : off + rec.nbytes]))))
        finally:
            for f in opened.values():
                os.close(f)
        for rec, check in checks:
            got = check.result()
            if got != rec.crc:
                where = f"item {rec.index.fqn!r} (offset {list(rec.index.offset or [])}) in {rec.file}"
                raise CheckpointCorruptError(
                    f"{source} cannot be imported: {where} fails its CRC-32 "
                    f"(recorded {rec.crc:08x}, read {got:08x}): the file is damaged; "
                    "copy it again from its source"
                )


def _kernel_copy(src: int, src_at: int, dst: int, dst_at: int, n: int) -> None:
    """``n`` bytes from ``src`` at ``src_at`` to ``dst`` at ``dst_at``, page cache to page cache
    (``sendfile``: between any two file systems, where ``copy_file_range`` needs one)."""
    os.lseek(dst, dst_at, os.SEEK_SET)
    done = 0
    while done < n:
        sent = os.sendfile(dst, src, src_at + done, min(n - done, SENDFILE_MAX))
        if sent == 0:
            raise OSError(errno.EIO, f"the stock file ended {n - done} bytes early")
        done += sent


def _start_write_back(fd: int, offset: int, n: int) -> None:
    """Start writing ``n`` bytes of ``fd`` at ``offset`` back to the disk, without waiting
    (``sync_file_range``, which Python's os lacks): the save's fsync then finds most of them
    written. Only a hint: where it fails the fsync does it all."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    libc.sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)


def _stock_reader(src: str, storage_options: dict[str, Any]) -> tuple[Metadata, Any]:
    """The stock checkpoint ``src``'s metadata, unpickled admitting only DCP's metadata records
    (``metadata.loads``: torch's own reader unpickles that file whatever it names, and a
    checkpoint from elsewhere is not to be trusted that far), and a reader of it."""
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from ..steps.metadata import loads

    local = _is_local(src)
    path = src.removeprefix("file://") if local else src
    try:
        with fsspec.open(f"{path.rstrip('/')}/.metadata", "rb", **({} if local else storage_options)) as f:
            blob = f.read()
    except FileNotFoundError as e:
        raise NoCheckpointError(f"{src} is no stock DCP checkpoint (no .metadata to read): {e}") from None
    try:
        md = loads(blob, stock=True)
    except ChecksumMismatch as e:
        raise CheckpointCorruptError(f"{src}/.metadata: {e}") from None

    class Checked(dcp.FileSystemReader if local else FsspecReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md.storage_meta = md.storage_meta or StorageMeta()
            md.storage_meta.load_id = self.load_id  # as torch's reader does
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            """torch's read, on ``IMPORT_READ_THREADS`` runs of the plan's items at once: its
            reader reads one item after another, and unpickling each leaves the disk idle
            (2.2x faster on 2 cores; each run opens its own streams)."""
            from torch.futures import Future

            runs = _runs(plan.items, IMPORT_READ_THREADS)
            read = super().read_data
            with ThreadPoolExecutor(len(runs) or 1) as pool:
                for f in [pool.submit(read, dataclasses.replace(plan, items=r), planner) for r in runs]:
                    f.result().wait()
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return md, (Checked(path) if local else Checked(path, **storage_options))


def _runs(items: list, n: int) -> list[list]:
    """``items`` cut into at most ``n`` consecutive runs of about equal bytes (so each thread
    reads its run of a file in order)."""
    sizes = [max(1, _read_bytes(it)) for it in items]
    total, runs, acc = sum(sizes), [[]], 0
    for it, size in zip(items, sizes, strict=True):
        if acc >= total * len(runs) / n and len(runs) < n:
            runs.append([])
        runs[-1].append(it)
        acc += size
    return [r for r in runs if r]


def _read_bytes(item: Any) -> int:
    return math.prod(item.lengths) if item.lengths else 0
