"""Run a function on several real processes joined by a gloo process group.

Ranks are forked from a ``forkserver`` that imported what ``preloaded.PRELOAD`` names once
for the whole test session: a fresh interpreter (``spawn``) spends ~4 CPU-seconds importing
them, per rank, on a 2-core machine, which was most of the suite's time. The server is a
clean single-threaded process (no process group, no pool), so each rank still starts as a
fresh one would; it gets the test's environment as it is at the call, as a spawned rank would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import preloaded
import torch.multiprocessing as mp

from tiered_dcp.cli.local_servers import free_port

_CONTEXT: Any = None


def _context() -> Any:
    """The session's forkserver context (started on first use, preloading what ``preloaded`` does)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(preloaded.PRELOAD)
    return _CONTEXT


def _child(fn: Callable, rank: int, world: int, port: int, env: dict, args: tuple, q: Any) -> None:
    os.environ.clear()  # the caller's environment now, not the server's from when it started
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", result))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(
    fn: Callable, world: int, *args: Any, env: dict | None = None, timeout: float = 180
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return each rank's result."""
    env = {**os.environ, "LOCAL_WORLD_SIZE": world, **(env or {})}
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, env, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, status, value = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def launch(script: str, world: int, argv: list[str], local_world: int = 1, timeout: float = 90) -> list:
    """Run ``python script *argv`` as ``world`` ranks of one job (``local_world`` a node),
    each a fork of the preloaded interpreter (``preloaded.py``):
    each rank's ``(returncode, stdout, stderr)``, as text. A rank still running after
    ``timeout`` seconds fails the test, every rank killed."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_WORLD_SIZE=str(local_world),
        )
        cmd = [sys.executable, script, *argv]
        procs.append(preloaded.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} hung") from None
        out.append((p.returncode, stdout.decode(), stderr.decode()))
    return out
