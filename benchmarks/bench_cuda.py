"""The CUDA paths on a machine with a GPU: exact async snapshots and loads of a CUDA state,
and the training loop's stall against stock DCP's ``async_save``, in the same run.

    python benchmarks/bench_cuda.py [--mib 1024] [--steps 5] [--disk DIR]

Checks (each a failure exit if wrong), on a RAM tier in /dev/shm over a disk tier (staging
into the RAM tier's part file, pinned with ``cudaHostRegister``) and on a disk tier alone
(staging into pinned shared-memory slots):

- ``async_save`` of a CUDA state (fp32, bf16, int64, nested, a Python value), the GPU
  tensors changed in place the moment it returns (or, with ``background_staging``, the
  moment staging completes), loads back onto the GPU as it was when saved, step after step
  (slots and part files reused); also in DCP's PROCESS mode, and for a sync ``dcp.save``.

Then the stall: the seconds ``async_save`` holds the loop for a ``--mib`` MiB CUDA state,
the median of the last half of ``--steps`` steps (every buffer reused; the first step's,
which makes and pins them, is printed too), for tiered-dcp (RAM tier keep=1 over disk: two
part files in turn), stock ``FileSystemWriter`` with DCP's default stager, and stock with a pinned stager
(``DefaultStager(StagingOptions(use_pinned_memory=True))``, one per save: reused, torch
2.11's failed its second save).
Prints a table, then JSON. Needs CUDA; a 1-rank gloo group is started for DCP's
collectives. Run it from outside the repository's root where tiered-dcp is not installed
(the writer process, ``python -m tiered_dcp.persist``, would import the uninstalled tree).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, wait_for

MiB = 1 << 20
DEVICE = "cuda"  # --device cpu: a dry run of the script where there is no GPU
warnings.filterwarnings("ignore")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--disk", default=tempfile.gettempdir())
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--load-gib", type=float, default=3.0, help="model + AdamW state loaded (GiB)")
    ap.add_argument("--load-runs", type=int, default=3)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA device (--device cpu: a dry run)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    work = tempfile.mkdtemp(prefix="tdcp-cuda-", dir=args.disk)
    shm = tempfile.mkdtemp(prefix="tdcp-cuda-", dir="/dev/shm")
    try:

        def cfg(name: str, ram: bool) -> TieredConfig:
            disk = Tier(f"{work}/{name}-disk", every=2 if ram else 1, keep=2)
            return TieredConfig(name, [Tier(f"{shm}/{name}", keep=1), disk] if ram else [disk])

        bad: list[str] = []
        bad += exact_async("ram+disk", cfg("a", True), 4)
        bad += exact_async("disk", cfg("b", False), 3)
        bad += exact_async("ram+disk background", cfg("c", True), 3, background=True)
        bad += exact_async("ram+disk PROCESS", cfg("d", True), 2, mode=AsyncCheckpointerType.PROCESS)
        bad += exact_sync("ram+disk", cfg("e", True))
        print("exact:", "every step loads as staged" if not bad else f"WRONG: {bad}", flush=True)

        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        ours = cfg("t", True)
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
        loads = load_times(args.load_gib, args.load_runs, work, shm)
        print("load:", json.dumps(loads), flush=True)
        if DEVICE == "cpu":  # pinned staging needs an accelerator
            del ways["stock_pinned_stall_s"]
        measured = {name: stalls(save, args.mib, args.steps) for name, save in ways.items()}
        seconds = {name: steady for name, (_, steady) in measured.items()}
        first = {name.replace("_stall_s", "_first_stall_s"): cold for name, (cold, _) in measured.items()}
    finally:
        shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    nbytes = args.mib * MiB
    ratios = {
        f"tiered_stall_vs_{k.removesuffix('_stall_s')}": seconds["tiered_ram_tier_stall_s"] / v
        for k, v in seconds.items()
        if k.startswith("stock")
    }
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"{device}, torch {torch.__version__}; {args.mib} MiB state")
    for k, v in {**seconds, **first}.items():
        print(f"{k:<30}{v:>8.3f} s {nbytes / v / 1e9:>7.2f} GB/s")
    for k, v in ratios.items():
        print(f"{k:<30}{v:>8.2f}")
    for k, v in loads.items():
        print(f"load {k:<30}{v:>8.3f}")
    print(json.dumps({"device": device, "torch": torch.__version__, "wrong": bad,
                      "seconds": seconds, "first": first, "ratios": ratios, "load": loads}))  # fmt: skip
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
