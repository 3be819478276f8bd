"""Recovery inside the job against a restart: fault to the first committed step after it.

    .venv/bin/python benchmarks/bench_inprocess.py [--mib 64] [--rounds 1] [--device cuda]

4 ranks on gloo as 2 nodes (two ranks a node), ``--mib`` MiB of state each, an async save
every step (``inprocess_train.py`` is the loop); rank 1 fails after step 6's save. Cases:

- ``nvrx-raise`` / ``nvrx-kill``: NvRx 0.7.0's ``inprocess.Wrapper`` (``setup.sh --test``
  unpacks it into ``.venv/nvrx``) with tiered-dcp (a RAM tier per node, each part
  replicated on the other node; ``tiered_dcp.inprocess.Abort`` composed with NvRx's
  ``AbortTorchDistributed``); the rank
  raises (every rank re-enters) or is SIGKILLed (the 3 others go on);
- ``torchrun``: the same loop and tiers, restarted by torchrun (``--max-restarts=1``, two
  agents as two nodes, c10d rendezvous, the settings the user guide gives);
- ``stock``: torchrun, stock DCP's ``async_save``/``load`` to a local directory;
- ``ft-``: NvRx 0.7.0's ``ft_launcher`` (``.venv/nvrx/bin/ft_launcher``), three launchers as
  three nodes (``--nnodes=2:3``: two active, a hot spare; the launch line of the user guide),
  with tiered-dcp or (``ft-stock-``) stock DCP; ``ft-node``: rank 2 takes its whole node
  down after step 6's save (its launcher and every process under it SIGKILLed, its RAM tier
  deleted): the spare takes its place and its ranks read their parts from their peers;
- ``-plain``: the loop waits for each save with a plain ``future.result()`` (DCP's examples)
  instead of the user guide's ``tiered_dcp.inprocess.result``, and the training group's
  timeout is 10 min (the survivors' saves cannot wait it out);
- ``-kill-in-save``: rank 1 is SIGKILLed as soon as step 6's save began, so every other
  rank's save waits on it when the launcher's SIGTERM comes; ``-wait1``: with
  ``TIERED_DCP_SIGTERM_WAIT=1`` (the handler waits 1 s at most).

Per case, the seconds from the fault (rank 1's clock just before it fails) to each phase on
the slowest surviving rank: ``abort`` (NvRx: its abort begun, i.e. the fault detected),
``aborted`` (NvRx's and tiered-dcp's aborts done), ``enter`` (the function called again /
the worker started), ``group`` (its process group built), ``loaded`` (the reload done) and
``committed`` (the first save after it complete); ``load`` (``load_latest`` alone, as
tiered-dcp recorded it: inside the restart vs in a fresh process) and ``choose`` (of it, the
ranks' agreement on the step); the MiB the reloads read from the ranks' own tiers,
from peers and from shared tiers (tiered-dcp's load records; the stock case has none);
the step loaded and the steps redone; the workers a launcher SIGKILLed at its stop timeout
(torchrun and ft_launcher). Medians of ``--rounds``. Never fails on timing.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from tiered_dcp.cli.local_servers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "inprocess_train.py")
NVRX = os.path.join(os.path.dirname(HERE), ".venv", "nvrx")  # setup.sh --test puts NvRx there
PHASES = ("aborting", "aborted", "enter", "group", "loaded", "committed")
FAULT_AT, STEPS = 6, 9
KILLED = "forcefully exiting via 9"  # torch's line when a launcher's stop timeout ends in SIGKILL


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("EVENT ")]


def outcome(launchers: list[subprocess.Popen]) -> list[dict]:
    """The ranks' events of every launcher, and a ``sigkilled`` event per worker a launcher
    SIGKILLed at its stop timeout (its log says so)."""
    got = []
    for p in launchers:
        out, err = p.communicate(timeout=240)
        got += events(out) + [{"event": "sigkilled", "t": 0.0}] * err.count(KILLED)
    return got


def run_nvrx(fault: str, root: str, mib: int, extra: dict[str, str]) -> list[dict]:
    port = free_port(span=3)  # the job uses MASTER_PORT + 1 and + 2 too (inprocess_train.py)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}  # CPU: no GPU health checks
    env.update(extra)
    env.update(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), NVRX) if p)
    args = [sys.executable, TRAIN, "nvrx", fault, root, str(mib), str(STEPS), str(FAULT_AT)]
    procs = [
        subprocess.Popen(
            args,
            env={**env, "RANK": str(r), "GROUP_RANK": str(r // 2)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(4)
    ]
    return [e for p in procs for e in events(p.communicate(timeout=240)[0])]


def run_torchrun(mode: str, fault: str, root: str, mib: int, extra: dict[str, str]) -> list[dict]:
    port = free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={n}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench",
                "--max-restarts=1",
                "--monitor-interval=0.1",
                TRAIN,
                mode,
                fault,
                root,
                str(mib),
                str(STEPS),
                str(FAULT_AT),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    return outcome(agents)


def start_ft_launchers(
    root: str, args: list[str], extra: dict[str, str], restarts: int = 1, outputs: list | None = None
) -> list[subprocess.Popen]:
    """Three ft_launchers as three nodes, each running ``args``, with the launch line
    docs/user-guide.md gives: two nodes needed, a hot spare, ``restarts`` restarts (the
    guide: one). Launcher 0 hosts
    the rendezvous and is always group rank 0 (``GROUP_RANK``: each one's place in NvRx's
    barrier order); the first round closes once two have joined, leaving 1 or 2 the spare.
    Each one's stdout and stderr are pipes, or ``outputs[n]``'s pair of files.
    (``tests/test_ft_launcher.py`` starts its jobs with it too.)"""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(extra, NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE="1", TMPDIR=root)  # the launchers' sockets
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), NVRX) if p)
    return [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(NVRX, "bin", "ft_launcher"),
                "--nnodes=2:3",
                "--nproc-per-node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=ft",
                f"--rdzv-conf=is_host={int(n == 0)}",  # one host on 127.0.0.1: say which one hosts
                f"--max-restarts={restarts}",
                "--monitor-interval=0.1",
                f"--log-dir={root}/logs",
                *args,
            ],
            env={**env, "GROUP_RANK": str(n)},
            stdout=outputs[n][0] if outputs else subprocess.PIPE,
            stderr=outputs[n][1] if outputs else subprocess.PIPE,
            text=True,
            start_new_session=True,  # a node of its own
        )
        for n in range(3)
    ]


def run_ft(mode: str, fault: str, root: str, mib: int, extra: dict[str, str]) -> list[dict]:
    """The loop under three ft_launchers: two active nodes and a hot spare."""
    args = [TRAIN, mode, fault, root, str(mib), str(STEPS), str(FAULT_AT)]
    return outcome(start_ft_launchers(root, args, extra))


# case -> (launcher, fault, the environment beside it): the loop waits for each save as the
# user guide says (tiered_dcp.inprocess.result), or as DCP's examples do ("plain")
CASES = {
    "nvrx-raise": ("nvrx", "raise", {}),
    "nvrx-kill": ("nvrx", "kill", {}),
    "nvrx-raise-plain": ("nvrx", "raise", {"BENCH_WAIT": "plain", "BENCH_PG_TIMEOUT": "600"}),
    "nvrx-kill-plain": ("nvrx", "kill", {"BENCH_WAIT": "plain", "BENCH_PG_TIMEOUT": "600"}),
    "torchrun": ("torchrun", "raise", {}),
    "torchrun-kill-in-save": ("torchrun", "kill-in-save", {}),
    "torchrun-kill-in-save-wait1": ("torchrun", "kill-in-save", {"TIERED_DCP_SIGTERM_WAIT": "1"}),
    "stock": ("stock", "raise", {}),
    "stock-kill-in-save": ("stock", "kill-in-save", {}),
    "ft-kill-in-save": ("ft", "kill-in-save", {}),
    "ft-kill-in-save-wait1": ("ft", "kill-in-save", {"TIERED_DCP_SIGTERM_WAIT": "1"}),
    "ft-stock-kill-in-save": ("ft-stock", "kill-in-save", {}),
    "ft-node": ("ft", "node", {}),
}

RATIOS = (  # (case, baseline): the fault to the first commit after it, case / baseline
    ("nvrx-raise", "torchrun"),
    ("nvrx-raise", "stock"),
    ("nvrx-kill", "torchrun"),
    ("nvrx-kill", "stock"),
    ("ft-kill-in-save", "ft-stock-kill-in-save"),
)


def measure(case: str, mib: int) -> dict:
    root = tempfile.mkdtemp(prefix="tdcp-bench-inproc-", dir="/dev/shm")
    launcher, fault, extra = CASES[case]
    try:
        if launcher == "nvrx":
            got = run_nvrx(fault, root, mib, extra)
        elif launcher.startswith("ft"):
            got = run_ft("stock" if launcher == "ft-stock" else "torchrun", fault, root, mib, extra)
        else:
            got = run_torchrun(launcher, fault, root, mib, extra)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (fault,) = [e["t"] for e in got if e["event"] == "fault"]
    out: dict = {}
    for phase in PHASES:
        after = [e for e in got if e["event"] == phase and e["t"] > fault]
        out[phase] = max(e["t"] for e in after) - fault if after else None
    starts = [e["started"] for e in got if e["event"] == "process" and e["started"] > fault]  # restarted
    out["process_start"] = max(starts) - fault if starts else None  # before its imports
    loaded = [e for e in got if e["event"] == "loaded" and e["t"] > fault]
    recorded = [e for e in loaded if "own" in e]  # tiered-dcp's record of each reload
    for src in ("own", "peer", "shared"):
        out[f"{src}_mib"] = sum(e[src] for e in recorded) / 2**20 if recorded else None
    out["choose_s"] = max((e["open_s"] for e in recorded), default=None)
    out["load_s"] = max((e["load_s"] for e in recorded), default=None)
    out["loaded_step"] = min(e["step"] for e in loaded) if loaded else None
    out["exact"] = all(e["exact"] for e in loaded)
    out["steps_redone"] = FAULT_AT - out["loaded_step"] if loaded else None
    out["ranks_done"] = sum(e["event"] == "done" for e in got)
    out["sigkilled"] = None if launcher == "nvrx" else sum(e["event"] == "sigkilled" for e in got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default="nvrx-raise,nvrx-kill,torchrun,stock", help=", ".join(CASES))
    ap.add_argument("--device", default="cpu", help="the state's device (cuda: every rank on the one card)")
    args = ap.parse_args()
    from common import exit_on_sigterm

    exit_on_sigterm()  # a killed run still removes its directories
    os.environ["BENCH_DEVICE"] = args.device  # the ranks' (inprocess_train.py)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}: the cases are {', '.join(CASES)}")
    rows: dict[str, list[dict]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            rows[case].append(measure(case, args.mib))
            print(case, json.dumps(rows[case][-1]), flush=True)
    med = {
        c: {
            k: statistics.median(r[k] for r in rs)
            for k in ("committed", "loaded", "enter")
            if all(r[k] is not None for r in rs)
        }
        for c, rs in rows.items()
    }
    print(
        f"\n4 ranks as 2 nodes, {args.mib} MiB a rank on {args.device}, a save every step, fault after "
        f"step {FAULT_AT}, "
        f"{args.rounds} round(s)"
    )
    width = max(12, *(len(c) + 1 for c in rows))
    print(
        f"{'case':<{width}}{'abort':>8}{'aborted':>8}{'enter':>8}{'group':>8}{'loaded':>8}{'committed':>11}"
        f"{'choose':>8}{'load':>8}  MiB own/peer/shared; loaded step, redone, exact, ranks done, SIGKILLed"
    )
    for c, rs in rows.items():
        r = rs[-1]
        cells = "".join(
            f"{statistics.median(x[p] for x in rs):>{11 if p == 'committed' else 8}.2f}"
            if all(x[p] is not None for x in rs)
            else f"{'-':>8}"
            for p in (*PHASES, "choose_s", "load_s")
        )
        mib = "/".join(
            "-" if r[f"{k}_mib"] is None else f"{r[f'{k}_mib']:.0f}" for k in ("own", "peer", "shared")
        )
        killed = "-" if r["sigkilled"] is None else r["sigkilled"]
        tail = f"{r['loaded_step']}, {r['steps_redone']}, {r['exact']}, {r['ranks_done']}, {killed}"
        print(f"{c:<{width}}{cells}  {mib}; {tail}")
    ratios = {
        f"{case}_vs_{base}": med[case]["committed"] / med[base]["committed"]
        for case, base in RATIOS
        if "committed" in med.get(case, {}) and "committed" in med.get(base, {})
    }
    for k, v in ratios.items():
        print(f"{k:<28}{v:6.2f}x")
    print(json.dumps({"bench": "inprocess", "mib": args.mib, "rows": rows, "medians": med, "ratios": ratios}))


if __name__ == "__main__":
    main()
