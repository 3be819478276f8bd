"""Reading a record off a tier: the bounds of what a tier may hold, and the checks.

Whoever can write a tier writes every record on it. So each record (marker, index, blocks
list, note) is read bounded in size before a byte is read (``read_record``,
``read_marker_bytes``), parsed with a depth limit (``parse_json``) and checked field by
field (``whole_number``, ``short_text``, ``short_list``, ``json_object``, ``dimensions``:
``format`` parses each record with them) before any other code sees it. A record that fails is damage
(``DamagedRecord``): the step is not whole in that root, and readers go to the next copy,
as for a checksum mismatch. Torch-free, as ``format``.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any

from .base import Storage

# The bounds of what a tier may hold: nothing read off one is trusted past them.
CHUNK_BYTES = 8 << 20  # raw bytes of a chunk at most (the writer cuts items so; blocks are smaller)
STORED_CHUNK_BYTES = 2 * CHUNK_BYTES  # stored bytes of a chunk at most (compression never doubles)
MAX_WORLD = 1 << 20  # ranks of a step
MAX_STEP = (1 << 63) - 1  # a step number (a signed 64-bit tensor carries it between ranks)
MAX_BYTES = 1 << 62  # any length or offset
MAX_DIMS = 64  # a tensor's dimensions
MAX_NAME = 4096  # characters of a name (a namespace, an item's key, a file, a domain)
MARKER_LIMIT = 16 << 20  # a commit marker's bytes (~120 per rank: 130k ranks)
MARKER_HEAD = 32 << 10  # a marker's first bytes: its world size among them (``read_marker_bytes``)
MARKER_PER_RANK = 512  # a marker's bytes per rank at most (a part, a clique's share, a domain)
METADATA_LIMIT = 4 << 30  # the metadata blob's bytes, as a marker may give them
NOTE_LIMIT = 64 << 10  # a pin, lease, failure note or quarantine mark's bytes (read: the start)
# An index describes some of the items the metadata does: ~2.8x the metadata's bytes at most
# measured (one rank, dedup, every chunk a block: an index names each block, the metadata not)
RECORDS_PER_METADATA_BYTE = 16
RECORDS_BASE = 64 << 10

REFS_LIMIT = 64 << 20  # a blocks list's bytes (35 per block of 1 MiB: a 1.8 TiB part)
# A part as a rank announces it to its clique (its file's chunks and the blocks it names):
# what a peer reserves for its replica before a byte arrives
MAX_PART_CHUNKS = 1 << 22
MAX_PART_BYTES = MAX_PART_CHUNKS * CHUNK_BYTES  # 32 TiB


class DamagedRecord(ValueError):
    """A record read from a tier that fails its checks; the message names the file and why."""


def read_record(store: Storage, key: str, limit: int) -> bytes:
    """``key``'s bytes, at most ``limit`` of them: one byte more is read, never the rest of a
    larger (or sparse, or endless) file. DamagedRecord past the limit; OSError as ``read``."""
    data = store.read(key, 0, limit + 1)
    if len(data) > limit:
        raise DamagedRecord(f"{store.describe(key)}: larger than {limit} bytes, which no such record is")
    return data


_WORLD_SIZE = re.compile(rb'"world_size":\s*(\d{1,7})[,\s}]')


def read_marker_bytes(store: Storage, key: str) -> bytes:
    """A commit marker's bytes, bounded by the world it describes: a marker longer than its
    head (``MARKER_HEAD``) must say its world size there (``to_bytes`` puts it third), and
    is read up to ``MARKER_PER_RANK`` bytes a rank (``MARKER_LIMIT`` at most). So a marker
    padded with what no rank needs is refused before it is read, let alone parsed."""
    head = store.read(key, 0, MARKER_HEAD)
    if len(head) < MARKER_HEAD:
        return head
    found = _WORLD_SIZE.search(head)
    if found is None:
        raise DamagedRecord(f"{store.describe(key)}: no world_size in its first {MARKER_HEAD} bytes")
    limit = min(MARKER_LIMIT, MARKER_HEAD + MARKER_PER_RANK * int(found.group(1)))
    data = head + store.read(key, MARKER_HEAD, limit - MARKER_HEAD + 1)  # the rest: no byte twice
    if len(data) > limit:
        raise DamagedRecord(f"{store.describe(key)}: larger than {limit} bytes, which no such marker is")
    return data


def records_limit(metadata_size: int) -> int:
    """The bytes an index (or a blocks list) of a step whose metadata has ``metadata_size``
    bytes may have: its records describe some of the items the metadata describes."""
    return RECORDS_BASE + RECORDS_PER_METADATA_BYTE * metadata_size


def parse_json(data: bytes, what: str) -> Any:
    """``data`` parsed; DamagedRecord if it is not JSON or nests deeper than the interpreter's
    recursion limit (the parser stops there: no record of ours nests more than 6 deep)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise DamagedRecord(f"{what} is not JSON ({type(e).__name__}: {str(e)[:120]})") from None


def whole_number(v: Any, what: str, most: int = MAX_BYTES, least: int = 0) -> int:
    """``v``, a whole number from ``least`` to ``most`` (not a bool), else DamagedRecord."""
    if type(v) is not int or not least <= v <= most:
        raise DamagedRecord(f"{what} must be a whole number from {least} to {most}, not {shown(v)}")
    return v


def short_text(v: Any, what: str, most: int = MAX_NAME) -> str:
    if not isinstance(v, str) or len(v) > most:
        raise DamagedRecord(f"{what} must be text of at most {most} characters, not {shown(v)}")
    return v


def short_list(v: Any, what: str, most: int) -> list:
    if not isinstance(v, list) or len(v) > most:
        raise DamagedRecord(f"{what} must be a list of at most {most} entries, not {shown(v)}")
    return v


def json_object(d: Any, what: str, required: set[str], optional: set[str] = frozenset()) -> dict:  # type: ignore[assignment]
    """``d``, a JSON object with every ``required`` key and no key beyond ``optional``."""
    if not isinstance(d, dict):
        raise DamagedRecord(f"{what} must be an object, not {shown(d)}")
    missing, extra = required - d.keys(), d.keys() - required - optional
    if missing or extra:
        said = [f"missing {sorted(missing)}"] * bool(missing) + [f"unknown {sorted(extra)[:5]}"] * bool(extra)
        raise DamagedRecord(f"{what}: {', '.join(said)}")
    return d


def whole_numbers(v: list | tuple) -> bool:
    """Whether every one of ``v`` is a whole number from 0 to ``MAX_BYTES`` (not a bool):
    builtins alone, as it runs per item and per chunk (an index holds tens of thousands)."""
    return set(map(type, v)) <= {int} and (not v or (min(v) >= 0 and max(v) <= MAX_BYTES))


def dimensions(v: Any, what: str) -> tuple[int, ...]:
    """A tensor's shape or offset, read off a tier: at most ``MAX_DIMS`` whole numbers."""
    if type(v) is not list or len(v) > MAX_DIMS or not whole_numbers(v):
        raise DamagedRecord(
            f"{what} must be at most {MAX_DIMS} whole numbers up to {MAX_BYTES}, not {shown(v)}"
        )
    return tuple(v)


def shown(v: Any) -> str:
    """``v`` as a message shows it: short (``reprlib``: bounded in depth, length and size,
    whatever a tier's writer made of it), a long list or object by its length alone."""
    if isinstance(v, list | dict) and len(v) > 8:
        return f"a {type(v).__name__} of {len(v)}"
    return _SHOWN.repr(v)


_SHOWN = reprlib.Repr()  # (its keyword arguments are Python 3.12's)
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 3, 8, 8
_SHOWN.maxstring = _SHOWN.maxlong = _SHOWN.maxother = 40
