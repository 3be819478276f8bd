"""Emergency saves on preemption: a real SIGTERM between two scheduled saves makes the loop
save its current step (tests/preemption_worker.py), on the fastest tier and, through the
writer process after the trainer exited, on the slower one; the next start loads it."""

import os
import re
import signal
import subprocess
import sys
import time

import preemption_worker as worker
import preloaded
import pytest
from dist_utils import free_port
from test_writer_process import load_exact, only

from tiered_dcp import TieredReader, TieredWriter, status, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def start(mode: str, root: str, env: dict | None = None) -> subprocess.Popen:
    """The trainer, its stderr in a file (a pipe nobody reads could fill and stall it)."""
    name = f"{root}/stderr.{(env or {}).get('RANK', 0)}"
    with open(name, "w") as err:
        proc = preloaded.Popen(
            [sys.executable, os.path.join(HERE, "preemption_worker.py"), mode, root],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    proc.stderr_file = name  # type: ignore[attr-defined]
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    with open(proc.stderr_file) as f:  # type: ignore[attr-defined]
        return f.read()[-4000:]


def wait_for_line(proc: subprocess.Popen, line: str, timeout: float = 300) -> None:
    """Read the trainer's output until ``line`` (it prints one line per save)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if not got:
            raise AssertionError(f"trainer ended before {line!r}: {seen} {stderr_of(proc)}")
        seen.append(got.strip())
        if got.strip() == line:
            return
    raise AssertionError(f"no {line!r} after {timeout} s: {seen}")


def finish(proc: subprocess.Popen) -> int:
    """The trainer's exit: status 0 and its emergency step."""
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + stderr_of(proc)
    found = re.findall(r"^emergency (\d+)$", out, re.M)
    assert len(found) == 1, out + stderr_of(proc)
    return int(found[0])


def committed(cfg, tier: int) -> set[int]:
    return {s.step for s in status(only(cfg, tier)) if s.state == "committed"}


@pytest.mark.parametrize("mode", ["ask", "callback"])
def test_sigterm_between_scheduled_saves_takes_an_emergency_save(tmp_path, mode):
    root = str(tmp_path)
    cfg = worker.config(root)
    proc = start(mode, root)
    wait_for_line(proc, "scheduled 10")  # its upload may still be in flight
    os.kill(proc.pid, signal.SIGTERM)
    step = finish(proc)
    # newer than the last scheduled save, and a step no tier's every= takes
    assert 10 < step < 20 and not cfg.tiers_for(step)
    assert committed(cfg, 0) == {10, step}  # the fastest tier holds it, committed before the exit
    # the trainer is gone: only its writer process can copy the step to the slower tier
    wait_for(cfg, step, emergency=True, timeout=120)
    for tier in (0, 1):
        load_exact(only(cfg, tier), step, worker.state(step))
    assert TieredReader(cfg).step == step  # what the next start loads
    assert TieredReader(only(cfg, 1)).step == step  # also with the node's RAM tier lost


def test_ranks_agree_on_the_emergency_step(tmp_path):
    """Only one rank is told; both save the same step, so it is complete."""
    root = str(tmp_path)
    cfg = worker.config(root)
    port = free_port()
    procs = [
        start(
            "ask",
            root,
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for rank in (0, 1)
    ]
    wait_for_line(procs[0], "scheduled 10")
    os.kill(procs[1].pid, signal.SIGTERM)
    steps = [finish(p) for p in procs]
    assert steps[0] == steps[1] and 10 < steps[0] < 20
    step = steps[0]
    assert committed(cfg, 0) == {10, step}
    wait_for(cfg, step, emergency=True, timeout=120)
    expected = worker.state(step, 0) | worker.state(step, 1)
    for tier in (0, 1):
        load_exact(only(cfg, tier), step, expected)


def test_emergency_writer_takes_every_tier_and_wait_for_follows(tmp_path):
    cfg = worker.config(str(tmp_path))
    with pytest.raises(ValueError, match="no tier takes step 7.*emergency=True"):
        TieredWriter(cfg, 7)
    assert TieredWriter(cfg, 7, emergency=True).tier_indexes == [0, 1]
    assert TieredWriter(cfg, 10, emergency=True).tier_indexes == [0, 1]
    with pytest.raises(ValueError, match="never takes step 7"):
        wait_for(cfg, 7, tier=1, timeout=0)
    with pytest.raises(TimeoutError):
        wait_for(cfg, 7, tier=1, timeout=0.1, emergency=True)
