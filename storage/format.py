"""The on-storage format: every name, the commit marker, item records and per-part indexes.

This module is the only code that knows the layout (docs/format.md). It imports neither
torch nor anything from ``tiered_dcp`` outside ``storage``, so the writer process can copy
steps with it alone. One tier root holds::

    <namespace>/step_<12-digit step>/
        rank_<5-digit rank>.part      one per rank: its items' stored chunks back to back
        rank_<5-digit rank>.index     that part's records *in this root* (JSON; format 2: pickled)
        pin.rank_<r>.t<tier>          rank r's writer still has to copy the step to tier <tier>
        metadata                      DCP's Metadata, pickled; the same bytes in every root
        COMMITTED                     the marker (JSON), written last

The DCP metadata holds what is true of an item on every tier (``ItemInfo``: its rank,
kind, dtype, shape and raw chunk checksums); each root's index holds where the item's
bytes are there (``Record``: file, offset, codecs, stored chunk lengths, and the item's
``ItemInfo`` again, so that an index reads on its own). So the metadata and the marker are
the same bytes on every tier, and copying a step to another tier is copying parts, writing
their indexes and copying those two files.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from .base import Storage
from .forks import renew_in_child
from .records import (
    CHUNK_BYTES,
    MAX_BYTES,
    MAX_NAME,
    MAX_STEP,
    MAX_WORLD,
    METADATA_LIMIT,
    STORED_CHUNK_BYTES,
    DamagedRecord,
    dimensions,
    json_object,
    parse_json,
    read_record,
    short_list,
    short_text,
    shown,
    whole_number,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
NONFINITE_NAMES = 16  # non-finite items a marker names (it counts them all)
READABLE_FORMATS = (1, 2, 3)
MARKER = "COMMITTED"
METADATA = "metadata"
STEP_PREFIX = "step_"
PIN_PREFIX = "pin."
LEASE_PREFIX = "lease."
FAILED_PREFIX = "failed."
QUARANTINE_INFIX = ".quarantined."

# -- names -------------------------------------------------------------------------------


def step_dir(namespace: str, step: int) -> str:
    """The directory of one step, relative to the tier root."""
    return f"{namespace}/{STEP_PREFIX}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name (as listed under the namespace) stands for, else None: only
    the name ``step_dir`` gives it (ASCII digits, at least 12, no sign, no more leading
    zeros, at most ``MAX_STEP``), so no two names stand for one step."""
    digits = name[len(STEP_PREFIX) :]
    if not (name.startswith(STEP_PREFIX) and digits.isascii() and digits.isdigit()) or len(digits) > 19:
        return None
    step = int(digits)
    return step if step <= MAX_STEP and digits == f"{step:012d}" else None


def part_name(rank: int) -> str:
    return f"rank_{rank:05d}.part"


def is_part_name(name: str) -> bool:
    """Whether a name listed in a step's directory is a (clean) part file."""
    digits = name[5:-5]
    return name.startswith("rank_") and name.endswith(".part") and digits.isascii() and digits.isdigit()


def part_key(namespace: str, step: int, rank: int) -> str:
    """Rank's part file of ``step``: in every root that holds the part, under this key."""
    return f"{step_dir(namespace, step)}/{part_name(rank)}"


def index_key(namespace: str, step: int, rank: int) -> str:
    """The records of rank's part in the root holding it: written right after the part."""
    return f"{step_dir(namespace, step)}/rank_{rank:05d}.index"


def pin_key(namespace: str, step: int, rank: int, target: int) -> str:
    """A pin: rank's writer still has to copy this step to tier ``target``; retention waits."""
    return f"{step_dir(namespace, step)}/{PIN_PREFIX}rank_{rank:05d}.t{target:02d}"


def is_pin(name: str) -> bool:
    return name.startswith(PIN_PREFIX)


def lease_key(namespace: str, step: int, holder: str) -> str:
    """A reader's lease on the step in this root: retention leaves the step alone while it
    is live. ``holder`` names the reader (host, pid and a random id)."""
    return f"{step_dir(namespace, step)}/{LEASE_PREFIX}{holder}"


def is_lease(name: str) -> bool:
    return name.startswith(LEASE_PREFIX)


def failed_key(namespace: str, step: int, rank: int) -> str:
    """Rank's note that its save of the step failed (the error, as text): the step will never
    be committed, and the next commit's retention removes it."""
    return f"{step_dir(namespace, step)}/{FAILED_PREFIX}rank_{rank:05d}"


def is_failed_note(name: str) -> bool:
    return name.startswith(FAILED_PREFIX)


def quarantine_key(namespace: str, step: int, ident: int, rank: int) -> str:
    """Rank's mark that the save of ``step`` whose metadata checksum is ``ident`` failed a load
    with no good copy left (the why, as text). It sits beside the step's directory, so the
    namespace listing every load and retention already makes shows it, and it names one
    save: a later save of the same step number is not quarantined by it."""
    return f"{step_dir(namespace, step)}{QUARANTINE_INFIX}{ident:016x}.rank_{rank:05d}"


def parse_quarantine(name: str) -> tuple[int, int] | None:
    """(step, ident) of a quarantine mark's name as listed under the namespace, else None."""
    head, sep, tail = name.partition(QUARANTINE_INFIX)
    step = parse_step_dir(head) if sep else None
    ident = tail.split(".", 1)[0]
    if step is None or len(ident) != 16 or any(c not in "0123456789abcdef" for c in ident):
        return None
    return step, int(ident, 16)


def metadata_key(namespace: str, step: int) -> str:
    return f"{step_dir(namespace, step)}/{METADATA}"


def marker_key(namespace: str, step: int) -> str:
    return f"{step_dir(namespace, step)}/{MARKER}"


# -- content-addressed blocks (dedup) ------------------------------------------------------

BLOCKS_DIR = "blocks"
GC_LEASE = "GC.lease"
GC_EPOCH = "GC.epoch"  # rewritten by a GC before it deletes a block: what a saver saw held may be gone
BLOCK_MAGIC = b"TDBLOCK1"  # a block file: magic, its codec (8 ASCII bytes, NUL-padded), payload
BLOCK_HEADER = 16
BLOCK_LIMIT = BLOCK_HEADER + STORED_CHUNK_BYTES  # a block file's bytes at most


SPARE_DIR = "spare"  # a memory tier's recycled part files, each named by its inode (``steps.part_file``)


def spare_dir(namespace: str) -> str:
    """Where a memory tier keeps the part files retention dropped, for the next save to reuse."""
    return f"{namespace}/{SPARE_DIR}"


def blocks_dir(namespace: str) -> str:
    """Where a root keeps the namespace's blocks: one file per distinct block, any step's."""
    return f"{namespace}/{BLOCKS_DIR}"


def block_key(directory: str, block: str) -> str:
    """A block's file under ``directory`` (``blocks_dir``; a record's ``file``), by its id."""
    return f"{directory}/{block[:2]}/{block}"


def is_block_id(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def stray_name(record: Record, namespace: str) -> str | None:
    """The first name in ``record`` that names no object of the namespace's layout, else
    None: readers open nothing else. A record names a part file of a step (its own, or one
    written before), or the namespace's blocks directory and block ids.

    Whoever can write a tier writes its indexes, so a name is compared with the names this
    module makes, never resolved: ``..``, an absolute path, a backslash or a NUL never match.
    """
    if record.blocks is not None:
        if record.file != blocks_dir(namespace):
            return record.file
        return next((b for b in record.blocks if not is_block_id(b)), None)
    directory, _, name = record.file.rpartition("/")
    step = parse_step_dir(directory.removeprefix(f"{namespace}/"))
    if step is not None and directory == step_dir(namespace, step) and is_part_name(name):
        return None
    return record.file


def refs_key(namespace: str, step: int, rank: int) -> str:
    """The blocks rank's part uses in this root (JSON list), written before any is relied on."""
    return f"{step_dir(namespace, step)}/rank_{rank:05d}.blocks"


def block_header(codec: str) -> bytes:
    name = codec.encode()
    if len(name) > 8:
        raise ValueError(f"codec name {codec!r} longer than 8 bytes")
    return BLOCK_MAGIC + name.ljust(8, b"\0")


def parse_block_header(data: bytes) -> str:
    """The codec a block file's header names; ValueError if it is no block header."""
    if len(data) < BLOCK_HEADER or data[:8] != BLOCK_MAGIC:
        raise ValueError("not a block file (bad header)")
    return data[8:BLOCK_HEADER].rstrip(b"\0").decode("ascii", "replace")


# -- the commit marker ---------------------------------------------------------------------


@dataclass
class PartInfo:
    rank: int
    node: int
    size: int  # the part's size where the step was first committed


@dataclass
class Marker:
    """The commit marker: what a complete copy of the step consists of."""

    step: int
    namespace: str
    world_size: int
    parts: list[PartInfo]
    metadata_size: int
    metadata_xxh3: int
    created: float = field(default_factory=time.time)
    replication: list[int] = field(default_factory=lambda: [1, 1])  # [factor, jump]
    format: int = FORMAT_VERSION
    nonfinite_items: int = 0  # items holding NaN/Inf when saved (``on_nonfinite="mark"``)
    nonfinite: list[str] = field(default_factory=list)  # the first NONFINITE_NAMES of them
    cliques: list[list[int]] | None = None  # failure domains: the cliques, else the jump rule
    domains: list[str] | None = None  # failure domains: rank -> its domain, as stated
    replica_mismatch_items: int = 0  # items whose replicas disagreed (``on_replica_mismatch="mark"``)
    replica_mismatch: list[str] = field(default_factory=list)  # the first NONFINITE_NAMES of them
    replica_ranks: list[int] = field(default_factory=list)  # the ranks whose copies were odd

    def to_bytes(self) -> bytes:
        d = asdict(self)
        if self.finite:  # a finite step's marker reads as before, by older versions too
            del d["nonfinite_items"], d["nonfinite"]
        if self.replicas_agree:  # so does one whose replicas agreed
            del d["replica_mismatch_items"], d["replica_mismatch"], d["replica_ranks"]
        for key in ("cliques", "domains"):  # so does one saved without failure domains
            if d[key] is None:
                del d[key]
        return json.dumps(d, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Marker:
        """A marker from its bytes, every field checked (``DamagedRecord`` naming the first
        that fails): types, ranges, one part per rank in rank order, a layout that places
        every rank, and no divisor zero."""
        d = json_object(
            parse_json(data, "the commit marker"), "the commit marker", _MARKER_REQUIRED, _MARKER_OPTIONAL
        )
        if type(d.get("format")) is not int or d.get("format") not in READABLE_FORMATS:
            raise DamagedRecord(f"unsupported marker format {shown(d.get('format'))}")
        world = whole_number(d["world_size"], "world_size", MAX_WORLD, 1)
        parts = []
        for r, p in enumerate(short_list(d["parts"], "parts", world)):
            p = json_object(p, f"part {r}", {"rank", "node", "size"})
            parts.append(
                PartInfo(
                    whole_number(p["rank"], "a part's rank", r, r),
                    whole_number(p["node"], "a node", MAX_WORLD),
                    whole_number(p["size"], "a part's size"),
                )
            )
        if len(parts) != world:
            raise DamagedRecord(f"the marker lists {len(parts)} parts for {world} ranks")
        replication = short_list(d.get("replication", [1, 1]), "replication", 2)
        if len(replication) != 2:
            raise DamagedRecord("replication must be [factor, jump]")
        factor, jump = (whole_number(n, "a replication factor or jump", MAX_WORLD, 1) for n in replication)
        created = d.get("created", 0.0)
        if type(created) not in (int, float) or not math.isfinite(created):
            raise DamagedRecord(f"created must be a time, not {shown(created)}")
        nonfinite = [
            short_text(n, "a non-finite item's name")
            for n in short_list(d.get("nonfinite", []), "nonfinite", NONFINITE_NAMES)
        ]
        marker = cls(
            whole_number(d["step"], "step", MAX_STEP),
            short_text(d["namespace"], "namespace"),
            world,
            parts,
            whole_number(d["metadata_size"], "metadata_size", METADATA_LIMIT),
            whole_number(d["metadata_xxh3"], "metadata_xxh3", (1 << 64) - 1),
            created,
            [factor, jump],
            d["format"],
            whole_number(d.get("nonfinite_items", 0), "nonfinite_items", MAX_BYTES, len(nonfinite)),
            nonfinite,
            d.get("cliques"),
            d.get("domains"),
            *_replica_fields(d, world),
        )
        _check_layout(marker)
        return marker

    @property
    def finite(self) -> bool:
        """False when the save found NaN/Inf in a floating tensor (loads pass it over)."""
        return self.nonfinite_items == 0

    @property
    def replicas_agree(self) -> bool:
        """False when the save found data-parallel replicas that disagree (loads pass it over)."""
        return self.replica_mismatch_items == 0

    @property
    def trusted(self) -> bool:
        """Whether loads that choose a step may choose this one (finite, replicas agreeing)."""
        return self.finite and self.replicas_agree

    @property
    def has_indexes(self) -> bool:
        """Whether every part has an index next to it (format 3); else the metadata's records
        hold where a part has none (formats 1 and 2)."""
        return self.format >= 3

    def part(self, rank: int) -> PartInfo | None:
        return next((p for p in self.parts if p.rank == rank), None)


_MARKER_REQUIRED = {"step", "namespace", "world_size", "parts", "metadata_size", "metadata_xxh3", "format"}
_MARKER_OPTIONAL = {
    *("created", "replication", "nonfinite_items", "nonfinite", "cliques", "domains"),
    *("replica_mismatch_items", "replica_mismatch", "replica_ranks"),
}


def _replica_fields(d: dict, world: int) -> tuple[int, list[str], list[int]]:
    """A marker's replica fields, checked: names as ``nonfinite``'s, ranks of the world."""
    names = [
        short_text(n, "a name of an item whose replicas disagreed")
        for n in short_list(d.get("replica_mismatch", []), "replica_mismatch", NONFINITE_NAMES)
    ]
    ranks = [
        whole_number(r, "a rank whose replica was odd", world - 1)
        for r in short_list(d.get("replica_ranks", []), "replica_ranks", world)
    ]
    count = whole_number(d.get("replica_mismatch_items", 0), "replica_mismatch_items", MAX_BYTES, len(names))
    return count, names, ranks


def _check_layout(marker: Marker) -> None:
    """``cliques`` split the ranks into groups of the replication factor, or of up to twice
    that less one where a world did not divide (laid out by node: ``cliques.by_node``; a world
    smaller than the factor is one group), else the jump rule places them (the world a
    multiple of factor x jump); ``domains`` name one domain per rank: a marker saying
    otherwise would send reads to the wrong roots."""
    world, (factor, jump) = marker.world_size, marker.replication
    if marker.cliques is not None:
        groups = short_list(marker.cliques, "cliques", world)
        flat = [r for g in groups if isinstance(g, list) for r in g]
        least, most = min(factor, world), max(2 * factor - 1, 1)
        if (
            not all(isinstance(g, list) and least <= len(g) <= most for g in groups)
            or not all(_is_count(r) for r in flat)
            or sorted(flat) != list(range(world))
        ):
            raise DamagedRecord(
                f"a marker's cliques must split its {world} ranks into groups of {least} to {most}"
            )
    elif factor > 1 and world % (factor * jump):
        raise DamagedRecord(f"a marker's replication {factor}x{jump} cannot place its {world} ranks")
    if marker.domains is not None and (
        not isinstance(marker.domains, list)
        or len(marker.domains) != world
        or not all(isinstance(d, str) and len(d) <= MAX_NAME for d in marker.domains)
    ):
        raise DamagedRecord(f"a marker's domains must name one domain for each of its {world} ranks")


def _is_count(n: object) -> bool:
    """A whole number >= 0 (not a bool): a rank or node in a marker becomes part of a name."""
    return type(n) is int and n >= 0


# -- items ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemKey:
    """Which item: DCP's ``MetadataIndex`` without torch, compared as it is (``index`` is a
    lookup hint, not part of the identity)."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def to_json(self) -> list[Any]:
        return [self.fqn, None if self.offset is None else list(self.offset), self.index]

    @classmethod
    def from_json(cls, v: list[Any]) -> ItemKey:
        if not isinstance(v, list) or len(v) != 3:
            raise DamagedRecord(f"an item key must be [name, offset, index], not {shown(v)}")
        fqn, offset, index = v
        if offset is not None:
            offset = dimensions(offset, "an item's offset")
        if index is not None:
            whole_number(index, "an item's index")
        return cls(short_text(fqn, "an item's name"), offset, index)


Chunk = tuple[int, int, int]  # (stored length, raw length, xxh3-64 of the raw bytes), as in an index


@dataclass(frozen=True, slots=True)
class ItemInfo:
    """What is true of an item on every tier: the DCP metadata's ``storage_data`` holds it,
    and each record of the item (``Record.info``) carries it. Slotted, as ``Record``: an
    index holds tens of thousands, and objects without a ``__dict__`` parse faster."""

    rank: int  # whose part holds the item
    kind: str  # "tensor" | "bytes"
    raw_chunks: tuple[tuple[int, int], ...]  # (raw length, xxh3-64) per chunk
    dtype: str | None = None  # tensors: "torch.float32"
    shape: tuple[int, ...] | None = None
    # A floating tensor that held NaN/Inf when saved. The indexes' records say so and the
    # marker counts such items; the metadata does not (``to_dict``), so there it reads False.
    nonfinite: bool = False

    @property
    def raw_length(self) -> int:
        return sum(n for n, _ in self.raw_chunks)

    def to_dict(self) -> dict[str, Any]:
        """The metadata's dict of the item. No ``nonfinite``: the metadata never held it."""
        d: dict[str, Any] = {
            "rank": self.rank,
            "kind": self.kind,
            "chunks": [list(c) for c in self.raw_chunks],
        }
        if self.kind == "tensor":
            d.update(dtype=self.dtype, shape=list(self.shape or ()))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ItemInfo:
        """From the metadata's dict, or from a record's (any format: its chunks are
        ``[stored, raw, xxh3]``, the last two being the info's); each field checked
        (``DamagedRecord``): a tensor's shape and dtype account for its raw bytes."""
        if not isinstance(d, dict):
            raise DamagedRecord(f"an item must be an object, not {shown(d)}")
        return cls.of_chunks(d, tuple((n, h) for _, n, h in _chunks(d.get("chunks"))))

    @classmethod
    def of_chunks(cls, d: dict[str, Any], chunks: tuple[tuple[int, int], ...]) -> ItemInfo:
        """``from_dict`` with the chunks already parsed (``Record.from_dict`` parses them once)."""
        kind, dtype, shape = d.get("kind", "bytes"), d.get("dtype"), d.get("shape")
        if kind not in ("tensor", "bytes"):
            raise DamagedRecord(f"an item's kind must be tensor or bytes, not {shown(kind)}")
        if dtype is not None and not (type(dtype) is str and len(dtype) <= 64):
            short_text(dtype, "an item's dtype", 64)
        if shape is not None:
            shape = dimensions(shape, "an item's shape")
        nonfinite = d.get("nonfinite", False)
        if type(nonfinite) is not bool:
            raise DamagedRecord(f"nonfinite must be true or false, not {shown(nonfinite)}")
        rank = d.get("rank")
        if type(rank) is not int or not 0 <= rank < MAX_WORLD:
            whole_number(rank, "an item's rank", MAX_WORLD - 1)  # raises, saying why
        if kind == "tensor":
            if dtype is None or shape is None:
                raise DamagedRecord("a tensor item names no dtype or shape")
            size = DTYPE_BYTES.get(dtype)
            raw = sum(n for n, _ in chunks)
            if size is not None and math.prod(shape) * size != raw:
                raise DamagedRecord(
                    f"a {dtype} tensor of shape {list(shape)[:8]} has {math.prod(shape) * size} bytes, "
                    f"not the {raw} its chunks hold"
                )
        return cls(rank, kind, chunks, dtype, shape, nonfinite)

    def same_item(self, other: ItemInfo) -> bool:
        """Whether ``other`` says what this says of the item (its ``nonfinite`` aside: only an
        index knows it), so that bytes read for one are the other's."""
        return (self.rank, self.kind, self.raw_chunks, self.dtype, self.shape) == (
            other.rank,
            other.kind,
            other.raw_chunks,
            other.dtype,
            other.shape,
        )


def _chunks(v: Any) -> list[tuple[int, int, int]]:
    """Chunks as a record (``[stored, raw, xxh3]``) or the metadata (``[raw, xxh3]``) has
    them, as (stored, raw, xxh3): a metadata chunk's stored length is its raw one. Written
    for speed (an index holds tens of thousands): one pass, no call per field."""
    if not isinstance(v, list):
        raise DamagedRecord(f"an item's chunks must be a list, not {shown(v)}")
    out = []
    for c in v:
        if type(c) is list and len(c) == 3:
            s, n, h = c
        elif type(c) is list and len(c) == 2:
            n, h = c
            s = n
        else:
            raise DamagedRecord(f"a chunk must be [stored, raw, xxh3], not {shown(c)}")
        if not (
            type(s) is int
            and type(n) is int
            and type(h) is int
            and 0 <= n <= CHUNK_BYTES
            and 0 <= s <= STORED_CHUNK_BYTES
            and 0 <= h < 1 << 64
        ):
            raise DamagedRecord(
                f"a chunk must be [stored <= {STORED_CHUNK_BYTES}, raw <= {CHUNK_BYTES}, xxh3 < 2^64], "
                f"not {shown(c)}"
            )
        out.append((s, n, h))
    return out


# The bytes per element of torch's dtypes, by name (torch-free): a tensor item's shape then
# accounts for its raw bytes. A name not here (a dtype of a newer torch) is not counted.
DTYPE_BYTES = {
    **dict.fromkeys(["torch.float64", "torch.int64", "torch.uint64", "torch.complex64"], 8),
    **dict.fromkeys(["torch.float32", "torch.int32", "torch.uint32", "torch.complex32"], 4),
    **dict.fromkeys(["torch.float16", "torch.bfloat16", "torch.int16", "torch.uint16"], 2),
    **dict.fromkeys(["torch.int8", "torch.uint8", "torch.bool"], 1),
    **dict.fromkeys(["torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz"], 1),
    **dict.fromkeys(["torch.float8_e5m2fnuz", "torch.float8_e8m0fnu"], 1),
    "torch.complex128": 16,
}


@dataclass(frozen=True, slots=True)
class Record:
    """Where one item's bytes are on one tier and how to undo their transforms (as torch's
    ``_StorageInfo``: file, offset, lengths, codecs), with the item's ``info``.

    ``file`` is the key of the file holding the bytes, relative to the tier root; it may
    name another step's part file (a record may point into data written before). Read from
    storage, it names nothing else (``stray_name``).

    Content-addressed (dedup) records have ``blocks``: chunk i is then the whole block file
    ``block_key(namespace, blocks[i])`` (shared by every step and rank using those bytes),
    and ``file``/``offset`` are unused. ``codecs`` names each chunk's codec where chunks
    differ (byte-grouped zstd is chosen per chunk); else every chunk has ``codec``.
    """

    file: str
    offset: int
    codec: str  # "raw" | "zstd" | "zstd-bg2" | "zstd-bg4"
    stored: tuple[int, ...]  # each chunk's stored length here; its raw length and checksum: info's
    info: ItemInfo
    blocks: tuple[str, ...] | None = None  # xxh3-128 (32 hex digits) of each chunk's raw bytes
    codecs: tuple[str, ...] | None = None  # per chunk, where they differ

    @property
    def length(self) -> int:
        """Stored bytes of the item's chunks (in ``file`` at ``offset``, or in its blocks)."""
        return sum(self.stored)

    @property
    def part_length(self) -> int:
        """Bytes the item takes in its part file: none when its chunks are blocks."""
        return 0 if self.blocks is not None else self.length

    def chunk_codec(self, i: int) -> str:
        return self.codecs[i] if self.codecs is not None else self.codec

    def to_dict(self) -> dict[str, Any]:
        """The record as an index holds it: each chunk ``[stored, raw, xxh3]``, the info's
        facts after (in the index's order, not the metadata's), then what applies of
        ``blocks``, ``codecs`` and ``nonfinite``."""
        info = self.info
        d: dict[str, Any] = {
            "file": self.file,
            "offset": self.offset,
            "codec": self.codec,
            "chunks": [[s, n, h] for s, (n, h) in zip(self.stored, info.raw_chunks, strict=True)],
            "rank": info.rank,
            "kind": info.kind,
        }
        if info.kind == "tensor":
            d.update(dtype=info.dtype, shape=list(info.shape or ()))
        if self.blocks is not None:
            d["blocks"] = list(self.blocks)
        if self.codecs is not None:
            d["codecs"] = list(self.codecs)
        if info.nonfinite:
            d["nonfinite"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], directory: str | None = None) -> Record:
        """A record from its dict, each field checked (``DamagedRecord``). Formats 1 and 2
        name the file by its base name only: ``directory`` (the step's directory) completes it."""
        if not isinstance(d, dict):
            raise DamagedRecord(f"a record must be an object, not {shown(d)}")
        file, offset, codec = d.get("file"), d.get("offset"), d.get("codec")
        if not (type(file) is str and len(file) <= MAX_NAME):
            short_text(file, "a record's file")  # raises, saying why
        if not (type(offset) is int and 0 <= offset <= MAX_BYTES):
            whole_number(offset, "a record's offset")
        if not (type(codec) is str and len(codec) <= 16):
            short_text(codec, "a codec", 16)
        chunks = _chunks(d.get("chunks"))
        stored = tuple(s for s, _, _ in chunks)
        blocks, codecs = d.get("blocks"), d.get("codecs")
        if blocks is not None:
            blocks = tuple(short_text(b, "a block id", 32) for b in short_list(blocks, "blocks", len(chunks)))
        if codecs is not None:
            codecs = tuple(short_text(c, "a codec", 16) for c in short_list(codecs, "codecs", len(chunks)))
        for named, what in ((blocks, "blocks"), (codecs, "codecs")):
            if named is not None and len(named) != len(chunks):
                raise DamagedRecord(f"a record names {len(named)} {what} for {len(chunks)} chunks")
        return cls(
            file if directory is None else f"{directory}/{file}",
            offset,
            codec,
            stored,
            ItemInfo.of_chunks(d, tuple((n, h) for _, n, h in chunks)),
            blocks,
            codecs,
        )


# -- per-part indexes ----------------------------------------------------------------------


class BadIndex(DamagedRecord):
    """An index file that fails its checks: the part is treated as absent from that root."""


@dataclass(frozen=True)
class PartIndex:
    """One part's records in one root, and the length its part file has there."""

    rank: int
    size: int
    records: dict[ItemKey, Record]
    written: int | None = None  # bytes its writer wrote for it here (the part, new blocks)

    def to_bytes(self) -> bytes:
        items = [{"key": k.to_json(), **r.to_dict()} for k, r in self.records.items()]
        doc: dict[str, Any] = {"format": FORMAT_VERSION, "rank": self.rank, "size": self.size, "items": items}
        if self.written is not None:
            doc["written"] = self.written
        return json.dumps(doc, separators=(",", ":")).encode()

    @property
    def logical_bytes(self) -> int:
        return sum(r.info.raw_length for r in self.records.values())

    @property
    def stored_bytes(self) -> int:
        """The stored bytes its records name (blocks counted once per use)."""
        return sum(r.length for r in self.records.values())

    @classmethod
    def from_bytes(cls, data: bytes, namespace: str, step: int, rank: int) -> PartIndex:
        """Parse rank's index read from ``step``'s directory: JSON, or format 2's pickle.
        Raises BadIndex when it cannot be parsed, or a record names what is no object of the
        namespace's layout (``check_names``)."""
        try:
            if data[:1] == b"{":
                doc = json_object(
                    parse_json(data, "the index"),
                    "the index",
                    {"format", "rank", "size", "items"},
                    {"written"},
                )
                if doc["format"] not in READABLE_FORMATS or type(doc["format"]) is not int:
                    raise DamagedRecord(f"unsupported index format {shown(doc['format'])}")
                records = {}
                for d in short_list(doc["items"], "items", MAX_BYTES):
                    if not isinstance(d, dict):
                        raise DamagedRecord(f"an item must be an object, not {shown(d)}")
                    records[ItemKey.from_json(d.get("key"))] = Record.from_dict(d)
                written = doc.get("written")
                written = None if written is None else whole_number(written, "written")
                index = cls(
                    whole_number(doc["rank"], "the index's rank", rank, rank),
                    whole_number(doc["size"], "size"),
                    records,
                    written,
                )
            else:
                legacy = _LegacyUnpickler(io.BytesIO(data)).load()
                if not isinstance(legacy, dict):
                    raise DamagedRecord(f"a format 2 index holds a {type(legacy).__name__}")
                directory = step_dir(namespace, step)
                records = {_legacy_key(k): Record.from_dict(r, directory) for k, r in legacy.items()}
                index = cls(rank, sum(r.length for r in records.values()), records)
        except DamagedRecord as e:
            raise BadIndex(str(e)) from None
        except Exception as e:  # noqa: BLE001 - any error while the record becomes objects is damage
            raise BadIndex(f"{type(e).__name__}: {str(e)[:200]}") from None
        return index.check_names(namespace).check_extents(part_key(namespace, step, rank))

    def check_names(self, namespace: str) -> PartIndex:
        """This index, if every record names only objects of the namespace's layout
        (``stray_name``); else BadIndex naming the first that does not, so the part counts
        as absent from that root (damage) and nothing it names is opened."""
        for key, rec in self.records.items():
            name = stray_name(rec, namespace)
            if name is not None:
                raise BadIndex(
                    f"item {key.fqn!r} names {name!r}, which is no part file of a step nor a "
                    f"block of namespace {namespace!r}: not read"
                )
        return self

    def check_extents(self, part: str) -> PartIndex:
        """This index, if each record's bytes in its own part (``part``) lie inside the part's
        size and raw chunks are stored at their raw length; else BadIndex."""
        for key, rec in self.records.items():
            if rec.blocks is not None:  # a block's codec is in its header
                continue
            if rec.file == part and rec.offset + rec.length > self.size:
                raise BadIndex(
                    f"item {key.fqn!r} lies at {rec.offset}+{rec.length}, past the part's {self.size} bytes"
                )
            for i, (s, (n, _)) in enumerate(zip(rec.stored, rec.info.raw_chunks, strict=True)):
                if rec.chunk_codec(i) == "raw" and s != n:
                    raise BadIndex(f"item {key.fqn!r}: raw chunk {i} stored in {s} bytes, not {n}")
        return self

    @classmethod
    def of(cls, rank: int, records: Iterable[tuple[ItemKey, Record]]) -> PartIndex:
        """The index of a part made of exactly these records, back to back."""
        recs = dict(records)
        return cls(rank, sum(r.part_length for r in recs.values()), recs)

    def in_file_order(self) -> list[tuple[ItemKey, Record]]:
        return sorted(self.records.items(), key=lambda kr: (kr[1].file, kr[1].offset))


def write_index(store: Storage, namespace: str, step: int, index: PartIndex) -> None:
    store.write(index_key(namespace, step, index.rank), [index.to_bytes()])


def read_index(store: Storage, namespace: str, step: int, rank: int, limit: int) -> PartIndex:
    """Rank's index in ``store``, at most ``limit`` bytes (``records_limit``). Raises
    FileNotFoundError when there is none, BadIndex when it fails its checks, OSError when it
    cannot be read."""
    key = index_key(namespace, step, rank)
    try:
        data = read_record(store, key, limit)
    except DamagedRecord as e:
        raise BadIndex(str(e)) from None
    try:
        return _parsed(data, namespace, step, rank)
    except BadIndex as e:
        raise BadIndex(f"{store.describe(key)}: {e}") from e


PARSED_RECORDS = 1 << 15  # records of the parses remembered (by their bytes), the latest used (~15 MB)
_PARSED: OrderedDict[tuple[bytes, str, int, int], PartIndex] = OrderedDict()
_PARSED_LOCK = threading.Lock()


@renew_in_child
def _renew_parsed_lock() -> None:
    """A child forked while another thread held the lock would wait on it forever."""
    global _PARSED_LOCK
    _PARSED_LOCK = threading.Lock()


def _parsed(data: bytes, namespace: str, step: int, rank: int) -> PartIndex:
    """``PartIndex.from_bytes``, remembered by the bytes' xxh3-128: a save every step reads
    the kept steps' indexes again at each retention (is each part whole?), and parsing and
    checking every record of thousands cost more than the rest of a save of small tensors.
    The same bytes parse the same way, so a remembered parse is the parse; each caller gets
    its own records dict."""
    key = (xxhash.xxh3_128_digest(data), namespace, step, rank)
    with _PARSED_LOCK:
        index = _PARSED.get(key)
        if index is not None:
            _PARSED.move_to_end(key)
    if index is None:
        index = PartIndex.from_bytes(data, namespace, step, rank)
        with _PARSED_LOCK:
            _PARSED[key] = index
            held = sum(len(i.records) for i in _PARSED.values())
            while held > PARSED_RECORDS and len(_PARSED) > 1:  # a rank's host memory stays bounded
                held -= len(_PARSED.popitem(last=False)[1].records)
    return dataclasses.replace(index, records=dict(index.records))


class IndexCache:
    """Per-part indexes, each read once per operation (a load, a verify, a writer's job).

    Scope one to one operation: a step saved again under the same number (after a crash)
    has new indexes. An index not there yet is looked for again next time.
    """

    def __init__(self) -> None:
        self._got: dict[tuple[str, str], PartIndex | BadIndex] = {}

    def get(self, store: Storage, namespace: str, step: int, rank: int, limit: int) -> PartIndex | None:
        """Rank's index in ``store`` (at most ``limit`` bytes), None where it has none; raises
        BadIndex, and OSError when it cannot be read (not remembered: that may pass)."""
        key = (store.url, index_key(namespace, step, rank))
        if key not in self._got:
            try:
                self._got[key] = read_index(store, namespace, step, rank, limit)
            except FileNotFoundError:
                return None
            except BadIndex as e:
                log.warning("unusable index (its part counts as absent from that root): %s", e)
                self._got[key] = e
        got = self._got[key]
        if isinstance(got, BadIndex):
            raise got
        return got


# -- format 2's pickled indexes, read without torch ----------------------------------------


class _LegacyIndex:
    """Stands in for torch's MetadataIndex while a format 2 index is unpickled."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None


class _LegacyUnpickler(pickle.Unpickler):
    """Admits only what a format 2 index holds: MetadataIndex, torch.Size and plain data."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"): _LegacyIndex,
        ("torch", "Size"): tuple,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"forbidden global: {module}.{name} has no place in an index file"
            ) from None


def _legacy_key(k: Any) -> ItemKey:
    if not isinstance(k, _LegacyIndex):
        raise TypeError(f"index key {k!r} is not a MetadataIndex")
    offset = getattr(k, "offset", None)
    return ItemKey(k.fqn, None if offset is None else tuple(offset), getattr(k, "index", None))
