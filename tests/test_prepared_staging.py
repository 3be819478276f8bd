"""The stall of an async save to a RAM tier is the copy alone, at any save rate.

What must hold, with real processes and real files in /dev/shm:

- no page of what a save stages into is faulted on the training thread: after the first
  save, the pool prepares the next saves' part files in the background, and
  ``TieredWriter.prepare`` does so before the first save (counted as minor page faults of
  the training thread during ``async_save``);
- every snapshot stays exact when staged into a prepared file (the state changed right
  after ``async_save`` returns);
- a slower tier that cannot keep up neither stalls saves nor grows host memory
  (``on_lagging_tier="skip"``): the RAM tier holds keep + 1 part files, the
  steps the slower tier could not finish are recorded as skipped, the newest reaches it,
  and whatever it committed loads exactly; ``on_lagging_tier="wait"`` makes saves wait,
  and every step reaches it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
import threading
import time
from pathlib import Path

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import settle
from dist_utils import run_ranks
from tiered_dcp.storage.format import blocks_dir, part_key

from tiered_dcp import (
    Tier,
    TieredConfig,
    TieredReader,
    TieredWriter,
    shutdown,
    status,
    wait_for,
    writer_status,
)
from tiered_dcp.save import staging
from tiered_dcp.save.staging import POOL

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _state(seed: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "i": torch.arange(7) + seed, "step": seed}


def _zeros(mib: int) -> dict:
    return {"w": torch.zeros(mib * MiB // 4), "i": torch.zeros(7, dtype=torch.int64), "step": 0}


def _exact(cfg: TieredConfig, step: int, mib: int, tier: int | None = None) -> bool:
    target = _zeros(mib)
    only = cfg if tier is None else TieredConfig(cfg.namespace, [cfg.tiers[tier]])
    dcp.load(target, storage_reader=TieredReader(only, step=step))
    want = _state(step, mib)
    return (
        torch.equal(target["w"], want["w"]) and torch.equal(target["i"], want["i"]) and target["step"] == step
    )


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _wait_prepared(timeout: float = 30) -> None:
    """Every preparation queued so far done: the pool's one preparing thread runs them in
    turn, so a no-op queued behind them runs once they have returned (polling its counters
    missed one between two files it made, its count of files in the making back at 0)."""
    staging._preparer().submit(lambda: None).result(timeout=timeout)


def _wait_released(timeout: float = 30) -> None:
    """The last save's staging slot let go: DCP's upload thread completes the save's future
    a moment before it drops the staged dict, which releases the slot. A save in that
    moment finds its slot still busy and copies beside it (the machine's pace decides)."""
    deadline = time.monotonic() + timeout
    while POOL.info()["busy"]:
        assert time.monotonic() < deadline, POOL.info()
        time.sleep(0.01)


def _part_files(cfg: TieredConfig) -> list[Path]:
    """The RAM tier's part files: its steps' (clean or being written) and its spares (a
    directory removed while it is listed is passed over: retention runs meanwhile)."""
    root = Path(cfg.tiers[0].root(0, 0), cfg.namespace)
    return [
        Path(d, n)
        for d, _, names in os.walk(root)
        for n in names
        if ".part" in n or os.path.basename(d) == "spare"
    ]


def _inodes(cfg: TieredConfig) -> set[int]:
    """The inodes of the RAM tier's part files now (one removed meanwhile is passed over)."""
    out = set()
    for p in _part_files(cfg):
        with contextlib.suppress(FileNotFoundError):
            out.add(p.stat().st_ino)
    return out


def _shm_held(shm: Path, pids: list[int] | None = None, opened: str = "") -> int:
    """The bytes of the files under ``shm`` and of those ``pids`` (this process by default)
    hold open under ``opened`` (``shm`` by default) with no name (prepared part files, one
    being made too), each inode once: this test's, not /dev/shm's as a whole, which other
    processes of the machine use too."""
    paths = [os.path.join(d, n) for d, _, names in os.walk(shm) for n in names]
    for pid in pids or [os.getpid()]:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(opened or str(shm)):
                        paths.append(f"/proc/{pid}/fd/{fd}")
    blocks = {}
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            blocks[st.st_ino] = st.st_blocks * 512
    return sum(blocks.values())


@pytest.fixture(autouse=True)
def _fresh_pool():
    POOL.close()
    yield
    POOL.close()


@pytest.mark.parametrize("prepared_first", [False, True])
def test_no_page_is_faulted_on_the_training_thread(shm, tmp_path, prepared_first):
    """A 16 MiB state is 4096 pages: a save copying into fresh pages faults each of them on
    the training thread; one staging into a prepared (or reused) file faults none of them."""
    mib = 16
    cfg = TieredConfig("faults", [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "ssd"), every=2)])
    state = _state(0, mib)
    if prepared_first:
        TieredWriter(cfg, step=1).prepare(state)
    faults = {}
    fut = None
    for step in range(1, 7):
        state["w"].copy_(_state(step, mib)["w"])
        state["i"].copy_(_state(step, mib)["i"])
        state["step"] = step
        if fut is not None:
            fut.result()
            _wait_released()
        _wait_prepared()  # the background work of the last save is not the training thread's
        before = _faults()
        fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step))
        faults[step] = _faults() - before
        state["w"].add_(1.0)  # the next training step, right after async_save returned
        state["i"].add_(1)
        state["step"] = -1
    fut.result()
    pages = mib * MiB // PAGE
    checked = range(1 if prepared_first else 2, 7)
    assert all(faults[s] < pages // 4 for s in checked), ({s: faults[s] for s in checked}, pages)
    settle(cfg)
    for step in (5, 6):
        assert _exact(cfg, step, mib, tier=0)
    assert _exact(cfg, 6, mib, tier=1)
    assert len(_part_files(cfg)) <= 3


def test_two_states_saved_in_turn_keep_each_others_prepared_files(shm):
    """A model and its EMA, saved in turn under two namespaces on one RAM tier: each save
    stages into a file prepared for its own layout; one state's save does not throw away
    the files prepared for the other (each save then faulted fresh pages on the training
    thread, as a first save does)."""
    mib = {"model": 16, "ema": 8}
    cfgs = {ns: TieredConfig(ns, [Tier(str(shm / "ram"), keep=2)]) for ns in mib}
    states = {ns: _state(0, n) for ns, n in mib.items()}
    faults: dict[tuple[str, int], int] = {}
    futs: list = []
    for step in range(1, 5):
        for ns, state in states.items():
            state["w"].copy_(_state(step, mib[ns])["w"])
            state["step"] = step
            for f in futs:
                f.result()
            _wait_prepared()
            before = _faults()
            futs = [dcp.async_save(state, storage_writer=TieredWriter(cfgs[ns], step=step))]
            faults[(ns, step)] = _faults() - before
    for f in futs:
        f.result()
    for (ns, step), n in faults.items():
        if step > 1:
            assert n < mib[ns] * MiB // PAGE // 4, faults
    for ns, cfg in cfgs.items():
        settle(cfg)
        target = _zeros(mib[ns])
        dcp.load(target, storage_reader=TieredReader(cfg, step=4))
        assert torch.equal(target["w"], _state(4, mib[ns])["w"]) and target["step"] == 4


def test_prepared_files_hold_at_most_keep_plus_one_steps(shm):
    """The prepared files and the kept steps' files together: keep + 1 per rank, as the
    memory guard counts them; closing the pool lets the unnamed ones go with it."""
    mib = 4
    cfg = TieredConfig("prep", [Tier(str(shm), keep=2)])
    used = lambda: _shm_held(shm)  # noqa: E731
    TieredWriter(cfg, step=1).prepare(_state(0, mib))
    assert POOL.prepared_bytes() == 3 * mib * MiB + 3 * 7 * 8
    assert _part_files(cfg) == []  # none named yet: no tier lists them
    peak = used()
    for step in range(1, 7):
        dcp.async_save(_state(step, mib), storage_writer=TieredWriter(cfg, step=step)).result()
        _wait_prepared()
        peak = max(peak, used())
    assert peak <= 3.1 * mib * MiB, peak / MiB
    for step in (5, 6):
        assert _exact(cfg, step, mib)
    POOL.close()
    assert used() <= 2.1 * mib * MiB  # the two kept steps


def _slow_tier_saves(
    shm: Path, tmp_path: Path, policy: str, monkeypatch, max_pending: int = 2
) -> tuple[TieredConfig, float, list[str], set[int]]:
    """Six async saves back to back to a RAM tier keep=2 and a disk tier taking every step
    at 4 MB/s (2 s per 8 MiB step); returns the config, the longest stall, the most part
    files the RAM tier held at once (named, or prepared with no name: listed, for a
    failure's message) and every part file's inode."""
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "4")
    mib = 8
    cfg = TieredConfig(
        f"lag-{policy}", [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "ssd"))], on_lagging_tier=policy
    )
    root = Path(cfg.tiers[0].root(0, 0), cfg.namespace)

    def held(after: int) -> list[str]:
        files = [f"{p.relative_to(root)} (after step {after}'s save)" for p in _part_files(cfg)]
        return files + [f"(prepared, after step {after}'s save) {POOL.info()}"] * (
            POOL.prepared_bytes() // (mib * MiB)
        )

    state = _state(0, mib)
    longest, most, fut, inodes = 0.0, [], None, set()
    for step in range(1, 7):
        state["w"].copy_(_state(step, mib)["w"])
        state["i"].copy_(_state(step, mib)["i"])
        state["step"] = step
        if fut is not None:
            fut.result()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step, max_pending=max_pending))
        longest = max(longest, time.perf_counter() - t0)
        state["w"].add_(1.0)  # changed right after async_save returned
        state["step"] = -1
        most = max(most, held(step), key=len)
        inodes |= _inodes(cfg)
    fut.result()
    most = max(most, held(6), key=len)
    inodes |= _inodes(cfg)
    return cfg, longest, most, inodes


def test_a_lagging_tier_is_skipped_not_waited_for(shm, tmp_path, monkeypatch):
    cfg, longest, most, inodes = _slow_tier_saves(shm, tmp_path, "skip", monkeypatch)
    assert longest < 1.0, f"a save waited {longest:.2f} s for the slow tier"
    assert len(most) <= 3, f"the RAM tier held {len(most)} part files (keep=2: at most 3): {most}"
    # the same 3 files served every save: none was deleted and made again in cold pages
    # (the writer process's retention deleted the spare the next save was to stage into)
    assert len(inodes) <= 3, inodes
    settle(cfg, timeout=120)
    (w,) = writer_status(cfg)
    skipped = sorted(s for s, t, _ in w.skipped if t == 1)
    assert skipped, "no step was recorded as skipped"
    assert all("keep window" in why for _, _, why in w.skipped)
    assert not w.failed
    tiers = [t.path for t in cfg.tiers]
    cmd = [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", cfg.namespace, *tiers]
    ls = preloaded.run(cmd, capture_output=True, text=True)
    assert f"SKIPPED step {skipped[0]} -> tier 1" in ls.stdout and "keep window" in ls.stdout, ls.stdout
    on_disk = sorted(r.step for r in status(cfg) if r.tier_index == 1 and r.state == "committed")
    assert 6 in on_disk and not set(skipped) & set(on_disk)
    for step in on_disk:  # what the slow tier committed is exact, though its source was reused
        assert _exact(cfg, step, 8, tier=1), step
    for step in (5, 6):
        assert _exact(cfg, step, 8, tier=0)
    shutdown(wait=True, timeout=60)


def test_wait_policy_waits_and_every_step_reaches_the_slow_tier(shm, tmp_path, monkeypatch):
    # max_pending=5: the writer's queue alone would let a fourth step be held
    cfg, longest, most, _ = _slow_tier_saves(shm, tmp_path, "wait", monkeypatch, max_pending=5)
    assert longest > 0.5, "no save waited for the slow tier"
    assert len(most) <= 3, f"the RAM tier held {len(most)} part files (keep=2: at most 3): {most}"
    settle(cfg, timeout=120)
    (w,) = writer_status(cfg)
    assert not w.skipped and not w.failed
    for step in range(1, 7):
        assert _exact(cfg, step, 8, tier=1), step
    shutdown(wait=True, timeout=60)


def test_config_refuses_an_unknown_lagging_policy():
    with pytest.raises(ValueError, match="on_lagging_tier"):
        TieredConfig("x", [Tier("/tmp/x")], on_lagging_tier="drop")


def test_part_key_of_a_prepared_file_is_its_step(shm):
    """A prepared file, once a save names it, is that step's part file (and no other)."""
    cfg = TieredConfig("named", [Tier(str(shm), keep=1)])
    TieredWriter(cfg, step=3).prepare(_state(0, 1))
    dcp.async_save(_state(3, 1), storage_writer=TieredWriter(cfg, step=3)).result()
    assert [p.relative_to(shm).as_posix() for p in _part_files(cfg)] == [part_key(cfg.namespace, 3, 0)]
    assert _exact(cfg, 3, 1)


def test_shutdown_while_the_next_files_are_prepared_leaves_none_held(shm):
    """``shutdown()`` right after a save, the next saves' files still being made in the
    background (the preparing thread held, then let go): what it makes after the pool
    closed is let go too, not held mapped until the process ends (a state's size each)."""
    mib = 4
    cfg = TieredConfig("late", [Tier(str(shm), keep=2)])
    dcp.async_save(_state(1, mib), storage_writer=TieredWriter(cfg, step=1)).result()
    _wait_prepared()
    hold = threading.Event()
    staging._preparer().submit(hold.wait, 30)  # the next preparation queues behind this
    dcp.async_save(_state(2, mib), storage_writer=TieredWriter(cfg, step=2)).result()
    _wait_released()
    shutdown(wait=False)
    hold.set()
    _wait_prepared()
    assert POOL.info()["slots"] == 0 and POOL.prepared_bytes() == 0, POOL.info()
    assert _shm_held(shm) <= 2.1 * mib * MiB  # the two kept steps' files, nothing unnamed
    assert _exact(cfg, 2, mib)


def test_a_resumed_job_prepares_no_more_than_the_tier_lacks(shm):
    """Steps a former process left on the RAM tier count among its keep + 1 files: a job
    resumed beside them prepares only the rest, and host memory stays at keep + 1 steps."""
    mib = 4
    cfg = TieredConfig("resume", [Tier(str(shm), keep=2)])
    for step in (1, 2):
        dcp.async_save(_state(step, mib), storage_writer=TieredWriter(cfg, step=step)).result()
    POOL.close()  # the former process is gone: its kept steps stay, nothing of it is mapped
    used = lambda: _shm_held(shm)  # noqa: E731 - the two kept steps' files among them
    TieredWriter(cfg, step=3).prepare(_state(0, mib))
    assert POOL.prepared_bytes() <= mib * MiB + 1024  # one file: the two kept steps' are the others
    peak = used()
    for step in range(3, 8):
        dcp.async_save(_state(step, mib), storage_writer=TieredWriter(cfg, step=step)).result()
        _wait_prepared()
        peak = max(peak, used())
    assert peak <= 3.1 * mib * MiB, peak / MiB
    for step in (6, 7):
        assert _exact(cfg, step, mib)


def _claimed(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_reused_part_file_is_claimed_to_its_size_and_holes_are_filled(shm):
    """``part_file.size_to`` on a staged file's reuse: a file with no hole is only cut or
    extended (the pages it holds are not walked again), one with a hole is claimed whole, so
    a full tmpfs fails there, never with SIGBUS in the copy."""
    from tiered_dcp.steps.part_file import size_to

    path = os.path.join(shm, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * (3 * PAGE + 100), 0)  # a finished part file: arena, then its tail
        size_to(fd, 2 * PAGE)  # reused by a save of 2 pages: cut
        assert os.fstat(fd).st_size == 2 * PAGE and _claimed(fd) >= 2 * PAGE
        size_to(fd, 5 * PAGE)  # a larger state: claimed from its end on
        assert os.fstat(fd).st_size == 5 * PAGE and _claimed(fd) >= 5 * PAGE
        os.ftruncate(fd, 0)
        os.ftruncate(fd, 4 * PAGE)
        os.pwrite(fd, b"y", 4 * PAGE - 1)  # a hole before its last page
        assert _claimed(fd) < 4 * PAGE
        size_to(fd, 4 * PAGE)
        assert _claimed(fd) >= 4 * PAGE
        os.ftruncate(fd, 6 * PAGE)  # a hole at its end, then cut to the size asked
        size_to(fd, 5 * PAGE)
        assert os.fstat(fd).st_size == 5 * PAGE and _claimed(fd) >= 5 * PAGE
    finally:
        os.close(fd)


@pytest.mark.parametrize("dedup", [False, True])
def test_the_writer_process_pauses_while_its_trainer_stages(shm, tmp_path, dedup):
    """A copy down the tiers waits while the trainer holds the staging lock (as ``async_save``
    does while it copies), and goes on once it is let go; chunk by chunk, or block by block
    with dedup."""
    from tiered_dcp.writer_process.client import writer_handle

    tiers = [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "disk"))]
    cfg = TieredConfig("pause", tiers, dedup=dedup)
    blocks = tmp_path / "disk" / blocks_dir("pause")

    def written_blocks() -> int:
        return sum(len(names) for _, _, names in os.walk(blocks))

    dcp.save(_state(1, 4), storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, timeout=60)  # its writer process runs
    before = written_blocks()
    with writer_handle(cfg, 0).rd.writer.staging.hold():
        dcp.save(_state(2, 4), storage_writer=TieredWriter(cfg, step=2))  # a sync save stages nothing
        with pytest.raises(TimeoutError):
            wait_for(cfg, 2, tier=1, timeout=1.5)
        assert written_blocks() == before  # step 2's new blocks wait too
    wait_for(cfg, 2, tier=1, timeout=60)
    assert written_blocks() > before or not dedup
    assert _exact(cfg, 2, 4, tier=1)
    shutdown()


def test_a_staging_lock_that_cannot_be_opened_fails_no_save(shm, tmp_path):
    """Whoever can write the run directory may leave a link (or a directory) where the lock
    goes: the save stages all the same, never through the link, and its step is loadable."""
    from tiered_dcp.writer_process.client import writer_handle

    cfg = TieredConfig("nolock", [Tier(str(shm / "ram"), keep=2), Tier(str(tmp_path / "disk"))])
    state = _state(1, 2)
    TieredWriter(cfg, step=1).prepare(state)  # the writer process and its run directory
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    lock = writer_handle(cfg, 0).rd.writer.staging.path
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    dcp.async_save(state, storage_writer=TieredWriter(cfg, step=1)).result()
    wait_for(cfg, 1, timeout=60)
    assert _exact(cfg, 1, 2) and _exact(cfg, 1, 2, tier=1)
    assert victim.read_bytes() == b"untouched"
    shutdown()


def _mapped(ino: int) -> bool:
    """Whether a slot of the pool maps the file of inode ``ino``."""
    return any(s.fd is not None and os.fstat(s.fd).st_ino == ino for s in POOL._slots)


def test_a_first_save_copies_into_private_memory_and_its_upload_moves_it_into_its_part_file(shm):
    """A first save with no ``prepare`` copies into private memory (faulted as
    stock DCP's first copy is, not claimed in the tier first); its upload moves the copy
    into the step's part file, which the pool then maps as if the save had staged there:
    no private copy is left, the snapshot is exact though the state changed at once, and
    the six saves go round the same keep + 1 files, the first step's among them."""
    mib = 8
    cfg = TieredConfig("first-copy", [Tier(str(shm), keep=2)])
    state = _state(1, mib)
    fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=1))
    state["w"].add_(1.0)  # the next training step, right after async_save returned
    fut.result()
    _wait_prepared()
    (first,) = _part_files(cfg)
    ino = first.stat().st_ino
    assert _mapped(ino) and POOL.info()["bytes"] == 0 and not POOL.first_copies
    assert _exact(cfg, 1, mib)
    inodes = {ino}
    for step in range(2, 7):
        dcp.async_save(_state(step, mib), storage_writer=TieredWriter(cfg, step=step)).result()
        _wait_prepared()
        inodes |= _inodes(cfg)
    assert len(inodes) == 3 and ino in _inodes(cfg)  # step 1's file went round again
    assert POOL.info()["bytes"] == 0
    for step in (5, 6):
        assert _exact(cfg, step, mib)


def test_beside_a_first_copy_the_next_files_wait_for_it_to_move(shm):
    """The first copy is a copy of the state the tier does not see: the files prepared for
    the next saves beside it are one, the rest made once it is in its part file, so host
    memory (the tier's files, prepared ones and the private copy, sampled) stays at keep +
    1 copies of the state (four without the wait)."""
    mib = 32
    cfg = TieredConfig("first-peak", [Tier(str(shm), keep=2)])
    nbytes = mib * MiB + 7 * 8
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _shm_held(shm) + POOL.info()["bytes"])
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        dcp.async_save(_state(1, mib), storage_writer=TieredWriter(cfg, step=1)).result()
        _wait_prepared()
    finally:
        done.set()
        sampler.join()
    assert POOL.prepared_bytes() == 2 * nbytes  # what saves 2 and 3 stage into, ready
    assert peak[0] <= 3.1 * nbytes, peak[0] / nbytes
    assert _exact(cfg, 1, mib)


def test_a_first_copy_that_cannot_reach_its_part_file_fails_its_save_alone(shm):
    """A link where the step's directory goes (whoever can write the tier may leave one):
    the upload can move the first copy nowhere, the save fails naming the step, no private
    copy or part file is left, nothing was written through the link, and the next save is
    exact."""
    cfg = TieredConfig("first-fails", [Tier(str(shm / "ram"), keep=2)])
    victim = shm / "victim"
    victim.mkdir()
    step_dir = shm / "ram" / part_key(cfg.namespace, 1, 0)
    step_dir.parent.parent.mkdir(parents=True)
    step_dir.parent.symlink_to(victim)
    fut = dcp.async_save(_state(1, 2), storage_writer=TieredWriter(cfg, step=1))
    with pytest.raises(BaseException, match="step_0*1|link") as failed:
        fut.result()
    del failed, fut  # its traceback holds the staged dict, and so the copy, as for any failed save
    gc.collect()
    _wait_prepared()
    assert list(victim.iterdir()) == [] and not POOL.first_copies
    assert POOL.info()["bytes"] == 0 and all(r.state != "committed" for r in status(cfg))
    step_dir.parent.unlink()
    dcp.async_save(_state(2, 2), storage_writer=TieredWriter(cfg, step=2)).result()
    assert _exact(cfg, 2, 2)


class Tagged(torch.Tensor):
    """A tensor subclass over ordinary storage: staged as an alias of its arena view."""


def _mapping_of(address: int) -> str:
    """What this process maps at ``address`` (/proc/self/maps): a file's path, or "" for
    private (anonymous) memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(a, 16) for a in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"nothing mapped at {address:#x}")


def test_a_first_copys_tensor_subclass_leaf_moves_into_the_part_file_too(shm):
    """A tensor-subclass leaf is staged as an alias of its arena view (``as_subclass``):
    the upload that moves a first copy into its part file moves it as well, so no staged
    leaf holds the private copy after it (which would hold one copy of the state beyond
    the keep + 1 in the tier for as long as the slot lives)."""
    mib = 8
    cfg = TieredConfig("first-sub", [Tier(str(shm), keep=2)])
    state = _state(1, mib)
    state["w"] = state["w"].as_subclass(Tagged)
    dcp.async_save(state, storage_writer=TieredWriter(cfg, step=1)).result()
    _wait_prepared()
    gc.collect()
    (first,) = _part_files(cfg)
    (slot,) = [s for s in POOL._slots if s.fd is not None and os.fstat(s.fd).st_ino == first.stat().st_ino]
    leaves = [v for v in slot.staged if isinstance(v, torch.Tensor)]
    assert {type(v) for v in leaves} == {Tagged, torch.Tensor}
    for leaf in leaves:
        assert _mapping_of(leaf.data_ptr()).startswith(str(shm)), type(leaf)
    target = _zeros(mib)
    dcp.load(target, storage_reader=TieredReader(cfg, step=1))
    assert torch.equal(target["w"], _state(1, mib)["w"])


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (DCP's background process of its PROCESS mode)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _process_mode_saves(rank: int, world: int, shm: str) -> tuple[list[float], bool]:
    """Three async saves in DCP's PROCESS mode, the first of a layout with no ``prepare``;
    after each (its upload and the next saves' files done), the shared memory held, in
    copies of the state; and whether each step loads exactly."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    mib = 16
    nbytes = mib * MiB + 7 * 8
    cfg = TieredConfig("first-process", [Tier(shm, keep=2)])
    held, exact = [], True
    for step in (1, 2, 3):
        writer = TieredWriter(cfg, step=step)
        dcp.async_save(
            _state(step, mib), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        ).result()
        _wait_prepared()
        held.append(_shm_held(Path(shm), _descendants(os.getpid()), "/dev/shm/") / nbytes)
        exact = exact and _exact(cfg, step, mib)
    return held, exact


def test_a_first_save_in_process_mode_stages_into_its_part_file(shm):
    """DCP's PROCESS mode pickles the staged copy for its background process: a first copy
    in private memory would be moved into a shared segment of torch's by the pickling, and
    copied once more into the part file by the upload (4x the state held here after the
    first save, its segment kept by DCP's process until the next request). Staged into
    its part file instead, host memory stays at keep + 1 copies from the first save on."""
    ((held, exact),) = run_ranks(_process_mode_saves, 1, str(shm), timeout=240)
    assert exact
    assert max(held) <= 3.05, held
