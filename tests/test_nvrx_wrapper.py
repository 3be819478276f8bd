"""tiered-dcp inside NVIDIA's in-process restart, for real: nvidia-resiliency-ext's
``inprocess.Wrapper`` (installed by ``scripts/setup.sh --test``) around a training function,
4 ranks as 2 nodes on gloo, a RAM tier per node with replicas across nodes, tiered-dcp's
``Abort`` composed with NvRx's ``AbortTorchDistributed``: one rank SIGKILLed, and three
exceptions in turn on three ranks, one node's RAM tier wiped at the third."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_dcp.cli.local_servers import free_port

NVRX = Path(__file__).resolve().parent.parent / ".venv" / "nvrx"  # setup.sh --test puts NvRx there
if not (NVRX / "nvidia_resiliency_ext" / "inprocess").is_dir():  # never on this process's path:
    pytest.skip("nvidia-resiliency-ext: setup.sh --test", allow_module_level=True)  # megatron would use it
TRAIN = str(Path(__file__).resolve().parent.parent / "benchmarks" / "inprocess_train.py")  # the bench's loop


def _rows(stdout: str, event: str) -> list[dict]:
    rows = [json.loads(line[len("EVENT ") :]) for line in stdout.splitlines() if line.startswith("EVENT ")]
    return [r for r in rows if r["event"] == event]


def _job(
    root: Path, fault: str, steps: int = 12, fault_at: int = 6
) -> tuple[list[tuple[int, list[dict], list[dict]]], str]:
    """Run the 4 ranks (1 MiB each, to ``steps``, rank 1 failing after ``fault_at``); per rank: its
    exit code, its reloads (one per call of the function) and its ends; and, for a failed
    assertion, each rank's events, the end of its stderr and its NvRx monitor's log.

    The loop waits for each save with a plain ``future.result()``, as DCP's examples do, and
    its group's collectives wait 10 min: a survivor whose save waits on the failed rank is
    freed by tiered-dcp's abort, or by nothing before NvRx's timeouts (60 s, then a kill)."""
    port = free_port(span=3)  # the job uses MASTER_PORT + 1 and + 2 too (inprocess_train.py)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}  # CPU: no GPU health checks
    env.update(BENCH_WAIT="plain", BENCH_PG_TIMEOUT="600")
    env.update(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(NVRX)) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, TRAIN, "nvrx", fault, str(root), "1", str(steps), str(fault_at)],
            env={**env, "RANK": str(r), "GROUP_RANK": str(r // 2)},  # its node, as torchrun says it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    out, report, faults = [], [], []
    try:
        for r, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=150)
            except subprocess.TimeoutExpired:  # what every rank said, for the failure's report
                for q in procs:
                    q.kill()
                for i, q in enumerate(procs[r:], r):
                    try:  # again, once killed, as subprocess's docs say; a child may hold the pipes
                        o, e = q.communicate(timeout=30)
                    except subprocess.TimeoutExpired:
                        o, e = "", "(its pipes stayed open: a child of it still holds them)"
                    report += [f"--- rank {i}: not done in 150 s (exit {q.poll()})", o[-3000:], e[-3000:]]
                report += [m.read_text()[-3000:] for m in sorted(root.glob("nvrx_monitor_*.log"))]
                pytest.fail("\n".join(report))
            out.append((p.returncode, _rows(stdout, "loaded"), _rows(stdout, "done")))
            faults += _rows(stdout, "fault")
            monitor = root / f"nvrx_monitor_{r}.log"
            report += [f"--- rank {r}: exit {p.returncode}", stdout, stderr[-3000:]]
            report += [monitor.read_text()[-3000:] if monitor.exists() else "(no monitor log)"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for _, calls, _ in out:  # each reload soon after its fault: before, NvRx gave up at 60 s
        for call in calls[1:]:
            before = max(f["t"] for f in faults if f["t"] < call["t"])
            assert call["t"] - before < 30, "\n".join(report)
    return out, "\n".join(report)


def test_a_rank_killed_the_other_three_reload_and_train_on_in_a_world_of_three(shm):
    """Rank 1 is SIGKILLed: NvRx shifts the others to ranks 0-2 of a world of 3; each
    reloads step 6 exactly (its own shard) and saves on to step 12, each part's replica on
    the other node; before, every save refused the world of 3 and the Wrapper looped."""
    ranks, report = _job(shm, "kill")
    assert ranks[1][0] == -9, report
    for code, calls, done in [r for i, r in enumerate(ranks) if i != 1]:
        assert code == 0 and len(done) == 1, report
        assert [(c["step"], c["exact"], c["world"]) for c in calls] == [(0, True, 4), (6, True, 3)], report
    for node in (0, 1):  # every part of the world of 3 on both nodes
        step = shm / "ram" / str(node) / "bench" / "step_000000000012"
        assert json.loads((step / "COMMITTED").read_text())["cliques"] == [[0, 1, 2]]
        assert len(list(step.glob("rank_*.part"))) == 3


def test_three_faults_in_one_job_each_reload_exact_the_last_with_a_node_tier_wiped(shm):
    """Ranks 1, 2 and 3 raise in turn after steps 4, 8 and 12, node 0's RAM tier wiped at the
    third: every rank re-enters each time in its own process and reloads the step just
    saved, exactly; the third time node 0's ranks read their whole state from their peers
    on node 1 (their own tier holds nothing), and the job trains on to step 16."""
    ranks, report = _job(shm, "three", steps=16, fault_at=4)
    for rank, (code, calls, done) in enumerate(ranks):
        assert code == 0 and [d["step"] for d in done] == [16], report
        got = [(c["step"], c["exact"], c["world"]) for c in calls]
        assert got == [(0, True, 4), (4, True, 4), (8, True, 4), (12, True, 4)], report
        part = calls[1]["own"]  # its 1 MiB tensor and its step: the bytes of its whole state
        assert part > 1 << 20, report
        read = [(c["own"], c["peer"], c["shared"]) for c in calls[1:]]
        # intact, then node 0's ranks (0 and 1) all from their peers; never a shared tier
        assert read == [(part, 0, 0), (part, 0, 0), (0, part, 0) if rank < 2 else (part, 0, 0)], report
