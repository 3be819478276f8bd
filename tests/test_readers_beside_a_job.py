"""Readers beside a running job: leases keep the step being read, dead readers free it, and a
failed save leaves nothing behind. Real processes, real files, a real full tmpfs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_writer_process import full_disk, small_state  # noqa: F401  (full_disk: a fixture)
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredReader, TieredWriter, status
from tiered_dcp.steps.leases import HOST, owner_alive

JOB = """
import sys, torch, torch.distributed.checkpoint as dcp
from tiered_dcp import Tier, TieredConfig, TieredWriter
root, steps = sys.argv[1], int(sys.argv[2])
cfg = TieredConfig("job", [Tier(root, keep=1)])
for step in range(1, steps + 1):
    # every value says which step it belongs to: a torn load would mix them
    sd = {"a": torch.full((64, 1024), float(step)), "b": torch.full((3, 7), float(step)), "step": step}
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))
"""


def job_config(root) -> TieredConfig:
    return TieredConfig("job", [Tier(str(root), keep=1)])


def load_newest(cfg: TieredConfig) -> int:
    target = {"a": torch.zeros(64, 1024), "b": torch.zeros(3, 7), "step": -1}
    reader = TieredReader(cfg, no_dist=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert target["step"] == reader.step
    assert torch.all(target["a"] == reader.step) and torch.all(target["b"] == reader.step), reader.step
    return reader.step


def test_every_load_beside_a_job_with_keep_1_succeeds_and_is_one_step(tmp_path):
    root = tmp_path / "ram"
    job = preloaded.Popen([sys.executable, "-c", JOB, str(root), "100"])
    cfg = job_config(root)
    seen = []
    try:
        while job.poll() is None:
            try:
                seen.append(load_newest(cfg))
            except NoCheckpointError:
                assert not seen  # only before the first step is committed
                time.sleep(0.01)
    finally:
        job.wait(timeout=120)
    assert job.returncode == 0
    seen.append(load_newest(cfg))
    assert seen[-1] == 100 and len(seen) >= 10, seen
    assert seen == sorted(seen)  # each load took the newest step at its time
    # the readers left no lease, and at most the one step a reader held at the job's last
    # commit (it goes at the tier's next commit; there is none)
    left = sorted(os.listdir(root / "job"))
    assert left in (["step_000000000100"], ["step_000000000099", "step_000000000100"]), left
    assert not [n for d in left for n in os.listdir(root / "job" / d) if n.startswith("lease.")]


def save(cfg: TieredConfig, step: int) -> None:
    sd = {"a": torch.full((64, 1024), float(step)), "b": torch.full((3, 7), float(step)), "step": step}
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))


def steps_on_disk(root) -> list[int]:
    return sorted(int(n.removeprefix("step_")) for n in os.listdir(root / "job"))


def test_a_leased_step_outlives_retention_until_the_read_is_done(tmp_path):
    cfg = job_config(tmp_path / "ram")
    save(cfg, 1)
    reader = TieredReader(cfg, no_dist=True)  # holds a lease on step 1 from here on
    save(cfg, 2)
    save(cfg, 3)
    assert steps_on_disk(tmp_path / "ram") == [1, 3]  # keep=1, plus the step being read
    target = {"a": torch.zeros(64, 1024), "b": torch.zeros(3, 7), "step": -1}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert target["step"] == 1 and torch.all(target["a"] == 1)
    save(cfg, 4)  # the lease was released when the load ended: step 1 goes at the next commit
    assert steps_on_disk(tmp_path / "ram") == [4]


def test_a_lease_written_as_retention_removes_its_step_is_no_lease(tmp_path, monkeypatch):
    """The reader saw step 2's marker; retention then removed the step (no lease there yet)
    just as the lease's file was being made in its directory: the write fails, and the
    reader chooses again (step 1). Before, a failed lease write counted as a read-only tier
    (no lease, read on), and the load failed on the step deleted under it ("removed from
    every tier holding it while it was opened")."""
    from tiered_dcp.storage.local import LocalStorage

    from tiered_dcp.steps.catalog import TierView
    from tiered_dcp.steps.retention import drop

    cfg = TieredConfig("job", [Tier(str(tmp_path / "ram"), keep=2)])
    save(cfg, 1)
    save(cfg, 2)
    make_dir, raced = LocalStorage.make_dir, []

    def removed_meanwhile(self, key: str) -> int:
        fd = make_dir(self, key)  # the lease's directory is open: retention takes the step now
        if key.endswith("step_000000000002") and not raced:
            raced.append(drop(TierView(cfg, 0, 0, 0), 2))
        return fd

    monkeypatch.setattr(LocalStorage, "make_dir", removed_meanwhile)
    assert load_newest(cfg) == 1
    assert raced == [True] and steps_on_disk(tmp_path / "ram") == [1]
    assert not [n for n in os.listdir(tmp_path / "ram/job/step_000000000001") if n.startswith("lease.")]


READER = """
import os, signal, sys
from tiered_dcp import Tier, TieredConfig, TieredReader
reader = TieredReader(TieredConfig("job", [Tier(sys.argv[1], keep=1)]), no_dist=True)
print(reader.step, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies holding its lease
"""


def test_a_reader_killed_mid_read_does_not_hold_retention(tmp_path):
    cfg = job_config(tmp_path / "ram")
    save(cfg, 1)
    r = preloaded.run([sys.executable, "-c", READER, str(tmp_path / "ram")], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL and r.stdout.strip() == "1", r.stderr
    sdir = tmp_path / "ram/job/step_000000000001"
    assert [n for n in os.listdir(sdir) if n.startswith("lease.")]  # its lease is still there
    save(cfg, 2)  # its pid is gone: the lease is dead, and retention removes the step at once
    assert steps_on_disk(tmp_path / "ram") == [2]


def test_lease_owners_elsewhere_hold_until_their_expiry():
    now = time.time()
    elsewhere = {"host": HOST + "-other", "pid": 1}
    assert owner_alive(json.dumps({**elsewhere, "expires": now + 60}).encode())
    assert not owner_alive(json.dumps({**elsewhere, "expires": now - 1}).encode())
    assert not owner_alive(json.dumps({"host": HOST, "pid": 2**22 + 12345, "expires": now + 60}).encode())
    assert owner_alive(json.dumps({"host": HOST, "pid": os.getpid(), "expires": now - 1}).encode())
    assert owner_alive(b"")  # a pin from before owners were recorded: kept, as it was


def test_a_save_that_fills_a_real_tmpfs_leaves_nothing_after_the_next_commit(tmp_path, full_disk):  # noqa: F811
    # the RAM tier is a real 1 MiB tmpfs; a slower tier makes the save write pins first
    cfg = TieredConfig("job", [Tier(str(full_disk), keep=2), Tier(str(tmp_path / "ssd"))])
    quarter = lambda step: {"w": torch.full((1 << 16,), float(step))}  # noqa: E731  (256 KiB)
    dcp.save(quarter(1), storage_writer=TieredWriter(cfg, step=1))
    filler = full_disk / "filler"  # something else fills the tmpfs after the memory guard passed,
    with open(filler, "wb") as f, contextlib.suppress(OSError):  # but for 128 KiB: room for pins,
        while True:  # not for the part
            f.write(bytes(64 << 10))
            f.flush()
    os.truncate(filler, os.path.getsize(filler) - (128 << 10))
    with pytest.raises(CheckpointException, match="No space left"):
        dcp.save(quarter(2), storage_writer=TieredWriter(cfg, step=2))
    filler.unlink()
    rows = {(r.tier_index, r.step): r for r in status(cfg)}
    assert rows[(0, 2)].state == "failed" and "No space left" in rows[(0, 2)].error, rows
    names = os.listdir(full_disk / "job/step_000000000002")
    assert not [n for n in names if n.startswith(("pin.", "rank_"))], names  # part and pins gone already
    dcp.save(quarter(3), storage_writer=TieredWriter(cfg, step=3))
    assert steps_on_disk(full_disk) == [1, 3]  # the failed step's directory is gone
    assert (0, 2) not in {(r.tier_index, r.step) for r in status(cfg)}
