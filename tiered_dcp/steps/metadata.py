"""The torch side of the format: the step's DCP ``Metadata`` blob, and DCP's item keys.

A save pickles DCP's Metadata with ``storage_data`` mapping each ``MetadataIndex`` to its
``ItemInfo`` as a plain dict (what is true of the item on every tier), so the blob is the
same bytes on every tier and checkpoints do not depend on this package's class names.
Reading it back admits only DCP's metadata classes and plain data (``_MetadataUnpickler``),
then checks that it describes a checkpoint whole (``check``) before any reader uses it.
Formats 1 and 2 kept each item's full record there instead; where such a step has no index
next to a part, ``legacy_index`` rebuilds one from those records.

torch is imported where a function needs DCP's classes, not with this module: a check of a
step (``loads(plain=True)``, ``tiered-dcp verify``) reads the blob into the torch-free
stand-ins of ``plain_metadata`` where it can, and ``check`` is the same for both (``Kinds``).

torch >= 2.15 pickles a sixth field in ``TensorProperties`` (the tensor's ``strides``),
which older torch's ``__setstate__`` refuses; under such a torch the unpickler reads it
with ``_newer_tensor_properties``, which drops the strides (no older torch uses them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import operator
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tiered_dcp.storage.codec import ChecksumMismatch
from tiered_dcp.storage.format import ItemInfo, ItemKey, PartIndex, Record, metadata_key, step_dir
from tiered_dcp.storage.records import DamagedRecord, whole_numbers

from . import plain_metadata
from .catalog import StepCopy, read_metadata_blob

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

Records = dict["MetadataIndex", Record]
DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _dcp() -> ModuleType:
    """DCP's metadata module (torch: imported on first use)."""
    module = sys.modules.get(DCP_METADATA)
    if module is None:
        import torch.distributed.checkpoint.metadata as module
    return module


@dataclass(frozen=True)
class Kinds:
    """The classes a metadata blob is read into, as ``check`` asks of them: DCP's own
    (``torch_kinds``), or the torch-free stand-ins of ``plain_metadata`` (``PLAIN_KINDS``)."""

    name: str
    metadata: type
    index: type
    tensor: type
    bytes: type
    dtype_facts: Callable[[Any], tuple[int, str] | None]  # a dtype's element size and name; None: no dtype


PLAIN_KINDS = Kinds(
    "plain",
    plain_metadata.Metadata,
    plain_metadata.MetadataIndex,
    plain_metadata.TensorStorageMetadata,
    plain_metadata.BytesStorageMetadata,
    plain_metadata.dtype_facts,
)


@functools.cache
def torch_kinds() -> Kinds:
    """DCP's metadata classes, and torch's dtypes' facts (each computed once)."""
    import torch

    m = _dcp()
    facts: dict[torch.dtype, tuple[int, str]] = {}

    def dtype_facts(dtype: Any) -> tuple[int, str] | None:
        if not isinstance(dtype, torch.dtype):
            return None
        if dtype not in facts:
            facts[dtype] = (torch.empty(0, dtype=dtype).element_size(), str(dtype))
        return facts[dtype]

    return Kinds(
        "torch", m.Metadata, m.MetadataIndex, m.TensorStorageMetadata, m.BytesStorageMetadata, dtype_facts
    )


def item_key(index: MetadataIndex) -> ItemKey:
    return ItemKey(index.fqn, None if index.offset is None else tuple(index.offset), index.index)


def index_of(key: ItemKey) -> MetadataIndex:
    return _dcp().MetadataIndex(key.fqn, key.offset, key.index)


def records_to_json(records: Mapping[MetadataIndex, Record]) -> bytes:
    """Records as plain data, for the ranks' exchanges (the store, a clique's group): JSON,
    as in an index file, so what a peer (or whoever reaches the store) sends is never code."""
    doc = [{"key": item_key(i).to_json(), **r.to_dict()} for i, r in records.items()]
    return json.dumps(doc, separators=(",", ":")).encode()


def records_from_json(data: bytes) -> Records:
    return {index_of(ItemKey.from_json(d["key"])): Record.from_dict(d) for d in json.loads(data)}


def part_index(rank: int, records: Mapping[MetadataIndex, Record]) -> PartIndex:
    """The index of rank's part as just written: these records, back to back."""
    return PartIndex.of(rank, ((item_key(i), r) for i, r in records.items()))


def build_blob(metadata: Metadata, records: Mapping[MetadataIndex, Record]) -> bytes:
    """The pickled metadata of a save, with each item's tier-independent facts."""
    storage_data = {i: r.info.to_dict() for i, r in records.items()}
    return pickle.dumps(
        dataclasses.replace(metadata, storage_data=storage_data), protocol=pickle.HIGHEST_PROTOCOL
    )


def loads(blob: bytes, world: int | None = None, stock: bool = False, plain: bool = False) -> Metadata:
    """Unpickle a metadata blob, admitting only what DCP's metadata is made of (``stock``:
    also what a stock ``FileSystemWriter`` puts in it, for an import), and check that it
    describes a checkpoint (``check``; ``world``: its ranks, where known). ChecksumMismatch
    (damage) otherwise. ``plain``: without torch where the blob allows (``plain_metadata``:
    stand-ins of DCP's classes); whatever that reader does not take, or finds wrong, is
    read again by torch's, which alone calls a blob damaged."""
    if plain and not stock:
        try:
            md = _unpickle(blob, plain_metadata.PlainUnpickler, PLAIN_KINDS)
            return _checked(md, blob, world, PLAIN_KINDS)
        except Exception:  # noqa: BLE001 - not read here: torch's reader decides
            pass
    kinds = torch_kinds()
    md = _unpickle(blob, _StockMetadataUnpickler if stock else _MetadataUnpickler, kinds)
    return md if stock else _checked(md, blob, world, kinds)


def _unpickle(blob: bytes, unpickler: type[pickle.Unpickler], kinds: Kinds) -> Any:
    try:
        md = unpickler(io.BytesIO(blob)).load()
    except Exception as e:  # noqa: BLE001 - any error while the blob becomes objects is damage
        raise _refused(e) from None
    if not isinstance(md, kinds.metadata):
        raise ChecksumMismatch(f"metadata holds a {type(md).__name__}, not DCP's Metadata")
    return md


def _checked(md: Any, blob: bytes, world: int | None, kinds: Kinds) -> Any:
    """``md`` with the facts ``check`` found in it (checked once per blob, world and kinds)."""
    key = (hashlib.blake2b(blob).digest(), world, kinds.name)  # cryptographic: no blob passes as another
    checked = _CHECKED.get(key)
    try:
        if checked is None:
            checked = check(md, world, kinds)
    except Exception as e:  # noqa: BLE001 - objects of the wrong kind fail the checks their own way
        raise _refused(e) from None
    setattr(md, CHECKED, checked)  # ``item_info`` reads them, rather than parse each again
    _CHECKED.clear()
    _CHECKED[key] = checked
    return md


def _refused(e: Exception) -> ChecksumMismatch:
    """Damage, whatever the error: an admitted constructor rejects what a blob calls it with
    by an error of its own (``_get_layout``: KeyError; ``int``: OverflowError; ``str``:
    LookupError), and a field of the wrong kind fails ``check`` by AttributeError or
    TypeError. Readers pass damage over to the next copy; any other error would escape them."""
    why = str(e) if isinstance(e, pickle.UnpicklingError | DamagedRecord) else f"{type(e).__name__}: {e}"
    return ChecksumMismatch(f"metadata refused: {why[:300]}")


# The item facts of the metadata blob checked last, by (its BLAKE2b digest, world, kinds): a
# load of the same save again in this process (a restart in the same process) checks it once.
_CHECKED: dict[tuple[bytes, int | None, str], dict] = {}


CHECKED = "_tiered_dcp_items"  # the attribute ``check`` leaves on a metadata: its items' facts


def check(
    md: Metadata, world: int | None, kinds: Kinds | None = None
) -> dict[tuple[str, tuple[int, ...] | None], ItemInfo]:
    """That ``md`` describes a checkpoint whole, as DCP's planner checks a save's plan: every
    tensor chunk inside its tensor and the chunks' volumes its volume; every item of the state
    dict with a stored item that says the same of it (kind, dtype, shape, its bytes), stored
    by a rank of the save, and no stored item of nothing. DamagedRecord (what, why) else;
    its items' facts by (name, offset) if it does. ``kinds``: what ``md`` was read into
    (default: DCP's classes)."""
    kinds = kinds or torch_kinds()
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise DamagedRecord("its state dict or storage data is not a mapping")
    stored: dict[tuple[str, tuple[int, ...] | None], ItemInfo] = {}
    for index, d in md.storage_data.items():
        if not isinstance(index, kinds.index) or not isinstance(index.fqn, str):
            raise DamagedRecord(f"a storage key is a {type(index).__name__}, not a MetadataIndex")
        info = ItemInfo.from_dict(d)
        if world is not None and info.rank >= world:
            raise DamagedRecord(f"item {index.fqn!r} is stored by rank {info.rank} of a save by {world}")
        stored[(index.fqn, None if index.offset is None else tuple(index.offset))] = info
    described = set()
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, kinds.tensor):
            described |= _check_tensor(fqn, entry, stored, kinds)
        elif isinstance(entry, kinds.bytes):
            info = stored.get((fqn, None))
            if info is None or info.kind != "bytes":
                raise DamagedRecord(f"value {fqn!r} has no stored item")
            described.add((fqn, None))
        else:
            raise DamagedRecord(f"entry {fqn!r} is a {type(entry).__name__}")
    extra = next((key for key in stored if key not in described), None)
    if extra is not None:
        raise DamagedRecord(f"stored item {extra[0]!r} is of nothing in the state dict")
    return stored


def _check_tensor(fqn: str, entry: Any, stored: dict, kinds: Kinds) -> set:
    """The stored items of tensor ``fqn``'s chunks, each checked (``check``)."""
    props, size = entry.properties, entry.size
    facts = kinds.dtype_facts(props.dtype)
    if facts is None or not whole_numbers(size):
        raise DamagedRecord(f"tensor {fqn!r} has no dtype or a bad size")
    itemsize, name = facts
    volume, keys = 0, set()
    for c in entry.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise DamagedRecord(
                f"a chunk of tensor {fqn!r} has {len(sizes)} dimensions, the tensor {len(size)}"
            )
        if not (
            whole_numbers(offsets)
            and whole_numbers(sizes)
            and all(map(operator.le, map(operator.add, offsets, sizes), size))
        ):
            raise DamagedRecord(f"a chunk of tensor {fqn!r} lies outside its size {list(size)}")
        info = stored.get((fqn, offsets))
        numel = math.prod(sizes)
        if (
            info is None
            or info.kind != "tensor"
            or info.shape != sizes
            or info.dtype != name
            or info.raw_length != numel * itemsize
        ):
            raise DamagedRecord(
                f"the chunk at {list(offsets)} of tensor {fqn!r} has no stored item of its dtype and shape"
            )
        volume += numel
        keys.add((fqn, offsets))
    if volume != math.prod(size):
        raise DamagedRecord(f"the chunks of tensor {fqn!r} hold {volume} elements, not its {math.prod(size)}")
    return keys


def load_metadata(copy: StepCopy, plain: bool = False) -> Metadata:
    """The step's metadata from this copy, checked against the marker's checksum (``plain``:
    without torch where it can, ``loads``).

    Raises OSError when it cannot be read and ChecksumMismatch when it is damaged.
    """
    blob = read_metadata_blob(copy)
    try:
        return loads(blob, copy.marker.world_size, plain=plain)
    except ChecksumMismatch as e:
        key = metadata_key(copy.marker.namespace, copy.step)
        raise ChecksumMismatch(f"{copy.store.describe(key)}: {e}") from e


def item_info(md: Metadata, index: MetadataIndex) -> ItemInfo | None:
    """What the metadata says of an item, in any format; None when it does not know it.
    From the facts ``check`` parsed (each once per load), where it did."""
    checked = getattr(md, CHECKED, None)
    if checked is not None:
        return checked.get((index.fqn, None if index.offset is None else tuple(index.offset)))
    d = md.storage_data.get(index) if isinstance(md.storage_data, dict) else None
    return None if d is None else ItemInfo.from_dict(d)


def legacy_index(md: Metadata, namespace: str, step: int, rank: int) -> PartIndex:
    """Format 1 and 2 steps without an index next to a part: the metadata's records of it.
    Raises BadIndex when one names what is no object of the layout (``PartIndex.check_names``)."""
    directory = step_dir(namespace, step)
    recs = ((item_key(i), Record.from_dict(d, directory)) for i, d in md.storage_data.items())
    return PartIndex.of(rank, [(k, r) for k, r in recs if r.info.rank == rank]).check_names(namespace)


@functools.cache
def _newer_tensor_properties() -> type:
    """Under a torch < 2.15, the class that reads a ``TensorProperties`` pickled by torch >=
    2.15 (whose state has a sixth entry, the strides, that this torch has no field for): it
    drops the strides and the object becomes a plain ``TensorProperties`` again. Under a
    torch >= 2.15, ``TensorProperties`` itself."""
    base = _dcp().TensorProperties
    if "strides" in {f.name for f in dataclasses.fields(base)}:
        return base

    class _NewerTensorProperties(base):  # type: ignore[misc, valid-type]
        def __setstate__(self, state: tuple) -> None:
            super().__setstate__(tuple(state[:5]))
            self.__class__ = base

    return _NewerTensorProperties


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch's dtypes, layouts and sizes, and plain data.

    Nothing else: whoever can write a tier can write this file, and unpickling calls what it
    names. Only classes *defined* in DCP's metadata module pass (plain records), never DCP's
    writers, readers or executors, whose constructors act.
    """

    _DCP = DCP_METADATA

    # no bytes nor bytearray: called with a number they allocate it (pickle stores bytes as
    # data, never as a call)
    _BUILTINS = ("tuple", "list", "dict", "set", "frozenset", "int", "float", "str", "bool", "slice")
    _PLAIN = {("builtins", n) for n in _BUILTINS} | {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    }

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in self._PLAIN:
            return super().find_class(module, name)
        if module == self._DCP:
            found = getattr(_dcp(), name, None)
            if found is _dcp().TensorProperties:
                return _newer_tensor_properties()  # under torch < 2.15, one that drops the strides
            if isinstance(found, type) and found.__module__ == self._DCP:  # its records and enums
                return found
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"forbidden global {module}.{name} (a checkpoint's metadata holds only DCP's metadata "
            "classes, torch dtypes and sizes, and plain data)"
        )


class _StockMetadataUnpickler(_MetadataUnpickler):
    """``_MetadataUnpickler`` and what a stock ``FileSystemWriter``'s metadata holds beside:
    its per-item ``_StorageInfo`` records and the checkpoint's path (a plain ``PosixPath``).
    torch's reader unpickles that file admitting anything; an import reads it this way first."""

    _STOCK = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._STOCK:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)
