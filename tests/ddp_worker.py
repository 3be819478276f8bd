"""A DDP training loop that torchrun runs (``test_torchrun.py``): the idiom a new user writes.

``torchrun --nproc-per-node 2 ddp_worker.py ROOT STEPS``: a DDP model on gloo, an async
save every step with no pause (the next step's all-reduces run while the save's
collectives do), without a ``process_group`` of its own; the previous save is waited for
before the next. Resumes from the newest step that loads; rank 0 writes ROOT/done.json
with the step it resumed from and the one it ended at, which a reload then checks.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredWriter, load_latest


def config(root: str) -> TieredConfig:
    return TieredConfig("ddp", [Tier(f"{root}/ram/{{node}}", every=1, keep=2)])


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = config(root)

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}

    try:
        restored = state()
        resumed = load_latest(restored, cfg)
        set_state_dict(
            model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"]
        )
    except NoCheckpointError:
        resumed = 0
    pending = None
    for step in range(resumed + 1, steps + 1):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        model(x).square().mean().backward()  # DDP's all-reduces, while the last save runs
        optimizer.step()
        optimizer.zero_grad()
        if pending is not None:
            pending.result()
        snapshot = state()
        snapshot["step"] = torch.tensor(step)
        pending = dcp.async_save(snapshot, storage_writer=TieredWriter(cfg, step=step))
    if pending is not None:
        pending.result()
    if dist.get_rank() == 0:
        with open(f"{root}/done.json", "w") as f:
            json.dump({"resumed": resumed, "ended": steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
