"""The CUDA paths on a machine with a GPU: exact async snapshots and loads of a CUDA state,
and the training loop's stall against stock DCP's ``async_save``, in the same run.

    python benchmarks/bench_cuda.py [--only PART ...] [--skip PART ...] [--disk DIR]
    python benchmarks/bench_cuda.py --device cpu --mib 16 --steps 4 --load-gib 0.05 \
        --load-runs 1 --train-gib 0.05 --train-loops 16:2 18:6       # a dry run, no GPU

Parts, run in this order (``--only``/``--skip`` pick them; each prints its table and a
``PART: {json}`` line as it ends (``exact``: one line), and a part that raises is reported
and the next one runs; SIGINT ends the part running and skips the rest; the last line is
the JSON of all of them; exit 1 if a part raised or a step loaded wrong):

``exact`` (a failure exit if wrong), on a RAM tier in /dev/shm over a disk tier (staging
into the RAM tier's part file, pinned with ``cudaHostRegister``) and on a disk tier alone
(staging into pinned shared-memory slots): ``async_save`` of a CUDA state (fp32, bf16,
int64, nested, a Python value), the GPU tensors changed in place the moment it returns
(or, with ``background_staging``, the moment staging completes), loads back onto the GPU
as it was when saved, step after step (slots and part files reused); also in DCP's
PROCESS mode, and for a sync ``dcp.save``.

``train``: a model + AdamW of ``--train-gib`` GiB of state (3.0: a 268M-parameter
model, 3.22 GB on the GPU), ``--train-batch`` rows a step (forward, backward, AdamW), run
once per ``--train-loops`` STEPS:EVERY (default 80:10 and 120:30) and per ``--train-ways``:
``none`` (no saves: the baseline), ``tiered_dcp`` (the README's tiers: RAM in /dev/shm
every=1 keep=2 over a disk tier every=2 keep=2, ``on_lagging_tier`` from ``--lagging``,
``TieredWriter.prepare`` before the first save, a fresh writer state each loop),
``stock_pinned`` (``FileSystemWriter`` with ``DefaultStager(StagingOptions(
use_pinned_memory=True))``, one per save, the last two saves kept) and, if asked,
``stock_default`` (DCP's own stager), ``tiered_ram_only`` (the RAM tier alone: no writer
process copying behind the saves) and, for a save every step (``--train-loops
60:1 60:10``), ``tiered_bg`` (``background_staging=True``) beside ``stock_bg`` (the pinned
``DefaultStager`` with async staging, torchtitan's ``async_with_pinned_mem``): the loop does
not synchronize, the copy runs under the next step's forward and backward, and the loop
waits for it just before that step's optimizer step (``train_loop``). Every EVERY steps:
``get_state_dict`` (timed apart), the device synchronized (untimed: the copy waits for
the step's kernels anyway), then the stall: waiting for the previous save's future, and
``async_save``. Per loop: every stall in
order (for tiered-dcp also where each went: the previous future waited for, ``stage``
and of it the slot's ``acquire`` and the ``copy``, the garbage collector's share, and each
save's ``commit``, its ``write_data`` in the background), the first, the worst of saves
2-3, the median and max of save 4 on ("steady"), the loop's seconds (first step to the
last done on the device, saves included; the last save's future after it is ``drain_s``)
and its ratio to ``none``'s; against the raw pinned device-to-host copy of the same bytes
(``raw_copy_s``). ``train targets``: the stall targets (tiered-dcp: every stall from the 2nd
<= 2x the raw copy, steady ones <= 1.3x, the sparsest loop <= 1.15x ``none``),
and the every-step targets (``tiered_bg``: every step <= 1.05x ``none``, every 10 <= 1.02x, the median
``async_save`` call <= 5 ms), True/False, never a failure exit.

``load``: a model + AdamW of ``--load-gib`` GiB loaded onto the GPU from the RAM tier
(after async and after sync saves), from the disk tier and by stock ``FileSystemReader``,
beside the raw pinned host-to-device copy (medians of ``--load-runs``).

``stall``: the seconds ``async_save`` holds the loop for a plain ``--mib`` MiB CUDA state,
the median of the last half of ``--steps`` saves back to back (every buffer reused; the
first, which makes and pins them, is printed too), for tiered-dcp (RAM tier keep=1 over
disk: two part files in turn), stock ``FileSystemWriter`` with DCP's default stager, and
stock with a pinned stager (one per save: reused, torch 2.11's failed its second save).

On the H100 (``scripts/gpu_check.sh``): ``train`` about 2.5 min, the others about 1.5 min.
``--device cpu`` is a dry run of every part (small sizes; no pinned memory, timings
meaningless). Needs CUDA otherwise; a 1-rank gloo group is started for DCP's collectives.
Run it from outside the repository's root where tiered-dcp is not installed (the writer
process, ``python -m tiered_dcp.writer_process.process``, would import the uninstalled tree).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, wait_for, writer_status
from tiered_dcp.save.staging import POOL
from tiered_dcp.writer_process.timings import Kind, read_records

MiB = 1 << 20
DEVICE = "cuda"  # --device cpu: a dry run of the script where there is no GPU
warnings.filterwarnings("ignore")
logging.getLogger("tiered_dcp").setLevel(logging.ERROR)  # steps the disk tier skipped: counted instead


def cuda_state(step: int) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(step)
    return {
        "w": torch.randn(16 * MiB // 4, device=DEVICE, generator=g),
        "nested": {
            "b": torch.randn(1000, 1000, device=DEVICE, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 40, (4096,), device=DEVICE, generator=g),
            "t": torch.randn(300, 200, device=DEVICE, generator=g).t(),  # not contiguous
        },
        "step": step,
    }


def on_cpu(state):
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    return state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state


def zeros_on_gpu(state):
    """A load target shaped as ``state``: zeros on the GPU, -1 for Python values."""
    if isinstance(state, dict):
        return {k: zeros_on_gpu(v) for k, v in state.items()}
    return torch.zeros_like(state, device=DEVICE) if isinstance(state, torch.Tensor) else -1


def same(got, want, path="") -> list[str]:
    if isinstance(want, dict):
        return [p for k in want for p in same(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, torch.Tensor):
        ok = got.device.type == DEVICE and torch.equal(got.cpu(), want)
        return [] if ok else [path]
    return [] if got == want else [path]


def change_in_place(state: dict) -> None:
    """What the next training step does to the live state, queued on the current stream."""
    state["w"].add_(1000.0)
    state["nested"]["b"].mul_(-1)
    state["nested"]["i"].add_(7)
    state["nested"]["t"].zero_()


def exact_async(name: str, cfg: TieredConfig, steps: int, **how) -> list[str]:
    """Save ``steps`` steps asynchronously, changing the GPU state once staged; each loads
    back as staged. The failures, as 'config/step/path'."""
    bad = []
    for step in range(1, steps + 1):
        state = cuda_state(step)
        want = on_cpu(state)
        kind = how.get("mode")
        extra = {"async_checkpointer_type": kind} if kind is not None else {}
        writer = TieredWriter(cfg, step=step, background_staging=how.get("background", False))
        result = dcp.async_save(state, storage_writer=writer, **extra)
        if how.get("background"):
            result.staging_completion.result()
            result = result.upload_completion
        change_in_place(state)
        result.result()
        got = zeros_on_gpu(want)
        dcp.load(got, storage_reader=TieredReader(cfg, step))
        bad += [f"{name}/step {step}{p}" for p in same(got, want)]
    return bad


def exact_sync(name: str, cfg: TieredConfig) -> list[str]:
    state = cuda_state(9)
    dcp.save(state, storage_writer=TieredWriter(cfg, step=9))
    got = zeros_on_gpu(state)
    dcp.load(got, storage_reader=TieredReader(cfg, 9))
    return [f"{name}/sync{p}" for p in same(got, on_cpu(state))]


def big_state(mib: int) -> dict:
    per = mib * MiB // 32 // 4
    return {f"layer{i}.weight": torch.randn(per, device=DEVICE) for i in range(32)}


def stalls(save, mib: int, steps: int) -> tuple[float, float]:
    """Seconds ``save(state, step)`` holds the caller: the first step's (buffers made and
    pinned), and the median of the last half of the steps (every buffer reused)."""
    state = big_state(mib)
    took = []
    for step in range(1, steps + 1):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = save(state, step)
        took.append(time.perf_counter() - t0)
        for t in state.values():
            t.add_(1.0)  # the next step
        fut.result()
    return took[0], statistics.median(took[steps // 2 :])


def training_state(gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``gib`` / 3 GiB of fp32 weights and its AdamW state after one step (the
    weights plus two moments: ``gib`` GiB in all), on ``DEVICE``."""
    width = 4096 if DEVICE == "cuda" else 1024
    layers = max(1, round(gib * (1 << 30) / 3 / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device=DEVICE)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_target(model: torch.nn.Module) -> dict:
    """What a restarted job loads into: a new model and AdamW (``get_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    other = copy.deepcopy(model)
    for p in other.parameters():
        p.data.zero_()
    opt = torch.optim.AdamW(other.parameters(), lr=1e-4)
    sd, osd = get_state_dict(other, opt)
    return {"model": sd, "optim": osd}


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sd, osd = get_state_dict(model, opt)
    return {"model": sd, "optim": osd}


def tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def timed_load(load, want: list[torch.Tensor], model: torch.nn.Module, runs: int) -> float:
    """Median seconds of ``load(target)`` onto the device (each checked exact)."""
    took = []
    for _ in range(runs):
        target = fresh_target(model)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        load(target)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)
        got = tensors(target)
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise AssertionError("a load was not exact")
    return statistics.median(took)


def load_times(gib: float, runs: int, work: str, shm: str) -> dict:
    """The load of a model + AdamW state onto the device: from the RAM tier after async
    saves and after a sync save, from the disk tier, and stock ``FileSystemReader``, beside
    the raw pinned host-to-device copy of the same bytes."""
    model, opt = training_state(gib)
    ram, disk = Tier(f"{shm}/load-ram", every=1, keep=2), Tier(f"{work}/load-disk", every=2, keep=2)
    ours = TieredConfig("load", [ram, disk])
    for step in (1, 2, 3, 4):  # as in training: async saves, the state changing between them
        for p in model.parameters():
            p.data.add_(1e-3)
        dcp.async_save(state_of(model, opt), storage_writer=TieredWriter(ours, step=step)).result()
    wait_for(ours, 4)
    want = tensors(state_of(model, opt))  # step 4's state: unchanged since
    nbytes = sum(t.numel() * t.element_size() for t in want)
    out = {"state_gb": nbytes / 1e9}
    out["tiered_ram_after_async_s"] = timed_load(
        lambda t: dcp.load(t, storage_reader=TieredReader(ours, 4)), want, model, runs
    )
    out["tiered_disk_s"] = timed_load(
        lambda t: dcp.load(t, storage_reader=TieredReader(TieredConfig("load", [disk]), 4)), want, model, runs
    )
    dcp.save(state_of(model, opt), storage_writer=TieredWriter(ours, step=5))
    out["tiered_ram_after_sync_s"] = timed_load(
        lambda t: dcp.load(t, storage_reader=TieredReader(ours, 5)), want, model, runs
    )
    dcp.save(state_of(model, opt), storage_writer=dcp.FileSystemWriter(f"{work}/load-stock"))
    out["stock_filesystem_s"] = timed_load(
        lambda t: dcp.load(t, storage_reader=dcp.FileSystemReader(f"{work}/load-stock")), want, model, runs
    )
    if DEVICE == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        took = []
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            took.append(time.perf_counter() - t0)
        out["raw_pinned_h2d_s"] = statistics.median(took)
        del host, dev
    stock = out["stock_filesystem_s"]
    for k in ("tiered_ram_after_async_s", "tiered_ram_after_sync_s", "tiered_disk_s"):
        out[k.removesuffix("_s") + "_vs_stock"] = out[k] / stock
    return out


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def raw_copy(state: dict, runs: int = 5) -> float:
    """Median seconds of the raw device-to-host copy of ``state``'s tensors into one
    preallocated (pinned, on CUDA) host buffer: what a save's stall is compared to."""
    ts = [t for t in tensors(state) if t.numel()]
    offsets, total = [], 0
    for t in ts:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned: a dtype view
    host = torch.empty(total, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dst = [host[o : o + t.numel() * t.element_size()].view(t.dtype) for o, t in zip(offsets, ts, strict=True)]
    took = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        for d, t in zip(dst, ts, strict=True):
            d.copy_(t.reshape(-1), non_blocking=True)
        sync()
        took.append(time.perf_counter() - t0)
    del dst, host
    return statistics.median(took)


def forward_backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """AdamW: the first thing in a step that changes the saved state."""
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One step of training: forward, backward, AdamW, on the current stream."""
    forward_backward(model, x)
    optimizer_step(opt)


class TieredSaves:
    """tiered-dcp with the README's tiers: RAM in /dev/shm every=1 keep=2 over a disk tier
    every=2 keep=2 (``ram_only``: the RAM tier alone, no writer process copying behind);
    ``TieredWriter.prepare`` before the first save. Per save it keeps where the stall went
    (``parts``): ``stage_s`` (``TieredWriter.stage_seconds``), and of it the slot's
    ``acquire_s`` and the ``copy_s`` (the staging pool's two steps, timed from here)."""

    def __init__(
        self, name: str, work: str, shm: str, lagging: str, ram_only: bool = False, background: bool = False
    ) -> None:
        self.background = background  # ``background_staging=True``: the copy runs under the next step
        self.roots = [f"{shm}/{name}"] + ([] if ram_only else [f"{work}/{name}-disk"])
        tiers = [Tier(self.roots[0], every=1, keep=2)]
        if not ram_only:
            tiers.append(Tier(self.roots[1], every=2, keep=2))
        self.config = TieredConfig(name, tiers, on_lagging_tier=lagging)
        self.parts: dict[str, list[float]] = {"stage_s": [], "acquire_s": [], "copy_s": []}
        # the pool's two steps timed on this process's pool (a diagnosis: no figure depends on it)
        POOL._acquire = self._clock("acquire_s", POOL._acquire)
        POOL.copier.copy_into = self._clock("copy_s", POOL.copier.copy_into)

    def _clock(self, key: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[key].append(time.perf_counter() - t0)

        return timed

    def prepare(self, state: dict, step: int) -> None:
        TieredWriter(self.config, step=step).prepare(state)
        for key in self.parts:  # prepare's own are not a save's
            self.parts[key].clear()

    def save(self, state: dict, step: int):
        writer = TieredWriter(self.config, step=step, background_staging=self.background)
        fut = dcp.async_save(state, storage_writer=writer)
        self.parts["stage_s"].append(writer.stage_seconds or 0.0)
        return fut

    def finished(self, step: int) -> None:
        """Nothing: the tiers' retention is tiered-dcp's own."""

    def skipped(self) -> list[int]:
        """The steps the disk tier skipped (``on_lagging_tier="skip"``)."""
        return sorted(step for w in writer_status(self.config) for step, _, _ in w.skipped)

    def commits(self) -> list[float]:
        """Each save's ``write_data`` (the future's part after planning), from its records."""
        return [r.commit_s or 0.0 for r in read_records(self.config, Kind.SAVE)]

    def close(self) -> None:
        """Let the writer process finish (the next loop starts from a fresh process state:
        its first save is a first save again), then free the tiers' bytes."""
        vars(POOL).pop("_acquire", None)  # the class's own again
        vars(POOL.copier).pop("copy_into", None)
        shutdown(wait=True, timeout=120)
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)


class StockSaves:
    """Stock ``FileSystemWriter`` on the disk, with a pinned ``DefaultStager`` (one per save:
    torch 2.11's failed its second stage when reused; closed once its save is done) or
    DCP's default stager; the last two saves kept, as the disk tier keeps two."""

    def __init__(self, name: str, work: str, pinned: bool, background: bool = False) -> None:
        self.root = f"{work}/{name}"
        self.pinned = pinned
        self.background = background  # the stager's async staging (torchtitan's async_with_pinned_mem)
        self.stagers: dict[int, object] = {}
        self.kept: list[int] = []

    def prepare(self, state: dict, step: int) -> None:
        """Nothing to prepare: stock stages into what the stager allocates."""

    def save(self, state: dict, step: int):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        writer = dcp.FileSystemWriter(f"{self.root}/{step}")
        if not self.pinned:
            return dcp.async_save(state, storage_writer=writer)
        on_gpu = DEVICE == "cuda"  # pinned memory and non-blocking copies need an accelerator
        stager = self.stagers[step] = DefaultStager(StagingOptions(on_gpu, False, self.background, on_gpu))
        return dcp.async_save(state, storage_writer=writer, async_stager=stager)

    def finished(self, step: int) -> None:
        if step in self.stagers:
            self.stagers.pop(step).close()
        self.kept.append(step)
        while len(self.kept) > 2:
            shutil.rmtree(f"{self.root}/{self.kept.pop(0)}", ignore_errors=True)

    def close(self) -> None:
        for stager in self.stagers.values():
            stager.close()
        shutil.rmtree(self.root, ignore_errors=True)


Saves = TieredSaves | StockSaves | None


class GcClock:
    """The seconds Python's garbage collector ran while ``on`` (a stall's share of it)."""

    def __init__(self) -> None:
        self.on, self.total, self._t0 = False, 0.0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0

    def close(self) -> None:
        gc.callbacks.remove(self._tick)


def train_loop(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, every: int, saves: Saves
) -> dict:
    """``steps`` training steps, an ``async_save`` every ``every`` (none if ``saves`` is
    None). A save's stall: the seconds from the step's kernels done (synchronized, untimed:
    the copy would wait for them anyway) until ``async_save`` returns, the wait for the
    previous save's future included (also apart: ``waits_s``; and the garbage collector's
    share: ``gc_s``); ``get_state_dict`` is timed apart. ``loop_s``: from the first step to
    the last one done on the device, saves included; ``drain_s``: the last save's future
    after it; ``close_s``: the writer process finishing (tiered).

    With background staging (``saves.background``) nothing is synchronized: the
    save returns at once and its copy runs while the next step's forward and backward do;
    the loop waits for it (``staging_completion``) just before that step's optimizer step
    (``staging_waits_s``), and for the previous upload before the next save (``waits_s``).
    ``calls_s``: each ``async_save`` call alone, the training thread's own time per save."""
    out: dict = {"steps": steps, "every": every, "stalls_s": [], "waits_s": [], "gc_s": []}
    out |= {"state_dict_s": [], "calls_s": [], "staging_waits_s": []}
    background = getattr(saves, "background", False)
    staging = None  # background: the copy the next optimizer step waits for
    prev = None  # (step, future)
    if saves is not None:
        t0 = time.perf_counter()
        saves.prepare(state_of(model, opt), every)
        out["prepare_s"] = time.perf_counter() - t0
    clock = GcClock()
    sync()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        forward_backward(model, x)
        if staging is not None:
            t1 = time.perf_counter()
            staging.result()
            out["staging_waits_s"].append(time.perf_counter() - t1)
            staging = None
        optimizer_step(opt)
        if saves is None or step % every:
            continue
        t1 = time.perf_counter()
        state = state_of(model, opt)
        out["state_dict_s"].append(time.perf_counter() - t1)
        if not background:
            sync()
        clock.on, clock.total = True, 0.0
        t1 = time.perf_counter()
        if prev is not None:
            prev[1].result()
        t2 = time.perf_counter()
        out["waits_s"].append(t2 - t1)
        fut = saves.save(state, step)
        out["calls_s"].append(time.perf_counter() - t2)
        if background:
            staging, fut = fut.staging_completion, fut.upload_completion
        out["stalls_s"].append(time.perf_counter() - t1)
        clock.on = False
        out["gc_s"].append(clock.total)
        if prev is not None:
            saves.finished(prev[0])
        prev = (step, fut)
    if staging is not None:
        staging.result()
    sync()
    out["loop_s"] = time.perf_counter() - t0
    clock.close()
    if prev is not None:
        t0 = time.perf_counter()
        prev[1].result()
        saves.finished(prev[0])
        out["drain_s"] = time.perf_counter() - t0
    if isinstance(saves, TieredSaves):
        out.update(saves.parts)
        out["commit_s"] = saves.commits()
    return out


def summarize(run: dict, raw: float, none_s: float | None) -> dict:
    """First, saves 2-3, steady (save 4 on) median and max, against the raw copy; the loop
    against the loop without saves."""
    s = run["stalls_s"]
    steady = s[3:]
    out = {
        "first_s": s[0] if s else None,
        "saves_2_3_max_s": max(s[1:3]) if len(s) > 1 else None,
        "steady_median_s": statistics.median(steady) if steady else None,
        "steady_max_s": max(steady) if steady else None,
        "loop_vs_none": run["loop_s"] / none_s if none_s else None,
    }
    out["worst_from_2nd_vs_raw"] = max(s[1:]) / raw if len(s) > 1 else None
    out["steady_median_vs_raw"] = out["steady_median_s"] / raw if steady else None
    out["steady_max_vs_raw"] = out["steady_max_s"] / raw if steady else None
    return out


def rounded(tree):
    """``tree`` with its floats to 4 significant digits: JSON a person reads."""
    if isinstance(tree, dict):
        return {k: rounded(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [rounded(v) for v in tree]
    return float(f"{tree:.4g}") if isinstance(tree, float) else tree


def fmt(v, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def print_row(every: int, way: str, run: dict) -> None:
    if "error" in run:
        print(f"every {every:<4}{way:<16}FAILED: {run['error']}", flush=True)
        return
    print(
        f"every {every:<4}{way:<16}{len(run['stalls_s']):>5}{run['loop_s']:>9.2f}"
        f"{fmt(run.get('loop_vs_none'), 8, 2)}{fmt(run.get('first_s'), 8, 3)}"
        f"{fmt(run.get('saves_2_3_max_s'), 8, 3)}{fmt(run.get('steady_median_s'), 8, 3)}"
        f"{fmt(run.get('steady_max_s'), 8, 3)}{fmt(run.get('worst_from_2nd_vs_raw'), 9, 2)}"
        f"{fmt(run.get('steady_max_vs_raw'), 9, 2)}",
        flush=True,
    )
    keys = ("stalls_s", "waits_s", "calls_s", "staging_waits_s", "stage_s", "acquire_s", "copy_s", "gc_s")
    for key in (*keys, "commit_s"):
        if run.get(key) and (key == "stalls_s" or max(run[key]) >= 0.001):  # the parts that took time
            label = key.removesuffix("_s") + ":"
            print(f"{'':<10}{label:<8}" + " ".join(f"{v:.3f}" for v in run[key]), flush=True)
    if run.get("disk_skipped"):
        print(f"{'':<10}disk tier skipped steps: {run['disk_skipped']}", flush=True)


TRAIN_HEADER = (
    f"{'loop':<10}{'way':<16}{'saves':>5}{'loop_s':>9}{'x_none':>8}{'first':>8}{'2-3max':>8}"
    f"{'st_med':>8}{'st_max':>8}{'2nd+/raw':>9}{'st/raw':>9}"
)


def targets(loops: dict) -> dict:
    """The H100 targets for tiered-dcp, each True/False (never a failure exit)."""
    out = {}
    for every, ways in loops.items():
        t = ways.get("tiered_dcp", {})
        if t.get("worst_from_2nd_vs_raw") is not None:
            out[f"every_{every}_from_2nd_le_2x_raw"] = t["worst_from_2nd_vs_raw"] <= 2.0
        if t.get("steady_max_vs_raw") is not None:
            out[f"every_{every}_steady_le_1.3x_raw"] = t["steady_max_vs_raw"] <= 1.3
    last = loops.get(max(loops, default=0), {}).get("tiered_dcp", {})
    if last.get("loop_vs_none") is not None:
        out["sparsest_loop_le_1.15x_none"] = last["loop_vs_none"] <= 1.15
    for every, bound in ((1, 1.05), (10, 1.02)):
        bg = loops.get(every, {}).get("tiered_bg", {})
        if bg.get("loop_vs_none") is not None:
            out[f"bg_every_{every}_loop_le_{bound}x_none"] = bg["loop_vs_none"] <= bound
        if bg.get("calls_s"):
            out[f"bg_every_{every}_call_median_le_5ms"] = (
                statistics.median(bg["calls_s"][3:] or bg["calls_s"]) <= 0.005
            )
    return out


def one_loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    every: int,
    saves: Saves,
    raw: float,
    none_s: float | None,
) -> dict:
    """A loop whose failure is its row's, not the part's."""
    try:
        run = train_loop(model, opt, x, steps, every, saves)
        run.update(summarize(run, raw, none_s))
    except Exception as e:  # the other loops' figures still count
        traceback.print_exc()
        run = {"error": f"{type(e).__name__}: {e}", "stalls_s": []}
    finally:
        if saves is not None:
            if isinstance(saves, TieredSaves) and "error" not in run:
                run["disk_skipped"] = saves.skipped()
            t0 = time.perf_counter()
            saves.close()
            if "error" not in run:
                run["close_s"] = time.perf_counter() - t0
    return run


def train_part(args: argparse.Namespace, work: str, shm: str) -> dict:
    """The training loop: a model + AdamW, a save every ``every`` steps with each way,
    beside the same loop without saves and the raw copy of the same bytes."""
    model, opt = training_state(args.train_gib)
    width = model[0].in_features
    batch = args.train_batch or (2048 if DEVICE == "cuda" else 16)
    x = torch.randn(batch, width, device=DEVICE)
    for _ in range(args.train_warmup):
        train_step(model, opt, x)
    state = state_of(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    raw = raw_copy(state)
    del state
    head = {"state_gb": nbytes / 1e9, "params": sum(p.numel() for p in model.parameters()), "batch": batch}
    head |= {"raw_copy_s": raw, "raw_copy_gbps": nbytes / raw / 1e9, "lagging": args.lagging}
    print(f"train setup: {json.dumps(head)}", flush=True)
    print(TRAIN_HEADER, flush=True)
    loops: dict = {}
    for steps, every in args.train_loops:
        ways = loops[every] = {}
        none_s = None
        for way in args.train_ways:
            name = f"train-{way}-{every}"
            saves = {
                "none": lambda: None,
                "tiered_dcp": lambda n=name: TieredSaves(n, work, shm, args.lagging),
                "tiered_ram_only": lambda n=name: TieredSaves(n, work, shm, args.lagging, ram_only=True),
                "stock_pinned": lambda n=name: StockSaves(n, work, pinned=True),
                "stock_default": lambda n=name: StockSaves(n, work, pinned=False),
                "tiered_bg": lambda n=name: TieredSaves(n, work, shm, args.lagging, background=True),
                "stock_bg": lambda n=name: StockSaves(n, work, pinned=True, background=True),
            }[way]()
            run = ways[way] = one_loop(model, opt, x, steps, every, saves, raw, none_s)
            if way == "none" and "error" not in run:
                none_s = run["loop_s"]
                run["loop_vs_none"] = 1.0
            print_row(every, way, run)
    out = {**head, "loops": loops, "targets": targets(loops)}
    print("train targets:", json.dumps(out["targets"]), flush=True)
    print("train:", json.dumps(rounded(out)), flush=True)
    return out


def tiers_of(name: str, work: str, shm: str, ram: bool) -> TieredConfig:
    """A RAM tier keep=1 over a disk tier every=2, or a disk tier alone."""
    disk = Tier(f"{work}/{name}-disk", every=2 if ram else 1, keep=2)
    return TieredConfig(name, [Tier(f"{shm}/{name}", keep=1), disk] if ram else [disk])


def exact_part(args: argparse.Namespace, work: str, shm: str) -> dict:
    """Every step of every way of saving loads back as staged; 'wrong' lists those that did not."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def cfg(name: str, ram: bool) -> TieredConfig:
        return tiers_of(name, work, shm, ram)

    bad: list[str] = []
    bad += exact_async("ram+disk", cfg("a", True), 4)
    bad += exact_async("disk", cfg("b", False), 3)
    bad += exact_async("ram+disk background", cfg("c", True), 3, background=True)
    bad += exact_async("ram+disk PROCESS", cfg("d", True), 2, mode=AsyncCheckpointerType.PROCESS)
    bad += exact_sync("ram+disk", cfg("e", True))
    print("exact:", "every step loads as staged" if not bad else f"WRONG: {bad}", flush=True)
    return {"wrong": bad}


def load_part(args: argparse.Namespace, work: str, shm: str) -> dict:
    loads = load_times(args.load_gib, args.load_runs, work, shm)
    for k, v in loads.items():
        print(f"load {k:<30}{v:>8.3f}", flush=True)
    print("load:", json.dumps(loads), flush=True)
    return loads


def stall_part(args: argparse.Namespace, work: str, shm: str) -> dict:
    """The stall of back-to-back saves of a plain ``--mib`` state (see the docstring)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    ours = tiers_of("t", work, shm, True)
    ways = {
        "tiered_ram_tier_stall_s": lambda st, step: dcp.async_save(
            st, storage_writer=TieredWriter(ours, step=step)
        ),
        "stock_default_stall_s": lambda st, step: dcp.async_save(
            st, storage_writer=dcp.FileSystemWriter(f"{work}/stock/{step}")
        ),
        "stock_pinned_stall_s": lambda st, step: dcp.async_save(
            st,
            storage_writer=dcp.FileSystemWriter(f"{work}/pinned/{step}"),
            # a stager per save: torch 2.11's fails its second stage (KeyError: <class 'type'>)
            async_stager=DefaultStager(StagingOptions(True, False, False, True)),
        ),
    }
    if DEVICE == "cpu":  # pinned staging needs an accelerator
        del ways["stock_pinned_stall_s"]
    measured = {name: stalls(save, args.mib, args.steps) for name, save in ways.items()}
    seconds = {name: steady for name, (_, steady) in measured.items()}
    first = {name.replace("_stall_s", "_first_stall_s"): cold for name, (cold, _) in measured.items()}
    ratios = {
        f"tiered_stall_vs_{k.removesuffix('_stall_s')}": seconds["tiered_ram_tier_stall_s"] / v
        for k, v in seconds.items()
        if k.startswith("stock")
    }
    nbytes = args.mib * MiB
    print(f"stall: {args.mib} MiB state, {args.steps} saves back to back", flush=True)
    for k, v in {**seconds, **first}.items():
        print(f"{k:<30}{v:>8.3f} s {nbytes / v / 1e9:>7.2f} GB/s", flush=True)
    for k, v in ratios.items():
        print(f"{k:<30}{v:>8.2f}", flush=True)
    out = {"seconds": seconds, "first": first, "ratios": ratios}
    print("stall:", json.dumps(out), flush=True)
    return out


PARTS = {"exact": exact_part, "train": train_part, "load": load_part, "stall": stall_part}
WAYS = ("none", "tiered_dcp", "stock_pinned", "stock_default", "tiered_ram_only", "tiered_bg", "stock_bg")


def loop_spec(text: str) -> tuple[int, int]:
    """'STEPS:EVERY', e.g. '80:10'."""
    steps, every = (int(v) for v in text.split(":"))
    if steps < 1 or every < 1:
        raise argparse.ArgumentTypeError(f"{text}: STEPS and EVERY must be positive")
    return steps, every


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="where the disk tiers and stock go")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), default=list(PARTS), help="the parts run")
    ap.add_argument("--skip", nargs="+", choices=list(PARTS), default=[], help="parts not run")
    ap.add_argument("--mib", type=int, default=1024, help="stall: the plain state (MiB)")
    ap.add_argument("--steps", type=int, default=8, help="stall: saves back to back")
    ap.add_argument("--load-gib", type=float, default=3.0, help="load: model + AdamW state loaded (GiB)")
    ap.add_argument("--load-runs", type=int, default=3)
    ap.add_argument("--train-gib", type=float, default=3.0, help="train: model + AdamW state (GiB)")
    ap.add_argument("--train-batch", type=int, default=0, help="train: rows per step (0: 2048 cuda, 16 cpu)")
    ap.add_argument("--train-loops", nargs="+", type=loop_spec, default=[(80, 10), (120, 30)],
                    metavar="STEPS:EVERY", help="train: the loops (default 80:10 120:30)")  # fmt: skip
    ap.add_argument("--train-ways", nargs="+", choices=WAYS, default=list(WAYS[:3]),
                    help="train: the ways (default none tiered_dcp stock_pinned)")  # fmt: skip
    ap.add_argument("--train-warmup", type=int, default=3, help="train: untimed steps first")
    ap.add_argument("--lagging", default="skip", choices=["skip", "wait"], help="train: on_lagging_tier")
    args = ap.parse_args()
    args.parts = [p for p in PARTS if p in args.only and p not in args.skip]
    args.train_ways = [w for w in WAYS if w in args.train_ways]
    return args


def run_part(name: str, args: argparse.Namespace, work: str, shm: str, results: dict) -> bool:
    """One part; its failure is printed and recorded, and the next part runs. False when
    interrupted (SIGINT: ``timeout -s INT`` in ``gpu_check.sh``): no part runs after it."""
    t0 = time.perf_counter()
    go_on = True
    try:
        results[name] = PARTS[name](args, work, shm)
    except Exception as e:  # the other parts' figures still count
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    except KeyboardInterrupt:
        traceback.print_exc()
        results[name] = {"error": "interrupted"}
        go_on = False
    print(f"part {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return go_on


def main() -> None:
    args = parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA device (--device cpu: a dry run)")
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{device}, torch {torch.__version__}; parts {' '.join(args.parts)}", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    work = tempfile.mkdtemp(prefix="tdcp-cuda-", dir=args.disk)
    shm = tempfile.mkdtemp(prefix="tdcp-cuda-", dir="/dev/shm")
    results: dict = {}
    try:
        for name in args.parts:
            if not run_part(name, args, work, shm, results):
                break
    finally:
        shutdown(wait=True, timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(rounded({"device": device, "torch": torch.__version__, **results})), flush=True)
    dist.destroy_process_group()
    failed = [n for n, r in results.items() if "error" in r or r.get("wrong")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
