"""A one-process trainer the tests kill: `python trainer_worker.py MODE ROOT`.

kill-after-save  saves a 256 MiB step 1 (sync), then SIGKILLs itself at once.
sigterm          saves step 1, starts an async_save of a 256 MiB step 2, SIGTERMs itself
                 while it is in flight (default SIGTERM action in place).
sigterm-chain    the same, with a user SIGTERM handler installed first; it records what it
                 saw and exits with status 3.
sigterm-staging  saves a 16 MiB step 1, then SIGTERMs itself from inside step 2's copy, on
                 the main thread (default staging).
sigterm-staging-bg  the same from a background staging's copy, which then takes 10 s more
                 (the staging lock held), its writer process started first.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter, latest_step
from tiered_dcp.save.staging import POOL

MiB = 1 << 20


def config(root: str) -> TieredConfig:
    return TieredConfig("trainer", [Tier(f"{root}/ram", keep=2), Tier(f"{root}/ssd", keep=2)])


def state(step: int, mib: int = 256) -> dict:
    g = torch.Generator().manual_seed(step)
    n = mib * MiB // 4 // 4
    return {f"w{i}": torch.randn(n, generator=g) for i in range(4)} | {"step": step}


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    cfg = config(root)
    if mode == "kill-after-save":
        dcp.save(state(1), storage_writer=TieredWriter(cfg, step=1))
        os.kill(os.getpid(), signal.SIGKILL)
    if mode.startswith("sigterm-staging"):
        background = mode == "sigterm-staging-bg"
        if background:
            TieredWriter(cfg, step=1).prepare(state(1, 16))  # the writer process, started
        dcp.save(state(1, 16), storage_writer=TieredWriter(cfg, step=1))  # its writer copies it down
        copy = POOL.copier.copy_into

        def signalled(slot, ex):
            os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread
            print("signalled", flush=True)
            if background:
                time.sleep(10)  # a long copy, the staging lock held
            return copy(slot, ex)

        POOL.copier.copy_into = signalled
        dcp.async_save(state(2), storage_writer=TieredWriter(cfg, step=2, background_staging=background))
        time.sleep(60)
        print("not reached", flush=True)
        sys.exit(0)
    if mode == "sigterm-chain":

        def user_handler(signum, frame):
            with open(f"{root}/user_handler", "w") as f:
                f.write(f"latest={latest_step(cfg)} in_flight={POOL.in_flight()}")
            os._exit(3)

        signal.signal(signal.SIGTERM, user_handler)
    dcp.async_save(state(1, 4), storage_writer=TieredWriter(cfg, step=1)).result()
    dcp.async_save(state(2), storage_writer=TieredWriter(cfg, step=2))
    print(f"in flight: {POOL.in_flight()}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
    print("not reached", flush=True)
