"""A small step written under torch 2.15, kept under ``tests/data/torch215``.

torch 2.15 pickles ``TensorProperties`` with a sixth field, the tensor's strides, which the
``__setstate__`` of older torch refuses; the tests load this step under whatever torch runs
them (CI: 2.13). Written by this script under torch 2.15.0 from PyPI, one process:

    export TIERED_DCP_RUNTIME_DIR=$(mktemp -d)
    /work/venv-t215/bin/python tests/torch215_checkpoint.py tests/data/torch215

Step 3 goes to the node-local "ram" tier (committed by the save) and to the shared zstd
"bucket" tier (by the writer process).
"""

from __future__ import annotations

import sys

import torch

STEP = 3


def config(root: str):
    from tiered_dcp import Tier, TieredConfig

    return TieredConfig(
        "t215", [Tier(f"{root}/ram/{{node}}"), Tier(f"{root}/bucket", compression="zstd", shared=True)]
    )


def state() -> dict:
    return {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "transposed": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # strides (1, 4)
        "nested": {"bf16": torch.arange(5, dtype=torch.bfloat16), "ids": [3, "three"]},
        "step": STEP,
    }


if __name__ == "__main__":
    import torch.distributed.checkpoint as dcp

    from tiered_dcp import TieredWriter, shutdown, wait_for

    cfg = config(sys.argv[1])
    dcp.save(state(), storage_writer=TieredWriter(cfg, STEP))
    wait_for(cfg, STEP, timeout=60)
    shutdown(wait=True, timeout=60)
    print(f"torch {torch.__version__}: step {STEP} written under {sys.argv[1]}")
