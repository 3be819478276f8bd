"""Data-parallel replicas on a CUDA device compared at a sync save: each copy is digested
where it lies (on the GPU, no copy to the host), and one flipped bit in one rank's replica
marks its step. Skipped without CUDA (CI has none); run on a GPU machine as
``python -m pytest -q tests/gpu``. ``tests/test_replicas.py`` runs the same path on CPU
tensors by emptying ``replica_check.HOST``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dist_utils, test_replicas


def _cuda_replicas_job(rank: int, world: int, root: str) -> int:
    import torch.distributed as dist
    from test_replicas import _save, flip_bit, ram_config

    from tiered_dcp import latest_step, shutdown
    from tiered_dcp.save import replica_check

    cfg = ram_config(root, "cuda")
    for step in (1, 2, 3):
        g = torch.Generator(device="cuda").manual_seed(step)
        state = {
            "w": torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16),
            "b": torch.randn(4097, device="cuda", generator=g),
            f"own{rank}": torch.full((8,), float(rank), device="cuda"),
        }
        if step == 2 and rank == 1:
            flip_bit(state["w"], byte=1 << 19, bit=5)
        _save(state, cfg, step, "sync")
    dist.barrier()
    shutdown()
    assert "cuda" not in replica_check.HOST  # the device's own digests, not the host's
    return latest_step(cfg)


def test_a_flipped_bit_in_a_gpu_replica_marks_its_step(tmp_path):
    from dist_utils import run_ranks
    from test_replicas import marker

    assert run_ranks(_cuda_replicas_job, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}) == [3, 3]
    m1, m2, m3 = (marker(str(tmp_path), "cuda", s) for s in (1, 2, 3))
    assert m1.replicas_agree and m3.replicas_agree
    assert (m2.replica_mismatch, m2.replica_ranks) == (["w"], [0, 1])
