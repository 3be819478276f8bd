"""A process that saves and loads with tiered-dcp, then forks a child that saves and loads on
its own (``test_forks.py``): one run, its staging mode on the command line.

    python fork_worker.py ROOT default|background

The parent saves steps 1 and 2 (a RAM tier, and a zstd disk tier that takes every step
through its writer process), loads step 1 from the zstd tier, starts the async save of step
3 and forks while it is in flight. The child saves steps 1 and 2 of a namespace of its own,
loads step 2 (RAM) and step 1 (zstd) and checks every byte; the parent then finishes its
save. Each prints one line; the child exits 0 when all it loaded was exact.
"""

import os
import signal
import sys

import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, load_latest, wait_for

ROOT, MODE = sys.argv[1], sys.argv[2]
N = 3 << 20  # 12 MiB of float32: several chunks to read and decode in parallel


def config(namespace: str) -> TieredConfig:
    return TieredConfig(
        namespace,
        [
            Tier(f"{ROOT}/ram/{{node}}", every=1, keep=2),
            Tier(f"{ROOT}/disk/{{node}}", every=1, keep=3, compression="zstd"),
        ],
    )


def state(step: int) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32) + step, "b": torch.full((5,), float(step))}


def save(cfg: TieredConfig, step: int):
    writer = TieredWriter(cfg, step=step, background_staging=MODE == "background")
    return dcp.async_save(state(step), storage_writer=writer)


def wait(future) -> None:
    getattr(future, "upload_completion", future).result()


def exact(loaded: dict, step: int) -> bool:
    return all(torch.equal(loaded[k], v) for k, v in state(step).items())


def load(cfg: TieredConfig, step: int | None = None) -> tuple[int, bool]:
    got = {"w": torch.zeros(N), "b": torch.zeros(5)}
    if step is None:
        step = load_latest(got, cfg)
    else:
        dcp.load(got, storage_reader=TieredReader(cfg, step=step))
    return step, exact(got, step)


def child() -> int:
    signal.alarm(30)  # a child that waits on its parent's pools or saves dies here, not never
    cfg = config("child")
    for step in (1, 2):
        wait(save(cfg, step))
    wait_for(cfg, 1, tier=1, timeout=30)
    ram, disk = load(cfg), load(cfg, 1)
    print(f"child: loaded {ram} and {disk}", flush=True)
    return 0 if ram == (2, True) and disk == (1, True) else 1


def main() -> None:
    cfg = config("parent")
    for step in (1, 2):
        wait(save(cfg, step))
    wait_for(cfg, 1, tier=1, timeout=30)
    assert load(cfg, 1) == (1, True)
    in_flight = save(cfg, 3)
    pid = os.fork()
    if pid == 0:
        os._exit(child())
    _, status = os.waitpid(pid, 0)
    wait(in_flight)
    print(f"parent: child exited {os.waitstatus_to_exitcode(status)}; loaded {load(cfg)}", flush=True)


if __name__ == "__main__":
    main()
