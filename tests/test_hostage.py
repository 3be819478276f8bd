"""Nothing holds a save or the writer process hostage.

The staging lock (``run_dir.StagingLock``) pauses the writer while the trainer copies a
save's state. What must hold, with real processes, real forks and real signals:

- a child forked while a save stages (background or default staging) does not keep the
  writer paused, nor the next save from staging, while it lives;
- a trainer stopped (SIGSTOP) while it holds the lock pauses its writer for a bounded
  time, and the wait counts as progress: the tier is not judged stalled;
- the lock is held around the copy alone, never around a wait for a staging slot;
- SIGTERM during staging: the writer copies down the tiers throughout the grace period,
  and a copy the signal interrupted is not waited for;
- a background staging that fails before the pool takes its reservation gives it back;
- with ``on_lagging_tier="wait"`` the RAM tier holds at most keep + 1 staged copies, saves
  back to back, whatever ``every`` the slower tier has;
- with ``"skip"`` and no ``prepare()``, the first save makes the files the next saves
  stage into, so saves 2 and 3 back to back fault no page on the training thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import live_files

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, wait_for, writer_status
from tiered_dcp.save.staging import POOL
from tiered_dcp.writer_process.client import writer_handle
from tiered_dcp.writer_process.run_dir import PAUSE_LIMIT, RunDir, TierState

MiB = 1 << 20
HERE = Path(__file__).parent

# Whether another process may take the lock shared now (exit 0) or not (exit 1): POSIX
# locks are the process's, so only another process sees the trainer's.
PROBE = """
import fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDWR)
except FileNotFoundError:
    sys.exit(0)  # nobody opened it yet
try:
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
except OSError:
    sys.exit(1)
"""


def held_by_another(path: Path) -> bool:
    return preloaded.run([sys.executable, "-c", PROBE, str(path)], timeout=30).returncode == 1


def state(step: int, mib: int = 4) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": step}


def exact(cfg: TieredConfig, step: int, tier: int, mib: int = 4) -> bool:
    target = {"w": torch.zeros(mib * MiB // 4), "step": 0}
    only = TieredConfig(cfg.namespace, [cfg.tiers[tier]])
    dcp.load(target, storage_reader=TieredReader(only, step=step))
    return torch.equal(target["w"], state(step, mib)["w"]) and target["step"] == step


def two_tiers(name: str, shm: Path, disk: Path, **kw) -> TieredConfig:
    return TieredConfig(name, [Tier(str(shm / "ram"), keep=2), Tier(str(disk / "disk"))], **kw)


@pytest.mark.parametrize("background", [False, True])
def test_a_child_forked_while_a_save_stages_holds_nothing(shm, tmp_path, monkeypatch, background):
    """flock's lock belongs to the open file, which a forked child inherits: the child held
    it for its whole life, the writer copied nothing and the next save waited on it."""
    cfg = two_tiers(f"fork{int(background)}", shm, tmp_path)
    TieredWriter(cfg, step=1).prepare(state(1))  # the writer process, started
    children: list[int] = []
    copy = POOL.copier.copy_into

    def forking(slot, ex):  # a DataLoader worker started while the save copies
        pid = os.fork()
        if pid == 0:
            time.sleep(40)
            os._exit(0)
        children.append(pid)
        return copy(slot, ex)

    monkeypatch.setattr(POOL.copier, "copy_into", forking)
    try:
        for step in (1, 2):
            t0 = time.monotonic()
            fut = dcp.async_save(
                state(step), storage_writer=TieredWriter(cfg, step=step, background_staging=background)
            )
            if background:
                fut.staging_completion.result(timeout=30)
            assert time.monotonic() - t0 < 5, f"save {step} staged in {time.monotonic() - t0:.1f} s"
            (fut.upload_completion if background else fut).result(timeout=30)
            wait_for(cfg, step, tier=1, timeout=5)  # the slower tier fills in while the child lives
        assert len(children) == 2 and all(os.waitpid(p, os.WNOHANG) == (0, 0) for p in children)
        assert exact(cfg, 2, tier=1)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutdown()


HOLD_AND_STOP = """
import os, signal, sys
from pathlib import Path
from tiered_dcp.writer_process.run_dir import StagingLock
with StagingLock(Path(sys.argv[1])).hold():
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_trainer_pauses_its_writer_a_bounded_time_and_no_stall(shm, tmp_path):
    """A trainer SIGSTOPped while it holds the lock (its pid alive, so no drain timeout
    fires): the writer waits ``PAUSE_LIMIT`` at most, then copies; the wait is progress, so
    with tier_timeout below the pause the tier is not judged stalled, and no step skipped."""
    cfg = two_tiers("stopped", shm, tmp_path, tier_timeout=1.0)
    dcp.save(state(1), storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, tier=1, timeout=30)
    lock = writer_handle(cfg, 0).rd.writer.staging.path
    stopped = preloaded.Popen(
        [sys.executable, "-c", HOLD_AND_STOP, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stopped.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        for step in (2, 3):
            dcp.save(state(step), storage_writer=TieredWriter(cfg, step=step))  # a sync save stages nothing
        wait_for(cfg, 3, tier=1, timeout=PAUSE_LIMIT + 20)
        waited = time.monotonic() - t0
        assert waited >= PAUSE_LIMIT - 1, f"the writer did not pause ({waited:.1f} s)"
        assert held_by_another(lock)  # still held: the writer read past it
        assert RunDir.of(cfg, 0).health.of(1).state is TierState.HEALTHY
        (w,) = writer_status(cfg)
        assert not w.skipped and not w.failed
        assert exact(cfg, 2, tier=1) and exact(cfg, 3, tier=1)
    finally:
        stopped.kill()
        stopped.wait()
        shutdown()


def test_the_lock_is_held_around_the_copy_alone(shm, tmp_path, monkeypatch):
    """Taken for the copy, not for the wait for a staging slot (a save issued while both
    slots upload waited on the slot with the writer paused)."""
    cfg = two_tiers("held", shm, tmp_path)
    TieredWriter(cfg, step=1).prepare(state(1))  # the writer process and its run directory
    lock = writer_handle(cfg, 0).rd.writer.staging.path
    seen = {"acquire": [], "copy": []}
    acquire, copy = POOL._acquire, POOL.copier.copy_into

    def acquiring(*a, **k):
        seen["acquire"].append(held_by_another(lock))
        return acquire(*a, **k)

    def copying(slot, ex):
        seen["copy"].append(held_by_another(lock))
        return copy(slot, ex)

    monkeypatch.setattr(POOL, "_acquire", acquiring)
    monkeypatch.setattr(POOL.copier, "copy_into", copying)
    for step in (1, 2):
        dcp.async_save(state(step), storage_writer=TieredWriter(cfg, step=step)).result()
    assert seen == {"acquire": [False, False], "copy": [True, True]}
    assert not held_by_another(lock)
    shutdown()


def test_a_failed_background_staging_gives_its_reservation_back(shm, tmp_path, monkeypatch):
    """A failure before the pool took the reservation (finding the writer) left the save
    counted in flight for ever: every later SIGTERM waited the full grace period."""
    import tiered_dcp.save.stager as stager_module

    cfg = two_tiers("leak", shm, tmp_path)

    def broken(config, rank):
        raise RuntimeError("no run directory")

    monkeypatch.setattr(stager_module, "writer_handle", broken)
    fut = dcp.async_save(state(1), storage_writer=TieredWriter(cfg, step=1, background_staging=True))
    with pytest.raises(RuntimeError, match="no run directory"):
        fut.upload_completion.result(timeout=30)  # DCP reports a staging's failure there
    assert POOL.in_flight() == 0
    shutdown()


def run_worker(mode: str, root: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **env}
    r = preloaded.run(
        [sys.executable, str(HERE / "trainer_worker.py"), mode, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )
    return r, time.time()


def test_sigterm_while_staging_returns_no_later_than_the_saves_it_can_finish(tmp_path):
    """The signal interrupts the copy on the main thread: that copy cannot go on while the
    handler waits, so it is not waited for (it was, for the whole grace period)."""
    root = tmp_path
    t0 = time.monotonic()
    r, _ = run_worker("sigterm-staging", root, TIERED_DCP_SIGTERM_WAIT="30")
    took = time.monotonic() - t0
    assert r.returncode == -signal.SIGTERM, r.stdout + r.stderr
    assert "not reached" not in r.stdout
    assert took < 20, f"the handler waited for the copy it interrupted ({took:.0f} s)"
    cfg = TieredConfig("trainer", [Tier(f"{root}/ram", keep=2), Tier(f"{root}/ssd", keep=2)])
    wait_for(cfg, 1, tier=1, timeout=60)  # the writer goes on after its trainer


def test_sigterm_lets_the_writer_copy_through_the_grace_period(tmp_path):
    """SIGTERM while a background staging copies for 8 s (the lock held): the handler waits
    for that save, and meanwhile the writer copies step 1 down, instead of staying paused
    until the copy ends."""
    root = tmp_path
    r, ended = run_worker("sigterm-staging-bg", root, TIERED_DCP_WRITER_MBPS="8")
    assert r.returncode == -signal.SIGTERM, r.stdout + r.stderr
    assert "signalled" in r.stdout
    cfg = TieredConfig("trainer", [Tier(f"{root}/ram", keep=2), Tier(f"{root}/ssd", keep=2)])
    wait_for(cfg, 1, tier=1, timeout=60)
    (outcome,) = [o for (step, tier), o in RunDir.of(cfg, 0).results.all().items() if (step, tier) == (1, 1)]
    assert outcome.finished is not None and outcome.finished < ended - 3, (
        f"step 1 reached the slower tier {ended - outcome.finished:.1f} s before the trainer ended"
    )
    shutdown()


def ram_copies(ram: Path) -> int:
    """The staged copies the RAM tier holds in /dev/shm: its part files (named, or spares)
    and the prepared ones the pool holds with no name, each file once."""
    inodes = {ino for ino, st in live_files(ram).items() if st.st_size >= MiB}
    for s in POOL._slots:  # only this tier's files count (earlier tests' stay mapped in the pool)
        if s.fd is not None and os.readlink(f"/proc/self/fd/{s.fd}").startswith(str(ram)):
            inodes.add(os.fstat(s.fd).st_ino)
    return len(inodes)


@pytest.mark.parametrize("every", [2, 5])
def test_the_keep_window_bounds_memory_under_wait_back_to_back(shm, tmp_path, monkeypatch, every):
    """RAM every=1 keep=2 over a slow disk tier: a save the RAM tier alone takes waits for
    an older step still pinned for the disk, as the disk's own steps do; never more than
    keep + 1 staged copies (it took a fourth file)."""
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "40")  # the disk tier lags
    cfg = TieredConfig("window", [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "disk"), every=every)])
    most = 0
    fut = None
    for step in range(1, 12):
        if fut is not None:
            fut.result()
        fut = dcp.async_save(state(step), storage_writer=TieredWriter(cfg, step=step))
        most = max(most, ram_copies(shm / "ram"))
    fut.result()
    assert most <= 3, f"{most} staged copies held (keep + 1 = 3)"
    for step in range(every, 12, every):
        wait_for(cfg, step, tier=1, timeout=60)
        assert exact(cfg, step, tier=1)
    shutdown()


def test_saves_back_to_back_find_their_files_made_by_the_first(shm, tmp_path, monkeypatch):
    """With ``"skip"`` and no ``prepare()``: the files the first save's next ``keep`` saves
    stage into are made before its future completes (they were made in a thread the next
    save overtook: here each takes 0.5 s more, as a large state's do), so saves 2 and 3 back
    to back fault no page of them on the training thread."""
    import resource

    from tiered_dcp.steps import part_file

    mib = 16
    cfg = TieredConfig(
        "b2b", [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "disk"), every=2)], on_lagging_tier="skip"
    )
    prepare = part_file.prepare

    def slow(*a, **k):
        time.sleep(0.5)
        return prepare(*a, **k)

    monkeypatch.setattr(part_file, "prepare", slow)
    pages = mib * MiB // os.sysconf("SC_PAGE_SIZE")
    fut = dcp.async_save(state(1, mib), storage_writer=TieredWriter(cfg, step=1))
    for step in (2, 3):
        fut.result()
        values = state(step, mib)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t0 = time.monotonic()
        fut = dcp.async_save(values, storage_writer=TieredWriter(cfg, step=step))
        took = time.monotonic() - t0
        faulted = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faulted < pages // 4, f"save {step} faulted {faulted} pages of {pages}"
        assert took < 0.4, f"save {step} waited {took:.2f} s for its file"
    fut.result()
    shutdown()
