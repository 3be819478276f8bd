"""A rank SIGKILLed in the middle of a save or before a load: the previous step loads on
restart, and the survivors say which step, phase and rank."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from crash_worker import config
from dist_utils import free_port, launch, run_ranks
from peer_loss_worker import config as peer_loss_config
from test_cli_export import cli

from tiered_dcp import TieredReader, latest_step, status

HERE = os.path.dirname(__file__)


def _reload(rank, world, root):
    reader = TieredReader(config(root))
    target = {f"r{r}": torch.zeros(1 << 18) for r in range(world)} | {"step": -1}
    dcp.load(target, storage_reader=reader)
    return reader.step, target["step"], [float(target[f"r{r}"].max()) for r in range(world)]


def test_rank_killed_mid_save_leaves_previous_step_loadable(tmp_path):
    root = str(tmp_path)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_WORLD_SIZE="2",
        )
        procs.append(
            preloaded.Popen(
                [sys.executable, os.path.join(HERE, "crash_worker.py"), root, "256"],
                env=env,
                stderr=subprocess.DEVNULL,
            )
        )
    dirty = os.path.join(root, "ram/0/crash/step_000000000002/rank_00001.part.dirty-*")
    deadline = time.time() + 120
    killed_mid_write = False
    while time.time() < deadline:
        files = glob.glob(dirty)
        if files and os.path.getsize(files[0]) > 0:
            procs[1].send_signal(signal.SIGKILL)
            killed_mid_write = True
            break
        assert procs[1].poll() is None, "rank 1 ended before it could be killed"
        time.sleep(0.001)
    assert killed_mid_write, "rank 1 never started writing step 2"
    # rank 0 writes its own part, then waits in the commit agreement for rank 1 (up to the
    # peer timeout, 2 minutes): killed there, as a launcher ends the survivors of a job
    index = os.path.join(root, "ram/0/crash/step_000000000002/rank_00000.index")
    while not os.path.exists(index) and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.01)
    assert os.path.exists(index), "rank 0 never finished writing its part of step 2"
    procs[0].kill()
    procs[0].wait()  # reaped: a zombie still counts as alive to the owner check
    procs[1].wait()

    cfg = config(root)
    assert latest_step(cfg) == 1  # keep=1: retention must not have run before a commit
    states = {(r.tier_index, r.step): r.state for r in status(cfg)}
    # rank 1 SIGKILLed, rank 0 killed in the agreement: no process of the save is left
    assert states[(0, 1)] == "committed" and states[(0, 2)] == "incomplete"
    r = cli("ls", "-n", "crash", f"{root}/ram/{{node}}", f"{root}/ssd")
    assert "step 2 on tier 0: incomplete: never committed" in r.stdout and "safe to remove" in r.stdout
    assert glob.glob(dirty), "the half-written part should still be there, under its dirty name"
    # the restarted job (same world size) resumes from step 1 on every rank
    results = run_ranks(_reload, 2, root)
    assert results == [(1, 1, [1.0, 1.0])] * 2


def _job_losing_rank_1(root: str, mode: str, world: int) -> list[tuple[dict, str]]:
    """Run tests/peer_loss_worker.py on ``world`` ranks (one per node); rank 1 SIGKILLs
    itself. Each survivor's reported error and stderr."""
    ranks = launch(os.path.join(HERE, "peer_loss_worker.py"), world, [root, mode])
    out = []
    for rank, (code, stdout, stderr) in enumerate(ranks):
        if rank == 1:
            assert code == -signal.SIGKILL
            continue
        lines = stdout.strip().splitlines()
        assert lines, f"rank {rank} reported nothing: {stderr[-2000:]}"
        out.append((json.loads(lines[-1]), stderr))
    return out


def test_peer_killed_mid_save_the_survivors_say_which_step_phase_and_rank(tmp_path):
    root = str(tmp_path)
    survivors = _job_losing_rank_1(root, "save", 4)
    assert len(survivors) == 3
    said = "step 2: rank(s) [1] stopped answering during the commit agreement"
    for _, stderr in survivors:  # DCP's own collective then raises torch's error: our line comes first
        assert said in stderr
    cfg = peer_loss_config(root)
    assert latest_step(cfg) == 1  # nothing half-written is reported as committed
    assert all(r.state != "committed" for r in status(cfg) if r.step == 2)


@pytest.mark.parametrize("mode", ["open", "latest"])
def test_peer_killed_before_a_load_raises_peer_lost_error_on_the_survivors(tmp_path, mode):
    survivors = _job_losing_rank_1(str(tmp_path), mode, 3)
    assert len(survivors) == 2
    for error, _ in survivors:
        assert error["type"] == "PeerLostError", error
        assert error["ranks"] == [1] and error["cause"] in ("RuntimeError", "DistBackendError")
        assert "rank(s) [1] stopped answering" in error["message"]
