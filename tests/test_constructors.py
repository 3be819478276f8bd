"""Constructors store their arguments: building a TieredWriter or a TieredReader runs no
collective, so one rank of a multi-rank job may build one while the others do not.

Two real ranks on gloo, as two nodes in two racks: the config has failure domains (the
writer gathers every rank's) and a process group is up (the reader's step is agreed by every
rank), the two things that would make a constructor wait for the other rank.
"""

import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter

ALONE_S = 3.0  # a constructor that waits for the other rank takes the peer timeout at least


def _config(root: str) -> TieredConfig:
    return TieredConfig(
        "alone",
        [Tier(f"{root}/ram/{{node}}", keep=2)],
        replication_factor=2,
        replication_jump=1,
        failure_domain="RACK",
        peer_timeout=2 * ALONE_S,
    )


def _build_alone(cfg: TieredConfig) -> str:
    """Build a writer and a reader on this rank only: "ok", or what went wrong."""
    outcome: list[str] = []

    def build() -> None:
        try:
            TieredWriter(cfg, step=1)
            TieredReader(cfg)
            outcome.append("ok")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=build, daemon=True)
    t.start()
    t.join(ALONE_S)
    return outcome[0] if outcome else f"blocked for {ALONE_S}s"


def _one_rank_builds_then_both_save_and_load(rank: int, world: int, root: str) -> dict:
    os.environ["RACK"] = f"rack-{rank}"
    cfg = _config(root)
    alone = _build_alone(cfg) if rank == 0 else "not built"
    dist.barrier()
    state = {f"w{rank}": torch.arange(6.0) + 10 * rank}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    target = {f"w{rank}": torch.zeros(6)}
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    return {"alone": alone, "step": reader.step, "exact": torch.equal(target[f"w{rank}"], state[f"w{rank}"])}


def test_one_rank_alone_builds_a_writer_and_a_reader_and_the_job_still_saves_and_loads(tmp_path):
    results = run_ranks(
        _one_rank_builds_then_both_save_and_load, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}, timeout=60
    )
    assert results[0]["alone"] == "ok", results
    assert [(r["step"], r["exact"]) for r in results] == [(1, True), (1, True)], results
