"""Content-addressed blocks (dedup): each distinct block stored once per tier root.

With ``TieredConfig(dedup=True)`` a tensor item of at least ``MIN_BLOCKED`` bytes is cut
into blocks of ``BLOCK_BYTES`` raw bytes, each named by the xxh3-128 of its raw bytes.
A root keeps one file per distinct block under ``<namespace>/blocks/`` (``format``), and a
step's records name the blocks they use (``Record.blocks``), whichever step or rank wrote
them first. A block a root already holds is never written (nor, by the writer process,
read from the faster tier) again. Torch-free: the writer process uses it.

Garbage collection is by reference and safe against a crash at any instant and against
saves running at the same time:

- A save (or a writer's copy) first writes the list of every block its part will use
  (``rank_<r>.blocks`` in the step's directory), then waits while a GC lease is held, and
  only then looks at which blocks the root holds, writing the missing ones.
- ``collect`` takes a lease (a file of its own), then reads the lists of every step
  directory still in the root (committed or not), then deletes the block files no list
  names, then drops its lease. A committed step's list is written before its marker, so
  nothing it uses is deleted; a GC killed midway leaves only unreferenced blocks, which
  the next one reclaims.
- Either the GC's lease is visible to the save (which then waits for it), or the save's
  list was written before the GC read the lists (so the GC keeps its blocks): each side
  writes its own file before reading the other's, so one of the two always holds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from . import owners
from .base import Buffer, Storage
from .codec import (
    CHUNK_BYTES,
    ChecksumMismatch,
    Encoder,
    checksummer,
    decode_chunk,
    encode_block,
    read_block,
    split,
)
from .forks import ThreadPool, renew_in_child
from .format import (
    BLOCK_HEADER,
    GC_EPOCH,
    GC_LEASE,
    Record,
    block_key,
    blocks_dir,
    is_block_id,
    parse_block_header,
    parse_step_dir,
    refs_key,
    step_dir,
)
from .records import NOTE_LIMIT, REFS_LIMIT, DamagedRecord, parse_json, read_record

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20  # raw bytes per block: small enough that a partly changed tensor dedups
MIN_BLOCKED = 64 << 10  # smaller items stay in the part file (a block file each would cost more)
LEASE_TTL = 600.0  # seconds after which a lease is presumed left by a dead GC on another host
LEASE_POLL = 0.05
THREADS = 8  # block checks and writes in flight per part (a bucket answers each in ~ms)
PARALLEL_HASH = 256 << 10  # chunks from this size are hashed on the hashing threads (``hashing``)


def block_id(raw: Buffer) -> str:
    """A block's name: the xxh3-128 of its raw bytes, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(raw)


def block_hasher() -> Any:
    """``block_id`` fed piece by piece (``update``, then ``hexdigest``): the same name."""
    return xxhash.xxh3_128()


Screen = Callable[[memoryview], bool]  # a check of a chunk's bytes (the non-finite check)
SCREEN_PIECE = 2 << 20  # bytes hashed, then screened while they are still in cache (L2/L3)


class Print(NamedTuple):
    """What ``fingerprints`` found of one chunk."""

    checksum: int
    block: str | None  # its block id, for a blocked chunk
    passed: bool  # its screen found nothing (True when it had none)


def fingerprints(
    chunks: list[memoryview],
    blocked: list[bool],
    known: list[str | None],
    screens: list[Screen | None] | None = None,
) -> list[Print]:
    """Each chunk's checksum, for a ``blocked`` one its block id (``known``'s, when the save
    planner named it already), and whether its screen passed.

    A chunk's screen runs piece by piece right after each ``SCREEN_PIECE`` is hashed, while
    those bytes are in cache, so beside the hash it costs a fraction of a pass of its own.
    A block of the previous call keeps its checksum and its screens' answers: the id names
    the bytes, and both are functions of them, so an unchanged block is hashed (and screened)
    once, not twice. Large chunks are hashed on ``hashing``'s threads, one per core of this
    rank (xxhash and numpy release the GIL on large buffers, so this scales with the
    cores), small ones inline."""
    global _LAST
    last = _LAST
    screens = screens or [None] * len(chunks)

    def one(i: int) -> Print:
        chunk, screen = chunks[i], screens[i]
        verdict: bool | None = None if screen else True
        name = known[i] if blocked[i] else None
        if blocked[i] and name is None:
            hasher = block_hasher()
            verdict, name = _fed(hasher, chunk, screen), hasher.hexdigest()
        h, verdicts = last.get(name, (None, {})) if name else (None, {})
        if verdict is None:
            verdict = verdicts.get(screen)
        if h is None:
            hasher = checksummer()
            ran = _fed(hasher, chunk, screen if verdict is None else None)
            h, verdict = hasher.intdigest(), ran if verdict is None else verdict
        if verdict is None:  # an unchanged block the planner named, not screened this way yet
            verdict = _fed(None, chunk, screen)
        return Print(h, name, verdict)

    big = [i for i, c in enumerate(chunks) if len(c) >= PARALLEL_HASH]
    futures = {i: hashing().submit(one, i) for i in big} if len(big) > 1 else {}
    got = [futures[i].result() if i in futures else one(i) for i in range(len(chunks))]
    _LAST = {}
    for p, screen in zip(got, screens, strict=True):
        if p.block is not None:
            verdicts = dict(last.get(p.block, (0, {}))[1])
            if screen is not None:
                verdicts[screen] = p.passed
            _LAST[p.block] = (p.checksum, verdicts)
    return got


def _fed(hasher: Any, buf: memoryview, screen: Screen | None) -> bool:
    """Feeds ``buf`` to ``hasher`` (if any), screening each piece after it; whether all passed
    (screening stops at the first piece that fails: one is enough)."""
    if screen is None:
        hasher.update(buf)
        return True
    passed = True
    for start in range(0, len(buf), SCREEN_PIECE):
        piece = buf[start : start + SCREEN_PIECE]
        if hasher is not None:
            hasher.update(piece)
        passed = passed and screen(piece)
    return passed


_LAST: dict[str, tuple[int, dict[Screen, bool]]] = {}  # block id -> its checksum and screens' answers


def blocked(kind: str, raw_length: int) -> bool:
    """Whether an item is stored as blocks when dedup is on."""
    return kind == "tensor" and raw_length >= MIN_BLOCKED


def chunks(kind: str, raw: memoryview, dedup: bool) -> tuple[list[memoryview], bool]:
    """An item's bytes cut as a save stores and checksums them: into blocks where it is
    ``blocked`` with dedup on, else into the codec's chunks; and whether into blocks. The
    writer's checksums and a dropped replica's digest both come from this cut."""
    cut = dedup and blocked(kind, len(raw))
    return split(raw, BLOCK_BYTES if cut else CHUNK_BYTES), cut


# -- references -------------------------------------------------------------------------


def write_refs(store: Storage, namespace: str, step: int, rank: int, ids: Iterable[str]) -> None:
    """The blocks rank's part of ``step`` uses in this root: before any of them is relied on."""
    store.write(refs_key(namespace, step, rank), [json.dumps(sorted(set(ids))).encode()])


def read_refs(store: Storage, key: str) -> set[str]:
    """The block ids a blocks list names; DamagedRecord (a ValueError) unless it is one."""
    ids = parse_json(read_record(store, key, REFS_LIMIT), store.describe(key))
    if not isinstance(ids, list) or not all(isinstance(i, str) and is_block_id(i) for i in ids):
        raise DamagedRecord(f"{store.describe(key)} is not a list of block ids")
    return set(ids)


def referenced(store: Storage, namespace: str) -> set[str]:
    """Every block some step directory of the root names. Raises when a list cannot be read
    (a GC must then delete nothing)."""
    refs: set[str] = set()
    for name in store.list(namespace):
        step = parse_step_dir(name)
        if step is None:
            continue
        sdir = step_dir(namespace, step)
        for f in store.list(sdir):
            if f.endswith(".blocks"):
                try:
                    refs |= read_refs(store, f"{sdir}/{f}")
                except FileNotFoundError:
                    continue  # the step was deleted while listed: it references nothing now
    return refs


# -- the GC lease -----------------------------------------------------------------------


def _leases(store: Storage, namespace: str) -> list[str]:
    return [n for n in store.list(blocks_dir(namespace)) if n.startswith(GC_LEASE)]


def _stale(store: Storage, key: str) -> bool:
    """A lease whose GC is gone: its process is dead (this host), or its time is over
    (``owners``); a lease torn by a crash while it was written is stale too."""
    try:
        return not owners.owner_alive(store.read(key, 0, NOTE_LIMIT), unreadable=False)
    except FileNotFoundError:
        return True


def wait_for_gc(store: Storage, namespace: str) -> None:
    """Return once no live GC holds a lease on the root's blocks (stale leases are removed)."""
    while True:
        live = []
        for name in _leases(store, namespace):
            key = f"{blocks_dir(namespace)}/{name}"
            if _stale(store, key):
                store.delete(key)
            else:
                live.append(name)
        if not live:
            return
        time.sleep(LEASE_POLL)


@dataclass
class Collected:
    """What one GC did."""

    deleted: int = 0
    freed_bytes: int = 0
    kept: int = 0


def collect(store: Storage, namespace: str) -> Collected | None:
    """Delete the root's blocks that no step directory references (see the module's doc).

    None when the root has no blocks, or a reference list could not be read (nothing is
    deleted then: a block it names might be).
    """
    bdir = blocks_dir(namespace)
    subdirs = [n for n in store.list(bdir) if len(n) == 2]
    if not subdirs:
        return None
    lease = f"{bdir}/{GC_LEASE}.{owners.HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store.write(lease, [owners.owner_record(LEASE_TTL)])
    try:
        try:
            refs = referenced(store, namespace)
        except (OSError, ValueError) as e:
            log.warning("block GC in %s skipped: a reference list is unreadable: %s", store.url, e)
            return None
        done = Collected()
        for sub in subdirs:
            for name in store.list(f"{bdir}/{sub}"):
                if not is_block_id(name):
                    continue  # a block being written under a dirty name, or a stranger
                if name in refs:
                    done.kept += 1
                    continue
                key = block_key(bdir, name)
                if not done.deleted:  # savers' memory of what this root holds ends here
                    new_epoch(store, bdir)
                done.freed_bytes += store.size(key) or 0
                store.delete(key)
                done.deleted += 1
        if done.deleted:
            log.info("block GC in %s: %d blocks (%d bytes) freed", store.url, done.deleted, done.freed_bytes)
        return done
    finally:
        store.delete(lease)


# -- writing ----------------------------------------------------------------------------


@dataclass
class PutResult:
    """Per part: bytes of the blocks it uses, and of those it wrote itself."""

    used_blocks: int = 0
    written_blocks: int = 0
    written_bytes: int = 0  # stored bytes of the blocks written (with their headers)


def held(store: Storage, directory: str, block: str) -> tuple[str, int] | None:
    """(codec, stored length) of a block the root holds, else None."""
    key = block_key(directory, block)
    try:
        head = store.read(key, 0, BLOCK_HEADER)
        size = store.size(key)
        codec = parse_block_header(head)
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a damaged header: written again (readers check every block anyway)
    if size is None:
        return None
    return codec, size - BLOCK_HEADER


# -- what a root holds, remembered between saves -----------------------------------------
#
# A saver checks each block of its part (a header read and a stat; on a bucket, requests).
# It remembers the blocks it saw held or wrote, per root, under the root's GC epoch: a
# token that every GC rewrites before it deletes a block, and that a saver creates when a
# node-local root has none (fresh or wiped; a shared root waits for its first GC). A
# later save that reads the same token after claiming its blocks (reference list, then no
# GC lease) skips their checks: no GC has deleted a block since they were seen (a GC
# after the claim keeps every block the list names). Only a GC deletes blocks: a block
# removed by hand from a root that kept its epoch file is reported when read, and the
# item read from another tier.

_HELD: dict[tuple[str, str], tuple[str, dict[str, tuple[str, int]]]] = {}
_HELD_LOCK = threading.Lock()


@renew_in_child
def _renew_held_lock() -> None:
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()


def new_epoch(store: Storage, directory: str) -> str:
    token = uuid.uuid4().hex
    store.write(f"{directory}/{GC_EPOCH}", [token.encode()])
    return token


def remembered(store: Storage, directory: str, create: bool) -> dict[str, tuple[str, int]]:
    """The blocks this process saw in the root since its current GC epoch began: (codec,
    stored length) by id, to fill in as this save sees more. Call after claiming.

    A root without an epoch gets one only where ``create`` (a node-local root: a few
    ranks); on a shared tier only a GC writes it, as every rank at once must not write
    one object. Until then nothing is remembered there."""
    try:
        token = bytes(store.read(f"{directory}/{GC_EPOCH}", 0, NOTE_LIMIT)).decode("utf-8", "replace")
    except FileNotFoundError:
        if not create:
            return {}
        token = new_epoch(store, directory)
    key = (store.url, directory)
    with _HELD_LOCK:
        got = _HELD.get(key)
        if got is None or got[0] != token:
            got = _HELD[key] = (token, {})
        return got[1]


pool = ThreadPool("tdcp-blocks", THREADS)  # block checks and writes: I/O, ``THREADS`` in flight


def rank_cores() -> int:
    """The cores this rank's own CPU work may take: those it may run on, shared with the
    other ranks of its node (``LOCAL_WORLD_SIZE``), which save at the same moment."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, len(os.sched_getaffinity(0)) // ranks)


# Threads for checksums and screens: one per core of ``rank_cores``. More threads than
# cores only take turns: 8 threads on 2 cores hashed and screened 1 GiB in 0.13 s where 2
# took 0.08 s (each evicts the others' pieces from the cache).
hashing = ThreadPool("tdcp-hash", rank_cores)


class BlockPut:
    """Puts the blocks of one part into a root: each one held there already is skipped.

    ``skip`` names blocks another rank of this save writes (the save planner's choice):
    they are neither checked nor written here. ``starts_epoch``: a root without a GC epoch
    gets one (``remembered``; the tier's placement says whether the save path may).
    """

    def __init__(
        self,
        store: Storage,
        namespace: str,
        encoder: Encoder,
        skip: Iterable[str] = (),
        kept: dict[str, list[Buffer]] | None = None,
        starts_epoch: bool = True,
    ) -> None:
        self.store, self.dir, self.enc = store, blocks_dir(namespace), encoder
        self.skip = set(skip)
        self.kept = kept  # if given: each block file written, as written (the replicas send them)
        self.result = PutResult()
        self._lock = threading.Lock()
        self.seen = remembered(store, self.dir, starts_epoch)  # after the caller's claim (``dedup.claim``)

    def put(self, block: str, raw: Buffer | None, dtype: str | None, fetch=None) -> tuple[int, str]:
        """Ensure ``block`` is in the root; return (stored length, codec) for the record.

        ``raw`` is its raw bytes, or None with ``fetch()`` returning them (the writer
        process reads a block from the faster tier only when the target lacks it).
        """
        with self._lock:
            self.result.used_blocks += 1
        if block in self.skip:
            return 0, self.enc.codec  # written by another rank of this save
        got = self.seen.get(block) or held(self.store, self.dir, block)
        if got is not None:
            self.seen[block] = got
            return got[1], got[0]
        view = memoryview(raw if raw is not None else fetch()).cast("B")
        codec = self.enc.choose(view, dtype)
        stored = self.enc.encode_as(view, codec)
        data = encode_block(codec, stored)
        n = self.store.write(block_key(self.dir, block), data)
        self.seen[block] = (codec, n - BLOCK_HEADER)
        with self._lock:
            if self.kept is not None:
                self.kept[block] = data
            self.result.written_blocks += 1
            self.result.written_bytes += n
        return n - BLOCK_HEADER, codec


def fetch_raw(store: Storage, record: Record, i: int) -> bytes:
    """Chunk i of a dedup record, raw and verified, read from ``store``."""
    n, h = record.info.raw_chunks[i]
    codec, stored = read_block(store, record, i)
    out = bytearray(n)
    decode_chunk(codec, stored, n, memoryview(out), i, h)
    return bytes(out)


__all__ = [
    "BLOCK_BYTES",
    "MIN_BLOCKED",
    "BlockPut",
    "ChecksumMismatch",
    "Collected",
    "PutResult",
    "block_id",
    "blocked",
    "collect",
    "fetch_raw",
    "held",
    "read_refs",
    "referenced",
    "wait_for_gc",
    "write_refs",
]
