"""Recovery inside the job. A job that restarts in its processes (NvRx's
in-process restart, a user's own loop) builds its process group again; tiered-dcp's own
groups and store keys must be of the new world on every rank, survivors and a replacement
alike, and nothing cached from the world before may be used.

Real processes on gloo, 4 ranks as 2 nodes, a RAM tier per node with clique replication;
the job's store (a TCPStore in the test process, as NvRx's store service or torchrun's
agent keeps it) outlives every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest
import torch.distributed as dist

from tiered_dcp.cli.local_servers import free_port

WORKER = str(Path(__file__).with_name("inprocess_worker.py"))


def _start(
    rank: int,
    port: int,
    root: Path,
    first: int,
    last: int,
    kill_at: int = -1,
    sizes: str = "4,4,4",
    racks: bool = False,
) -> subprocess.Popen:
    """One rank (two a node) in worlds ``first`` to ``last`` of ``sizes`` (``inprocess_worker``);
    ``racks``: each node its own failure domain (``RACK``)."""
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", **({"RACK": f"rack-{rank // 2}"} if racks else {}))
    args = [str(a) for a in (rank, sizes, port, root, first, last, kill_at)]
    return preloaded.Popen(
        [sys.executable, WORKER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _worlds(out: str) -> list[dict]:
    return [json.loads(line[len("WORLD ") :]) for line in out.splitlines() if line.startswith("WORLD ")]


def test_survivors_and_a_replacement_save_and_load_in_the_new_world(shm):
    """Rank 3 is killed after the first world's saves; ranks 0-2 go on in their processes
    (their sequence numbers and caches are of the first world), a fresh rank 3 joins the
    second world. Every rank loads the newest step exactly (rank 3's part from its node's
    RAM tier), and the saves after it, replicated across nodes, commit: before, the
    survivors' group names were ahead of the replacement's and the first replica exchange
    waited out its peer_timeout."""
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    procs = [_start(r, port, shm, 0, 2, kill_at=3) for r in range(4)]
    try:
        killed = procs[3]
        killed.wait(timeout=120)
        assert killed.returncode == -9, killed.stderr.read()[-3000:]
        outs = [_worlds(killed.stdout.read())]  # its first world's
        procs[3] = _start(3, port, shm, 1, 2)
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
            outs.append(_worlds(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del server
    by_world: dict[int, list[dict]] = {}
    for rows in outs:
        for row in rows:
            by_world.setdefault(row["world"], []).append(row)
    assert sorted(len(v) for v in by_world.values()) == [4, 4, 4]
    assert [r["saved"] for r in by_world[0]] == [[1, 2, 3]] * 4
    for n, loaded in ((1, 3), (2, 6)):
        assert all(r["loaded"] == loaded and r["exact"] for r in by_world[n]), by_world[n]
        assert all(r["saved"] == [loaded + 1, loaded + 2, loaded + 3] for r in by_world[n])


def _twenty_worlds(rank: int, world: int, root: str) -> list[tuple[list[str], int, int]]:
    """20 worlds in these processes, each a new default group on the job's store under a
    prefix of its own: a load, two replicated async saves, ``abort``, teardown. Per world:
    the threads' names, open files, process groups alive."""
    import gc
    import threading
    import weakref

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed import distributed_c10d

    from tiered_dcp import Tier, TieredConfig, TieredWriter, abort, load_latest

    cfg = TieredConfig(
        "twenty", [Tier(f"{root}/ram/{{node}}", keep=2)], replication_factor=2, replication_jump=1
    )
    base = distributed_c10d._get_default_store()
    dist.destroy_process_group()
    counts, step, groups = [], 0, []
    for n in range(20):
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"_inprocess_{n}", base), rank=rank, world_size=world
        )
        state = {f"w{rank}": torch.zeros(1 << 16), "step": -1}
        if n:
            step = load_latest(state, cfg)
            assert (
                torch.equal(state[f"w{rank}"], torch.full((1 << 16,), float(step))) and state["step"] == step
            )
        for _ in range(2):
            step += 1
            state = {f"w{rank}": torch.full((1 << 16,), float(step)), "step": step}
            dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step)).result()
        abort()
        groups.append(weakref.ref(distributed_c10d._get_default_group()))
        dist.destroy_process_group()
        gc.collect()
        alive = sum(g() is not None for g in groups)
        names = sorted(t.name for t in threading.enumerate())
        counts.append((names, len(os.listdir("/proc/self/fd")), alive))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("_inprocess_last", base), rank=rank, world_size=world
    )
    return counts


def _kinds(names: list[str]) -> set[str]:
    """Thread names without a pool worker's index (``tdcp-hash_1``: ``tdcp-hash``)."""
    return {re.sub(r"_\d+$", "", n) for n in names}


def test_twenty_restarts_in_one_process_leak_nothing(shm):
    """Threads, open files and process groups after each of 20 worlds (two ranks on two
    nodes, each save's part replicated to the other): after the 20th as after the 2nd (the
    first starts the pools' and DCP's threads), and every reload exact. A pool may add a
    worker up to its bound whenever a task finds the others busy, which depends on the
    machine's pace: what must not happen is a thread of a new kind (a pool or a thread
    made per world) or a name twice (a pool made again while its old workers live)."""
    from dist_utils import run_ranks

    for counts in run_ranks(_twenty_worlds, 2, str(shm), env={"LOCAL_WORLD_SIZE": 1}, timeout=240):
        names = counts[-1][0]
        assert len(set(names)) == len(names) and _kinds(names) == _kinds(counts[1][0]), counts
        assert counts[-1][1:] == counts[1][1:], counts


def test_a_save_staged_in_a_world_that_is_gone_is_abandoned(tmp_path):
    """A save staged before the fault whose upload starts in the next world (``abort``,
    the group rebuilt): it raises, and its step is never committed; the next save is."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_dcp import Tier, TieredConfig, TieredWriter, abort, latest_step

    port = free_port()
    base = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cfg = TieredConfig("gone", [Tier(str(tmp_path / "ram"), keep=2)])
    dist.init_process_group("gloo", store=dist.PrefixStore("_inprocess_0", base), rank=0, world_size=1)
    try:
        writer = TieredWriter(cfg, step=1)
        staged = writer.stage({"w": torch.ones(1024)})  # as async_save does, before its upload
        abort()
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore("_inprocess_1", base), rank=0, world_size=1)
        with pytest.raises(BaseException, match="world that is gone"):
            dcp.save(staged, storage_writer=writer)
        assert latest_step(cfg) is None
        dcp.save({"w": torch.ones(1024)}, storage_writer=TieredWriter(cfg, step=2))
        assert latest_step(cfg) == 2
    finally:
        dist.destroy_process_group()


def test_the_survivors_of_a_lost_rank_go_on_saving_in_a_world_of_three(shm):
    """Rank 3 is killed and not replaced: ranks 0-2 go on in a world of 3 (NvRx's default
    rank assignment shrinks the world so), on 2 nodes, each its own rack (failure domains),
    no longer even. Each reloads its newest step exactly and the saves go on, each part's
    replica on the other rack; before, every save refused the world ("needs a world size
    divisible by 2") and the Wrapper restarted again and again. (Without failure domains,
    the jump rule's refusal of the same world: test_nvrx_wrapper's SIGKILL.)"""
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    procs = [_start(r, port, shm, 0, 2, kill_at=3, sizes="4,3,3", racks=True) for r in range(4)]
    try:
        assert procs[3].wait(timeout=120) == -9, procs[3].stderr.read()[-3000:]
        rows = []
        for rank, p in enumerate(procs[:3]):
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
            rows += _worlds(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del server
    for n, loaded in ((1, 3), (2, 6)):
        got = [r for r in rows if r["world"] == n]
        assert len(got) == 3 and all(r["loaded"] == loaded and r["exact"] for r in got), got
    marker = json.loads((shm / "ram" / "1" / "inproc" / "step_000000000009" / "COMMITTED").read_text())
    assert marker["world_size"] == 3 and marker["cliques"] == [[0, 1, 2]]
    assert sorted(p.name for p in (shm / "ram" / "1" / "inproc" / "step_000000000009").glob("*.part")) == [
        f"rank_0000{r}.part" for r in range(3)
    ]


def _construct_alone(rank: int, world: int, root: str) -> bool:
    """Rank 0 alone constructs a reader and a writer with failure domains; rank 1 goes on."""
    from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter

    os.environ["RACK"] = f"rack-{rank}"
    cfg = TieredConfig(
        "alone", [Tier(f"{root}/{{node}}")], replication_factor=2, replication_jump=1, failure_domain="RACK"
    )
    if rank == 0:
        TieredReader(cfg)
        TieredWriter(cfg, step=1)
    return True


def test_one_rank_constructs_a_reader_and_a_writer_alone(tmp_path):
    """Constructors run no collective (DESIGN.md section 1): a rank that constructs them alone
    does not wait for the others (before, the reader's step agreement and the writer's
    failure-domain gather were collectives in the constructors: rank 0 hung here)."""
    from dist_utils import run_ranks

    got = run_ranks(_construct_alone, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}, timeout=60)
    assert got == [True, True]


def test_a_failed_async_save_reaches_the_loop_as_an_ordinary_exception(shm):
    """DCP raises a failed save as its CheckpointException, a BaseException that NvRx's
    Wrapper takes as the end of the job; ``tiered_dcp.inprocess.result`` raises it as a
    TieredCheckpointError (an Exception: the Wrapper restarts), naming the rank's error."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_dcp import Tier, TieredCheckpointError, TieredConfig, TieredWriter
    from tiered_dcp.inprocess import result

    cfg = TieredConfig("failing", [Tier(str(shm / "ram"), keep=2)])
    (shm / "ram" / "failing").mkdir(parents=True)
    (shm / "ram" / "failing" / "step_000000000001").symlink_to(shm)  # a link where the step goes
    fut = dcp.async_save({"w": torch.ones(1024)}, storage_writer=TieredWriter(cfg, step=1))
    with pytest.raises(TieredCheckpointError, match="a link, or a file") as e:
        result(fut)
    assert isinstance(e.value, Exception) and type(e.value.__cause__).__name__ == "CheckpointException"
    ok = dcp.async_save({"w": torch.ones(1024)}, storage_writer=TieredWriter(cfg, step=2))
    result(ok)  # a save that succeeds returns as DCP's future does


def test_waiting_for_a_save_lets_a_restart_in_at_once():
    """NvRx's monitor restarts the loop by raising an exception in the training thread; a
    thread blocked in ``future.result()`` (a save stuck in a collective with a lost rank)
    takes it only when the save gives up, at the process group's timeout. ``result`` waits
    in slices: the exception gets in within a fraction of a second."""
    import concurrent.futures
    import ctypes
    import threading
    import time

    from tiered_dcp.inprocess import result

    class Restart(Exception):
        pass

    waiting = threading.Event()

    class Stuck(concurrent.futures.Future):  # a save that never ends
        def result(self, timeout=None):
            waiting.set()
            return super().result(timeout)

    main = threading.get_ident()

    def interrupt() -> None:
        waiting.wait()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(Restart))

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(Restart):
        result(Stuck(), timeout=20)
    assert time.monotonic() - t0 < 10  # got in while it waited, not at the end of its 20 s


def test_abort_waits_for_an_upload_at_work_but_not_for_a_failed_save_still_held(shm, monkeypatch):
    """``abort`` waits up to its timeout for an upload or commit still running and returns
    how many were still at work, and does not wait for a save whose future failed and still
    holds its staged state: nothing of ours runs for that one. Before, it waited for every
    staging slot not yet released, the whole timeout (1 s) at every NvRx restart, as the
    failed save's traceback held its staged dict until gc. No process group here: leaving
    the world has no wait to end (that part: the test below)."""
    import gc
    import threading
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_dcp import Tier, TieredConfig, TieredWriter, abort, latest_step
    from tiered_dcp.ranks import worlds
    from tiered_dcp.save.staging import POOL

    cfg = TieredConfig("aborting", [Tier(str(shm / "ram"), keep=2)])
    (shm / "ram" / "aborting").mkdir(parents=True)
    (shm / "ram" / "aborting" / "step_000000000001").symlink_to(shm)  # step 1 fails
    failed = dcp.async_save({"w": torch.ones(1 << 16)}, storage_writer=TieredWriter(cfg, step=1))
    assert failed.exception(timeout=30) is not None
    assert POOL.in_flight() >= 1  # its slot: held until DCP's dict goes (here: with the future)
    started = time.monotonic()
    assert abort(timeout=30.0) == 0
    assert time.monotonic() - started < 30.0  # it did not wait its timeout out for that slot

    entered, gate = threading.Event(), threading.Event()

    class Held(TieredWriter):  # an upload held in write_data until the test lets it go
        def _write_part(self, *args):  # in write_data, inside its ``worlds.working`` block
            entered.set()
            assert gate.wait(120), "the test never let the upload go"
            return super()._write_part(*args)

    uploading = dcp.async_save({"w": torch.ones(1 << 16)}, storage_writer=Held(cfg, step=2))
    try:
        assert entered.wait(60), "the upload never reached write_data"
        started = time.monotonic()
        assert abort(timeout=0.5) == 1  # still at work when the time ran out: not waited for further
        assert time.monotonic() - started >= 0.5  # it waited its timeout first
        assert latest_step(cfg) is None and not uploading.done()

        wait_quiet = worlds.wait_quiet

        def let_go_then_wait(timeout: float) -> int:  # the upload goes on only once abort waits
            gate.set()
            return wait_quiet(timeout)

        monkeypatch.setattr(worlds, "wait_quiet", let_go_then_wait)
        assert abort(timeout=60.0) == 0  # waited for it to end: its step committed by then
        assert latest_step(cfg) == 2
    finally:
        gate.set()  # a failed check leaves no upload held for the tests after it
    uploading.result(timeout=60)
    del failed
    gc.collect()  # the failed save's traceback holds its slot: freed here, not in a later test


def _leave_while_waiting(rank: int, world: int) -> str:
    """Both ranks wait on one key of an operation that no rank sets, as a save's commit
    agreement waits for a rank that is gone; rank 0's wait is a save's work in progress
    (``worlds.working``, as its upload is), and rank 0 calls ``abort`` once it waits. What
    ended each rank's wait."""
    import threading
    import time

    from tiered_dcp import abort
    from tiered_dcp.ranks import worlds

    op = worlds.Op("leaving", "save", 1, 120.0)  # the same name on both ranks; waits end at 120 s
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            with worlds.working():
                op.wait(op.key("agreed"), "the commit agreement")
        except Exception as e:  # noqa: BLE001 - what ended it is the result
            ended.append(e)

    if rank == 1:
        wait()
    else:
        waiting = threading.Thread(target=wait)
        waiting.start()
        deadline = time.monotonic() + 60
        while not worlds.waits_now():  # the wait is in progress
            assert time.monotonic() < deadline, "the wait never began"
            time.sleep(0.01)
        # the wait ends first (else the work went on to its 120 s and abort returned 1 at 30 s)
        assert abort(timeout=30.0) == 0
        waiting.join()
    (e,) = ended
    return f"{type(e).__name__}: {e}"


def test_abort_ends_every_wait_on_other_ranks_here_and_on_the_others():
    """``abort`` leaves the world first, then waits for the saves at work: a wait of this
    process on other ranks ends at once with ``AbortedError`` (not at its timeout, which a
    rank that is gone would need), so the save's work ends within ``abort``'s wait, and the
    same wait on another rank ends with ``PeerLostError`` naming the rank that left."""
    from dist_utils import run_ranks

    here, other = run_ranks(_leave_while_waiting, 2, env={"LOCAL_WORLD_SIZE": 1}, timeout=240)
    assert here.startswith("AbortedError:") and "tiered_dcp.abort" in here, here
    assert other.startswith("PeerLostError:") and "rank 0 left the world (tiered_dcp.abort)" in other, other
