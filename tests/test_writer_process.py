"""The writer process: it outlives its trainer, survives its own death, reports failures,
keeps up (or makes the save wait) and never drops a committed step. Real processes,
real signals, a real full disk."""

import os
import signal
import subprocess
import sys
import time

import preloaded
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import trainer_worker
from conftest import settle
from dist_utils import run_ranks
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tiered_dcp import (
    Tier,
    TieredCheckpointError,
    TieredConfig,
    TieredReader,
    TieredWriter,
    shutdown,
    status,
    wait_for,
    writer_status,
)
from tiered_dcp.save.staging import POOL
from tiered_dcp.save.writer import writer_handle
from tiered_dcp.writer_process.process import KEEP_RESULTS
from tiered_dcp.writer_process.run_dir import Job, Outcome, OutcomeState, RunDir

HERE = os.path.dirname(__file__)
MiB = 1 << 20


def small_state(step: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.arange(7) * step, "step": step}


def load_exact(cfg: TieredConfig, step: int, expected: dict) -> None:
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else -1 for k, v in expected.items()}
    reader = TieredReader(cfg, step=step)
    dcp.load(target, storage_reader=reader)
    for k, v in expected.items():
        assert torch.equal(target[k], v) if torch.is_tensor(v) else target[k] == v, k


def only(cfg: TieredConfig, index: int) -> TieredConfig:
    """The same job seen through one of its tiers alone."""
    return TieredConfig(cfg.namespace, [cfg.tiers[index]])


def writer_pids(cfg: TieredConfig) -> list[int]:
    """Live processes running a writer for ``cfg`` (found by their command line)."""
    needle = str(RunDir.of(cfg, 0).path.parent).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if b"tiered_dcp.writer_process.process" in cmd and needle in cmd and not zombie:
                pids.append(int(entry))
    return pids


def run_trainer(mode: str, root: str) -> subprocess.CompletedProcess:
    return preloaded.run(
        [sys.executable, os.path.join(HERE, "trainer_worker.py"), mode, root],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_trainer_killed_after_save_writer_finishes_then_exits(tmp_path):
    root = str(tmp_path)
    cfg = trainer_worker.config(root)
    r = run_trainer("kill-after-save", root)
    assert r.returncode == -signal.SIGKILL, r.stderr
    wait_for(cfg, 1, tier=1, timeout=120)  # the SSD copy, written after the trainer died
    deadline = time.monotonic() + 30
    while writer_pids(cfg) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert writer_pids(cfg) == [], "the writer lingers after its trainer died and its queue emptied"
    load_exact(only(cfg, 1), 1, trainer_worker.state(1))


@pytest.mark.parametrize("mode", ["sigterm", "sigterm-chain"])
def test_sigterm_finishes_the_async_save_in_flight(tmp_path, mode):
    root = str(tmp_path)
    cfg = trainer_worker.config(root)
    r = run_trainer(mode, root)
    assert "in flight: 1" in r.stdout and "not reached" not in r.stdout, r.stdout + r.stderr
    if mode == "sigterm":
        assert r.returncode == -signal.SIGTERM  # ended as SIGTERM would have ended it
    else:
        assert r.returncode == 3  # the user's own handler ran, after the save finished
        assert (tmp_path / "user_handler").read_text() == "latest=2 in_flight=0"
    assert 2 in {s.step for s in status(only(cfg, 0)) if s.state == "committed"}
    wait_for(cfg, 2, timeout=120)
    for tier in (0, 1):
        load_exact(only(cfg, tier), 2, trainer_worker.state(2))


def test_writer_killed_between_saves_is_replaced(tmp_path, caplog, monkeypatch):
    cfg = TieredConfig("wk", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    dcp.save(small_state(1), storage_writer=TieredWriter(cfg, step=1))
    settle(cfg)
    (w,) = writer_status(cfg)
    os.kill(w.pid, signal.SIGKILL)
    # the next writer starts throttled (4 MiB take it 8 s), so it is killed in the middle of
    # copying step 2: its step directory there is made when the copy begins
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "0.5")
    while writer_status(cfg)[0].running:
        time.sleep(0.05)
    dcp.save(small_state(2), storage_writer=TieredWriter(cfg, step=2))
    assert any("died" in r.getMessage() for r in caplog.records)
    while not (tmp_path / "ssd/wk/step_000000000002").exists():
        time.sleep(0.05)
    (w,) = writer_status(cfg)
    assert w.queue == [(2, 1)]
    os.kill(w.pid, signal.SIGKILL)  # mid-copy, step 2 still queued
    monkeypatch.delenv("TIERED_DCP_WRITER_MBPS")
    while writer_status(cfg)[0].running:
        time.sleep(0.05)
    dcp.save(small_state(3), storage_writer=TieredWriter(cfg, step=3))
    for step in (1, 2, 3):  # the new writer resumed step 2, then wrote step 3
        wait_for(cfg, step, timeout=60)
        load_exact(only(cfg, 1), step, small_state(step))


def test_ten_quick_async_saves_keep_three_everywhere(tmp_path):
    cfg = TieredConfig(
        "ten",
        [
            Tier(str(tmp_path / "ram"), keep=3),
            Tier(str(tmp_path / "ssd"), keep=3),
            Tier(str(tmp_path / "bucket"), keep=3, shared=True, compression="zstd"),
        ],
    )
    sd = small_state(0)
    fut = None
    saved = {}
    for step in range(1, 11):
        if fut is not None:
            fut.result()  # the usual loop: the previous save is done before the next starts
        sd["w"].add_(1.0)  # training changes the state between saves
        sd["step"] = step
        saved[step] = {"w": sd["w"].clone(), "b": sd["b"], "step": step}
        fut = dcp.async_save(sd, storage_writer=TieredWriter(cfg, step=step))
    fut.result()
    settle(cfg)
    held = {}
    for row in status(cfg):
        assert row.state == "committed", row
        held.setdefault(row.tier_index, []).append(row.step)
    assert held == {0: [8, 9, 10], 1: [8, 9, 10], 2: [8, 9, 10]}
    for step in (8, 9, 10):
        for tier in range(3):
            load_exact(only(cfg, tier), step, saved[step])
    assert POOL.info()["slots"] <= 2


def test_writer_behind_makes_the_save_wait_and_drops_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "20")  # 4 MiB take ~0.2 s per step
    cfg = TieredConfig("behind", [Tier(str(tmp_path / "ram"), keep=1), Tier(str(tmp_path / "ssd"))])
    waited = 0.0
    for step in range(1, 7):
        writer = TieredWriter(cfg, step=step, max_pending=1)
        dcp.async_save(small_state(step), storage_writer=writer).result()
        waited += writer.handoff_wait
    assert waited > 0.1  # the saves waited for the writer instead of queueing without bound
    assert any("behind" in r.getMessage() for r in caplog.records)
    settle(cfg)
    for step in range(1, 7):  # every step reached the slow tier
        load_exact(only(cfg, 1), step, small_state(step))
    assert [r.step for r in status(only(cfg, 0))] == [6]  # and RAM kept only keep=1


@pytest.fixture
def full_disk(tmp_path):
    """A real 1 MiB tmpfs: a tier on it fills up. Needs root (mount)."""
    path = tmp_path / "tiny"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield path
    subprocess.run(["umount", "-l", str(path)])


def test_full_slow_tier_is_reported_and_training_goes_on(tmp_path, full_disk, caplog):
    cfg = TieredConfig("full", [Tier(str(tmp_path / "ram"), keep=2), Tier(str(full_disk), keep=2)])
    for step in range(1, 4):
        t0 = time.perf_counter()
        dcp.save(small_state(step), storage_writer=TieredWriter(cfg, step=step))
        assert time.perf_counter() - t0 < 30  # the save did not hang on the broken tier
        # its verdict before the next save: a writer slower than the saves would skip the
        # older queued steps of a failing tier, or find them gone from the RAM tier's window
        with pytest.raises(TieredCheckpointError, match="No space left"):
            wait_for(cfg, step, tier=1, timeout=30)
    settle(cfg)
    rows = {(r.tier_index, r.step): r for r in status(cfg)}
    assert [s for (t, s), r in rows.items() if t == 0 and r.state == "committed"] == [2, 3]
    slow = [rows[(1, s)] for s in (1, 2, 3)]
    assert all(r.state == "failed" and "No space left" in r.error for r in slow), slow
    assert not list(full_disk.glob("full/*/COMMITTED"))  # never marked committed there
    (w,) = writer_status(cfg)
    assert [f[:2] for f in w.failed] == [(1, 1), (2, 1), (3, 1)]
    # the trainer reports it too, at its next save
    dcp.save(small_state(4), storage_writer=TieredWriter(cfg, step=4))
    assert any("NOT written" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
    load_exact(cfg, 4, small_state(4))  # the fast tier kept its steps


def _shared_tier_waits_for_every_rank(rank, world, root):
    if rank == 1:
        os.environ["TIERED_DCP_WRITER_MBPS"] = "0.1"  # this rank's writer is slow: ~10 s for its part
    cfg = TieredConfig("sh", [Tier(f"{root}/ram/{{rank}}"), Tier(f"{root}/bucket", shared=True)])
    dcp.save({f"r{rank}": small_state(rank, mib=1)["w"]}, storage_writer=TieredWriter(cfg, step=1))
    dist.barrier()
    return True


def test_shared_tier_commits_only_when_every_rank_part_is_there(tmp_path):
    root = str(tmp_path)
    run_ranks(_shared_tier_waits_for_every_rank, 2, root)
    sdir = tmp_path / "bucket/sh/step_000000000001"
    deadline = time.monotonic() + 60
    while not (sdir / "rank_00000.index").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not (sdir / "COMMITTED").exists() and not (sdir / "rank_00001.index").exists()
    cfg = TieredConfig("sh", [Tier(f"{root}/ram/{{rank}}"), Tier(f"{root}/bucket", shared=True)])
    wait_for(cfg, 1, tier=1, timeout=60)
    expected = {f"r{r}": small_state(r, mib=1)["w"] for r in range(2)}
    load_exact(only(cfg, 1), 1, expected)


def test_staging_buffers_are_reused_resized_and_freed(tmp_path):
    cfg = TieredConfig("stage", [Tier(str(tmp_path / "ram"), keep=2)])
    sd = small_state(1)
    POOL.close()
    ptrs = []
    for step in (1, 2, 3):
        staged = TieredWriter(cfg, step=step).stage(sd)
        ptrs.append(staged["w"].data_ptr())
        assert torch.equal(staged["w"], sd["w"])
        del staged  # DCP drops the staged copy when the upload ends; the slot frees
    assert len(set(ptrs)) == 1  # one buffer, reused
    assert all(slot.arena.untyped_storage().is_shared() for slot in POOL._slots)
    info = POOL.info()
    assert info["slots"] == 1 and info["busy"] == 0 and info["bytes"] >= 4 * MiB
    bigger = small_state(1, mib=8)
    staged = TieredWriter(cfg, step=4).stage(bigger)
    assert POOL.info()["bytes"] >= 8 * MiB > info["bytes"] and POOL.info()["slots"] == 1
    del staged
    TieredWriter(cfg, step=5).close()
    assert POOL.info() == {"slots": 0, "busy": 0, "bytes": 0, "files": 0, "max_slots": 2}


def test_background_staging_returns_before_the_copy(tmp_path):
    cfg = TieredConfig("bg", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"), every=2)])
    sd = small_state(1, mib=64)
    expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in sd.items()}
    resp = dcp.async_save(sd, storage_writer=TieredWriter(cfg, step=2, background_staging=True))
    assert isinstance(resp, AsyncSaveResponse)
    resp.staging_completion.result()
    sd["w"].add_(1.0)  # safe once staging completed: the save holds its own copy
    resp.upload_completion.result()
    wait_for(cfg, 2, timeout=60)
    for tier in (0, 1):
        load_exact(only(cfg, tier), 2, expected)


def test_wait_for_and_cli_show_the_queue(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "2")
    tiers = [str(tmp_path / "ram"), str(tmp_path / "ssd")]
    cfg = TieredConfig("cli", [Tier(t) for t in tiers])
    dcp.save(small_state(1), storage_writer=TieredWriter(cfg, step=1))
    with pytest.raises(TimeoutError, match="not committed on"):
        wait_for(cfg, 1, tier=1, timeout=0.2)
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", "cli", *tiers],
        capture_output=True,
        text=True,
    )
    assert "committed" in r.stdout and "queued: step 1 -> tier 1" in r.stdout, r.stdout
    with pytest.raises(ValueError, match="unknown tier"):
        wait_for(cfg, 1, tier=5)
    monkeypatch.delenv("TIERED_DCP_WRITER_MBPS")
    wait_for(cfg, 1, tier=str(tmp_path / "ssd"), timeout=60)
    assert shutdown(wait=True, timeout=60)  # the writer exits, and its runtime dir goes
    assert writer_status(cfg) == [] and not RunDir.of(cfg, 0).exists()


def test_a_step_whose_save_never_committed_is_abandoned_and_reported(tmp_path):
    cfg = TieredConfig("ab", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    dcp.save(small_state(1), storage_writer=TieredWriter(cfg, step=1))
    settle(cfg)
    # a save of step 2 that died after its part was written and queued, before the commit
    handle = writer_handle(cfg, 0)
    (tmp_path / "ram/ab/step_000000000002").mkdir(parents=True)
    (tmp_path / "ram/ab/step_000000000002/rank_00000.part").write_bytes(b"x" * 100)
    (tmp_path / "ram/ab/step_000000000002/pin.rank_00000.t01").write_bytes(b"")
    handle.enqueue(Job(2, 0, 1, 0, 0, time.time()))
    handle.ensure(os.getpid())
    dcp.save(small_state(3), storage_writer=TieredWriter(cfg, step=3))  # a newer step commits
    settle(cfg)
    (w,) = writer_status(cfg)
    assert [(s, t) for s, t, _ in w.failed] == [(2, 1)] and "abandoned" in w.failed[0][2]
    wait_for(cfg, 3, timeout=60)
    assert not (tmp_path / "ssd/ab/step_000000000002/COMMITTED").exists()


def test_outcomes_are_pruned_and_a_new_trainer_clears_a_dead_ones(tmp_path):
    cfg = TieredConfig("pr", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    rd = RunDir.of(cfg, 0)
    rd.make()
    for step in range(150):
        rd.results.write(Outcome(step=step, target=1, state=OutcomeState.FAILED))
    rd.results.prune(1, KEEP_RESULTS)
    assert sorted(rd.results.all()) == [(s, 1) for s in range(50, 150)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (rd.path / "owner").write_text(str(dead.pid))  # the outcomes of a trainer that is gone
    dcp.save(small_state(1), storage_writer=TieredWriter(cfg, step=1))
    settle(cfg)
    assert list(rd.results.all()) == [(1, 1)] and rd.results.all()[(1, 1)].state is OutcomeState.COMMITTED
