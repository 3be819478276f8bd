"""A step's metadata blob read without torch, for the commands that only check a step
(``tiered-dcp verify``): importing torch takes seconds, the rest of a check milliseconds.

The blob is DCP's ``Metadata`` pickled (``metadata.build_blob``). ``PlainUnpickler`` admits
the names torch's reader admits (``metadata._MetadataUnpickler``), only fewer: DCP's
metadata records as they are pickled (built from their ``__dict__``, no constructor run),
the dtypes of ``DTYPE_SIZES``, the strided layout, sizes of whole numbers. Each becomes a
stand-in of this module, at least as strict as the class it stands for: whatever a
stand-in does not take as DCP's own would (another name, state of another shape, a
constructor called) raises ``NotPlain``, and so does anything ``metadata.loads`` finds
wrong in what it read: the blob is then read again by torch's reader, which alone calls a
blob damaged. A blob read here gives ``check`` and its readers the same facts as torch's.
"""

from __future__ import annotations

import pickle
from typing import Any

DCP = "torch.distributed.checkpoint.metadata"

# torch's dtypes (their pickled names, present in every torch this package supports) and
# their element sizes; any other dtype is read by torch's reader
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
MEMORY_FORMATS = (0, 1, 2)  # DCP's _MEM_FORMAT_ENCODING values


class NotPlain(Exception):
    """The blob holds what this reader does not take as DCP's own: torch's reader decides."""


class _Record:
    """A DCP metadata record (a dataclass): built by pickle from its ``__dict__``, never
    constructed; unhashable, as a dataclass with ``eq`` is."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotPlain(f"{type(self).__name__} called")  # DCP's blobs never call one

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__class__":  # pickle's slot state could make it another stand-in
            raise NotPlain("a record's class is set")
        super().__setattr__(name, value)


class Metadata(_Record):
    planner_data = None  # the dataclass's defaults, read where the blob left them out
    storage_data = None
    storage_meta = None
    version = None


class StorageMeta(_Record):
    checkpoint_id = None
    save_id = None
    load_id = None


class ChunkStorageMetadata(_Record):
    pass


class TensorStorageMetadata(_Record):
    pass


class BytesStorageMetadata(_Record):
    pass


class MetadataIndex(_Record):
    """DCP's item key: frozen, compared and hashed by name and offset."""

    offset = None
    index = None

    def __setattr__(self, name: str, value: Any) -> None:
        raise NotPlain("MetadataIndex is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))


class MemoryFormat:
    """DCP's ``_MEM_FORMAT_ENCODING``: one of its values (no ``__dict__``: no record can
    become one, and pickle cannot build into the shared values)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:  # pickle's slot state sets __class__ so
        raise NotPlain("a memory format is immutable")

    def __new__(cls, value: Any) -> MemoryFormat:
        if type(value) is not int or value not in MEMORY_FORMATS:
            raise NotPlain(f"memory format {value!r}")
        return _MEMORY_FORMATS[value]


_MEMORY_FORMATS = {v: object.__new__(MemoryFormat) for v in MEMORY_FORMATS}


class TensorProperties(_Record):
    """Pickled as the tuple its ``__getstate__`` makes: (dtype, layout, requires_grad,
    memory format, pin_memory), and the strides from torch 2.15 on."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not tuple or len(state) not in (5, 6):
            raise NotPlain("TensorProperties state")
        if not any(state[3] is m for m in _MEMORY_FORMATS.values()):  # one of the values, itself
            raise NotPlain("TensorProperties state")
        self.__dict__.update(dtype=state[0], layout=state[1], requires_grad=state[2], pin_memory=state[4])


class Dtype:
    """A torch dtype by name (``torch.float32``): its element size is ``DTYPE_SIZES``'."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise NotPlain("a dtype is immutable")

    def __reduce__(self) -> Any:
        raise NotPlain("a dtype is not pickled here")

    def __str__(self) -> str:
        return f"torch.{self.name}"


class Layout:
    """``torch.strided``, the layout of every tensor DCP saves."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:  # the one shared value: no build into it
        raise NotPlain("a layout is immutable")


_DTYPES = {name: Dtype(name) for name in DTYPE_SIZES}
STRIDED = Layout()


def dtype_facts(dtype: Any) -> tuple[int, str] | None:
    """A stand-in dtype's element size and name (``str(torch.float32)``); None if no dtype."""
    if type(dtype) is not Dtype:
        return None
    return DTYPE_SIZES[dtype.name], str(dtype)


def _size(*args: Any) -> tuple[int, ...]:
    """``torch.Size(ints)``, as a tuple of those ints."""
    if len(args) != 1 or type(args[0]) not in (tuple, list) or any(type(v) is not int for v in args[0]):
        raise NotPlain("torch.Size of what is no list of ints")
    return tuple(args[0])


def _layout(name: Any) -> Layout:
    """``torch.serialization._get_layout``: the strided layout only."""
    if type(name) is not str or name != "torch.strided":
        raise NotPlain(f"layout {name!r}")
    return STRIDED


_DCP_NAMES = {
    "Metadata": Metadata,
    "StorageMeta": StorageMeta,
    "ChunkStorageMetadata": ChunkStorageMetadata,
    "TensorStorageMetadata": TensorStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata,
    "MetadataIndex": MetadataIndex,
    "TensorProperties": TensorProperties,
    "_MEM_FORMAT_ENCODING": MemoryFormat,
}
_BUILTINS = ("tuple", "list", "dict", "set", "frozenset", "int", "float", "str", "bool", "slice")


class PlainUnpickler(pickle.Unpickler):
    """torch's metadata unpickler's names, less some, as the stand-ins above."""

    def find_class(self, module: str, name: str) -> Any:
        if (module == "builtins" and name in _BUILTINS) or (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        found = {
            DCP: _DCP_NAMES.get(name),
            "torch": _size if name == "Size" else _DTYPES.get(name),
            "torch.serialization": _layout if name == "_get_layout" else None,
        }.get(module)
        if found is None:
            raise NotPlain(f"{module}.{name}")
        return found
