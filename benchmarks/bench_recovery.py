"""What recovery costs: the non-finite check on every save, and a resume past a damaged step.

    .venv/bin/python benchmarks/bench_recovery.py [--mib 256] [--runs 7]

- save: a sync ``dcp.save`` of ``--mib`` MiB (float32 and bfloat16 halves) to a RAM tier
  in /dev/shm, with ``on_nonfinite="mark"`` (the default: every floating tensor checked)
  against the same save with ``"ignore"`` (no check), runs interleaved; the target is the
  check within 5% of the save's time.
- resume: ``load_latest`` of the same state when the newest step's only copy is damaged
  (it fails, quarantines it and loads the step before) against a plain load of an intact
  step, and against ``load_latest`` once the mark is there (a plain load of the older step).

``--dir`` puts the tier elsewhere (a local disk: the save is fsynced there).

Every figure is the median of ``--runs`` runs. Prints a table, then JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from common import exit_on_sigterm, make_state
from tiered_dcp.storage.format import part_key

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, load_latest

warnings.filterwarnings("ignore")


def state(mib: int) -> dict:
    half = make_state(mib // 2, 16)
    return half | {f"bf16.{k}": v.to(torch.bfloat16) for k, v in make_state(mib // 2, 16).items()}


def save_times(root: str, sd: dict, runs: int) -> dict[str, float]:
    """Median seconds of a sync save per policy, the policies interleaved run by run."""
    times: dict[str, list[float]] = {"mark": [], "ignore": []}
    for run in range(runs + 1):
        for policy in list(times)[:: 1 if run % 2 else -1]:  # each policy first in every other run
            cfg = TieredConfig(f"bench-{policy}", [Tier(f"{root}/ram", keep=1)], on_nonfinite=policy)
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=TieredWriter(cfg, step=run))
            if run:  # the first run of each warms the page cache and the tier
                times[policy].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def resume_times(root: str, sd: dict, runs: int) -> dict[str, float]:
    out: dict[str, list[float]] = {
        "plain load": [],
        "load_latest past a damaged step": [],
        "load_latest, marked": [],
    }
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    for run in range(runs):
        cfg = TieredConfig(f"resume{run}", [Tier(f"{root}/ram", keep=3)])
        for step in (1, 2):
            dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=TieredReader(cfg))
        out["plain load"].append(time.perf_counter() - t0)
        (part,) = glob.glob(f"{root}/ram/{part_key(cfg.namespace, 2, 0)}")
        with open(part, "r+b") as f:  # a byte near the end: the load reads almost all of it first
            f.seek(-100, 2)
            byte = f.read(1)
            f.seek(-100, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        t0 = time.perf_counter()
        assert load_latest(target, cfg) == 1
        out["load_latest past a damaged step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert load_latest(target, cfg) == 1
        out["load_latest, marked"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--dir", default="/dev/shm", help="where the tier lives (/dev/shm: RAM; a disk path: SSD)"
    )
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    import logging

    logging.getLogger("tiered_dcp").setLevel(logging.ERROR)
    sd = state(args.mib)
    root = tempfile.mkdtemp(prefix="bench-recovery-", dir=args.dir)
    try:
        saves = save_times(root, sd, args.runs)
        resumes = resume_times(root, sd, max(3, args.runs // 2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    check = saves["mark"] / saves["ignore"]
    print(f"recovery, {args.mib} MiB (float32 + bfloat16), tier in {args.dir}, medians")
    print(f"{'measure':<40}{'seconds':>9}")
    for k, v in {**{f"save, on_nonfinite={p}": t for p, t in saves.items()}, **resumes}.items():
        print(f"{k:<40}{v:>9.3f}")
    verdict = "met" if check <= 1.05 else "NOT met"
    print(f"\nsave with the check / without: {check:.3f} (target <= 1.05: {verdict})")
    fallback = resumes["load_latest past a damaged step"] / resumes["plain load"]
    print(f"resume past a damaged step / plain load: {fallback:.2f}")
    print(json.dumps({"mib": args.mib, "save_s": saves, "resume_s": resumes, "check_ratio": check}))


if __name__ == "__main__":
    main()
