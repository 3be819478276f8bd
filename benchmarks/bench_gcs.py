"""A gs:// tier vs torch's FsspecWriter / FsspecReader, on the same fake-gcs-server and bytes.

    .venv/bin/python benchmarks/bench_gcs.py [--mib 256] [--runs 5] [--tensors 32]

Single process, no process group. Save: a sync ``dcp.save`` whose only tier is gs://
(``TieredWriter``) vs ``FsspecWriter`` on the same bucket. Load: ``dcp.load`` with
``TieredReader`` vs ``FsspecReader``. Also timed: our save with the part uploaded as 8
pieces in parallel and composed (``part_size`` = 1/8 of the state; by default a part of up to
256 MiB is one request), and gcsfs's own upload of the same bytes as one object
(``pipe_file``). Every figure is the median of ``--runs`` runs; every run writes a fresh checkpoint and
the previous one is deleted, so the in-memory server holds about two at a time. Prints a
table, then JSON. Never fails on timing.

The emulator (tests/gcs_emulator.py) keeps objects in memory and shares the machine's cores
with the client: its figures compare the clients against each other on one server, never
against real GCS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import MiB, make_state, report  # noqa: E402
from gcs_emulator import Emulator  # noqa: E402
from tiered_dcp.storage import open_storage  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter  # noqa: E402

warnings.filterwarnings("ignore")


def timed(fn, runs: int, setup=None) -> float:
    times = []
    for i in range(runs):
        if setup:
            setup(i)
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--runs", type=int, default=5, help="runs per figure; the median is reported")
    ap.add_argument("--tensors", type=int, default=32, help="tensors in the state (default 32)")
    ap.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a storage option of our gs:// tier (part_size, max_concurrency...)",
    )
    args = ap.parse_args()
    state = make_state(args.mib, args.tensors)
    nbytes = sum(t.nbytes for t in state.values())
    res: dict[str, float] = {}
    with Emulator() as em:
        em.create_bucket("bench")
        so = em.storage_options()
        bucket = open_storage("gs://bench", so)
        mine = {**so, **dict(kv.split("=", 1) for kv in args.option)}
        ours = TieredConfig("ours", [Tier("gs://bench/tiered", storage_options=mine, keep=1)])
        pieces = {**mine, "part_size": -(-nbytes // 8)}
        ours_pieces = TieredConfig("pieces", [Tier("gs://bench/tiered", storage_options=pieces, keep=1)])
        target = {k: torch.empty_like(v) for k, v in state.items()}

        def drop(prefix):
            return lambda i: bucket.delete(prefix)

        # --- gcsfs's own upload of all the bytes as one object
        blob = b"".join(memoryview(t.numpy()).cast("B") for t in state.values())
        res["gcsfs_pipe_one_object_s"] = timed(
            lambda i: bucket.fs.pipe_file("bench/blob", blob, chunksize=2 * nbytes), args.runs
        )
        bucket.delete("blob")

        # --- save: ours (defaults), ours (8 pieces in parallel, composed), torch's
        res["tiered_save_s"] = timed(
            lambda i: dcp.save(state, storage_writer=TieredWriter(ours, step=i)), args.runs
        )
        res["tiered_save_8_pieces_s"] = timed(
            lambda i: dcp.save(state, storage_writer=TieredWriter(ours_pieces, step=i)), args.runs
        )
        res["fsspec_writer_save_s"] = timed(
            lambda i: dcp.save(state, storage_writer=FsspecWriter(f"gs://bench/fsspec/{i}", **so)),
            args.runs,
            setup=drop("fsspec"),
        )
        # --- load the last of each
        res["tiered_load_s"] = timed(lambda i: dcp.load(target, storage_reader=TieredReader(ours)), args.runs)
        assert all(torch.equal(target[k], state[k]) for k in state)
        for t in target.values():
            t.zero_()
        last = f"gs://bench/fsspec/{args.runs - 1}"
        res["fsspec_reader_load_s"] = timed(
            lambda i: dcp.load(target, storage_reader=FsspecReader(last, **so)), args.runs
        )
        assert all(torch.equal(target[k], state[k]) for k in state)

    ratios = {
        "save_speedup_vs_fsspec_writer": res["fsspec_writer_save_s"] / res["tiered_save_s"],
        "load_speedup_vs_fsspec_reader": res["fsspec_reader_load_s"] / res["tiered_load_s"],
        "save_8_pieces_speedup_vs_fsspec_writer": res["fsspec_writer_save_s"] / res["tiered_save_8_pieces_s"],
        "save_speedup_vs_gcsfs_pipe_one_object": res["gcsfs_pipe_one_object_s"] / res["tiered_save_s"],
    }
    targets = {
        "save_speedup_vs_fsspec_writer": (">=", 2),
        "load_speedup_vs_fsspec_reader": (">=", 2),
    }
    report(
        f"gs:// on fake-gcs-server; state: {nbytes / MiB:.0f} MiB in {len(state)} tensors; "
        f"median of {args.runs} runs",
        nbytes,
        res,
        ratios,
        targets,
    )
    print(json.dumps({"bytes": nbytes, "runs": args.runs, "seconds": res, "ratios": ratios}))


if __name__ == "__main__":
    main()
