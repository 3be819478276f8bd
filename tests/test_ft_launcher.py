"""tiered-dcp under NVIDIA's ft_launcher, for real: nvidia-resiliency-ext 0.7.0's launcher
(``scripts/setup.sh --test`` unpacks it into ``.venv/nvrx``), in-job restarts on its barrier
rendezvous with a hot spare. Three launchers on this host, each a node
(``NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1``): 2 active nodes of 2 ranks and a spare.
``benchmarks/inprocess_train.py`` is the loop: 1 MiB a rank, an async save every step to a
RAM tier per node (``ROOT/ram/<group rank>``), each part replicated on the other node. One
job takes both faults in turn: a worker killed in a save, then a node lost."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_inprocess import TRAIN, start_ft_launchers  # noqa: E402 - the benchmark's loop and launch line

NVRX = REPO / ".venv" / "nvrx"  # setup.sh --test puts NvRx there, off this process's path
if not (NVRX / "nvidia_resiliency_ext" / "fault_tolerance").is_dir():
    pytest.skip("nvidia-resiliency-ext: setup.sh --test", allow_module_level=True)
STEPS, FAULT_AT = 8, 3  # rank 1 SIGKILLed in step 3's save; rank 2's node lost after step 6's
KILL_IN_SAVE, NODE_LOST = FAULT_AT, 2 * FAULT_AT
KILLED_BY_LAUNCHER = "forcefully exiting via 9"  # torch's line when a stop timeout ends in SIGKILL
STORE_HOST_GONE = "Failed to recv, got 0 bytes"  # a launcher still reading the store at its close


@pytest.fixture(scope="module")
def job() -> Iterator[list[tuple[int, str, str]]]:
    """One job, both faults in turn (a launcher's start and the first workers' imports are
    most of a job's cost here): the three launchers' exit codes, stdouts (their ranks'
    events) and stderrs. Each has a place in the barrier's order (``GROUP_RANK``: its
    infrastructure rank): launcher 0, which hosts the rendezvous, is always group rank 0; the
    first round closes once two have joined, leaving launcher 1 or 2 as the spare."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(prefix="tdcp-test-", dir="/dev/shm"))  # a real tmpfs, as `shm`
    args = [TRAIN, "torchrun", "kill-in-save+node", str(root), "1", str(STEPS), str(FAULT_AT)]
    # files, not pipes: a process a launcher leaves behind (NvRx's rank monitors outlive a
    # killed one) would hold a pipe open, and reading it to its end would never end
    paths = [(root / f"launcher{n}.out", root / f"launcher{n}.err") for n in range(3)]
    files = [(open(out, "w"), open(err, "w")) for out, err in paths]  # noqa: SIM115 - closed below
    # a restart per fault and one more: on a loaded machine a rank's first start can fail in
    # init_process_group, before any fault ("Failed to recv", seen with its imports taking
    # 20 s), and that restart must not be one a fault needs
    launchers = start_ft_launchers(str(root), args, {}, restarts=3, outputs=files)
    deadline = time.monotonic() + 300
    try:
        for p in launchers:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        yield [
            (p.returncode, out.read_text(), err.read_text())
            for p, (out, err) in zip(launchers, paths, strict=True)
        ]
    except subprocess.TimeoutExpired:  # what each launcher said, for the failure's report
        _kill_job(launchers)
        said = [
            f"--- launcher {n} (exit {p.wait()}):\n{paths[n][1].read_text()[-3000:]}"
            for n, p in enumerate(launchers)
        ]
        pytest.fail("the launchers did not finish within 300 s\n" + "\n".join(said))
    finally:
        _kill_job(launchers)
        for pair in files:
            for f in pair:
                f.close()
        shutil.rmtree(root, ignore_errors=True)


def _kill_job(launchers: list[subprocess.Popen]) -> None:
    """Every process of the job's running launchers SIGKILLed: each one's tree, and what its
    session holds beyond it (a killed launcher's rank monitors live on), so that nothing
    outlives a failed test. A launcher already reaped is passed over: its pid may be another
    process's now."""
    import psutil  # NvRx's own dependency

    live = [p for p in launchers if p.poll() is None]
    doomed: list[psutil.Process] = []
    for p in live:
        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(p.pid)
            doomed += [launcher, *launcher.children(recursive=True)]
    sessions = {p.pid for p in live}
    for proc in psutil.process_iter() if sessions else ():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) in sessions:
                doomed.append(proc)
    for proc in doomed:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _events(stdout: str, event: str) -> list[dict]:
    rows = [json.loads(line[len("EVENT ") :]) for line in stdout.splitlines() if line.startswith("EVENT ")]
    return [r for r in rows if r["event"] == event]


def _fault_time(nodes: list[tuple[int, str, str]], step: int) -> float:
    (t,) = [e["t"] for _, out, _ in nodes for e in _events(out, "fault") if e["step"] == step]
    return t


def _between(
    nodes: list[tuple[int, str, str]], event: str, start: float, end: float = float("inf")
) -> list[dict]:
    """Every rank's ``event`` between two times, by rank, each with the node that printed it."""
    rows = [{**e, "node": n} for n, (_, out, _) in enumerate(nodes) for e in _events(out, event)]
    return sorted((e for e in rows if start < e["t"] < end), key=lambda e: e["rank"])


def _exit_codes(nodes: list[tuple[int, str, str]]) -> list[int]:
    """Each launcher's exit code, where one that read the rendezvous store after launcher 0 (its
    host) ended a successful job counts as 0: NvRx 0.7.0's host keeps the store 3 s after the
    job (``launcher.py``: ``grace_period = 3.0``), and a loaded machine can make another
    launcher's last poll later (``DistNetworkError`` in its agent, exit 1). Its ranks' events
    are still checked one by one; the host's own exit code is taken as it is."""
    host_ok = nodes[0][0] == 0
    late = [n > 0 and c == 1 and host_ok and STORE_HOST_GONE in e for n, (c, _, e) in enumerate(nodes)]
    return [0 if was_late else code for was_late, (code, _, _) in zip(late, nodes, strict=True)]


def _report(nodes: list[tuple[int, str, str]]) -> str:
    parts = [f"--- node {n}: exit {code}\n{out}\n{err[-4000:]}" for n, (code, out, err) in enumerate(nodes)]
    return "\n".join(parts)


def test_a_worker_killed_in_a_save_every_rank_resumes_and_no_worker_is_sigkilled(job):
    """Rank 1 is SIGKILLed as soon as step 3's save began: every other rank's save waits on it.
    The launchers stop the other workers with SIGTERM; each leaves its save at once (rank 0:
    a rank of its host is gone; node 1's ranks: the job's store, which rank 0 hosted, is
    gone) instead of waiting until the launcher's stop timeout SIGKILLs it. Every rank
    resumes step 2, the newest step committed everywhere, exactly, and trains on."""
    report = _report(job)
    assert not any(KILLED_BY_LAUNCHER in err for _, _, err in job), report
    loaded = _between(job, "loaded", _fault_time(job, KILL_IN_SAVE), _fault_time(job, NODE_LOST))
    assert [(e["rank"], e["step"], e["exact"], e["world"]) for e in loaded] == [
        (r, KILL_IN_SAVE - 1, True, 4) for r in range(4)
    ], report


def test_a_node_killed_the_spare_takes_its_place_and_reads_its_ranks_from_peers(job):
    """Rank 2 takes its node down after step 6's save: its launcher and every process under
    it SIGKILLed, its RAM tier deleted. Node 0's ranks' next save fails (its peers are gone),
    their launcher restarts the job, and the spare joins: its ranks (2 and 3) find their RAM
    tier empty and read step 6 from their replicas on node 0, node 0's ranks from their own
    tier; nothing comes from a shared tier. Every rank resumes step 6 exactly and trains to
    the end."""
    report = _report(job)
    (killed,) = [
        n for n, (_, out, _) in enumerate(job) if any(e["step"] == NODE_LOST for e in _events(out, "fault"))
    ]
    spare = 3 - killed  # launchers 1 and 2: the one no round had taken
    assert _exit_codes(job) == [-9 if n == killed else 0 for n in range(3)], report
    loaded = _between(job, "loaded", _fault_time(job, NODE_LOST))
    assert [(e["rank"], e["step"], e["exact"], e["world"]) for e in loaded] == [
        (r, NODE_LOST, True, 4) for r in range(4)
    ], report
    assert [e["node"] for e in loaded] == [0, 0, spare, spare], report
    part = loaded[0]["own"]  # a rank's 1 MiB tensor and its step: its whole state
    assert part > 1 << 20, report
    read = [(e["own"], e["peer"], e["shared"]) for e in loaded]
    assert read == [(part, 0, 0), (part, 0, 0), (0, part, 0), (0, part, 0)], report
    assert [e["rank"] for e in _between(job, "done", _fault_time(job, NODE_LOST))] == [0, 1, 2, 3], report
