"""``run_ranks`` (``dist_utils.py``): ranks forked from the preloaded server, each on the
call's own environment; a failing rank fails the test at once with its traceback, and ranks
that outlive the timeout fail it too, none left running."""

from __future__ import annotations

import os
import time

import pytest
from dist_utils import run_ranks


def _sees(rank: int, world: int, x: str) -> tuple:
    import torch.distributed as dist

    return rank, world, dist.get_world_size(), x, os.environ["LOCAL_WORLD_SIZE"], os.getpid()


def _one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom")
    time.sleep(120)


def _hangs(rank: int, world: int, pids: str) -> None:
    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def test_each_rank_runs_the_call_in_a_group_of_its_own_process():
    got = run_ranks(_sees, 3, "a", env={"LOCAL_WORLD_SIZE": 1})
    assert [g[:5] for g in got] == [(r, 3, 3, "a", "1") for r in range(3)]
    assert len({g[5] for g in got} | {os.getpid()}) == 4


def test_a_failing_rank_fails_the_test_at_once_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="ValueError: boom") as e:
        run_ranks(_one_fails, 2)
    assert "rank 1:" in str(e.value) and "rank 0" not in str(e.value)  # the killed one is no error
    assert time.monotonic() - started < 30  # not rank 0's 120 s


def test_ranks_past_the_timeout_fail_it_and_are_killed(tmp_path):
    with pytest.raises(AssertionError, match="rank 0: was killed"):
        run_ranks(_hangs, 2, str(tmp_path), timeout=3)
    for rank in (0, 1):
        pid = int((tmp_path / str(rank)).read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_free_ports_lie_below_the_kernels_range_and_are_free_with_their_span():
    """A port the kernel never hands out by itself (a gloo listener's, an outgoing
    connection's: those of ``bind(0)``), with each port of its span free to bind."""
    import socket
    from pathlib import Path

    from tiered_dcp.cli.local_servers import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port(span=3)
        assert port >= 10000 and port + 3 <= low, (port, low)
        for p in range(port, port + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low  # where free_port's ports came from before
