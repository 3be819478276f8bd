"""Host memory: what a configuration will hold in RAM, what the host has, and the guard.

A RAM tier (a directory on tmpfs or ramfs, such as ``/dev/shm``) and the staging copies
of async saves live in the host's memory. A configuration that cannot fit is not found
out until the kernel's OOM killer ends the job, often an hour in, when retention first
holds ``keep`` steps plus the one being written; ``guard`` compares the two numbers
before the first byte of the first save is staged and refuses with both of them.

Per node, a memory tier holds each local rank's part (and its clique peers' replicas on a
node-local tier) of ``keep`` steps plus the one being written; every local rank is
assumed to hold as much as this one (the ranks of a sharded model do, to a few percent).
Dedup makes the kept steps share their unchanged blocks, so with ``dedup=True`` only one
step is counted (the least a tier holds). A tier with ``keep=None`` grows by a step per
save and is counted as one; a warning says so.

A RAM tier that saves stage into holds no more than that even when a slower tier lags
(``TieredConfig.on_lagging_tier``: its retention passes over the copy's pin, or the save
waits for it), and the part files prepared ahead of the saves (``staging``) make up, with
the tier's own, those ``keep + 1`` steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from tiered_dcp.storage.format import spare_dir
from tiered_dcp.storage.local import MEMORY_FS, mount_of

from ..config import TieredConfig, here
from ..steps.placement import placement_for
from ..writer_process.timings import Kind, read_records

log = logging.getLogger(__name__)

GiB = 1 << 30


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def held_bytes(path: str) -> int:
    """What the files under ``path`` hold (a namespace's kept steps, reused as they are replaced)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):  # removed since the listing
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


@dataclass(frozen=True)
class TierHold:
    """What one memory tier will hold on this node at most (a step more than it keeps)."""

    index: int
    path: str  # this node's root
    mount: str
    steps: int  # kept steps plus the one being written
    copies: int  # parts per rank in this root: 1, or the clique's on a node-local tier
    nbytes: int
    held: int  # what the namespace holds there already (replaced step by step)
    written_here: bool  # the save writes it itself (a slower tier is the writer process's)


@dataclass(frozen=True)
class MemoryPlan:
    """What a configuration will hold in this node's memory, beside what the host has."""

    state: int  # this rank's bytes per save
    local_ranks: int
    tiers: list[TierHold]
    staging: int  # the async saves' staged copies, all local ranks
    staging_mount: str  # where they live (torch's shared memory)
    available: int | None  # MemAvailable
    free: dict[str, int]  # mount -> free bytes of each memory file system involved
    reused: int  # staging this process holds already (its buffers are reused)

    def shortfalls(self) -> list[str]:
        """What does not fit, one sentence each (empty when everything does)."""
        out = []
        for mount, free in self.free.items():
            need = sum(t.nbytes for t in self.tiers if t.mount == mount and t.written_here)
            if mount == self.staging_mount:
                need += self.staging
            have = free + sum(t.held for t in self.tiers if t.mount == mount) + self._reused(mount)
            if need > have:
                out.append(f"{mount} needs {_gib(need)} and has {_gib(have)} free")
        if self.available is not None:
            need = sum(t.nbytes for t in self.tiers) + self.staging
            have = self.available + sum(t.held for t in self.tiers) + self.reused
            if need > have:
                out.append(f"the host needs {_gib(need)} of memory and has {_gib(have)} available")
        return out

    def _reused(self, mount: str) -> int:
        return self.reused if mount == self.staging_mount else 0

    def describe(self) -> str:
        parts = [
            f"tier {t.index} ({t.path}): {_gib(self.state)} x {self.local_ranks} local rank(s)"
            f"{f' x {t.copies} copies' if t.copies > 1 else ''} x {t.steps} step(s) = {_gib(t.nbytes)}"
            for t in self.tiers
        ]
        if self.staging:
            parts.append(f"staging of async saves: {_gib(self.staging)}")
        return "; ".join(parts)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def memory_roots(config: TieredConfig) -> list[tuple[int, str, str]]:
    """(index, this process's root, mount point) of each tier of ``config`` in this host's memory."""
    node, rank = here()
    out = []
    for i, tier in enumerate(config.tiers):
        if tier.is_local_fs:
            root = tier.root(node, rank).removeprefix("file://")
            mount, fstype = mount_of(root)
            if fstype in MEMORY_FS:
                out.append((i, root, mount))
    return out


@dataclass(frozen=True)
class TierMemory:
    """What a namespace's files on one memory tier hold now."""

    index: int
    path: str  # this process's root
    steps: int  # bytes of its steps (parts, indexes, markers, dedup blocks)
    spares: int  # bytes of dropped steps' part files, kept for the next saves to stage into


@dataclass(frozen=True)
class HostMemory:
    """The host memory a namespace holds on this node: its files on each memory tier, and
    each rank's staging buffers (from the newest save each recorded, ``records``)."""

    tiers: list[TierMemory]
    staging: dict[int, int]  # rank -> bytes

    @property
    def total(self) -> int:
        return sum(t.steps + t.spares for t in self.tiers) + sum(self.staging.values())


def held(config: TieredConfig) -> HostMemory:
    """What ``config``'s namespace holds in this node's memory now."""
    tiers = []
    for i, root, _ in memory_roots(config):
        ns_dir = os.path.join(root, config.namespace)
        spares = held_bytes(os.path.join(root, spare_dir(config.namespace)))
        tiers.append(TierMemory(i, root, held_bytes(ns_dir) - spares, spares))
    staging = {}
    for r in read_records(config, Kind.SAVE, tail_bytes=1 << 16):  # this node's; the newest wins
        if r.staged is not None:
            staging[r.rank] = r.staged
    return HostMemory(tiers, dict(sorted(staging.items())))


def plan(
    config: TieredConfig, state_bytes: int, staging_copies: int, first: int = 0, reused: int = 0
) -> MemoryPlan:
    """What ``config`` will hold in this node's memory for saves of ``state_bytes`` per rank,
    with ``staging_copies`` staged copies per rank (0 for a sync save); ``first``: the tier
    the save writes itself."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    tiers = []
    for i, root, mount in memory_roots(config):
        tier = config.tiers[i]
        if tier.keep is None:
            log.warning(
                "tier %s is in memory (on %s) and keeps every step (keep=None): it grows by a step "
                "per save until the host runs out; give it a keep",
                tier.path,
                mount,
            )
        steps = 1 if config.dedup or tier.keep is None else tier.keep + 1
        copies = placement_for(tier).copies(config.replication_factor)  # with its clique peers' replicas
        ns_dir = os.path.join(root, config.namespace)
        held = held_bytes(ns_dir) if os.path.isdir(ns_dir) else 0
        nbytes = state_bytes * local * copies * steps
        tiers.append(TierHold(i, root, mount, steps, copies, nbytes, held, i == first))
    shm, _ = mount_of("/dev/shm") if os.path.isdir("/dev/shm") else ("", "")
    mounts = {t.mount for t in tiers} | ({shm} if staging_copies and shm else set())
    return MemoryPlan(
        state=state_bytes,
        local_ranks=local,
        tiers=tiers,
        staging=state_bytes * staging_copies * local,
        staging_mount=shm,
        available=mem_available(),
        free={m: free_bytes(m) for m in sorted(mounts) if m},
        reused=reused,
    )


_GUARDED: set[tuple[str, int, int, int]] = set()


def guard(config: TieredConfig, state_bytes: int, staging_copies: int, first: int, reused: int = 0) -> None:
    """Refuse (``ValueError``) a save whose configuration cannot fit in this host's memory.

    Every memory tier counts against ``MemAvailable``; a tmpfs's free space is checked for
    the tier the save writes itself (``first``): a slower tier that fills up is the writer
    process's to report while training goes on. Once per process, namespace, state size and
    staging; the numbers and what to change are in the message."""
    key = (config.namespace, state_bytes, staging_copies, first)
    if key in _GUARDED:
        return
    p = plan(config, state_bytes, staging_copies, first, reused)
    short = p.shortfalls()
    if short:
        raise ValueError(
            f"TieredConfig {config.namespace!r} cannot fit in this host's memory: "
            f"{'; '.join(short)}. It would hold {p.describe()}. Lower keep on the memory "
            "tier, save to it less often (a larger every, with a disk tier every step), move "
            "it to a disk tier, turn on dedup=True if much of the state does not change, or "
            "lower TieredWriter(staging_slots=...)"
        )
    _GUARDED.add(key)
