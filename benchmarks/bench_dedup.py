"""Dedup and float-aware compression, as ratios in one run.

1. LoRA-style state (90% of the bytes frozen), saved twice with ``dedup=True``: the second
   save's new bytes and time vs the first, per tier (tier 0 on the save path, tier 1 by
   the writer process), with tier 0 in RAM (/dev/shm) and on a local disk (the system's
   temporary directory, or ``--disk``). Target: <= 0.15 of both.
2. Embedding table where 1% of the rows change: bytes the second save writes, dedup on
   vs off (rows picked at random, and as one contiguous range).
3. Compression of bf16 / fp32 weights and fp32 Adam states: plain zstd vs byte-grouped
   zstd (tiered-dcp's per-chunk choice) vs torch's own ``ZStandard`` extension of
   ``FileSystemWriter``: stored/raw and throughput.
4. Load time of the same state from a raw tier and from a zstd tier.

Run: ``.venv/bin/python benchmarks/bench_dedup.py [--mib 64]``
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm, files, new_bytes
from tiered_dcp.storage.codec import Encoder

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, wait_for
from tiered_dcp.writer_process.run_dir import RunDir

warnings.filterwarnings("ignore")


def writer_seconds(cfg: TieredConfig, tier: int, step: int) -> float:
    return RunDir.of(cfg, 0).results.all()[(step, tier)].seconds


def lora(mib: int, step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    a = torch.Generator().manual_seed(step)
    per = mib * MiB // 20 // 4  # 18 frozen tensors, 2 adapters: 90% frozen
    sd = {f"frozen{i}": torch.randn(per, generator=g) * 0.02 for i in range(18)}
    sd.update({f"adapter{i}": torch.randn(per, generator=a) * 0.02 for i in range(2)})
    return sd


def bench_lora(base: str, mib: int, first: str, where: str) -> dict:
    """The LoRA saves with tier 0 under ``first`` (RAM or a local disk), tier 1 under ``base``."""
    name = where.replace(" ", "-")
    tier0, tier1 = f"{first}/lora/t0", f"{base}/lora/{name}"
    cfg = TieredConfig(
        f"lora-{name}", [Tier(f"{tier0}/{{node}}"), Tier(tier1, shared=True, compression="zstd")], dedup=True
    )
    tier0 += "/0"
    out = {}
    before = (files(tier0), files(tier1))
    for step in (1, 2):
        sd = lora(mib, step)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))
        save_s = time.perf_counter() - t0
        wait_for(cfg, step, timeout=600)
        after = (files(tier0), files(tier1))
        out[step] = {
            "tier0_bytes": new_bytes(before[0], after[0]),
            "tier0_s": save_s,
            "tier1_bytes": new_bytes(before[1], after[1]),
            "tier1_s": writer_seconds(cfg, 1, step),
        }
        before = after
    print(f"\n1. LoRA-style state, {mib} MiB fp32, 90% frozen, dedup=True, tier 0 on {where}")
    print(f"{'':<10}{'tier0 MiB':>10}{'tier0 s':>9}{'tier1 MiB':>11}{'tier1 s':>9}")
    for step, r in out.items():
        print(
            f"save {step:<5}{r['tier0_bytes'] / MiB:>10.2f}{r['tier0_s']:>9.3f}"
            f"{r['tier1_bytes'] / MiB:>11.2f}{r['tier1_s']:>9.3f}"
        )
    ratios = {k: out[2][k] / out[1][k] for k in out[1]}
    for k, v in ratios.items():
        print(f"second/first {k:<12}{v:>7.3f}  target <= 0.15  {'yes' if v <= 0.15 else 'NO'}")
    return ratios


def bench_embedding(base: str, mib: int) -> None:
    rows, dim = mib * MiB // (256 * 4), 256
    g = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=g) * 0.02
    print(f"\n2. Embedding table {rows} x {dim} fp32 ({mib} MiB), 1% of rows change")
    for how in ("random", "contiguous"):
        changed = table.clone()
        n = rows // 100
        idx = torch.randperm(rows, generator=g)[:n] if how == "random" else torch.arange(n) + rows // 2
        changed[idx] += 1e-3
        for dedup in (False, True):
            root = f"{base}/emb-{how}-{dedup}"
            cfg = TieredConfig("emb", [Tier(f"{root}/{{node}}")], dedup=dedup)
            dcp.save({"emb": table}, storage_writer=TieredWriter(cfg, step=1))
            before = files(root)
            dcp.save({"emb": changed}, storage_writer=TieredWriter(cfg, step=2))
            written = new_bytes(before, files(root))
            print(
                f"   {how:<11} rows, dedup={dedup!s:<5}: second save writes {written / MiB:7.2f} MiB "
                f"({written / table.numel() / 4:.3f} of the table)"
            )
        touched = {
            kib: len(set((idx * dim * 4 // (kib << 10)).tolist())) * (kib << 10) / (rows * dim * 4)
            for kib in (1024, 256, 64, 16)
        }
        print(
            f"   {how:<11} rows: share of blocks holding a changed row, by block size: "
            + ", ".join(f"{kib} KiB {share:.3f}" for kib, share in touched.items())
        )


def zstd_ext_size(base: str, sd: dict) -> tuple[int, float]:
    """Bytes and seconds of a stock FileSystemWriter save with torch's ZStandard extension."""
    from torch.distributed.checkpoint._extension import ZStandard

    d = tempfile.mkdtemp(dir=base)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, _extensions=[ZStandard()]))
    secs = time.perf_counter() - t0
    size = sum(os.path.getsize(f) for f in glob.glob(f"{d}/*.distcp"))
    return size, secs


def bench_compression(base: str, mib: int) -> None:
    g = torch.Generator().manual_seed(0)
    n = mib * MiB // 4
    w = torch.randn(n, generator=g) * 0.02
    cases = {
        "bf16 weights": w.to(torch.bfloat16),
        "fp32 weights": w,
        "fp32 Adam exp_avg": torch.randn(n, generator=g) * 1e-4,
        "fp32 Adam exp_avg_sq": (torch.randn(n, generator=g) * 1e-4) ** 2,
    }
    print(f"\n3. Compression, {mib} MiB fp32 / {mib // 2} MiB bf16 each (stored/raw, MB/s of raw bytes)")
    print(f"{'':<22}{'plain zstd':>18}{'byte-grouped':>18}{'torch ZStandard':>18}")
    enc = Encoder("zstd")
    for name, t in cases.items():
        raw = memoryview(t.view(torch.uint8).numpy())  # no copy: bytearray(storage) iterates per byte
        chunks = [raw[i : i + 8 * MiB] for i in range(0, len(raw), 8 * MiB)]
        t0 = time.perf_counter()
        plain = sum(len(enc.encode(c)) for c in chunks)
        t1 = time.perf_counter()
        grouped = sum(len(enc.encode_as(c, enc.choose(c, str(t.dtype)))) for c in chunks)
        t2 = time.perf_counter()
        ext, ext_s = zstd_ext_size(base, {"t": t})
        cols = [(plain, t1 - t0), (grouped, t2 - t1), (ext, ext_s)]
        print(
            f"{name:<22}" + "".join(f"{b / len(raw):>8.3f} {len(raw) / s / 1e6:>6.0f}MB/s" for b, s in cols)
        )


def bench_load(base: str, mib: int) -> None:
    sd = lora(mib, 1)
    print(f"\n4. Load of {mib} MiB fp32 weights (randn*0.02) from one tier (median of 3)")
    for comp in (None, "zstd"):
        cfg = TieredConfig("load", [Tier(f"{base}/load-{comp}", shared=True, compression=comp)])
        dcp.save(sd, storage_writer=TieredWriter(cfg, step=1))
        stored = sum(size for _, size in files(f"{base}/load-{comp}").values())
        times = []
        for _ in range(3):
            target = {k: torch.empty_like(v) for k, v in sd.items()}
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=TieredReader(cfg, step=1))
            times.append(time.perf_counter() - t0)
        assert all(torch.equal(target[k], sd[k]) for k in sd)
        s = sorted(times)[1]
        gbs = mib * MiB / s / 1e9
        print(f"   compression={comp!s:<5}: {s:.3f} s ({gbs:.2f} GB/s), stored {stored / MiB:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--disk", default=None, help="a local disk directory for tier 0's second run")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dedup-") as base,
        tempfile.TemporaryDirectory(dir=args.disk, prefix="bench-dedup-") as disk,
    ):
        bench_lora(base, args.mib, base, "RAM")
        bench_lora(base, args.mib, disk, "local disk")
        bench_embedding(base, args.mib)
        bench_compression(base, args.mib)
        bench_load(base, args.mib)
    from tiered_dcp import shutdown

    shutdown(wait=True, timeout=60)


if __name__ == "__main__":
    main()
