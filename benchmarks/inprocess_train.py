"""The training loop ``bench_inprocess.py`` runs, one rank (not a benchmark by itself;
``tests/test_nvrx_wrapper.py`` runs it too).

    python inprocess_train.py MODE FAULT ROOT MIB STEPS FAULT_AT

MODE: ``nvrx`` (NvRx's inprocess.Wrapper, tiered-dcp), ``torchrun`` (tiered-dcp, a torchrun
restart) or ``stock`` (stock DCP to a local directory, a torchrun restart). Each rank holds
MIB MiB of its own (on ``BENCH_DEVICE``, default cpu) and saves asynchronously every step
(tiered-dcp: a RAM tier per node, every part replicated on the other node); rank 1 fails
once after step FAULT_AT's save (FAULT ``raise`` or ``kill``), or is SIGKILLed as soon as
that save began (``kill-in-save``: every other rank's save then waits on it), or (``three``) ranks 1, 2
and 3 raise in turn after steps FAULT_AT, 2*FAULT_AT and 3*FAULT_AT, node 0's RAM tier
wiped at the third, or (``node``) rank 2 takes its whole node down after step FAULT_AT's
save: its launcher and every process under it SIGKILLed, its RAM tier deleted (under NvRx's
ft_launcher a hot spare takes its place). Faults joined by ``+`` (``kill-in-save+node``) happen
in turn, after steps FAULT_AT, 2*FAULT_AT, ... Prints ``EVENT`` JSON lines with wall-clock times.
"""

import time

STARTED = time.time()  # before the imports: a restarted worker pays them

import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402 - NvRx finds its CallWrapper by this annotation

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import tiered_dcp  # noqa: E402
import tiered_dcp.inprocess  # noqa: E402
from tiered_dcp import Tier, TieredConfig, TieredWriter, load_latest  # noqa: E402
from tiered_dcp.writer_process.timings import Kind, read_records  # noqa: E402

MODE, FAULT, ROOT = sys.argv[1], sys.argv[2], sys.argv[3]
DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))  # cuda: every rank on the one card
MIB, STEPS, FAULT_AT = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
WAIT = os.environ.get("BENCH_WAIT", "guide")  # how the loop waits: "plain" fut.result(), or the guide's
PG_TIMEOUT = float(os.environ.get("BENCH_PG_TIMEOUT", "5"))  # the training group's collectives
FIRST_RANK = int(os.environ.setdefault("BENCH_FIRST_RANK", os.environ["RANK"]))
CFG = TieredConfig(
    "bench", [Tier(f"{ROOT}/ram/{{node}}", keep=2)], replication_factor=2, replication_jump=2, peer_timeout=10
)


def faults(spec: str) -> dict[int, tuple[int, str, bool]]:
    """After which step which rank fails, how, and whether node 0's RAM tier is wiped with
    it: ``three`` (the docstring), else faults joined by ``+``, the i-th after step
    i*FAULT_AT (``node``: rank 2's, node 1, as node 0 hosts the job's store and the
    rendezvous; any other: rank 1's)."""
    if spec == "three":
        return {
            FAULT_AT: (1, "raise", False),
            2 * FAULT_AT: (2, "raise", False),
            3 * FAULT_AT: (3, "raise", True),
        }
    kinds = spec.split("+")
    return {i * FAULT_AT: (2 if k == "node" else 1, k, False) for i, k in enumerate(kinds, start=1)}


FAULTS = faults(FAULT)


def event(name: str, **fields: object) -> None:
    line = "EVENT " + json.dumps({"event": name, "t": time.time(), "rank": FIRST_RANK, **fields}) + "\n"
    os.write(1, line.encode())  # one write: the ranks under one agent share its stdout


def stock_latest(state: dict) -> int:
    """Stock DCP's resume: the newest step directory whose metadata is written."""
    os.makedirs(f"{ROOT}/stock", exist_ok=True)
    done = [
        int(d.split("_")[1])
        for d in os.listdir(f"{ROOT}/stock")
        if os.path.exists(f"{ROOT}/stock/{d}/.metadata")
    ]
    if not done:
        return 0
    step = max(done)
    dcp.load(state, checkpoint_id=f"{ROOT}/stock/step_{step}")
    return step


def first_attempt(step: int) -> bool:
    """Whether this is the first time a rank reaches the fault after ``step`` (once per job:
    a restarted worker finds the mark)."""
    mark = f"{ROOT}/fault_{step}"
    if os.path.exists(mark):
        return False
    open(mark, "w").close()
    return True


def kill_node() -> None:
    """This rank's node lost at once, as a machine is: its launcher (this process's parent) and
    every process under it (the ranks, their writer processes, the launcher's monitors)
    SIGKILLed, each by its pid (their process groups may hold others: a test's), then its
    RAM tier gone, then this process."""
    import psutil  # NvRx's own dependency: present wherever its launcher runs

    launcher = psutil.Process(os.getppid())
    node = [launcher, *launcher.children(recursive=True)]  # listed first: orphans are not found
    for proc in node:
        if proc.pid != os.getpid():
            with contextlib.suppress(psutil.NoSuchProcess):  # one that just ended
                proc.kill()
    shutil.rmtree(f"{ROOT}/ram/{os.environ['GROUP_RANK']}", ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)


def read_from(rank: int, step: int) -> dict:
    """This rank's load of ``step``, as tiered-dcp recorded it: the bytes from its own
    tiers, from peers and from shared tiers, the seconds choosing the step and in all."""
    if MODE == "stock" or step == 0:
        return {}
    loads = [r for r in read_records(CFG, Kind.LOAD, tail_bytes=1 << 16) if (r.rank, r.step) == (rank, step)]
    last = loads[-1]
    return {
        "own": last.read_own,
        "peer": last.read_peer,
        "shared": last.read_shared,
        "open_s": last.open_s,
        "load_s": last.seconds,
    }


class Timed(tiered_dcp.inprocess.Abort):
    """The abort's start (``ours=False``: reports only) or tiered-dcp's Abort, then its end
    (NvRx's Compose runs the last hook first: they go last and first around NvRx's own)."""

    def __init__(self, name: str, ours: bool) -> None:
        super().__init__()
        self.name, self.ours = name, ours

    def __call__(self, state: object) -> object:
        state = super().__call__(state) if self.ours else state
        event(self.name)
        return state


def train(store: dist.Store, world: int, rank: int) -> None:
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT)
    )
    event("group")
    key = f"w{FIRST_RANK}"
    state = {key: torch.zeros(MIB << 18, device=DEVICE), "step": 0}
    if MODE == "stock":
        step = stock_latest(state)
    else:
        try:
            step = load_latest(state, CFG)
        except tiered_dcp.NoCheckpointError:
            step = 0
    exact = step == 0 or bool((state[key] == step).all())
    event("loaded", step=step, exact=exact, world=world, **read_from(rank, step))
    first = True
    for s in range(step + 1, STEPS + 1):
        state = {key: torch.full((MIB << 18,), float(s), device=DEVICE), "step": s}
        if MODE == "stock":
            fut = dcp.async_save(state, checkpoint_id=f"{ROOT}/stock/step_{s}")
        else:
            fut = dcp.async_save(state, storage_writer=TieredWriter(CFG, step=s))
        fault = FAULTS.get(s)
        if fault is not None and fault[1] == "kill-in-save" and fault[0] == FIRST_RANK and first_attempt(s):
            event("fault", step=s)  # the save just began on every rank: its commit needs this one
            os.kill(os.getpid(), signal.SIGKILL)
        if MODE == "stock" or WAIT == "plain":  # DCP's examples' wait
            fut.result()
        else:  # the user guide's: a failed save raised as an ordinary exception
            tiered_dcp.inprocess.result(fut)
        if first:
            event("committed", step=s)
            first = False
        if fault is not None and fault[0] == FIRST_RANK and first_attempt(s):
            if fault[2]:  # node 0's RAM tier is lost too: its ranks reload from their peers
                shutil.rmtree(f"{ROOT}/ram/0", ignore_errors=True)
            event("fault", step=s)
            if fault[1] == "node":
                kill_node()
            if fault[1] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault after step {s}")
    event("done", step=STEPS)


def torchrun_main() -> None:
    event("enter")
    train(None, int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]))  # type: ignore[arg-type]


def nvrx_main() -> None:
    import nvidia_resiliency_ext.inprocess as inprocess

    s = datetime.timedelta(seconds=1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gc.collect()  # NvRx's restart runs gc.collect() until it finds nothing: ~0.3 s a pass here
    gc.freeze()  # over torch's objects; frozen after set-up, a pass is ~0 (docs/user-guide.md)
    app = dist.TCPStore(  # the job's store, its host rank 0 (NvRx's examples: it must outlive a fault)
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world_size=world, is_master=rank == 0
    )

    @inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
        abort=inprocess.Compose(  # run last first: aborting, NvRx's, tiered-dcp's (timed)
            Timed("aborted", ours=True),
            inprocess.abort.AbortTorchDistributed(),
            Timed("aborting", ours=False),
        ),
        monitor_thread_interval=0.2 * s,
        monitor_process_interval=0.2 * s,
        progress_watchdog_interval=0.2 * s,
        last_call_wait=0.2 * s,
        heartbeat_interval=0.5 * s,
        heartbeat_timeout=30 * s,  # NvRx's defaults: its timers catch hangs, the faults here are
        soft_timeout=60 * s,  # found without them (a loaded machine hit a 45 s hard timeout)
        hard_timeout=90 * s,
        barrier_timeout=120 * s,
        completion_timeout=120 * s,
        monitor_process_logfile=f"{ROOT}/nvrx_monitor_{{rank}}.log",  # its SIGTERMs, for a failed test
    )
    def wrapped(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:  # noqa: UP045
        assert call_wrapper is not None
        event("enter", iteration=call_wrapper.iteration)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # NvRx's, this call's
        train(dist.PrefixStore(f"iteration_{call_wrapper.iteration}", app), world, rank)

    wrapped()


if __name__ == "__main__":
    event("process", started=STARTED)
    nvrx_main() if MODE == "nvrx" else torchrun_main()
