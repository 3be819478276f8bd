"""The demo: 2 ranks train, one is killed mid-save, the job resumes from the tiers.

Run it with ``tiered-dcp demo``. The launcher starts two worker processes on gloo (one
simulated node). They train a small FSDP2 MLP and save every step to a RAM tier, every 5th
to an SSD tier and every 10th to a "bucket" (a local directory declared shared). Rank 1 is
SIGKILLed while it saves step ``kill_at``; the launcher stops the job as torchrun would,
restarts it, and the new job loads the newest complete step and checks that it is exactly
the state that was saved (each rank logged a hash of its shard before each save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORLD = 2


def demo_config(workdir: str, ram_root: str):
    from .config import Tier, TieredConfig

    return TieredConfig(
        "demo",
        [
            Tier(f"{ram_root}/{{node}}", every=1, keep=2),
            Tier(f"{workdir}/ssd/{{node}}", every=5, keep=3),
            Tier(f"{workdir}/bucket", every=10, compression="zstd", shared=True),
        ],
    )


# ----------------------------------------------------------------------------- worker


def _state_hash(state) -> str:
    import torch
    import xxhash
    from torch.distributed.tensor import DTensor

    h = xxhash.xxh3_64()

    def walk(prefix, v):
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, DTensor | torch.Tensor):
            t = v.to_local() if isinstance(v, DTensor) else v
            h.update(prefix.encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("", state)
    return h.hexdigest()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from . import TieredReader, TieredWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = demo_config(args.dir, args.ram)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 512, generator=g)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def state(step: int) -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "step": step}

    report: dict = {"rank": rank, "saves": []}
    start = 0
    if args.resume:
        train_step(0)  # materialise optimizer state so there is something to load into
        reader = TieredReader(cfg)
        sd = state(-1)
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = sd["step"]
        truth = {}
        with open(f"{args.dir}/truth/rank{rank}.jsonl") as f:
            for line in f:
                rec = json.loads(line)
                truth[rec["step"]] = rec["hash"]
        report["resume"] = {
            "step": start,
            "tier": reader.tiers[0],
            "tier_path": cfg.tiers[reader.tiers[0]].path,
            "seconds": time.perf_counter() - t0,
            "match": truth.get(start) == _state_hash(state(start)),
        }
    os.makedirs(f"{args.dir}/truth", exist_ok=True)
    for step in range(start + 1, args.steps + 1):
        train_step(step)
        sd = state(step)
        with open(f"{args.dir}/truth/rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "hash": _state_hash(sd)}) + "\n")
        with open(f"{args.dir}/progress.rank{rank}", "w") as f:
            f.write(str(step))
        writer = TieredWriter(cfg, step=step)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer)
        report["saves"].append(
            {"step": step, "tiers": writer.tier_indexes, "blocked": time.perf_counter() - t0}
        )
    tensors = [
        *model.parameters(),
        *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    ]
    report["state_bytes"] = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)
    with open(f"{args.dir}/report.{args.phase}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher


def _launch(
    workdir: str, ram: str, steps: int, phase: str, resume: bool, port: int
) -> list[subprocess.Popen]:
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "tiered_dcp.demo",
            "--dir",
            workdir,
            "--ram",
            ram,
            "--steps",
            str(steps),
            "--phase",
            phase,
        ] + (["--resume"] if resume else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return procs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_progress(workdir: str, rank: int) -> int:
    try:
        with open(f"{workdir}/progress.rank{rank}") as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _fail(procs: list[subprocess.Popen], what: str) -> int:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        err = p.stderr.read().decode(errors="replace") if p.stderr else ""
        p.wait()
        if p.returncode not in (0, None) and err:
            print(f"--- a worker's stderr (exit {p.returncode}):\n{err[-3000:]}", file=sys.stderr)
    print(f"demo failed: {what}", file=sys.stderr)
    return 1


def run_demo(workdir: str | None = None, steps: int = 30, kill_at: int = 17) -> int:
    """Run the demo; return 0 when the resumed state matched the saved one."""
    if not 1 < kill_at < steps:
        raise ValueError(f"--kill-at must be between 2 and {steps - 1}")
    from .api import status

    own_dir = workdir is None
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="tiered-dcp-demo-"))
    ram = f"{workdir}/ram"
    if own_dir and os.access("/dev/shm", os.W_OK):
        ram = tempfile.mkdtemp(prefix="tiered-dcp-demo-", dir="/dev/shm")
    for stale in ("truth", "ssd", "bucket", "ram"):
        shutil.rmtree(f"{workdir}/{stale}", ignore_errors=True)
    cfg = demo_config(workdir, ram)
    names = ["RAM", "SSD", "bucket"]
    print(f"tiered-dcp demo: {WORLD} ranks on gloo train an FSDP2 MLP for {steps} steps")
    for i, t in enumerate(cfg.tiers):
        extra = f", {t.compression}" if t.compression else ""
        print(f"  tier {i} {names[i]:<6} {t.path}  (every {t.every}, keep {t.keep or 'all'}{extra})")
    try:
        # phase 1: train, and kill rank 1 while it saves step kill_at
        t_start = time.perf_counter()
        procs = _launch(workdir, ram, steps, "1", False, _free_port())
        while _read_progress(workdir, 1) < kill_at:
            if any(p.poll() not in (None, 0) for p in procs):
                return _fail(procs, "a worker died before the planned kill")
            if time.perf_counter() - t_start > 300:
                return _fail(procs, "phase 1 took longer than 300 s")
            time.sleep(0.002)
        os.kill(procs[1].pid, signal.SIGKILL)
        print(f"\n  phase 1: saved steps 1..{kill_at - 1}; rank 1 SIGKILLed while saving step {kill_at}")
        deadline = time.time() + 15
        while procs[0].poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if procs[0].poll() is None:
            procs[0].kill()
        for p in procs:
            p.wait()
        print("           the job stopped (rank 0 lost its peer); restarting it")
        # phase 2: restart, resume from the newest complete step, finish training
        procs = _launch(workdir, ram, steps, "2", True, _free_port())
        deadline = time.time() + 300
        while any(p.poll() is None for p in procs):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                return _fail(procs, "the restarted job failed")
            time.sleep(0.05)
        reports = []
        for rank in range(WORLD):
            with open(f"{workdir}/report.2.rank{rank}.json") as f:
                reports.append(json.load(f))
        resume = [r["resume"] for r in reports]
        ok = all(r["match"] for r in resume)
        r0 = resume[0]
        print(
            f"  resume:  newest complete step {r0['step']}, read from tier {r0['tier']} "
            f"({names[r0['tier']]}) in {r0['seconds'] * 1000:.0f} ms"
        )
        print(
            "           restored state == state saved at that step: "
            + ", ".join(f"rank {i} {'yes' if r['match'] else 'NO'}" for i, r in enumerate(resume))
        )
        print(f"  phase 2: trained steps {r0['step'] + 1}..{steps}")
        blocked = [s["blocked"] for s in reports[0]["saves"]]
        saved_steps = list(range(1, kill_at)) + [s["step"] for s in reports[0]["saves"]]
        held: dict[int, list[int]] = {}
        for row in status(cfg):
            if row.state == "committed":
                held.setdefault(row.tier_index, []).append(row.step)
        print(f"\n  {'tier':<8}{'steps saved':>12}   held now")
        for i, t in enumerate(cfg.tiers):
            n = sum(1 for s in saved_steps if t.takes(s))
            print(f"  {names[i]:<8}{n:>12}   {held.get(i, [])}")
        mb = sum(r["state_bytes"] for r in reports) / 1e6
        print(
            f"\n  state per save: {mb:.1f} MB over {WORLD} ranks; training blocked per save "
            f"(sync dcp.save, all tiers taking the step): median {statistics.median(blocked) * 1000:.0f} ms, "
            f"max {max(blocked) * 1000:.0f} ms"
        )
        print(
            f"\n  {'OK' if ok else 'FAILED'}: the job resumed from step {r0['step']} "
            f"with exactly the saved state"
        )
        return 0 if ok else 1
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description="tiered-dcp demo worker (started by `tiered-dcp demo`)")
    p.add_argument("--dir", required=True)
    p.add_argument("--ram", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--phase", required=True)
    p.add_argument("--resume", action="store_true")
    worker(p.parse_args())


if __name__ == "__main__":
    main()
