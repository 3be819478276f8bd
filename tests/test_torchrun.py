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
from tiered_dcp.cli.local_servers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, DIE_AT = 8, 5


def torchrun(
    script: str, *args: str, restarts: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``script`` (of this folder) on 2 ranks under torchrun; with ``restarts``, the launcher
    settings docs/user-guide.md recommends for restarts (see "torchrun")."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launch = ["--max-restarts=1", "--monitor-interval=0.1"] if restarts else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *launch]
    cmd += [os.path.join(HERE, script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_rank_dies_torchrun_restarts_and_every_rank_resumes_from_ram(tmp_path):
    root = str(tmp_path)
    r = torchrun("torchrun_worker.py", root, str(STEPS), str(DIE_AT))
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


TRAIN = os.path.join(os.path.dirname(HERE), "benchmarks", "inprocess_train.py")  # bench_inprocess's loop


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("EVENT ") :]) for line in text.splitlines() if line.startswith("EVENT ")]


def test_a_worker_killed_during_a_save_the_others_exit_at_once_and_resume_exact(tmp_path):
    """Two agents as two nodes, a rank each, a save every step; rank 1 is SIGKILLed as soon as
    step 6's save began. Its agent SIGTERMs rank 0, whose save waits on rank 1: the handler
    finds rank 1 gone and abandons the save at once (before, it waited for it until torchrun
    gave up after 30 s and SIGKILLed it). Every rank resumes step 5 exactly."""
    port = free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *common,
                f"--node-rank={n}",
                "--rdzv-id=kill",
                "--max-restarts=1",
                "--monitor-interval=0.1",
                TRAIN,
                "torchrun",
                "kill-in-save",
                str(tmp_path),
                "1",
                "9",
                "6",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in agents]
    report = "\n".join(o + e[-4000:] for o, e in outs)
    assert all(p.returncode == 0 for p in agents), report
    assert not any("forcefully exiting via 9" in e for _, e in outs), report  # nobody SIGKILLed
    # rank 0 ends by whichever comes first: its agent's SIGTERM while its save waits (the
    # handler finds rank 1 gone and abandons the save), or its save's next gloo collective,
    # which finds rank 1's connection reset (it fails by itself, the SIGTERM may still come as
    # it exits); the check above is the one that fails when the handler waits for the save
    loaded = [e for o, _ in outs for e in _events(o) if e["event"] == "loaded"]
    assert sorted((e["rank"], e["step"], e["exact"]) for e in loaded if e["step"]) == [
        (0, 5, True),
        (1, 5, True),
    ]
    assert len([e for o, _ in outs for e in _events(o) if e["event"] == "done"]) == 2, report


def test_a_ddp_job_saving_on_the_default_group_trains_to_the_end(tmp_path):
    """The idiom a new user writes: DDP, an async save every step without a process group
    of its own, no pause between steps. DCP's collectives of each save would run on the
    default group while DDP's all-reduces do (before: both waited forever, silently);
    tiered-dcp runs them on a group of its own, and the job trains to its end."""
    r = torchrun("ddp_worker.py", str(tmp_path), "12", restarts=False, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert json.loads((tmp_path / "done.json").read_text()) == {"resumed": 0, "ended": 12}
    from ddp_worker import config

    assert latest_step(config(str(tmp_path))) == 12
