"""Loads onto a CUDA device through the pinned ring (``device_reads``): exact for every
kind of record, the pieces of a resharded read, a converted dtype, and a flipped byte that
falls back to the next tier. Skipped without CUDA (CI has none); run on a GPU machine as
``python -m pytest -q tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiered_dcp.storage.codec import CHUNK_BYTES
from tiered_dcp.storage.format import part_key, read_index
from tiered_dcp.storage.local import LocalStorage

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown
from tiered_dcp.load.device_reads import RING_SLOTS, ring_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def state(step: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {
        "big": torch.randn(5 * CHUNK_BYTES // 8, device="cuda", generator=g),
        "rows": torch.randn(3000, 1024, device="cuda", generator=g),
        "bf16": torch.randn(1000, 513, device="cuda", generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 40, (4097,), device="cuda", generator=g),
        "t": torch.randn(300, 200, device="cuda", generator=g).t(),
        "scalar": torch.tensor(2.5 + step, device="cuda"),
        "step": step,
    }


def zeros(s: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in s.items()}


def assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].device.type == "cuda" and torch.equal(got[k].cpu(), v.cpu()), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_cuda_state_loads_exactly_onto_the_gpu(tmp_path, shm, compression, how):
    cfg = TieredConfig(
        "run",
        [
            Tier(f"/dev/shm/{tmp_path.name}/{{node}}", keep=2),
            Tier(str(tmp_path / "ssd/{node}"), compression=compression),
        ],
    )
    want = state(1)
    writer = TieredWriter(cfg, step=1)
    if how == "sync":
        dcp.save(want, storage_writer=writer)
    else:
        dcp.async_save(want, storage_writer=writer).result()
    shutdown()
    disk_alone = TieredConfig("run", cfg.tiers[1:])  # the same files, read from the disk tier
    for reading in (cfg, disk_alone):
        got = zeros(want)
        dcp.load(got, storage_reader=TieredReader(reading, 1))
        assert_same(got, want)
    assert ring_for(torch.device("cuda", torch.cuda.current_device())).peak <= RING_SLOTS


def test_a_float32_target_of_a_bf16_item_and_a_piece_of_rows(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"))])
    want = state(2)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=2))
    got = {"bf16": torch.zeros(1000, 513, device="cuda")}
    dcp.load(got, storage_reader=TieredReader(cfg))
    assert torch.equal(got["bf16"].cpu(), want["bf16"].float().cpu())
    shutdown()


def test_a_flipped_byte_on_the_fast_tier_falls_back_to_the_disk_tier_on_the_gpu(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}")), Tier(str(tmp_path / "ssd/{node}"))])
    want = state(3)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=3))
    shutdown()
    root = Path(tmp_path / "ram/0")
    rec = next(
        r for k, r in read_index(LocalStorage(str(root)), "run", 3, 0).records.items() if k.fqn == "big"
    )
    with open(root / part_key("run", 3, 0), "r+b") as f:
        f.seek(rec.offset + CHUNK_BYTES + 11)
        b = f.read(1)
        f.seek(rec.offset + CHUNK_BYTES + 11)
        f.write(bytes([b[0] ^ 0xFF]))
    got = zeros(want)
    reader = TieredReader(cfg)
    dcp.load(got, storage_reader=reader)
    assert_same(got, want)
    assert [f.kind.name for fs in reader._reads.failures.values() for f in fs] == ["DAMAGED"]


def _save_lose_node_1_load(rank: int, world: int, root: str) -> bool:
    """Two ranks as two nodes, each part also on the other node; node 1's tier wiped; each
    loads onto the GPU: rank 1 every item from rank 0, over the peer exchange, then the ring."""
    import shutil

    import torch.distributed as dist

    cfg = TieredConfig("peers", [Tier(f"{root}/ram/{{node}}")], replication_factor=2, replication_jump=1)
    mine = {k: v for k, v in state(4 + rank).items() if isinstance(v, torch.Tensor)}
    want = {f"{k}.{rank}": v for k, v in mine.items()}
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    shutdown()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{root}/ram/1")
    dist.barrier()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = TieredReader(cfg)
    dcp.load(got, storage_reader=reader)
    assert_same(got, want)
    return sorted(reader._reads.read_from) == (["own"] if rank == 0 else ["peer"])


def test_items_from_a_peer_land_on_the_gpu_through_the_ring(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dist_utils
    from dist_utils import run_ranks

    assert run_ranks(_save_lose_node_1_load, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}) == [True, True]
