"""torchrun in-job restarts: a rank dies mid-run, the agent restarts the job, every rank
resumes from the newest complete step on the RAM tier and ends where an uninterrupted run
ends (tests/torchrun_worker.py is the training loop)."""

import json
import os
import subprocess
import sys

import torch
import torchrun_worker as worker
from conftest import assert_state_equal

from tiered_dcp import TieredConfig, latest_step, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, DIE_AT = 8, 5


def torchrun(root: str) -> subprocess.CompletedProcess:
    """The launcher settings docs/user-guide.md recommends for restarts (see "torchrun")."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        os.path.join(HERE, "torchrun_worker.py"),
        root,
        str(STEPS),
        str(DIE_AT),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_rank_dies_torchrun_restarts_and_every_rank_resumes_from_ram(tmp_path):
    root = str(tmp_path)
    r = torchrun(root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    for rank in (0, 1):
        first = json.loads((tmp_path / f"rank{rank}.attempt0.json").read_text())
        assert first["resumed"] is None
        again = json.loads((tmp_path / f"rank{rank}.attempt1.json").read_text())  # the restart happened
        # step DIE_AT was never saved (its rank died first): the newest complete step is the one
        # before, which only the RAM tier takes (the SSD takes every 3rd)
        assert again == {"resumed": DIE_AT - 1, "step_in_state": DIE_AT - 1, "latest": DIE_AT - 1}
    assert (DIE_AT - 1) % worker.config(root).tiers[1].every != 0
    shards = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    got = {"w": torch.cat([s["w"] for s in shards]), "b": shards[0]["b"]}
    assert_state_equal(got, worker.expected(STEPS))  # what an uninterrupted run ends with
    assert torch.equal(shards[1]["b"], shards[0]["b"])
    cfg = worker.config(root)
    assert latest_step(cfg) == STEPS
    wait_for(cfg, 6, tier=1, timeout=120)  # the restarted ranks' writers filled the SSD tier
    assert latest_step(TieredConfig(cfg.namespace, [cfg.tiers[1]])) == 6
