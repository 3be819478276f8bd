"""What staging copies for each kind of value, so that a staged state is a true snapshot.

``async_save`` returns after staging, and the training loop then changes the state in
place: anything the staged copy still shares with the live state would be saved as it is
at upload time, a torn checkpoint that loads without error. So every leaf of the state
dict is of one *kind*, and each kind says:

- ``pieces``: the tensors whose bytes go into the staging arena (plain tensors, a
  DTensor's local tensor, a ShardedTensor's local shards, a checkpointable object's
  shards); copied like any tensor (pinned arena, side stream for CUDA);
- ``layout``: what must match for a slot's buffers (and the staged objects built over
  them) to be reused by the next save;
- ``build``: the staged value over the arena views of its pieces, made once per slot;
- ``refresh``: the per-save part (a deep copy of Python values, a subclass's attributes);
- ``recipe``: what DCP's PROCESS mode ships of a staged value instead of its tensors (the
  staging arena travels once, as one shared-memory handle, and each piece is a view of it
  again in the receiving process): torch's own pickling of a view into shared memory
  copies it into a fresh segment, and of a DTensor's local tensor at a storage offset crashes.

A value none of the kinds can snapshot is refused with ``SnapshotError`` naming its key
(``refused``): never saved silently as it is later.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.utils import find_tensor_shard
from torch.distributed.tensor import DTensor

from ..errors import SnapshotError


def is_plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)


def _piece_layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.device.type)


@dataclass(frozen=True)
class Kind:
    """How one kind of leaf is snapshotted (see the module docstring)."""

    name: str
    pieces: Callable[[Any], list[torch.Tensor]]
    layout: Callable[[Any], tuple]  # static facts beyond the pieces' dtype, shape and device
    build: Callable[[Any, list[torch.Tensor]], Any]
    refresh: Callable[[Any, Any], Any] | None = None  # None: the built value is reused as it is
    # (staged value) -> picklable facts; ``rebuild(facts, views)`` makes it again elsewhere
    recipe: Callable[[Any], tuple] = lambda staged: ()
    rebuild: Callable[[tuple, list[torch.Tensor]], Any] = lambda facts, views: views[0]


# -- plain tensors and DTensors over plain local tensors ------------------------------------

PLAIN = Kind(
    "tensor",  # ``examine`` lays plain tensors out itself, on the fast path
    pieces=lambda v: [v],
    layout=lambda v: (),
    build=lambda v, views: views[0],
)

DTENSOR = Kind(
    "DTensor",
    pieces=lambda v: [v._local_tensor],
    layout=lambda v: (v._spec,),
    build=lambda v, views: DTensor(views[0], v._spec, requires_grad=False),
    recipe=lambda staged: (staged._spec,),
    rebuild=lambda facts, views: DTensor(views[0], facts[0], requires_grad=False),
)


# -- ShardedTensor and objects implementing DCP's checkpointable protocol -------------------


class SnapshotTensor(torch.Tensor):
    """A frozen copy of a sharded value: its DCP write items and their shards' bytes.

    Stands in the staged state for a ShardedTensor, a DTensor over a non-plain local
    tensor, or any tensor subclass implementing DCP's checkpointable protocol
    (``__create_write_items__`` / ``__get_tensor_shard__``). It answers that protocol
    from the snapshot, so DCP plans and resolves it exactly as it would the original.
    It holds no storage of its own; its shards are views of the staging arena.
    """

    _items: list[WriteItem]
    _shards: dict[tuple[int, ...] | None, torch.Tensor]
    _original: str

    @staticmethod
    def __new__(
        cls,
        items: list[WriteItem],
        shards: list[torch.Tensor],
        size: torch.Size,
        dtype: torch.dtype,
        original: str,
    ) -> SnapshotTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device="cpu")
        r._items = items
        r._shards = {_offset_key(it.index.offset): s for it, s in zip(items, shards, strict=True)}
        r._original = original
        return r

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [dataclasses.replace(it, index=dataclasses.replace(it.index, fqn=fqn)) for it in self._items]

    def __create_chunk_list__(self) -> list[Any]:
        return [it.tensor_data.chunk for it in self._items if it.tensor_data is not None]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._shards[_offset_key(index.offset)]

    def __reduce_ex__(self, protocol: int) -> tuple:  # DCP's PROCESS mode ships it
        return (
            _rebuild_snapshot,
            (self._items, list(self._shards.values()), self.size(), self.dtype, self._original),
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SnapshotTensor(of {self._original}, {len(self._items)} shard(s), size={tuple(self.size())})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"a staged {cls.__name__} is read by DCP only; {func} is not supported on it")


def _rebuild_snapshot(
    items: list[WriteItem], shards: list[torch.Tensor], size: Any, dtype: Any, original: str
):
    return SnapshotTensor(items, shards, size, dtype, original)


def _offset_key(offset: Any) -> tuple[int, ...] | None:
    return None if offset is None else tuple(offset)


def _flat(value: Any) -> Any:
    """A ShardedTensor whose shards are ShardedTensors, flattened as DCP's planner does."""
    if isinstance(value, ShardedTensor) and any(
        isinstance(s.tensor, ShardedTensor) for s in value.local_shards()
    ):
        from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

        return _flatten_sharded_tensors({"v": value})["v"]
    return value


def _items(value: Any) -> list[WriteItem]:
    return _create_write_items("", _flat(value))


def _shards(value: Any) -> list[torch.Tensor]:
    value = _flat(value)
    shards = [find_tensor_shard(value, it.index) for it in _create_write_items("", value)]
    for s in shards:
        if not is_plain(s):
            raise TypeError(f"its shard is a {type(s).__name__}, not a plain tensor")
    return shards


SHARDED = Kind(
    "sharded",
    pieces=_shards,
    layout=lambda v: (type(v), tuple(_items(v)), tuple(v.size()), v.dtype),
    build=lambda v, views: SnapshotTensor(_items(v), views, v.size(), v.dtype, type(v).__name__),
    recipe=lambda staged: (staged._items, staged.size(), staged.dtype, staged._original),
    rebuild=lambda facts, views: SnapshotTensor(facts[0], views, *facts[1:]),
)


# -- other tensor subclasses -------------------------------------------------------------


def _simple_subclass(t: torch.Tensor) -> bool:
    """A subclass over ordinary storage (no ``__torch_dispatch__`` of its own)."""
    return not any(
        "__torch_dispatch__" in c.__dict__ for c in type(t).__mro__[: type(t).__mro__.index(torch.Tensor)]
    )


def _build_subclass(v: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
    return views[0].as_subclass(type(v)) if _simple_subclass(v) else views[0]


def _refresh_subclass(v: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    if type(staged) is type(v):
        staged.__dict__.clear()
        staged.__dict__.update(copy.deepcopy(v.__dict__))
    return staged


def _rebuild_subclass(facts: tuple, views: list[torch.Tensor]) -> torch.Tensor:
    kind, attrs = facts
    if kind is torch.Tensor:
        return views[0]
    staged = views[0].as_subclass(kind)
    staged.__dict__.update(attrs)
    return staged


SUBCLASS = Kind(
    "tensor subclass",
    pieces=lambda v: [v],
    layout=lambda v: (type(v),),
    build=_build_subclass,
    refresh=_refresh_subclass,
    recipe=lambda staged: (type(staged), staged.__dict__ if type(staged) is not torch.Tensor else {}),
    rebuild=_rebuild_subclass,
)


# -- everything else: Python values --------------------------------------------------------

PYTHON = Kind(
    "python",
    pieces=lambda v: [],
    layout=lambda v: (),
    build=lambda v, views: None,
    refresh=lambda v, staged: copy.deepcopy(v),
    recipe=lambda staged: (staged,),  # no pieces: the value itself
    rebuild=lambda facts, views: facts[0],
)


KINDS = {k.name: k for k in (PLAIN, DTENSOR, SHARDED, SUBCLASS, PYTHON)}


def plain_layout(t: torch.Tensor) -> tuple:
    """A plain tensor's layout (what picks its staging slot): the one place it is made."""
    return ("tensor", t.dtype, t.shape, t.device.type)


def examine(value: Any) -> tuple[Kind, list[torch.Tensor], tuple]:
    """``value``'s kind, the tensors to copy and its layout; raises if it cannot be staged."""
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the common case, fast
        return PLAIN, [value], plain_layout(value)
    if isinstance(value, DTensor) and is_plain(value._local_tensor):
        kind = DTENSOR
    elif isinstance(value, ShardedTensor) or (
        isinstance(value, torch.Tensor) and hasattr(value, "__create_write_items__")
    ):
        kind = SHARDED
    elif isinstance(value, torch.Tensor):
        kind = SUBCLASS
    else:
        kind = PYTHON
    pieces = kind.pieces(value)
    return kind, pieces, (kind.name, *kind.layout(value), *(_piece_layout(p) for p in pieces))


def refused(path: str, value: Any, why: BaseException) -> SnapshotError:
    kind = type(value)
    return SnapshotError(
        f"async_save cannot snapshot state_dict[{path!r}] of type {kind.__module__}.{kind.__qualname__} "
        f"({type(why).__name__}: {why}); it would be saved as it is when the upload runs, not as it is "
        "now. Make it deep-copyable (define __deepcopy__ or __getstate__), turn it into a tensor or "
        "plain Python data (or a Stateful whose state_dict() is), or save this state with dcp.save"
    )
