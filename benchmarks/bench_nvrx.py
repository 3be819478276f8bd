"""The comparison with NVIDIA's local checkpointing (NvRx), on CPU, in one run.

    .venv/bin/python benchmarks/bench_nvrx.py [--mib 64] [--loads 10] [--rounds 3]

Needs ``nvidia-resiliency-ext`` importable (not a dependency of this project): e.g.
``pip install --no-deps --target /tmp/nvrx nvidia-resiliency-ext`` and ``PYTHONPATH=/tmp/nvrx``,
or ``PYTHONPATH`` at a checkout's ``src`` (its ``checkpointing/local`` is plain Python; PyPI
has no 0.7.0 for Python 3.11). Without it the bench says so and exits 2.

The same job both ways: 4 real processes on gloo as 2 nodes (ranks 0-1, 2-3), each holding
``--mib`` MiB in 32 float32 tensors, replicas across the nodes (cliques {0, 2} and {1, 3}),
everything in /dev/shm. One step saved; then ``--loads`` timed loads into preallocated
tensors with every node's files intact, and as many after node 1's files are deleted; the
slowest rank's seconds, median per kind. The two ways take turns going first, each in a
process of its own, for ``--rounds`` rounds; printed are the medians and the ratio
tiered-dcp / NvRx per round (below 1: tiered-dcp is faster).

- tiered-dcp: ``benchmarks/bench_peer_reads.py`` (``TieredReader(config)`` + ``dcp.load``).
- NvRx: ``LocalCheckpointManager`` with ``CliqueReplicationStrategy`` (jump 2, factor 2), a
  fresh manager per load (``find_latest`` + ``load``), then the loaded tensors copied into
  the preallocated ones (``--no-copy``: not; NvRx's load returns new tensors, and a
  restart copies them into the model and optimizer, as tiered-dcp's load does in place).
  NvRx is written for CUDA states; its few CUDA calls are shimmed in its own processes
  (``Tensor.cuda`` and ``torch.cuda.synchronize`` do nothing, ``empty_like(...,
  device="cuda")`` stays on the host), and a TensorAwareStateDict that accepts host
  tensors and leaves them there on load stands in for ``BasicTensorAwareStateDict``.

Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from common import exit_on_sigterm, make_state, slowest, spawn_ranks

WORLD, RANKS_PER_NODE = 4, 2
HERE = os.path.dirname(os.path.abspath(__file__))


def _shim_cuda() -> None:
    """NvRx's CUDA calls, made host no-ops in this process only."""
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    empty_like = torch.empty_like

    def host_empty_like(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return empty_like(t, *a, **k)

    torch.empty_like = host_empty_like  # type: ignore[assignment]


try:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
except ImportError:  # main() says how to install it
    BasicTensorAwareStateDict = object  # type: ignore[assignment,misc]


class HostStateDict(BasicTensorAwareStateDict):  # type: ignore[misc,valid-type]
    """NvRx's BasicTensorAwareStateDict without its CUDA-only check."""

    def __init__(self, state_dict: dict) -> None:
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """The tensors stay on the host (NvRx moves them back to CUDA here)."""


def nvrx_rank(rank: int, root: str, args: dict) -> dict[str, list[float]]:
    """One rank of NvRx's job: save a step, then time loads intact and with node 1 lost."""
    _shim_cuda()
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    strategy = CliqueReplicationStrategy.from_replication_params(2, 2)
    node_dir = f"{root}/node{rank // RANKS_PER_NODE}"
    state = {f"r{rank}.{k}": v for k, v in make_state(args["mib"]).items()}
    LocalCheckpointManager(node_dir, repl_strategy=strategy).save(HostStateDict(dict(state)), 1)
    out: dict[str, list[float]] = {}
    for kind in ("intact", "node_lost"):
        if kind == "node_lost":
            dist.barrier()
            if rank == 0:
                shutil.rmtree(f"{root}/node1")
            dist.barrier()
        target = {k: torch.empty_like(v) for k, v in state.items()}
        took = []
        for i in range(args["loads"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            manager = LocalCheckpointManager(node_dir, repl_strategy=strategy)
            if manager.find_latest() != 1:
                raise AssertionError("NvRx found no step 1")
            loaded, _ = manager.load()
            for k, t in target.items():
                if args["copy"]:
                    t.copy_(loaded.state_dict[k])
                else:  # checked below, untimed
                    target[k] = loaded.state_dict[k]
            seconds = slowest(time.perf_counter() - t0)
            if i:
                took.append(seconds)
            if not all(torch.equal(target[k], state[k]) for k in state):
                raise AssertionError("NvRx loaded wrong")
        out[kind] = took
    return out


def run_nvrx(args: argparse.Namespace) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="tdcp-bench-nvrx-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        spec = {"mib": args.mib, "loads": args.loads, "copy": not args.no_copy}
        got = spawn_ranks(nvrx_rank, WORLD, root, spec, env={"LOCAL_WORLD_SIZE": RANKS_PER_NODE}, timeout=280)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {kind: statistics.median(got[0][kind]) for kind in ("intact", "node_lost")}


def run_ours(args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, os.path.join(HERE, "bench_peer_reads.py"), "--mib", str(args.mib)]
    done = subprocess.run([*cmd, "--loads", str(args.loads)], capture_output=True, text=True, timeout=290)
    if done.returncode:
        raise RuntimeError(f"bench_peer_reads failed:\n{done.stdout}\n{done.stderr}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {kind: summary[kind]["load_median_s"] for kind in ("intact", "node_lost")}


def run_one(way: str, args: argparse.Namespace) -> dict[str, float]:
    """One way's medians, in a process of its own (NvRx's shims stay there)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", way, "--mib", str(args.mib)]
    cmd += ["--loads", str(args.loads), *["--no-copy"] * args.no_copy]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{way} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="state per rank in MiB (default 64)")
    ap.add_argument("--loads", type=int, default=10, help="timed loads of each kind (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the two ways taking turns (default 3)")
    ap.add_argument("--no-copy", action="store_true", help="NvRx: time no copy into the preallocated tensors")
    ap.add_argument("--one", choices=["nvrx", "tiered"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    if args.one:
        print(json.dumps(run_nvrx(args) if args.one == "nvrx" else run_ours(args)))
        return
    try:
        import nvidia_resiliency_ext  # noqa: F401
    except ImportError:
        print("nvidia-resiliency-ext is not importable: install it to compare (see this file's docstring)")
        sys.exit(2)
    rows = []
    for i in range(args.rounds):
        order = ["nvrx", "tiered"] if i % 2 == 0 else ["tiered", "nvrx"]
        row = {way: run_one(way, args) for way in order}
        rows.append(row)
        line = "  ".join(f"{w} {k} {row[w][k] * 1e3:.1f} ms" for w in order for k in row[w])
        print(f"round {i + 1}: {line}")
    print(f"\n{WORLD} ranks as 2 nodes, {args.mib} MiB per rank, /dev/shm, {args.loads} loads, slowest rank")
    result: dict[str, Any] = {"bench": "nvrx", "mib": args.mib, "loads": args.loads}
    result["nvrx_copy"] = not args.no_copy
    for kind in ("intact", "node_lost"):
        ratios = [r["tiered"][kind] / r["nvrx"][kind] for r in rows]
        nvrx = statistics.median(r["nvrx"][kind] for r in rows)
        ours = statistics.median(r["tiered"][kind] for r in rows)
        print(
            f"{kind:<10} NvRx {nvrx * 1e3:7.1f} ms  tiered-dcp {ours * 1e3:7.1f} ms  tiered/NvRx per round "
            f"{' '.join(f'{x:.2f}' for x in ratios)}  median {statistics.median(ratios):.2f}"
        )
        nvrx_s, tiered_s = [r["nvrx"][kind] for r in rows], [r["tiered"][kind] for r in rows]
        result[kind] = {"nvrx_s": nvrx_s, "tiered_s": tiered_s, "ratios": ratios}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
