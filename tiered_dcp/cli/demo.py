"""The demo: 2 ranks train, one is killed mid-save, the job resumes from the tiers.

Run it with ``tiered-dcp demo``. The launcher starts two worker processes on gloo (one
simulated node). They train a small FSDP2 MLP and save every step with ``dcp.async_save``
to a RAM tier, every 5th also to an SSD tier and every 10th to a "bucket" (a local
directory declared shared). A save's future completes once the step is committed on RAM;
each rank's writer process fills in the slower tiers behind it, and the launcher shows
them filling in. The loop waits for save N's future before starting save N+1; the demo
times that wait apart from the stall (the time ``async_save`` takes to return), and
compares the stall with the stock ``FileSystemWriter``'s on the same state.

Rank 1 is SIGKILLed while it saves step ``kill_at``; the launcher stops the job as
torchrun would, restarts it, and the new job loads the newest complete step and checks
that it is exactly the state that was saved (each rank logged a hash of its shard before
each save).

A second scene loses a node: 4 ranks as 2 simulated nodes (``{node}`` paths,
LOCAL_WORLD_SIZE=2) with ``replication_factor=2, replication_jump=2``, so each node's RAM
tier also holds its peers' replicas. They train and ``dcp.save`` a few steps, the newest
being only in RAM (the shared bucket has an older one); node 1's RAM tier is wiped, and
the ranks rebuild their model and optimizer and load with ``TieredReader``: the newest step
comes from the replicas node 0 holds, and must be exactly the state that was saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from .local_servers import free_port

WORLD = 2
NAMES = ["RAM", "SSD", "bucket"]
STOCK_SAVES = 3  # stock FileSystemWriter async saves timed at the start of each phase


def demo_config(workdir: str, ram_root: str):
    from ..config import Tier, TieredConfig

    return TieredConfig(
        "demo",
        [
            Tier(f"{ram_root}/{{node}}", every=1, keep=2),
            Tier(f"{workdir}/ssd/{{node}}", every=5, keep=3),
            Tier(f"{workdir}/bucket", every=10, compression="zstd", shared=True),
        ],
    )


# The node-loss scene: 4 ranks as 2 simulated nodes (ranks 0-1 on node 0, 2-3 on node 1).
# With replication_factor=2, replication_jump=2 the cliques are {0, 2} and {1, 3}: each node
# holds its own ranks' parts and their peers' replicas, so either node alone holds a step.
NL_WORLD, NL_LOCAL = 4, 2
NL_STEPS = 6  # the bucket takes every 4th: steps 5 and 6 are only in the cluster's RAM
NL_HIDDEN = 512  # a narrower MLP than the first scene's: this scene is about where the bytes are
NL_LOST = 1  # the node whose tiers are wiped


def node_loss_config(workdir: str, ram_root: str):
    from ..config import Tier, TieredConfig

    return TieredConfig(
        "demo-nodeloss",
        [
            Tier(f"{ram_root}/nodeloss/{{node}}", every=1, keep=2),
            Tier(f"{workdir}/nodeloss/bucket", every=4, shared=True),
        ],
        replication_factor=2,
        replication_jump=2,
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


def _loaded_from(cfg, rank: int) -> list[int]:
    """The tiers this rank's last load read from, as its load record says (``timings``)."""
    from ..writer_process.timings import Kind, read_records

    loads = [r for r in read_records(cfg, Kind.LOAD, tail_bytes=1 << 16) if r.rank == rank]
    return list(loads[-1].tiers or ())


def _build(mesh, hidden: int = 2048):
    """The demo's model, an MLP sharded with FSDP2 over ``mesh``, and its optimizer."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(512, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 512))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model, opt, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 512, generator=g)
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def worker(args: argparse.Namespace) -> None:
    """One rank of the first scene: resume if told to, then train and save ``args.steps`` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .. import shutdown

    dist.init_process_group("gloo")
    # DCP runs an async save's collectives in its upload thread while training runs FSDP's
    # collectives in the main thread: give checkpointing a process group of its own.
    ckpt_pg = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    cfg = demo_config(args.dir, args.ram)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = _build(mesh)
    job = _DemoRank(args, cfg, rank, model, opt, ckpt_pg)
    report: dict = {"rank": rank}
    start = 0
    if args.resume:
        start, report["resume"] = job.resume()
    os.makedirs(f"{args.dir}/truth", exist_ok=True)
    job.train(start)
    report["state_bytes"] = job.state_bytes()
    with open(f"{args.dir}/report.{args.phase}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    shutdown(wait=False)  # free the staging buffers; the writer finishes the slower tiers alone
    dist.barrier()
    dist.destroy_process_group()


class _DemoRank:
    """One rank of the first scene: its model, its saves, and what it logs of them (the truth
    of each step's state, the timing of each save)."""

    def __init__(
        self, args: argparse.Namespace, cfg: Any, rank: int, model: Any, opt: Any, ckpt_pg: Any
    ) -> None:
        self.args, self.cfg, self.rank = args, cfg, rank
        self.model, self.opt, self.ckpt_pg = model, opt, ckpt_pg

    def state(self, step: int) -> dict:
        return _state(self.model, self.opt, step)

    def resume(self) -> tuple[int, dict]:
        """Load the newest step that loads; (that step, what the resume report says of it)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .. import load_latest

        _train_step(self.model, self.opt, 0)  # materialise optimizer state so there is something to load into
        sd = self.state(-1)
        t0 = time.perf_counter()
        load_latest(sd, self.cfg)  # the resume call: the newest step that loads, on every rank
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = sd["step"]
        truth = {}
        with open(f"{self.args.dir}/truth/rank{self.rank}.jsonl") as f:
            for line in f:
                rec = json.loads(line)
                truth[rec["step"]] = rec["hash"]
        return start, {
            "step": start,
            "tier": _loaded_from(self.cfg, self.rank)[0],
            "seconds": time.perf_counter() - t0,
            "match": truth.get(start) == _state_hash(self.state(start)),
        }

    def train(self, start: int) -> None:
        """Train and async-save steps ``start + 1`` to ``args.steps``, each save done before
        the next starts; the first also times the stock writer's saves."""
        import torch.distributed.checkpoint as dcp

        from .. import TieredWriter

        args, rank = self.args, self.rank
        pending = None  # (writer, stall, future) of the save still uploading
        for step in range(start + 1, args.steps + 1):
            _train_step(self.model, self.opt, step)
            sd = self.state(step)
            with open(f"{args.dir}/truth/rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "hash": _state_hash(sd)}) + "\n")
            if pending is None:
                self.stock_stalls(sd)
            else:
                self.finish(*pending)  # save N must be done before save N+1 starts
            writer = TieredWriter(self.cfg, step=step)
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=writer, process_group=self.ckpt_pg)
            pending = (writer, time.perf_counter() - t0, fut)
            with open(f"{args.dir}/progress.rank{rank}", "w") as f:
                f.write(str(step))  # save `step` is under way; save `step - 1` is committed
        if pending is not None:
            self.finish(*pending)

    def log_timing(self, rec: dict) -> None:
        if self.rank == 0:
            with open(f"{self.args.dir}/timing.jsonl", "a") as f:
                f.write(json.dumps({"phase": self.args.phase, **rec}) + "\n")

    def stock_stalls(self, sd: dict) -> None:
        """The stock writer's stall (the time async_save takes to return) on this state."""
        import torch.distributed.checkpoint as dcp

        stalls = []
        for i in range(STOCK_SAVES):
            path = f"{self.args.dir}/stock.{self.args.phase}.{i}"
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path), process_group=self.ckpt_pg)
            stalls.append(time.perf_counter() - t0)
            fut.result()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        self.log_timing({"stock": stalls})

    def finish(self, writer: Any, stall: float, fut: Any) -> None:
        """Wait for a save's future; log its stall, that wait, and how much of the wait was
        spent handing the step to a writer process that had fallen behind."""
        t0 = time.perf_counter()
        fut.result()
        wait = time.perf_counter() - t0
        self.log_timing({"step": writer.step, "stall": stall, "wait": wait, "handoff": writer.handoff_wait})

    def state_bytes(self) -> int:
        """The bytes of this rank's shards of the model and the optimizer state."""
        import torch

        tensors = [
            *self.model.parameters(),
            *(v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)),
        ]
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def node_loss_worker(args: argparse.Namespace) -> None:
    """Save ``args.steps`` steps, lose node NL_LOST's tiers, rebuild the state, load it back."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from .. import TieredWriter, load_latest, shutdown, wait_for
    from ..config import node_of
    from ..steps.placement import placement_for

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = node_of(rank)
    cfg = node_loss_config(args.dir, args.ram)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model, opt = _build(mesh, NL_HIDDEN)
    for step in range(1, args.steps + 1):
        _train_step(model, opt, step)
        dcp.save(_state(model, opt, step), storage_writer=TieredWriter(cfg, step=step))
    saved = _state_hash(_state(model, opt, args.steps))
    # The bucket's newest step must be there before a node goes: wait for it, then for the
    # writer processes to exit (shutdown alone does not wait for a writer still starting up).
    bucket = cfg.tiers[1]
    wait_for(cfg, args.steps // bucket.every * bucket.every, tier=1, timeout=60)
    if not shutdown(wait=True, timeout=60):
        raise RuntimeError("the writer processes did not exit within 60 s")
    dist.barrier()
    if rank == NL_LOST * NL_LOCAL:  # the lost node's first rank: every node-local tier is gone
        for tier in cfg.tiers:
            if placement_for(tier).node_owned:
                shutil.rmtree(tier.root(NL_LOST, rank), ignore_errors=True)
    dist.barrier()

    # the restart: a new model and optimizer (other weights), then the state from the tiers
    del model, opt
    torch.manual_seed(1)
    model, opt = _build(mesh, NL_HIDDEN)
    _train_step(model, opt, 0)  # materialise optimizer state so there is something to load into
    own = [tier.root(node, rank) for tier in cfg.tiers if placement_for(tier).node_owned]
    held = any(os.path.isdir(root) and os.listdir(root) for root in own)
    t0 = time.perf_counter()
    sd = _state(model, opt, -1)
    step = load_latest(sd, cfg)
    seconds = time.perf_counter() - t0
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    report = {
        "rank": rank,
        "node": node,
        "held": bool(held),
        "step": sd["step"],
        "tiers": _loaded_from(cfg, rank),
        "seconds": seconds,
        "match": sd["step"] == args.steps and _state_hash(_state(model, opt, sd["step"])) == saved,
    }
    with open(f"{args.dir}/report.{args.phase}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher


def _launch(
    workdir: str,
    ram: str,
    steps: int,
    phase: str,
    resume: bool,
    port: int,
    world: int = WORLD,
    local: int = WORLD,
    scene: str = "kill",
    start: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> list[subprocess.Popen]:
    """Start ``world`` ranks, ``local`` per simulated node, each with ``start``."""
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % local),
            LOCAL_WORLD_SIZE=str(local),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "tiered_dcp.cli.demo",
            "--dir",
            workdir,
            "--ram",
            ram,
            "--steps",
            str(steps),
            "--phase",
            phase,
            "--scene",
            scene,
        ] + (["--resume"] if resume else [])
        with open(f"{workdir}/stderr.{phase}.rank{rank}", "wb") as err:  # a file: a pipe can fill up
            procs.append(start(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs


def _read_progress(workdir: str, rank: int) -> int:
    try:
        with open(f"{workdir}/progress.rank{rank}") as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _fail(procs: list[subprocess.Popen], workdir: str, phase: str, what: str) -> int:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for rank, p in enumerate(procs):
        p.wait()
        try:
            with open(f"{workdir}/stderr.{phase}.rank{rank}", errors="replace") as f:
                err = f.read()
        except OSError:
            err = ""
        if p.returncode not in (0, None) and err:
            print(f"--- rank {rank}'s stderr (exit {p.returncode}):\n{err[-3000:]}", file=sys.stderr)
    print(f"demo failed: {what}", file=sys.stderr)
    return 1


def _where(cfg, step: int) -> str:
    """Where ``step`` stands on each tier taking it, e.g. 'RAM committed | SSD queued'."""
    from ..api import status
    from ..steps.status import StepStatus

    rows = status(cfg)
    newest = {}
    for r in rows:
        if r.state is StepStatus.COMMITTED:
            newest[r.tier_index] = max(newest.get(r.tier_index, -1), r.step)
    state = {r.tier_index: r.state for r in rows if r.step == step}
    cells = []
    for i in cfg.tiers_for(step):
        s = state.get(i) or ("dropped" if cfg.tiers[i].keep and newest.get(i, -1) > step else "-")
        cells.append(f"{NAMES[i]} {s}")
    return f"step {step}: " + " | ".join(cells)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _node_loss_scene(workdir: str, ram: str, start: Callable[..., subprocess.Popen]) -> bool:
    """Lose a node after the newest step left the shared tier behind; resume from peers."""
    from ..api import status
    from ..steps.status import StepStatus

    cfg = node_loss_config(workdir, ram)
    names = ["RAM", "bucket"]
    _reset_node_loss(workdir, ram, cfg)
    _print_node_loss_setup(cfg, names)
    reports = _run_node_loss(workdir, ram, cfg, start)
    if reports is None:
        return False
    bucket = max(
        (r.step for r in status(cfg) if r.tier_index == 1 and r.state is StepStatus.COMMITTED), default=None
    )
    _print_node_loss_resume(cfg, names, reports, bucket)
    problems = _node_loss_problems(cfg, reports, bucket)
    if problems:
        print("\n  FAILED: " + "; ".join(problems))
        return False
    step = reports[0]["step"]
    print(
        f"\n  OK: with node {NL_LOST} lost, the job resumed from step {step} (the bucket has {bucket}) "
        "with exactly the saved state"
    )
    return True


def _reset_node_loss(workdir: str, ram: str, cfg: Any) -> None:
    """Remove what an earlier run of the scene left: its tiers, reports and writers' queues."""
    from ..api import writer_status
    from ..writer_process.run_dir import job_dir

    shutil.rmtree(f"{workdir}/nodeloss", ignore_errors=True)
    shutil.rmtree(f"{ram}/nodeloss", ignore_errors=True)
    for rank in range(NL_WORLD):
        if os.path.exists(f"{workdir}/report.nodeloss.rank{rank}.json"):
            os.remove(f"{workdir}/report.nodeloss.rank{rank}.json")
    if not any(w.running for w in writer_status(cfg)):
        shutil.rmtree(job_dir(cfg), ignore_errors=True)


def _lost_ranks() -> list[int]:
    return list(range(NL_LOST * NL_LOCAL, (NL_LOST + 1) * NL_LOCAL))


def _print_node_loss_setup(cfg: Any, names: list[str]) -> None:
    from ..steps.placement import placement_for

    nodes = NL_WORLD // NL_LOCAL
    layout = ", ".join(f"{n * NL_LOCAL}-{(n + 1) * NL_LOCAL - 1}" for n in range(nodes))
    print(
        f"\ntiered-dcp demo, node loss: {NL_WORLD} ranks on {nodes} simulated nodes (ranks {layout}) "
        f"train and dcp.save {NL_STEPS} steps"
    )
    print(
        f"  replication_factor={cfg.replication_factor}, replication_jump={cfg.replication_jump}: "
        "each rank's part is also kept by its clique peer on the other node"
    )
    for i, t in enumerate(cfg.tiers):
        where = placement_for(t).kind
        print(f"  tier {i} {names[i]:<6} {t.path}  (every {t.every}, keep {t.keep or 'all'}, {where})")


def _run_node_loss(
    workdir: str, ram: str, cfg: Any, start: Callable[..., subprocess.Popen]
) -> list[dict] | None:
    """Run the scene's ranks; their reports, or None (said why) if it failed."""
    from ..api import writer_status
    from ..writer_process.run_dir import job_dir

    phase = "nodeloss"
    procs = _launch(workdir, ram, NL_STEPS, phase, False, free_port(), NL_WORLD, NL_LOCAL, "node-loss", start)
    deadline = time.time() + 120
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                _fail(procs, workdir, phase, "the node-loss scene failed")
                return None
            time.sleep(0.02)
        reports = []
        for rank in range(NL_WORLD):
            with open(f"{workdir}/report.{phase}.rank{rank}.json") as f:
                reports.append(json.load(f))
        return reports
    finally:
        deadline = time.time() + 5  # the writers exit once their queues are empty
        while any(w.running for w in writer_status(cfg)) and time.time() < deadline:
            time.sleep(0.05)
        shutil.rmtree(job_dir(cfg), ignore_errors=True)


def _print_node_loss_resume(cfg: Any, names: list[str], reports: list[dict], bucket: int | None) -> None:
    """What was saved, what was lost, and where the resume read its step from."""
    step = reports[0]["step"]
    lost_ranks = _lost_ranks()
    lost_root = cfg.tiers[0].root(NL_LOST, lost_ranks[0])
    print(
        f"\n  saved:   steps 1..{NL_STEPS}; the bucket took step {bucket}, "
        f"so step {NL_STEPS} is only in the nodes' RAM"
    )
    lost = ", ".join(map(str, lost_ranks))
    print(f"  lost:    node {NL_LOST} (ranks {lost}): its RAM tier {lost_root} wiped")
    print("           the job restarts: every rank builds a new model and optimizer, loads with TieredReader")
    read = sorted({t for r in reports for t in r["tiers"]})
    where = "peer replicas in the cluster's RAM" if read == [0] else " + ".join(names[t] for t in read)
    newer = "newer than" if bucket is not None and step > bucket else "not newer than"
    print(f"  resume:  step {step}, from {where} ({newer} step {bucket} on the shared tier)")
    if read == [0] and not any(r["held"] for r in reports if r["node"] == NL_LOST):
        print(
            f"           node {NL_LOST}'s ranks held none of it: node {1 - NL_LOST} sent them their replicas"
        )
    took = _ms(max(r["seconds"] for r in reports))
    print(f"           loaded in {took} (TieredReader + dcp.load, slowest rank)")
    print(
        f"           restored state == state saved at step {NL_STEPS}: "
        + ", ".join(f"rank {r['rank']} {'yes' if r['match'] else 'NO'}" for r in reports)
    )


def _node_loss_problems(cfg: Any, reports: list[dict], bucket: int | None) -> list[str]:
    """What the scene got wrong: every way the resume missed what it was to show."""
    lost_root = cfg.tiers[0].root(NL_LOST, _lost_ranks()[0])
    read = sorted({t for r in reports for t in r["tiers"]})
    problems = []
    if not all(r["match"] for r in reports):
        problems.append("the restored state differs from the saved one")
    if any(r["step"] != NL_STEPS for r in reports):
        problems.append(f"resumed from step(s) {sorted({r['step'] for r in reports})}, not {NL_STEPS}")
    if bucket is None or bucket >= NL_STEPS:
        problems.append(f"the bucket's newest step is {bucket}: the scene needs an older one there")
    if any(r["tiers"] != [0] for r in reports):
        problems.append(f"read from tier(s) {read}, not the RAM tier alone")
    if any(r["held"] for r in reports if r["node"] == NL_LOST) or os.path.exists(lost_root):
        problems.append(f"node {NL_LOST}'s RAM tier was not wiped")
    if any(not r["held"] for r in reports if r["node"] != NL_LOST):
        problems.append(f"node {1 - NL_LOST}'s RAM tier was empty before the load")
    return problems


def run_demo(
    workdir: str | None = None,
    steps: int = 30,
    kill_at: int = 17,
    start: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> int:
    """Run the demo; return 0 when the resumed state matched the saved one in both scenes.
    ``start``: how each rank's process is started from its ``python`` command line
    (``subprocess.Popen``'s signature; a test passes one that forks an interpreter that has
    imported torch already)."""
    if not 1 < kill_at < steps:
        raise ValueError(f"--kill-at must be between 2 and {steps - 1}")
    own_dir = workdir is None
    workdir, ram = _demo_dirs(workdir)
    cfg = demo_config(workdir, ram)
    _reset_demo(workdir, cfg)
    _print_demo_setup(cfg, steps)
    try:
        failed = _kill_phase(workdir, ram, steps, kill_at, start)
        if failed is not None:
            return failed
        phase2 = _resume_phase(workdir, ram, cfg, steps, kill_at, start)
        if isinstance(phase2, int):
            return phase2
        reports, lines, ended = phase2
        ok, resumed = _print_resume(reports, steps, lines)
        if not _wait_for_slower(cfg, steps, ended):
            return 1
        saved_steps = list(range(1, kill_at)) + list(range(resumed + 1, steps + 1))
        _print_held(cfg, saved_steps)
        _print_timings(workdir, reports)
        print(
            f"\n  {'OK' if ok else 'FAILED'}: the job resumed from step {resumed} "
            f"with exactly the saved state"
        )
        ok = _node_loss_scene(workdir, ram, start) and ok
        _print_next(cfg, own_dir)
        return 0 if ok else 1
    finally:
        if own_dir:
            _remove_demo(cfg, workdir, ram)


def _demo_dirs(workdir: str | None) -> tuple[str, str]:
    """(the work directory, the RAM tier's root): given, or temporary ones (RAM in /dev/shm)."""
    own_dir = workdir is None
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="tiered-dcp-demo-"))
    ram = f"{workdir}/ram"
    if own_dir and os.access("/dev/shm", os.W_OK):
        ram = tempfile.mkdtemp(prefix="tiered-dcp-demo-", dir="/dev/shm")
    return workdir, ram


def _reset_demo(workdir: str, cfg: Any) -> None:
    """Remove what an earlier run left in ``workdir``: tiers, logs, and writers' queues."""
    from ..api import writer_status
    from ..writer_process.run_dir import job_dir

    os.makedirs(workdir, exist_ok=True)
    for stale in ("truth", "ssd", "bucket", "ram"):
        shutil.rmtree(f"{workdir}/{stale}", ignore_errors=True)
    for stale in ("timing.jsonl", "progress.rank0", "progress.rank1", "report.2.rank0.json"):
        if os.path.exists(f"{workdir}/{stale}"):
            os.remove(f"{workdir}/{stale}")
    if not any(w.running for w in writer_status(cfg)):  # a previous run's queue and results
        shutil.rmtree(job_dir(cfg), ignore_errors=True)


def _remove_demo(cfg: Any, workdir: str, ram: str) -> None:
    """Remove the temporary directories, once the writers are gone."""
    from ..api import writer_status
    from ..writer_process.run_dir import job_dir

    deadline = time.time() + 5  # the writers exit once their trainer is gone
    while any(w.running for w in writer_status(cfg)) and time.time() < deadline:
        time.sleep(0.05)
    shutil.rmtree(job_dir(cfg), ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(ram, ignore_errors=True)


def _print_demo_setup(cfg: Any, steps: int) -> None:
    print(
        f"tiered-dcp demo: {WORLD} ranks on gloo train an FSDP2 MLP for {steps} steps, "
        f"saving each with dcp.async_save (namespace {cfg.namespace!r})"
    )
    for i, t in enumerate(cfg.tiers):
        extra = f", {t.compression}" if t.compression else ""
        print(f"  tier {i} {NAMES[i]:<6} {t.path}  (every {t.every}, keep {t.keep or 'all'}{extra})")


def _kill_phase(
    workdir: str, ram: str, steps: int, kill_at: int, start: Callable[..., subprocess.Popen]
) -> int | None:
    """Phase 1: train, and kill rank 1 while it saves step ``kill_at``; an exit code if it failed."""
    t_start = time.perf_counter()
    procs = _launch(workdir, ram, steps, "1", False, free_port(), start=start)
    while _read_progress(workdir, 1) < kill_at:
        if any(p.poll() not in (None, 0) for p in procs):
            return _fail(procs, workdir, "1", "a worker died before the planned kill")
        if time.perf_counter() - t_start > 300:
            return _fail(procs, workdir, "1", "phase 1 took longer than 300 s")
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
    return None


def _last_steps(cfg: Any, steps: int) -> dict[int, int]:
    """slower tier -> the last step of the run it takes."""
    return {i: steps // cfg.tiers[i].every * cfg.tiers[i].every for i in range(1, len(cfg.tiers))}


def _resume_phase(
    workdir: str, ram: str, cfg: Any, steps: int, kill_at: int, start: Callable[..., subprocess.Popen]
) -> tuple[list[dict], list[str], float | None] | int:
    """Phase 2: restart, resume from the newest complete step, finish training, and note the
    slower tiers filling in behind the saves. (the ranks' reports, the notes, when the last
    save was committed on RAM), or an exit code if it failed."""
    procs = _launch(workdir, ram, steps, "2", True, free_port(), start=start)
    deadline = time.time() + 300
    slower = range(1, len(cfg.tiers))
    last = _last_steps(cfg, steps)
    end = max(last.values(), default=0)  # shown once training is over
    to_show = [s for s in range(kill_at, end) if any(cfg.tiers[i].takes(s) for i in slower)]
    lines: list[str] = []
    ended = None  # when the last save was committed on RAM
    while any(p.poll() is None for p in procs):
        if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
            return _fail(procs, workdir, "2", "the restarted job failed")
        # progress N: save N is under way, so save N-1 is committed on RAM on every rank
        now = _read_progress(workdir, 0)
        if to_show and to_show[0] < now:
            m = to_show.pop(0)
            recent = {m} | {m // cfg.tiers[i].every * cfg.tiers[i].every for i in slower}
            for k, s in enumerate(sorted(recent - {0}, reverse=True)):
                lines.append(f"{f'at step {now}:' if k == 0 else '':<13}{_where(cfg, s)}")
        if ended is None and os.path.exists(f"{workdir}/report.2.rank0.json"):  # last save committed
            ended = time.perf_counter()
            for k, s in enumerate(sorted(set(last.values()) - {0}, reverse=True)):
                lines.append(f"{'at the end:' if k == 0 else '':<13}{_where(cfg, s)}")
        time.sleep(0.02)
    reports = []
    for rank in range(WORLD):
        with open(f"{workdir}/report.2.rank{rank}.json") as f:
            reports.append(json.load(f))
    return reports, lines, ended


def _print_resume(reports: list[dict], steps: int, lines: list[str]) -> tuple[bool, int]:
    """What the restarted job resumed from, and the notes of phase 2; (whether every rank's
    state matched, the step resumed from)."""
    resume = [r["resume"] for r in reports]
    ok = all(r["match"] for r in resume)
    r0 = resume[0]
    print(
        f"  resume:  newest complete step {r0['step']}, read from tier {r0['tier']} "
        f"({NAMES[r0['tier']]}) in {_ms(r0['seconds'])}"
    )
    print(
        "           restored state == state saved at that step: "
        + ", ".join(f"rank {i} {'yes' if r['match'] else 'NO'}" for i, r in enumerate(resume))
    )
    print(f"  phase 2: trained steps {r0['step'] + 1}..{steps}; the slower tiers fill in behind:")
    for line in lines:
        print(f"           {line}")
    return ok, r0["step"]


def _wait_for_slower(cfg: Any, steps: int, ended: float | None) -> bool:
    """Wait until every slower tier has its last step; say how long after the last save."""
    from ..api import wait_for
    from ..errors import TieredCheckpointError

    last = _last_steps(cfg, steps)
    try:
        for i, s in last.items():
            if s > 0:
                wait_for(cfg, s, tier=i, timeout=120)
    except (TimeoutError, TieredCheckpointError) as e:
        print(f"  the slower tiers did not catch up: {e}")
        return False
    waited = ", ".join(f"{NAMES[i]} {s}" for i, s in last.items() if s > 0)
    if waited:
        took = _ms(time.perf_counter() - (ended or time.perf_counter()))
        print(f"           {took} after the last save, every tier had its last step ({waited})")
    return True


def _print_held(cfg: Any, saved_steps: list[int]) -> None:
    """Each tier: how many of the saved steps it took, and which it holds now."""
    from ..api import status
    from ..steps.status import StepStatus

    held: dict[int, list[int]] = {}
    for row in status(cfg):
        if row.state is StepStatus.COMMITTED:
            held.setdefault(row.tier_index, []).append(row.step)
    print(f"\n  {'tier':<8}{'steps saved':>12}   held now")
    for i, t in enumerate(cfg.tiers):
        n = sum(1 for s in saved_steps if t.takes(s))
        print(f"  {NAMES[i]:<8}{n:>12}   {held.get(i, [])}")


def _print_timings(workdir: str, reports: list[dict]) -> None:
    """The saves' stalls and waits on rank 0, beside the stock writer's stall."""
    from ..writer_process.client import MAX_PENDING

    saves, stock = [], []
    with open(f"{workdir}/timing.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "stock" in rec:
                stock += rec["stock"]
            else:
                saves.append(rec)
    mb = sum(r["state_bytes"] for r in reports) / 1e6
    stalls = [r["stall"] for r in saves]
    ours, theirs = statistics.median(stalls), statistics.median(stock)
    slowest = max(saves, key=lambda r: r["wait"])
    print(f"\n  {len(saves)} saves of {mb:.1f} MB ({WORLD} ranks) with dcp.async_save, timed on rank 0:")
    print(
        f"    {'stall (async_save returns):':<36}median {_ms(ours)}, max {_ms(max(stalls))}; "
        f"stock FileSystemWriter: median {_ms(theirs)} ({theirs / max(ours, 1e-6):.1f}x ours)"
    )
    waits = [r["wait"] for r in saves]
    print(
        f"    {'wait (its future, before the next):':<36}median {_ms(statistics.median(waits))}, "
        f"max {_ms(slowest['wait'])} (step {slowest['step']})"
    )
    if slowest["handoff"] > 0.5 * slowest["wait"]:
        print(
            f"      (its writer process had max_pending={MAX_PENDING} steps queued for a tier: "
            f"the handoff took {_ms(slowest['handoff'])})"
        )


def _print_next(cfg, own_dir: bool) -> None:
    """What to try next: the commands that look at the tiers the demo left (with --dir)."""
    if own_dir:
        print(
            "\n  the tiers were in a temporary directory and are removed now; "
            "`tiered-dcp demo --dir DIR` keeps them to look at"
        )
        return
    tiers = " ".join(shlex.quote(t.path) for t in cfg.tiers)
    print(f"\n  the tiers are kept; look at them (namespace {cfg.namespace!r}):")
    print(f"    tiered-dcp ls -n {cfg.namespace} {tiers}")
    print(f"    tiered-dcp verify -n {cfg.namespace} {tiers}")
    print(f"    tiered-dcp export -n {cfg.namespace} {tiers} --to demo-export")


def main() -> None:
    p = argparse.ArgumentParser(description="tiered-dcp demo worker (started by `tiered-dcp demo`)")
    p.add_argument("--dir", required=True)
    p.add_argument("--ram", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--phase", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--scene", choices=["kill", "node-loss"], default="kill")

    def work() -> None:
        args = p.parse_args()
        (node_loss_worker if args.scene == "node-loss" else worker)(args)

    run_worker(work)


def run_worker(work: Callable[[], object]) -> NoReturn:
    """Run a worker process's ``work`` and exit with 0, or 1 and its traceback, skipping the
    interpreter's teardown (seconds of garbage collection over torch)."""
    code = 0
    try:
        work()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
