"""Run a function on several real processes joined by a gloo process group.

Each rank is a Python program forked from the test process's preloaded server
(``preloaded.py``), which imported torch, DCP and tiered_dcp once: a fresh interpreter spends
~4 CPU-seconds importing them, per rank, on a 2-core machine, which was most of the suite's
time. The server is a clean single-threaded process (no process group, no pool), so each rank
still starts as a fresh one would; it gets the test's environment as it is at the call and
the test process's ``sys.path``, as a ``multiprocessing`` child would, and the function and
its arguments pickled, as one would.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import preloaded

from tiered_dcp.cli.local_servers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
_RANK = f"import sys; sys.path.insert(0, {HERE!r}); import dist_utils; dist_utils.rank_main(sys.argv[1])"


def rank_main(call: str) -> None:
    """One rank of ``run_ranks``: the call in the folder ``call`` (``path.json``: the test
    process's ``sys.path``; ``call.pickle``: the function and its arguments), its outcome
    pickled to ``call/<rank>``; an error exits 1 (its traceback is the outcome)."""
    with open(os.path.join(call, "path.json")) as f:
        sys.path[:] = json.load(f)  # before unpickling: the function is found by its module
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        with open(os.path.join(call, "call.pickle"), "rb") as f:
            fn, args = pickle.load(f)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        outcome = ("ok", fn(rank, world, *args))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        outcome = ("error", traceback.format_exc())
    with open(os.path.join(call, str(rank)), "wb") as f:
        pickle.dump(outcome, f)
    # the end of a multiprocessing child: its threads joined, no atexit function run (torch's
    # finalizers of its operator registrations alone take ~40 ms a process)
    threading._shutdown()  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if outcome[0] == "error" else 0)


def run_ranks(
    fn: Callable, world: int, *args: Any, env: dict | None = None, timeout: float = 180
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return each rank's result.
    A rank that fails fails the test with its traceback, the others killed a second later;
    ranks still running after ``timeout`` seconds fail it too."""
    port = free_port()
    base = {**os.environ, "LOCAL_WORLD_SIZE": str(world), **{k: str(v) for k, v in (env or {}).items()}}
    with tempfile.TemporaryDirectory(prefix="tdcp-ranks-") as call:
        with open(os.path.join(call, "path.json"), "w") as f:
            json.dump(sys.path, f)
        with open(os.path.join(call, "call.pickle"), "wb") as f:
            pickle.dump((fn, args), f)
        procs = []
        for rank in range(world):
            rank_env = dict(
                base,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
            )
            procs.append(preloaded.Popen([sys.executable, "-c", _RANK, call], env=rank_env))
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in procs]
                if None not in codes or any(codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            grace = time.monotonic() + (1 if any(p.returncode for p in procs) else 5)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(grace - time.monotonic(), 0.01))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outcomes = []
        for rank, p in enumerate(procs):
            try:
                with open(os.path.join(call, str(rank)), "rb") as f:
                    outcomes.append(pickle.load(f))
            except FileNotFoundError:  # killed: by us (another failed, or the timeout) or not
                said = "was killed" if p.returncode == -9 else f"exited {p.returncode}"
                outcomes.append(("lost", f"{said} before it had an outcome ({timeout} s allowed)"))
    errors = [f"rank {r}:\n{v}" for r, (status, v) in enumerate(outcomes) if status == "error"]
    errors = errors or [f"rank {r}: {v}" for r, (status, v) in enumerate(outcomes) if status == "lost"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in outcomes]


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
