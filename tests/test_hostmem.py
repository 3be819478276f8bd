"""The memory guard: a configuration that cannot fit in host memory is refused before the
first byte is staged, with both numbers and what to change (real /proc/meminfo, real
/dev/shm)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_writer_process import full_disk  # noqa: F401  (a fixture: a real 1 MiB tmpfs)
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown
from tiered_dcp.save import host_memory
from tiered_dcp.save.staging import POOL

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

STATE_MIB = 8


@pytest.fixture
def shm():
    d = tempfile.mkdtemp(prefix="hostmem-", dir="/dev/shm")
    yield d
    shutdown()
    shutil.rmtree(d, ignore_errors=True)


def state() -> dict:
    return {"w": torch.randn(STATE_MIB << 18)}


def too_many_steps() -> int:
    """A keep whose steps of the state are more than this host's memory and /dev/shm hold in
    all: what is available or free now changes as other processes allocate and free."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    most = max(total, shutil.disk_usage("/dev/shm").total)
    return 2 * most // (STATE_MIB << 20)


def test_an_async_save_that_cannot_fit_is_refused_before_anything_is_staged(shm):
    cfg = TieredConfig("big", [Tier(f"{shm}/ram", keep=too_many_steps())])
    staged_before = POOL.info()["bytes"]
    with pytest.raises(ValueError) as info:
        dcp.async_save(state(), storage_writer=TieredWriter(cfg, step=1))
    msg = str(info.value)
    assert "cannot fit in this host's memory" in msg and "GiB available" in msg and "GiB free" in msg
    assert "Lower keep" in msg and f"{shm}/ram" in msg
    assert POOL.info()["bytes"] == staged_before  # nothing staged
    assert not os.path.exists(f"{shm}/ram/big")  # nothing written


def test_a_sync_save_that_cannot_fit_is_refused_and_one_that_fits_saves(shm):
    cfg = TieredConfig("big", [Tier(f"{shm}/ram", keep=too_many_steps())])
    with pytest.raises(CheckpointException, match="cannot fit in this host's memory"):
        dcp.save(state(), storage_writer=TieredWriter(cfg, step=1))
    assert not os.path.exists(f"{shm}/ram/big")
    fits = TieredConfig("fits", [Tier(f"{shm}/ram", keep=2)])
    dcp.save(state(), storage_writer=TieredWriter(fits, step=1))
    assert os.path.isdir(f"{shm}/ram/fits")


def test_what_a_configuration_holds(shm, tmp_path, monkeypatch):
    """Disk tiers are not counted; a node-local memory tier holds its clique's copies of keep
    steps plus the one being written, per local rank; dedup counts one step; staging is per
    slot; a namespace's files already there count as reusable."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    n = 1 << 20
    cfg = TieredConfig(
        "plan",
        [Tier(f"{shm}/ram/{{node}}", keep=2), Tier(str(tmp_path / "ssd" / "{node}"), keep=1)],
        replication_factor=2,
        replication_jump=4,
    )
    p = host_memory.plan(cfg, n, staging_copies=2)
    (ram,) = p.tiers
    assert (ram.index, ram.steps, ram.copies, ram.nbytes) == (0, 3, 2, n * 4 * 2 * 3)
    assert ram.mount == "/dev/shm" and p.staging == n * 2 * 4 and not p.shortfalls()
    dedup = TieredConfig("plan", [Tier(f"{shm}/ram", keep=2)], dedup=True)
    assert host_memory.plan(dedup, n, 0).tiers[0].steps == 1
    os.makedirs(f"{shm}/ram/0/plan/step_000000000001")
    with open(f"{shm}/ram/0/plan/step_000000000001/rank_00000.part", "wb") as f:
        f.write(b"x" * 4096)
    assert host_memory.plan(cfg, n, 0).tiers[0].held == 4096


def test_the_fastest_tier_on_a_full_tmpfs_is_refused_a_slower_one_is_not(tmp_path, full_disk):  # noqa: F811
    """A real 1 MiB tmpfs: the tier a save writes itself must fit in it; a slower tier on it
    is the writer process's to report (training goes on), and counts against memory only."""
    big = {"w": torch.randn(1 << 18)}  # 1 MiB: three steps of it do not fit
    first = TieredConfig("tiny", [Tier(str(full_disk), keep=2)])
    with pytest.raises(CheckpointException, match=f"{full_disk} needs 3.00 MiB|{full_disk} needs 0.00 GiB"):
        dcp.save(big, storage_writer=TieredWriter(first, step=1))
    slower = TieredConfig("tiny", [Tier(str(tmp_path / "ram"), keep=2), Tier(str(full_disk), keep=2)])
    p = host_memory.plan(slower, 1 << 20, 0, first=0)
    assert [t.written_here for t in p.tiers] == [False] and not p.shortfalls()


def test_host_memory_shows_each_memory_tier_and_the_staging(shm):
    """What the namespace holds in memory, per tier (steps and spare part files) and per
    rank in staging buffers, as ``host_memory`` returns it and ``tiered-dcp ls`` prints it."""
    import sys

    from tiered_dcp import host_memory

    n = STATE_MIB << 20
    gc.collect()  # a failed save of an earlier test holds its staging slot until collected
    POOL.close()
    into_tier = TieredConfig("held-tier", [Tier(f"{shm}/ram", keep=2)])
    for step in range(1, 5):
        dcp.async_save(state(), storage_writer=TieredWriter(into_tier, step=step)).result()
    mem = host_memory(into_tier)
    (tier,) = mem.tiers
    assert (tier.index, tier.path) == (0, f"{shm}/ram")
    assert 2 * n <= tier.steps < 2.1 * n  # the two kept steps
    assert tier.spares == n  # step 2's file, for the next save to stage into
    assert mem.staging == {0: 0}  # staged into the tier's files
    ls = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", "held-tier", f"{shm}/ram"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ls.returncode == 0, ls.stderr
    assert "host memory held on this node: 24.0 MiB" in ls.stdout, ls.stdout
    assert "16.0 MiB in steps, 8.0 MiB in spare files" in ls.stdout
    assert "rank 0's staging buffers: 0 B" in ls.stdout
    POOL.close()
    every_step = TieredConfig("held-all", [Tier(f"{shm}/all")])  # keep=None: reused buffers
    dcp.async_save(state(), storage_writer=TieredWriter(every_step, step=1)).result()
    assert host_memory(every_step).staging == {0: n}
