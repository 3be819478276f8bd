"""Reusable staging buffers: the one copy an async save costs the training loop.

``stage`` copies the state into host buffers that are allocated once per state layout and
reused by every later save. The buffers live in shared memory, so DCP's PROCESS mode
hands them to its subprocess without another copy, and are pinned (with the device copies
on a side stream) when the state is on CUDA. A fresh allocation per save runs at a
fraction of a warm copy's speed; reuse is what makes the stall one warm copy.

Memory is bounded: at most ``slots`` staged copies exist per process (each save passes its
writer's ``staging_slots``: the pool is the process's, the bound is the save's). A slot is busy from
``stage`` until DCP drops the staged dict, which it does when that save's upload ends
(success or failure); a save that finds every slot busy waits for the oldest upload.

Where the save's first tier is in memory, a slot's buffer is the step's part file there
(``part_file``): the staged copy is the tier's copy. Such a slot stays mapped after its
save, its file a kept step, and is staged into again once retention has made that file a
spare (or the save that staged it failed before writing it); one whose file was deleted
is let go. Pieces are laid out largest element first, back to back, so each is aligned to
its element and no byte of the arena is padding.

No page is faulted, allocated or registered on the training thread once saves run: after
a save has staged, the pool prepares in the background (``prepare_soon``) the part files
the next saves will stage into, up to ``keep + 1`` per layout (what the RAM tier holds at
most: its kept steps and the one being written): each made ahead with no name
(``part_file.prepare``), mapped, every page touched and, on CUDA, registered; a save names
one (``part_file.adopt``) when no spare of its own is there to take. ``prepare`` does the
same before the first save (``TieredWriter.prepare``). A save of a CPU state that finds no
file ready (the first, without ``prepare``) copies into private memory instead, which
faults cheaper than a tmpfs file's claimed pages; its upload moves the copy into the part
file (``FirstCopies.move``), which is then the slot's as if it had been staged into. Not when the
staged copy is shipped to another process (DCP's PROCESS mode): torch's pickling would move
the private copy into a shared segment of its own, which that process holds while its
upload copies it once more into the part file; such a save stages into its file.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered_dcp.storage.forks import ThreadPool, renew_in_child

from ..errors import SnapshotError
from ..steps import part_file
from ..steps.part_file import TierFile
from .snapshot import KINDS, PLAIN, SUBCLASS, Kind, plain_layout, refused
from .snapshot import examine as examine_leaf

log = logging.getLogger(__name__)

SLOTS = 2  # a save's bound on staged copies when it names none (``TieredWriter(staging_slots=)``)
MAPPED_FILES = 8  # idle part-file slots kept mapped (their files kept steps), the newest first

# The arena of each staged part file by its dirty path, in every process holding one (the
# trainer, DCP's background process): what the save's write finds its staged bytes in.
STAGED_FILES: dict[str, torch.Tensor] = {}


class StagedStateDict(dict):
    """The staged copy handed to DCP; weak-referenceable so its slot frees when dropped.

    Pickled (DCP's PROCESS mode sends it to its background process) as its arena, one
    shared-memory handle, plus each leaf's recipe (``snapshot.Kind.recipe``): the receiving
    process maps the same pages and builds the leaves over them again, so nothing is
    copied (torch would copy every piece, a view into the arena, into a segment of its own).
    """

    __slots__ = ("__weakref__", "_ship", "slot_wait")

    def __reduce__(self) -> tuple:
        ship = getattr(self, "_ship", None)
        if ship is None:
            return (StagedStateDict, (dict(self),))
        return (_received, ship)


def _received(
    arena: torch.Tensor, spans: list[tuple], template: Any, leaves: list[tuple], file: str | None
) -> StagedStateDict:
    """A shipped ``StagedStateDict`` again, over the same shared memory (``__reduce__``)."""
    views = arena_views(arena.untyped_storage(), spans)
    values = [KINDS[name].rebuild(facts, views[a:b]) for name, facts, a, b in leaves]
    staged = StagedStateDict(_fill(template, values))
    if file is not None:
        _register(staged, file, arena)
    return staged


def _register(staged: StagedStateDict, file: str, arena: torch.Tensor) -> None:
    """Make ``arena`` the staged part file ``file``'s, for as long as ``staged`` lives."""
    STAGED_FILES[file] = arena
    weakref.finalize(staged, STAGED_FILES.pop, file, None)


@contextlib.contextmanager
def registered(file: str, arena: torch.Tensor) -> Iterator[None]:
    """``arena`` as the part file ``file``'s while a save that filled it without staging (an
    import: ``importing``) writes it."""
    STAGED_FILES[file] = arena
    try:
        yield
    finally:
        STAGED_FILES.pop(file, None)


def staged_file(file: str) -> torch.Tensor | None:
    """The arena a save staged into its part file ``file`` (its dirty path), in this process."""
    return STAGED_FILES.get(file)


def arena_views(storage: torch.UntypedStorage, spans: list[tuple]) -> list[torch.Tensor]:
    """A tensor over each span (offset, bytes, dtype, shape) of ``storage``.

    Each over a storage of its own (offset 0): DTensor mis-reports the data pointer of a
    local tensor at a storage offset, which breaks its pickling."""
    return [
        torch.empty(0, dtype=dtype).set_(storage[off : off + n], 0, shape, _strides(shape))
        for off, n, dtype, shape in spans
    ]


class _Hole:
    """Where leaf ``index`` sits in the template of a state dict."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Refusal(Exception):
    """A leaf ``examine`` could not stage."""

    def __init__(self, value: Any, why: Exception) -> None:
        self.value, self.why = value, why


def _flatten(obj: Any, ex: Examined) -> Any:
    """A template of ``obj`` with every leaf replaced by a ``_Hole``; leaves examined in order.

    On the training thread at every save, once per leaf: plain tensors in plain dicts, what
    a trainer's state mostly is, take a path of their own (~3 µs a leaf, not ~7)."""
    if type(obj) is dict:
        plain = ex.plain
        return {
            k: plain(v) if type(v) is torch.Tensor or type(v) is torch.nn.Parameter else _flatten(v, ex)
            for k, v in obj.items()
        }
    if isinstance(obj, Mapping):
        return {k: _flatten(v, ex) for k, v in obj.items()}
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        items = [_flatten(v, ex) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    try:
        kind, pieces, layout = examine_leaf(obj)
    except Exception as e:
        raise _Refusal(obj, e) from e
    values = ex.values
    values.append(obj)
    ex.kinds.append(kind)
    ex.pieces.append(pieces)
    ex.flat_pieces += pieces
    ex.layouts.append(layout)
    if kind.refresh is not None:
        ex.refresh.append(len(values) - 1)
    return _Hole(len(values) - 1)


def _fill(template: Any, values: list[Any]) -> Any:
    if isinstance(template, _Hole):
        return values[template.index]
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, values) for v in template]
    if isinstance(template, tuple):
        return tuple(_fill(v, values) for v in template)
    return template


def _path(tree: Any, found: Callable[[Any], bool]) -> str | None:
    """The dotted key (as DCP names it) of the first leaf of ``tree`` that is ``found``."""
    if isinstance(tree, Mapping) or (isinstance(tree, list | tuple) and not hasattr(tree, "_fields")):
        for k, v in tree.items() if isinstance(tree, Mapping) else enumerate(tree):
            sub = _path(v, found)
            if sub is not None:
                return f"{k}.{sub}" if sub else str(k)
        return None
    return "" if found(tree) else None


@dataclass
class Examined:
    """A state dict taken apart: its containers (a template) and its leaves, per leaf:
    the value, its kind, the tensors to copy and its layout (see ``snapshot``)."""

    template: Any = None
    values: list[Any] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)
    pieces: list[list[torch.Tensor]] = field(default_factory=list)
    flat_pieces: list[torch.Tensor] = field(default_factory=list)  # every leaf's, in order
    layouts: list[tuple] = field(default_factory=list)
    refresh: list[int] = field(default_factory=list)  # the leaves with a per-save part
    written: dict[Any, Any] = field(default_factory=dict)  # CUDA device -> event (``mark_written``)

    def plain(self, t: torch.Tensor) -> _Hole:
        """A plain tensor leaf (``snapshot.examine``'s fast path, inlined): its hole."""
        values = self.values
        values.append(t)
        self.kinds.append(PLAIN)
        self.pieces.append([t])
        self.flat_pieces.append(t)
        self.layouts.append(plain_layout(t))
        return _Hole(len(values) - 1)

    def mark_written(self) -> None:
        """Record, per CUDA device of the state, an event on the caller's current stream:
        the state's last writes, which the copies wait for. Called on the training thread,
        so that a copy made later on another (``background_staging``) waits for its
        stream, not for that thread's own."""
        for device in {p.device for p in self.flat_pieces if p.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.written[device] = event

    @functools.cached_property
    def nbytes(self) -> int:
        """The bytes a staged copy of this state takes (its arena: no padding)."""
        return sum(_nbytes(p) for p in self.flat_pieces)

    @property
    def signature(self) -> tuple:
        """What decides the buffers' layout: every leaf's kind, pieces and static metadata."""
        return tuple(self.layouts)

    def refused(self, index: int, why: Exception) -> SnapshotError:
        path = _path(self.template, lambda hole: hole.index == index)
        return refused(path or "?", self.values[index], why)

    def owner(self, piece: int) -> int:
        """The leaf whose pieces include the ``piece``-th of ``flat_pieces``."""
        for leaf, pieces in enumerate(self.pieces):
            piece -= len(pieces)
            if piece < 0:
                return leaf
        return len(self.pieces) - 1


def examine(state_dict: Mapping[str, Any]) -> Examined:
    """Classify every leaf; raises ``SnapshotError`` (naming its key) for one of no kind."""
    ex = Examined()
    try:
        ex.template = _flatten(state_dict, ex)
    except _Refusal as r:
        value = r.value
        path = _path(state_dict, lambda leaf: leaf is value)
        raise refused(path or "?", value, r.why) from r.why
    return ex


def _pin(ptr: int, nbytes: int, device: int) -> None:
    # under the state's device: these run on the pool's threads and DCP's upload thread,
    # whose current device is 0 (a context on GPU 0 for every local rank otherwise)
    with torch.cuda.device(device):
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable
    if rc != 0:
        raise RuntimeError(f"pinning {nbytes} staging bytes failed with cudaError {rc}")


def _unpin(ptr: int, device: int) -> None:
    with torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass(eq=False)  # one slot is one set of buffers: compared by identity, never by its tensors
class _Slot:
    """One staged copy's buffers: a single shared-memory arena and the views into it."""

    signature: tuple
    arena: torch.Tensor
    flat_targets: list[torch.Tensor]  # the arena view of each piece, in ``Examined.flat_pieces`` order
    spans: list[tuple]  # per piece: (offset in the arena, bytes, dtype, shape)
    staged: list[Any]  # per leaf: the staged value built over those views (see ``snapshot``)
    kinds: list[Kind]  # per leaf
    counts: list[int]  # per leaf: how many pieces it has
    pinned: int | None  # the CUDA device it is registered under; None: not pinned
    fd: int | None = None  # a part file's (``part_file``); None: shared memory of its own
    file: TierFile | None = None  # where the part file was put last
    busy: bool = False
    copier: int | None = None  # the thread taking it and copying into it, until its copy is done
    prepared: bool = False  # a part file made ahead, with no name yet (``part_file.prepare``)
    first_copy: bool = False  # private memory until its upload moves it into ``file`` (``FirstCopies.move``)
    spares: str | None = None  # a prepared file's: the spare directory of the namespace it is for
    generation: int = 0
    limit: int = SLOTS  # the bound of the save that took it last (``StagingPool.stage``'s ``slots``)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.arena.numel()

    def free(self) -> None:
        if self.pinned is not None:
            _unpin(self.arena.data_ptr(), self.pinned)
            self.pinned = None
        self.flat_targets, self.staged = [], []
        self.arena = torch.empty(0, dtype=torch.uint8)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def arena_layout(pieces: list[torch.Tensor]) -> list[tuple]:
    """Per piece, in order: (offset in the arena, bytes, dtype, shape). Largest element
    first, back to back: each piece is aligned to its element size (powers of two) and no
    byte is padding, so a part file staged this way holds only its items' bytes."""
    spans: list[tuple] = [()] * len(pieces)
    off = 0
    for i in sorted(range(len(pieces)), key=lambda i: -pieces[i].element_size()):
        p = pieces[i]
        spans[i] = (off, _nbytes(p), p.dtype, p.shape)
        off += _nbytes(p)
    return spans


def _allocate(ex: Examined, target: TierFile | None, prepared: int | None = None) -> _Slot:
    """A slot for ``ex``: shared memory of its own, the part file ``target`` (claimed now),
    or the prepared file open as ``prepared`` (``part_file.prepare``, which it then owns)."""
    total = ex.nbytes
    fd = prepared
    if target is None and fd is None:
        storage = torch.UntypedStorage._new_shared(max(total, 1), device="cpu")
    else:
        if fd is None:
            assert target is not None
            fd = part_file.create(target, total)
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, total)  # maps it (a dup of fd)
        except BaseException:
            os.close(fd)
            if target is not None:
                part_file.discard(target)
            raise
    arena = torch.empty(0, dtype=torch.uint8).set_(storage)
    if target is None:
        arena.fill_(0)  # touch every page now, not during a save's copy
    device = next((p.device.index for p in ex.flat_pieces if p.device.type == "cuda"), None)
    if device is not None:
        _pin(arena.data_ptr(), arena.numel(), device)
    slot = _slot_over(ex, arena, device, fd)
    slot.file = target
    slot.prepared = prepared is not None
    return slot


def _first_copy(ex: Examined, target: TierFile) -> _Slot:
    """A slot in private memory for a save of a CPU state that finds no part file ready (a
    layout's first save, with no ``prepare`` before it): nothing is claimed or touched
    before the copy, which faults its pages as stock DCP's first copy does (a tmpfs file's
    pages cost ~1.6x as much: claimed, then faulted). Its upload moves it into ``target``
    (``FirstCopies.move``), off the training thread, and frees it."""
    slot = _slot_over(ex, torch.empty(max(ex.nbytes, 1), dtype=torch.uint8), None, None)
    slot.file, slot.first_copy = target, True
    return slot


def _slot_over(ex: Examined, arena: torch.Tensor, device: int | None, fd: int | None) -> _Slot:
    """A slot whose views and staged values lie in ``arena`` (laid out by ``arena_layout``)."""
    spans = arena_layout(ex.flat_pieces)
    targets = arena_views(arena.untyped_storage(), spans)
    staged: list[Any] = []
    first = 0
    for value, kind, pieces in zip(ex.values, ex.kinds, ex.pieces, strict=True):
        staged.append(kind.build(value, targets[first : first + len(pieces)]))
        first += len(pieces)
    counts = [len(p) for p in ex.pieces]
    slot = _Slot(ex.signature, arena, targets, spans, staged, list(ex.kinds), counts, device, fd)
    slot.nbytes = ex.nbytes
    return slot


def _move_onto(slot: _Slot, storage: torch.UntypedStorage) -> None:
    """Set the slot's views onto ``storage`` at their spans, and each leaf that aliases one
    (a tensor subclass: ``as_subclass`` makes a tensor of its own over the same storage)
    onto its view: nothing staged keeps the storage they were in (a first copy's)."""
    for view, (off, n, _, shape) in zip(slot.flat_targets, slot.spans, strict=True):
        view.set_(storage[off : off + n], 0, shape, _strides(shape))
    first = 0
    for kind, leaf, n in zip(slot.kinds, slot.staged, slot.counts, strict=True):
        if kind is SUBCLASS and leaf is not slot.flat_targets[first]:
            leaf.set_(slot.flat_targets[first])
        first += n


def _recipes(slot: _Slot, values: list[Any]) -> list[tuple]:
    """Per leaf: its kind's name, its recipe and the range of its pieces (``_received``)."""
    out, first = [], 0
    for kind, value, n in zip(slot.kinds, values, slot.counts, strict=True):
        out.append((kind.name, kind.recipe(value), first, first + n))
        first += n
    return out


def _strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


class InFlight:
    """A save counted in flight before its background staging takes a slot (the SIGTERM
    handler waits for it); released once, by the staging or by whatever failed before it."""

    __slots__ = ("_pool", "_held")

    def __init__(self, pool: StagingPool) -> None:
        self._pool = pool
        self._held = True

    def release(self) -> None:
        with self._pool._cond:
            if self._held:
                self._held = False
                self._pool._reserved -= 1
                self._pool._cond.notify_all()


class FirstCopies:
    """First copies (``_first_copy``) not yet in their part files, by the file's dirty path:
    the slot and its staged dict. A first save of a CPU state with no file ready copies into
    private memory (cheaper to fault than a tmpfs file's claimed pages); its upload moves the
    copy into the part file (``move``), which is then the slot's, as if it had been staged
    into. Shares the pool's lock: ``StagingPool.prepare`` waits on it for a move."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._held: dict[str, tuple[_Slot, weakref.ref]] = {}

    def add(self, slot: _Slot, staged: StagedStateDict) -> None:
        assert slot.file is not None
        with self._cond:
            self._held[slot.file.dirty] = (slot, weakref.ref(staged))

    def forget(self, slot: _Slot) -> None:
        """``slot`` was released with its copy never moved (under the pool's lock)."""
        if slot.file is not None and self._held.get(slot.file.dirty, (None,))[0] is slot:
            del self._held[slot.file.dirty]

    def __bool__(self) -> bool:
        return bool(self._held)

    def move(self, target: TierFile) -> torch.Tensor | None:
        """The part file ``target`` with the first copy staged for it (``_first_copy``)
        moved in: made, mapped, copied into, the staged dict's tensors set onto it and the
        private copy freed. Called by that save's upload, off the training thread; the part
        file is then the slot's, as if the save had staged into it (later saves reclaim it).
        None where there is none (another process's save, or it failed: the upload writes
        the file from the staged tensors, as for any other tier)."""
        with self._cond:
            slot, ref = self._held.get(target.dirty, (None, None))
        staged = ref() if ref is not None else None
        if slot is None or staged is None:
            return None
        fd = None
        try:
            fd = part_file.create(target, slot.nbytes)
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, slot.nbytes)
            arena = torch.empty(0, dtype=torch.uint8).set_(storage)
            arena.copy_(slot.arena[: slot.nbytes])
            _move_onto(slot, storage)
            with self._cond:  # the private copy goes with the last tensor over it
                slot.arena, slot.fd, slot.first_copy = arena, fd, False
            staged._ship = (arena, *staged._ship[1:4], target.dirty)
            _register(staged, target.dirty, arena)
            return arena
        except Exception as e:  # noqa: BLE001 - the upload writes the file from the staged tensors
            # its text, not the error: a kept log record would hold this frame, and the copy
            why = str(e)
            log.warning("moving a first save's copy into %s failed (%s); written from it", target.dirty, why)
            if fd is not None and slot.fd is None:
                os.close(fd)
                part_file.discard(target)
            return None
        finally:
            self.give_up(target)

    def give_up(self, target: TierFile) -> None:
        """No ``move`` for ``target`` in this process: the next saves' files are made beside
        its copy now (``StagingPool.prepare`` waits for it otherwise)."""
        with self._cond:
            self._held.pop(target.dirty, None)
            self._cond.notify_all()

    def for_namespace(self, where: TierFile) -> list[_Slot]:
        """The first copies waiting for their part files in ``where``'s namespace (under the
        pool's lock)."""
        slots = [slot for slot, _ in self._held.values()]
        return [slot for slot in slots if slot.file is not None and slot.file.spares == where.spares]


class Copier:
    """The copy of a state into a slot's buffers (the stall of a save): host pieces on the
    calling thread, device pieces on a side stream per device, kept."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}  # device -> the side stream its copies run on

    @torch.no_grad()
    def copy_into(self, slot: _Slot, ex: Examined) -> list[Any]:
        """Copy every piece into its arena view; then the per-save part of each leaf."""
        stream = self._side_stream(ex) if slot.pinned is not None else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        nb = stream is not None
        i = 0
        try:
            with ctx:
                for i, (src, dst) in enumerate(zip(ex.flat_pieces, slot.flat_targets, strict=True)):  # noqa: B007
                    dst.copy_(src, non_blocking=nb)
            if stream is not None:
                stream.synchronize()
        except Exception as e:
            raise ex.refused(ex.owner(i), e) from e
        values = list(slot.staged)
        for i in ex.refresh:
            try:
                values[i] = ex.kinds[i].refresh(ex.values[i], values[i])
            except Exception as e:
                raise ex.refused(i, e) from e
        return values

    def _side_stream(self, ex: Examined) -> Any:
        """The stream the device-to-host copies run on, one per device and kept: ordered
        after the state's last writes by their events (``Examined.mark_written``), so the
        training stream (the next step's kernels) is never queued behind the copies."""
        device = next(p.device for p in ex.flat_pieces if p.device.type == "cuda")
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        if not ex.written:
            ex.mark_written()
        for event in ex.written.values():
            stream.wait_event(event)
        return stream


class StagingPool:
    """The process's staging slots (see the module docstring)."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._cond = threading.Condition(threading.RLock())
        self._closing = False
        self._closes = 0  # ``close`` calls: a preparation asked for before the last makes nothing more
        self._reserved = 0  # saves counted in flight whose background staging has no slot yet
        self._preparing = 0  # part files ``prepare`` is making now (counted as slots ahead)
        self.first_copies = FirstCopies(self._cond)
        self.copier = Copier()
        self._inherited: list[_Slot] = []  # a forked child's: its parent's slots (``_renew_pool``)

    def reserve(self) -> InFlight:
        """Count a save as in flight before its background staging has taken a slot."""
        with self._cond:
            self._reserved += 1
        return InFlight(self)

    def stage(
        self,
        state: Mapping[str, Any] | Examined,
        reserved: InFlight | None = None,
        target: TierFile | None = None,
        slots: int = SLOTS,
        quiet: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        shipped: bool = False,
    ) -> StagedStateDict:
        """A snapshot of ``state`` in a slot's buffers (``examine`` it first to refuse early);
        with ``target``, in that part file of the RAM tier (``part_file``). ``slots``: the
        staged copies this save lets the process hold (it waits for an upload beyond).
        ``quiet()`` is entered around the copy alone (the writer's pause: never around a
        wait for a slot). ``shipped``: the copy goes to another process to be written (DCP's
        PROCESS mode), so it is never a first copy in private memory (``_first_copy``)."""
        try:
            examined = state if isinstance(state, Examined) else examine(state)
            slot, waited = self._acquire(examined, target if examined.nbytes else None, slots, shipped)
        finally:
            if reserved is not None:
                reserved.release()
        try:
            with quiet():
                values = self.copier.copy_into(slot, examined)
        except BaseException:
            slot.copier = None
            if slot.fd is not None and target is not None:
                part_file.discard(target)
            self._release(slot, slot.generation)
            raise
        slot.copier = None
        staged = StagedStateDict(_fill(examined.template, values))
        staged.slot_wait = waited  # saves faster than their commits wait here (``slots``)
        file = slot.file.dirty if slot.fd is not None and slot.file is not None else None
        staged._ship = (slot.arena, slot.spans, examined.template, _recipes(slot, values), file)
        if file is not None:
            _register(staged, file, slot.arena)
        if slot.first_copy and slot.file is not None:
            self.first_copies.add(slot, staged)
        weakref.finalize(staged, self._release, slot, slot.generation)
        return staged

    def prepare(self, ex: Examined, where: TierFile | None, files: int, opened: int | None = None) -> int:
        """Make ready what the next saves of ``ex``'s layout stage into, so that none faults,
        allocates or registers a page: part files in ``where``'s tier (with no name yet,
        ``part_file.prepare``) until ``files`` of this layout are mapped (``MAPPED_FILES`` at
        most), or, without ``where``, one shared-memory buffer. Each page is touched (and
        registered on CUDA) here. Returns the bytes made.

        Beside a first copy still in private memory (``_first_copy``, counted as the file it
        becomes) one file is made, the rest once it is in its file (``FirstCopies.move``): host memory
        stays at ``files`` copies of the state.

        ``opened``: the pool's ``close`` count when a save asked for these (``prepare_soon``);
        once the pool is closed again (``shutdown()`` right after that save) nothing more
        is made, and a file made meanwhile is let go: no process holds a state's size in
        files after its pool closed. Without it, a first use of the pool, as a save's."""
        made = 0
        with self._cond:
            if opened is None:
                self._closing = False
                opened = self._closes

        def missing() -> int:  # under ``_cond``; none once the pool was closed since ``opened``
            return self._missing(ex, where, files) if self._closes == opened else 0

        while True:
            with self._cond:
                need = missing()
                while need and made and where is not None and self.first_copies.for_namespace(where):
                    self._cond.wait(timeout=0.5)
                    need = missing()
                if not need:
                    return made
                self._preparing += 1
            try:
                fd = part_file.prepare(where, ex.nbytes) if where is not None else None
                slot = _allocate(ex, None, fd)
                slot.spares = where.spares if where is not None else None
            finally:
                with self._cond:
                    self._preparing -= 1
                    self._cond.notify_all()
            with self._cond:
                if self._closes != opened:  # closed while it was made: nothing will stage into it
                    slot.free()
                    return made
                self._slots.append(slot)  # behind the mapped kept steps: their spares go first
                self._cond.notify_all()
            made += slot.nbytes

    def _missing(self, ex: Examined, where: TierFile | None, files: int) -> int:
        """How many buffers ``prepare`` still makes (under ``_cond``)."""
        signature = ex.signature
        if where is None:
            have = sum(s.fd is None and not s.first_copy and s.signature == signature for s in self._slots)
            return 0 if have or not ex.nbytes else 1
        mine = [s for s in self._slots if s.fd is not None]
        have = sum(s.signature == signature for s in mine)
        have += sum(s.signature == signature for s in self.first_copies.for_namespace(where))
        others = part_file.unmapped(where, {os.fstat(s.fd).st_ino for s in mine})  # type: ignore[arg-type]
        return max(0, min(files, MAPPED_FILES) - have - others - self._preparing)

    def prepare_soon(self, ex: Examined, where: TierFile | None, files: int) -> Future[int]:
        """``prepare`` on the pool's own thread, off the training thread; a failure (a full
        tier) is logged, and the save that finds nothing prepared claims its file itself."""
        with self._cond:
            opened = self._closes

        def run() -> int:
            try:
                return self.prepare(ex, where, files, opened)
            except Exception as e:  # noqa: BLE001 - the next save claims its file itself
                log.warning("preparing the next saves' part files failed (they make their own): %s", e)
                return 0

        return _preparer().submit(run)

    def mapped_inodes(self) -> frozenset[int]:
        """The part files this pool keeps mapped (by inode): a replica received into this
        root takes another spare, so that the next saves here find theirs still mapped."""
        with self._cond:
            return frozenset(os.fstat(s.fd).st_ino for s in self._slots if s.fd is not None)

    def files_ahead(self, ex: Examined) -> int:
        """The part files of ``ex``'s layout mapped and idle (kept steps, spares, prepared)
        or being prepared: what the next saves of that layout may find ready."""
        with self._cond:
            idle = sum(s.fd is not None and not s.busy and s.signature == ex.signature for s in self._slots)
            return idle + self._preparing

    def _acquire(
        self, ex: Examined, target: TierFile | None, slots: int, shipped: bool
    ) -> tuple[_Slot, float]:
        """A slot for ``ex``, and the seconds spent waiting for one (for a busy slot to be
        released or a prepared file to be made); ``shipped``: none in private memory."""
        signature = ex.signature
        started = time.monotonic()
        waited = 0.0
        warned = collected = False
        with self._cond:
            self._closing = False
            while True:
                slot = self._reusable(signature, target)
                if slot is not None:
                    return self._take(slot, slots), waited
                if target is not None and self._preparing:  # one is on its way: no page faulted here
                    waited += self._wait(0.05)
                    continue
                self._let_go_of_files(signature, target)
                counted = [s for s in self._slots if s.busy or s.fd is None]
                idle = [s for s in counted if not s.busy]
                if idle:  # the state changed shape, or saves go to part files now: its buffer goes
                    self._drop(idle[0])
                    counted.remove(idle[0])
                if len(counted) < slots:
                    on_cpu = all(p.device.type == "cpu" for p in ex.flat_pieces)
                    if target is not None and on_cpu and slots > 1 and not shipped:  # room beside the file
                        slot = _first_copy(ex, target)
                    else:
                        slot = _allocate(ex, target)
                    self._slots.insert(0, slot)
                    return self._take(slot, slots), waited
                if not collected and waited > 0.5:  # a staged dict left in a cycle (an exception's
                    collected = True  # traceback) frees its slot at a collection only
                    gc.collect()
                    continue
                if not warned and time.monotonic() - started > 5:
                    warned = True
                    log.warning(
                        "all %d staging slots are held by saves still uploading; this save waits "
                        "for the oldest (wait for each async_save's future before the next save "
                        "to avoid this)",
                        slots,
                    )
                waited += self._wait(1.0)

    def _wait(self, timeout: float) -> float:
        """Wait on the pool's condition (held) for up to ``timeout``; the seconds waited."""
        t0 = time.monotonic()
        self._cond.wait(timeout=timeout)
        return time.monotonic() - t0

    def _reusable(self, signature: tuple, target: TierFile | None) -> _Slot | None:
        """An idle slot of this layout: shared memory for a save without ``target``, else a
        part file that ``part_file.reclaim`` could move to ``target`` (still mapped here), else
        a prepared one (``part_file.adopt``)."""
        idle = [
            s
            for s in self._slots
            if not s.busy and s.signature == signature and (s.fd is None) == (target is None)
        ]
        if target is None:
            return idle[0] if idle else None
        for slot in idle:
            assert slot.fd is not None
            if slot.file is not None and part_file.reclaim(slot.fd, slot.file, target, slot.nbytes):
                slot.file = target
                return slot
        for slot in idle:
            if slot.prepared:
                assert slot.fd is not None
                part_file.adopt(slot.fd, target, slot.nbytes)
                slot.prepared, slot.file = False, target
                return slot
        return None

    def _let_go_of_files(self, signature: tuple, target: TierFile | None) -> None:
        """Unmap idle part-file slots whose file was deleted, and the oldest beyond
        ``MAPPED_FILES`` (their files are kept steps, held by the tier, not by the map);
        prepared ones of another layout for ``target``'s namespace go (its state changed
        shape). Those prepared for another namespace stay: two states saved in turn (a
        model and its EMA) each find their own."""
        spares = target.spares if target is not None else None
        for slot in [s for s in self._slots if s.prepared and not s.busy and s.spares == spares]:
            if slot.signature != signature:
                self._drop(slot)
        files = [s for s in self._slots if s.fd is not None and not s.busy and not s.prepared]
        for i, slot in enumerate(files):
            if i >= MAPPED_FILES or part_file.gone(slot.fd):  # type: ignore[arg-type]
                self._drop(slot)

    def _take(self, slot: _Slot, slots: int) -> _Slot:
        slot.busy = True
        slot.copier = threading.get_ident()
        slot.limit = slots
        slot.generation += 1
        return slot

    def _release(self, slot: _Slot, generation: int) -> None:
        with self._cond:
            if slot.busy and slot.generation == generation and slot not in self._inherited:
                slot.busy = False
                counted = sum(s.busy or s.fd is None for s in self._slots)
                if self._closing or slot.first_copy or (slot.fd is None and counted > slot.limit):
                    self._drop(slot)
                self.first_copies.forget(slot)
                self._cond.notify_all()

    def _drop(self, slot: _Slot) -> None:
        self._slots.remove(slot)
        slot.free()

    def in_flight(self, besides: int | None = None) -> int:
        """The saves staged or staging and not done uploading; ``besides``: not counting the
        one thread ``besides`` is copying now (a SIGTERM handler interrupted it there, on
        that thread: it cannot go on while the handler waits)."""
        with self._cond:
            busy = sum(s.busy and (besides is None or s.copier != besides) for s in self._slots)
            return self._reserved + busy

    def wait_idle(self, timeout: float, besides: int | None = None) -> bool:
        """Wait until no staged save is uploading (``in_flight``); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.in_flight(besides):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.5))
        return True

    def info(self) -> dict[str, int]:
        with self._cond:
            return {
                "slots": len(self._slots),
                "busy": sum(s.busy for s in self._slots),
                "bytes": sum(s.nbytes for s in self._slots if s.fd is None),  # tier files not counted
                "files": sum(s.fd is not None for s in self._slots),
                "max_slots": max((s.limit for s in self._slots), default=SLOTS),
            }

    def prepared_bytes(self) -> int:
        """The bytes of part files prepared for coming saves (in the RAM tier's memory, but
        named by no step yet: no listing of the tier shows them)."""
        with self._cond:
            return sum(s.nbytes for s in self._slots if s.prepared)

    def close(self) -> None:
        """Free the idle slots now and the busy ones as their uploads end; part files that
        no step holds (a spare, or one whose save never wrote it) are deleted."""
        with self._cond:
            for slot in [s for s in self._slots if not s.busy]:
                if slot.fd is not None and slot.file is not None:
                    part_file.delete_unused(slot.fd, slot.file)
                self._drop(slot)
            self._closing = True
            self._closes += 1
            self._cond.notify_all()  # a preparation waiting beside a first copy stops


POOL = StagingPool()
_preparer = ThreadPool("tiered-dcp-prepare", 1)  # ``prepare_soon``'s thread


@renew_in_child
def _renew_pool() -> None:
    """A forked child starts with no slot: its parent's are the parent's saves (their part
    files, their staged dicts in flight). They stay mapped here, never staged into, freed
    or deleted from here; the child's own saves take slots of their own."""
    inherited = POOL._inherited + POOL._slots
    POOL.__init__()  # type: ignore[misc]
    POOL._inherited = inherited
    STAGED_FILES.clear()


@renew_in_child
def _one_torch_thread() -> None:
    """GNU OpenMP's pool of the thread that forked is not there in the child, and a parallel
    op on that thread waits for it forever: this module's copies (``dst.copy_``), a load's,
    and any of the child's own. The child runs torch's CPU ops on one thread, as torch's
    DataLoader workers do."""
    if torch.get_num_threads() > 1 and "OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(1)
