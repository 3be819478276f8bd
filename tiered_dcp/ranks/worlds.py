"""One world of this process: the default process group it was made for, and leaving it.

A job that restarts inside its processes (NVIDIA's in-process restart, torchft, a user's
own loop) makes a new default group, on a store with a prefix of its own (NvRx's
``_inprocess_<n>``, torchrun's ``/worker/attempt_<n>``). What this process keeps for a
world (``World``: the names of its operations, its store clients, the keys it left, the
waits on other ranks in progress) is made afresh at the first call in the new world, so
that no two worlds meet in the store.

Leaving a world (``leave_world``: ``tiered_dcp.abort``, a SIGTERM that finds a rank gone)
ends every wait of this process on it at once: a wait on a key is woken by setting that
key to a mark saying who left (``LEFT``), which also ends the same wait on every other rank,
and each save or load that waited raises ``AbortedError`` (``PeerLostError`` on the others,
naming the rank that left). A save waits on other ranks through a key only (``Op.wait``):
its arrival, its commit's agreement; its replica transfers run among ranks that all
arrived.

Which processes of the world share this host (``Op.arrive`` records each rank's pid once
per world) lets a SIGTERM tell a peer that is gone from one that is alive
(``save.preemption``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from tiered_dcp.storage.forks import renew_in_child

from ..errors import AbortedError, PeerLostError

LEFT = b"tiered_dcp:left:"  # a key set to this, then "<rank>:<why>", was set by a rank leaving the world


def dist_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group; 0 without one."""
    return dist.get_rank() if dist_up() else 0


def size() -> int:
    """The default group's size; 1 without one."""
    return dist.get_world_size() if dist_up() else 1


@dataclass(eq=False)
class Wait:
    """A wait of this process on other ranks, in progress: for ``key`` (an ``Op``'s), from
    ``ranks`` (empty: any), since ``since`` (``time.monotonic``)."""

    key: str
    ranks: tuple[int, ...]
    what: str
    since: float = field(default_factory=time.monotonic)


class World:
    """What this process keeps for the world of one default process group: the sequence
    numbers of its operations' names, its store clients, the keys it left in the store and
    its waits on other ranks. ``generation`` counts the worlds this process has been in
    (caches of a world's facts, such as its failure domains, key on it); ``left`` says why
    this process left it (``leave_world``), None while it is in it."""

    def __init__(self, group: Any, generation: int) -> None:
        self.group = weakref.ref(group)  # never keeps a destroyed group alive
        self.pid = os.getpid()  # a forked child is in a world of its own
        self.generation = generation
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.store: dist.Store = distributed_c10d._get_default_store()
        self.seq: dict[str, int] = {}
        self.clients: dict[float, dist.Store] = {}
        self.to_sweep: dict[str, list[str]] = {}
        self.left: str | None = None
        self.waits: set[Wait] = set()
        self.lock = threading.Lock()
        self.told_host = False  # this rank's pid is in the host's list (``Op.arrive``)
        self.dcp_group: Any = None  # async saves' DCP collectives, off the training's group (``dcp_group``)

    def current(self) -> bool:
        return self.pid == os.getpid() and dist_up() and self.group() is distributed_c10d._get_default_group()

    def check(self, step: int | None, what: str) -> None:
        """Raise ``AbortedError`` once this process left the world: nothing more is done in it."""
        if self.left is not None:
            where = "the newest step" if step is None else f"step {step}"
            raise AbortedError(
                f"{where}: abandoned during {what}, never committed: this process left its world "
                f"({self.left}); save again in the new world (load_latest first, on every rank)",
                step,
                what,
            )

    def client(self, timeout: float) -> dist.Store:
        """A client of the job's store (its prefixes kept) whose waits end after ``timeout``
        (the job's are 30 min), apart from the job's own: a wait holds its client, and
        ``leave_world`` wakes it through the job's. One per world and timeout, kept:
        connecting can stall for 5 s when connections open in quick succession (one in ~25
        here). A store that cannot be cloned (a FileStore, a HashStore) is used as it is."""
        if timeout not in self.clients:
            try:
                client = self.store.clone()
                client.set_timeout(datetime.timedelta(seconds=timeout))
            except Exception:  # noqa: BLE001 - no second client of this store: the job's own
                client = self.store
            self.clients[timeout] = client
        return self.clients[timeout]


_WORLD: World | None = None
_GENERATION = 0


def world() -> World:
    """This process's state for the current default process group, new for a new group."""
    global _WORLD, _GENERATION
    if _WORLD is None or not _WORLD.current():
        _GENERATION += 1
        _WORLD = World(distributed_c10d._get_default_group(), _GENERATION)
    return _WORLD


def current() -> World | None:
    """The current world, if this process is in one (none is made here)."""
    w = _WORLD
    return w if w is not None and w.current() else None


def generation() -> int:
    """Which world this process is in (0: none yet, or no process group)."""
    return world().generation if dist_up() else 0


def leave_world(why: str) -> None:
    """Leave the current world: every wait of this process on it ends now (its key set to
    ``LEFT``, which also ends that wait on the other ranks), every operation of it raises
    ``AbortedError`` at its next step, and the next call starts a new world even if the
    default group were the same object."""
    global _WORLD
    w, _WORLD = _WORLD, None
    if w is None:
        return
    with w.lock:
        w.left = why
        waits = list(w.waits)
    if waits:  # on a thread: a store that does not answer must not hold the caller
        threading.Thread(target=_wake, args=(w, waits, why), daemon=True, name="tiered-dcp-leave").start()


def _wake(w: World, waits: list[Wait], why: str) -> None:
    """Set each waited-for key that no rank set yet to the ``LEFT`` mark, through the job's
    client (each wait holds a client of its own)."""
    mark = LEFT + f"{w.rank}:{why}".encode()
    for wait in waits:
        with contextlib.suppress(Exception):  # a store that is gone ends the wait anyway
            w.store.compare_set(wait.key, b"", mark)


def waits_now() -> list[Wait]:
    """The waits of this process on other ranks of the current world, in progress."""
    w = _WORLD
    if w is None:
        return []
    with w.lock:
        return list(w.waits)


@renew_in_child
def _renew_in_child() -> None:
    """A forked child is in no world of its parent's and runs none of its saves."""
    global _WORLD, _WORK, _working
    _WORLD, _WORK, _working = None, threading.Condition(), 0


_WORK = threading.Condition()
_working = 0  # threads in a save's upload or commit (``working``): what ``abort`` waits for


@contextlib.contextmanager
def working() -> Iterator[None]:
    """A save's own work in progress (its upload, its commit): ``tiered_dcp.abort`` waits
    for it to end, not for a staged state a failed save's future still holds."""
    global _working
    with _WORK:
        _working += 1
    try:
        yield
    finally:
        with _WORK:
            _working -= 1
            _WORK.notify_all()


def wait_quiet(timeout: float) -> int:
    """Wait up to ``timeout`` seconds for every ``working`` block to end; how many have not."""
    deadline = time.monotonic() + timeout
    with _WORK:
        while _working and (left := deadline - time.monotonic()) > 0:
            _WORK.wait(left)
        return _working


def next_name(namespace: str, purpose: str) -> str:
    """A store prefix unique to this operation in this world and equal on every rank of it
    (same call order from the world's start)."""
    seq, key = world().seq, f"{namespace}/{purpose}"
    seq[key] = seq.get(key, 0) + 1
    return f"tiered_dcp/{key}/{seq[key]}"


def sweep(purpose: str) -> None:
    """Delete the keys this process left for ``purpose`` at its previous operation of it
    (every rank has left that one by the time it starts the next: a save's or a load's
    collective lies between): the store keeps one operation's keys per purpose."""
    w = world()
    for key in w.to_sweep.pop(purpose, []):
        w.store.delete_key(key)


def sweep_later(purpose: str, keys: Sequence[str]) -> None:
    """Keys this operation wrote in the store, deleted by the next ``sweep(purpose)``."""
    world().to_sweep.setdefault(purpose, []).extend(keys)


def store() -> dist.Store:
    """The job's store (the default group's, under all its prefixes): every key of ours."""
    return world().store


def rendezvous_store(timeout: float) -> dist.Store:
    """``World.client`` of the current world."""
    return world().client(timeout)


class Op:
    """One operation of a world (a save) and its keys in the job's store, under ``name``:
    every wait of it on other ranks goes through ``wait``, which ``leave_world`` ends. It
    keeps the world it began in: a thread still at work after its world was left never
    writes into the next world's store."""

    def __init__(self, namespace: str, purpose: str, step: int | None, timeout: float) -> None:
        sweep(purpose)  # the previous operation of it ended on every rank: nobody reads its keys
        self.world = world()
        self.name = next_name(namespace, purpose)
        self.purpose, self.step, self.timeout = purpose, step, timeout
        self.store = self.world.store

    def key(self, suffix: str) -> str:
        return f"{self.name}/{suffix}"

    def sweep_later(self, keys: Sequence[str]) -> None:
        """Keys of this operation, deleted when the next one of its purpose begins."""
        self.world.to_sweep.setdefault(self.purpose, []).extend(keys)

    def check(self, what: str) -> None:
        self.world.check(self.step, what)

    def wait(self, key: str, what: str, ranks: Sequence[int] = (), timeout: float | None = None) -> bytes:
        """``key``'s value once a rank set it, waiting up to ``timeout`` (default: the peer
        timeout; then the store's error). ``AbortedError`` when this process left the world
        meanwhile; ``PeerLostError`` when another rank did (its ``LEFT`` mark)."""
        self.check(what)
        w = self.world
        wait = Wait(key, tuple(ranks), what)
        with w.lock:
            w.waits.add(wait)
        try:
            seconds = self.timeout if timeout is None else timeout
            w.client(self.timeout).wait([key], datetime.timedelta(seconds=seconds))
        finally:
            with w.lock:
                w.waits.discard(wait)
        self.check(what)
        value = self.store.get(key)
        if value.startswith(LEFT):
            rank, _, why = value[len(LEFT) :].decode(errors="replace").partition(":")
            raise PeerLostError(
                f"step {self.step}: rank {rank} left the world ({why}) during {what}; this save "
                "is never committed: restart (the resume loads the newest committed step)",
                self.step,
                what,
                (int(rank),) if rank.isdigit() else (),
            )
        return value

    def arrive(self, what: str) -> None:
        """Wait until every rank of the world reached this point of the operation (a save's
        set-up, before DCP's first collective of it): a rank that never comes is waited for
        here, where ``leave_world`` ends the wait, and named when the timeout ends it."""
        w, count, done, who = self.world, self.key("count"), self.key("all"), self.key("who")
        self.sweep_later([count, done, who])
        if not w.told_host:
            self.store.append(_host_key(), f"{w.rank}:{os.getpid()},".encode())
            w.told_host = True
        self.store.append(who, f"{w.rank},".encode())
        if self.store.add(count, 1) == w.size:
            self.store.set(done, b"1")
        try:
            self.wait(done, what)
        except dist.DistStoreError as e:
            came = {int(r) for r in self.store.get(who).decode().split(",") if r.isdigit()}
            late = sorted(set(range(w.size)) - came)
            raise PeerLostError(
                f"step {self.step}: rank(s) {late} did not reach {what} within peer_timeout="
                f"{self.timeout:g} s (every rank must save the same steps); this save is never committed",
                self.step,
                what,
                tuple(late),
            ) from e


def _host_key() -> str:
    """The store key listing the world's processes on this host (in one pid namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot, ns = "", ""
    return f"tiered_dcp/hosts/{socket.gethostname()}/{boot}/{ns}"


def ranks_on_this_host(w: World) -> list[tuple[int, int]] | None:
    """The ranks of ``w`` that live on this host, with their pids (those that reached a
    save's first barrier); None when the store does not answer."""
    try:
        listed = w.store.get(_host_key()).decode().split(",") if w.store.check([_host_key()]) else []
    except Exception:  # noqa: BLE001 - the store is gone: nothing can be told from it
        return None
    found = []
    for entry in filter(None, listed):
        rank, _, pid = entry.partition(":")
        with contextlib.suppress(ValueError):
            found.append((int(rank), int(pid)))
    return found
