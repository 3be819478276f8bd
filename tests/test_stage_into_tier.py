"""Async saves to a RAM tier in /dev/shm stage straight into the step's part file there.

The staged copy is the tier's copy (host memory at the floor: the kept steps plus the one
being written), and a part file retention drops is recycled as a later save's staging
target. What must hold: every step loads exactly, also after its file was recycled, in
THREAD and PROCESS modes, with background staging, on several ranks with holes in the file
(items another rank writes) and replicas; a save killed mid-staging leaves the kept steps
loadable and the next save works; the memory /dev/shm holds stays near the floor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import preloaded
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import live_files, settle
from dist_utils import run_ranks
from tiered_dcp.storage.format import part_key, read_index, step_dir
from tiered_dcp.storage.local import LocalStorage
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, latest_step, status
from tiered_dcp.ops.verify import verify_step
from tiered_dcp.save.staging import POOL

MiB = 1 << 20


def _state(seed: int, mib: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(mib * MiB // 4, generator=g),
        "h": torch.randn(333, generator=g).to(torch.bfloat16),  # odd size: the layout has no padding
        "i": torch.arange(5, dtype=torch.int64) + seed,
        "meta": {"step": seed, "name": f"s{seed}"},
    }


def _zeros(mib: int = 2) -> dict:
    return {
        "w": torch.zeros(mib * MiB // 4),
        "h": torch.zeros(333, dtype=torch.bfloat16),
        "i": torch.zeros(5, dtype=torch.int64),
        "meta": {"step": 0, "name": ""},
    }


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("w", "h", "i")) and a["meta"] == b["meta"]


def _part(cfg: TieredConfig, step: int, rank: int = 0, tier: int = 0) -> Path:
    return Path(cfg.tiers[tier].root(0, rank)) / part_key(cfg.namespace, step, rank)


def _used(path: Path) -> int:
    return sum(st.st_size for st in live_files(path).values())


def _save_change_load(cfg: TieredConfig, steps: range, kind, background: bool) -> list[str]:
    """Save each step async, change the state right after staging, load every step back."""
    problems = []
    for step in steps:
        state = _state(step)
        expected = _state(step)
        writer = TieredWriter(cfg, step=step, background_staging=background)
        resp = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind)
        if background:
            resp.staging_completion.result()
        state["w"].add_(1.0)  # the next training step, in place
        state["meta"]["step"] = -1
        (resp.upload_completion if background else resp).result()
        for s in (step - 1, step):  # the step before it too: it may have been staged into a recycled file
            if s < steps.start:
                continue
            target = _zeros()
            dcp.load(target, storage_reader=TieredReader(cfg, step=s))
            if not _equal(target, _state(s) if s != step else expected):
                problems.append(f"step {s} after saving {step}")
    return problems


def _recycled(rank: int, world: int, shm: str, ssd: str, mode: str) -> list[str]:
    cfg = TieredConfig(f"rec-{mode}", [Tier(f"{shm}/ram", keep=2), Tier(ssd, every=3)])
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    inodes: dict[int, int] = {}
    problems = []
    for step in range(1, 8):
        problems += _save_change_load(cfg, range(step, step + 1), kind, mode.startswith("background"))
        part = _part(cfg, step)
        inodes[step] = part.stat().st_ino
        index = read_index(LocalStorage(cfg.tiers[0].root(0, 0)), cfg.namespace, step, 0, 1 << 30)
        if part.stat().st_size != index.size:  # exactly its records: no stale tail, no gap
            problems.append(f"step {step}: part of {part.stat().st_size} bytes, index says {index.size}")
    # retention dropped steps 1.. and their files were staged into again (same inode, new step)
    if len(set(inodes.values())) == len(inodes):
        problems.append(f"no part file was recycled: {inodes}")
    settle(cfg)
    for step in (6, 7):
        target = _zeros()
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        if not _equal(target, _state(step)):
            problems.append(f"step {step} at the end")
    if list(Path(shm, "ram").rglob("*.dirty-*")):
        problems.append("a staged file was left dirty")
    problems += [p for check in verify_step(cfg, 7) for p in check.problems]
    return problems


@pytest.mark.parametrize("mode", ["thread", "process", "background-thread"])
def test_steps_load_exactly_from_recycled_part_files(tmp_path, shm, mode):
    (problems,) = run_ranks(_recycled, 1, str(shm), str(tmp_path / "ssd"), mode, timeout=240)
    assert problems == []


def test_ram_tier_holds_the_kept_steps_and_the_one_being_written(shm, tmp_path):
    """Memory at the floor: /dev/shm holds at most keep + 1 steps (+ a spare), and no
    staging buffer of its own (the pool's shared-memory bytes stay 0)."""
    cfg = TieredConfig("floor", [Tier(str(shm / "ram"), keep=2)])
    peak = 0
    for step in range(1, 7):
        f = dcp.async_save(_state(step, mib=4), storage_writer=TieredWriter(cfg, step=step))
        peak = max(peak, _used(shm))
        f.result()
        peak = max(peak, _used(shm))
        assert POOL.info()["bytes"] == 0, "a staging buffer beside the tier's file"
    assert peak <= 3.1 * 4 * MiB, f"{peak / MiB:.1f} MiB in /dev/shm for 4 MiB steps, keep=2"


def test_a_ram_tier_that_keeps_every_step_stages_into_reused_buffers(shm):
    """keep=None: no part file is ever a spare, so a save staging into its step's file would
    copy into fresh pages every time (a cold stall); such saves stage into the pool's reused
    buffers instead, and the tier gets its copy from them."""
    POOL.close()
    cfg = TieredConfig("keepall", [Tier(str(shm / "ram"))])
    for step in (1, 2, 3):
        dcp.async_save(_state(step), storage_writer=TieredWriter(cfg, step=step)).result()
        assert POOL.info()["files"] == 0 and POOL.info()["bytes"] > 0
    for step in (1, 2, 3):
        target = _zeros()
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        assert _equal(target, _state(step))
    POOL.close()


def test_a_mapped_part_file_deleted_behind_a_newer_one_is_let_go(shm, tmp_path):
    """Retention deletes a spare nobody claimed while its slot is still mapped here; the next
    save that needs other buffers lets that slot go. Slots were compared field by field,
    tensors included, so letting go of one behind another of the same layout failed that
    save ("Boolean value of Tensor ... is ambiguous"; seen on a GPU machine first)."""
    import shutil

    from tiered_dcp.storage.format import spare_dir

    POOL.close()
    cfg = TieredConfig("s", [Tier(str(shm), keep=1)])
    for step in (1, 2):  # two part files mapped, step 1's a spare once step 2 committed
        dcp.async_save(_state(step), storage_writer=TieredWriter(cfg, step=step)).result()
    assert POOL.info()["files"] == 2
    shutil.rmtree(shm / spare_dir("s"))  # the older file deleted under its map
    other = TieredConfig("d", [Tier(str(tmp_path / "disk"))])  # staged into shared memory
    dcp.async_save(_state(3), storage_writer=TieredWriter(other, step=3)).result()
    assert POOL.info()["files"] == 1
    target = _zeros()
    dcp.load(target, storage_reader=TieredReader(other, step=3))
    assert _equal(target, _state(3))
    POOL.close()


def _holes(rank: int, world: int, root: str) -> list[str]:
    """Two ranks; a replicated tensor DCP has only one rank write (a hole in the other's
    file), a tensor of each rank's own, and Python values (byte items, appended)."""
    cfg = TieredConfig("holes", [Tier(f"{root}/ram/{{node}}", keep=2)], replication_factor=2)
    problems = []
    for step in range(1, 6):
        state = {
            "shared": torch.full((3 * MiB // 4,), float(step)),  # the same on both ranks
            f"own{rank}": torch.full((MiB // 4,), float(step * 10 + rank)),
            "meta": {"step": step},  # the same on both ranks (DCP saves one)
        }
        expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}
        f = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step))
        state["shared"].add_(100)
        f.result()
        target = {
            "shared": torch.zeros(3 * MiB // 4),
            f"own{rank}": torch.zeros(MiB // 4),
            "meta": {"step": 0},
        }
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        if not (
            torch.equal(target["shared"], expected["shared"])
            and torch.equal(target[f"own{rank}"], expected[f"own{rank}"])
            and target["meta"] == expected["meta"]
        ):
            problems.append(f"rank {rank} step {step}")
        size = _part(cfg, step, rank).stat().st_size  # one rank's file had a hole, now closed
        if not (POOL.info()["files"] and (size < 2 * MiB) == (rank != writes_shared(cfg, step))):
            problems.append(f"rank {rank} step {step}: a part of {size} bytes, not staged in place")
    dist.barrier()
    return problems


def writes_shared(cfg: TieredConfig, step: int) -> int:
    """The rank whose part holds the replicated tensor (DCP's plan picks one)."""
    store = LocalStorage(cfg.tiers[0].root(0, 0))
    for rank in (0, 1):
        index = read_index(store, cfg.namespace, step, rank, 1 << 30)
        if any(key.fqn == "shared" for key in index.records):
            return rank
    return -1


def test_holes_and_replicas_on_two_ranks(tmp_path, shm):
    problems = run_ranks(_holes, 2, str(shm), env={"LOCAL_WORLD_SIZE": 1}, timeout=240)
    assert problems == [[], []]


_KILLED_TRAINER = textwrap.dedent(
    """
    import sys, torch, torch.distributed.checkpoint as dcp
    from tiered_dcp import Tier, TieredConfig, TieredWriter
    cfg = TieredConfig("killed", [Tier(sys.argv[1], keep=2)])
    state = {"w": torch.randn(96 << 20 >> 2)}
    print("staging", flush=True)
    dcp.async_save(state, storage_writer=TieredWriter(cfg, step=int(sys.argv[2]))).result()
    print("done", flush=True)
    """
)


def test_sigkill_mid_staging_leaves_the_kept_steps_loadable(shm):
    cfg = TieredConfig("killed", [Tier(str(shm / "ram"), keep=2)])
    for step in (1, 2):
        dcp.async_save(_state(step), storage_writer=TieredWriter(cfg, step=step)).result()
    POOL.close()
    proc = preloaded.Popen(
        [sys.executable, "-c", _KILLED_TRAINER, str(shm / "ram"), "3"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "staging"
    deadline = time.monotonic() + 60
    sdir = shm / "ram" / step_dir("killed", 3)
    while not list(sdir.glob("*.dirty-*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest_step(cfg) == 2
    for step in (1, 2):
        target = _zeros()
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        assert _equal(target, _state(step))
    # the next job saves on: the killed save's leftovers go with its step directory
    for step in (3, 4, 5):
        dcp.async_save(_state(step), storage_writer=TieredWriter(cfg, step=step)).result()
    assert latest_step(cfg) == 5
    assert not sdir.exists() or not list(sdir.glob("*.dirty-*"))
    assert [r.step for r in status(cfg) if r.state == "committed"] == [4, 5]


def test_a_symlink_among_the_spares_is_never_written_through(shm, tmp_path):
    """Whoever can write the tier leaves a link to a file outside it among the spares: the
    save that claims it stages into a file of its own, and the outside file is untouched."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious" * 1000)
    cfg = TieredConfig("links", [Tier(str(shm / "ram"), keep=2)])
    spares = shm / "ram" / "links" / "spare"
    spares.mkdir(parents=True)
    (spares / "12345").symlink_to(outside)
    POOL.close()
    dcp.async_save(_state(1), storage_writer=TieredWriter(cfg, step=1)).result()
    assert outside.read_bytes() == b"precious" * 1000
    assert not _part(cfg, 1).is_symlink()
    target = _zeros()
    dcp.load(target, storage_reader=TieredReader(cfg, step=1))
    assert _equal(target, _state(1))
    POOL.close()
