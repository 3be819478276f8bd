"""The failure drill: the demo's workload under a random schedule of real faults.

``tiered-dcp drill --minutes N`` trains the demo's FSDP2 MLP on 2 ranks, as 2 simulated
nodes (``{node}`` paths, ``replication_factor=2``), saving every step with
``dcp.async_save`` to a RAM tier, every 3rd to an SSD tier and every 5th to a bucket: a
fake-gcs-server behind a fault proxy (``local_servers``) where it is installed, else a shared
directory. Every restart resumes with ``load_latest``. Every few seconds of training it
injects one fault, the kinds taken in a shuffled cycle, each kind once at least:

- ``kill``: one rank SIGKILLed (mid-step or mid-save, wherever it is); the job is stopped
  and restarted, as torchrun would;
- ``kill-save``: one rank SIGKILLs itself 0-50 ms into a save, the save still in flight;
  the others are left to fail by themselves and their error (type and first line, and what
  became of their own save in flight) is reported; a root that committed the save must hold
  it whole (``verify``); the job restarts;
- ``wipe``: a node lost: both ranks killed, the node's writer process killed, its RAM and
  SSD roots and its runtime directory removed; the job restarts;
- ``flip``: the job crashes and a byte is flipped in the newest committed step's part on
  node 0's RAM tier; ``verify`` must see the damage and the restart must still load the
  step's exact state (from a replica or a slower tier);
- ``damage``: the job halts after saving a step that only the RAM tier takes and crashes; a
  byte is flipped in every copy of one rank's part of it (its own and its clique replica),
  or of its metadata on every root; the restart must load the step before it, say so, and
  quarantine the damaged one;
- ``nan``: a weight of one rank is set to NaN before a save; the step is saved (marked
  non-finite, ``on_nonfinite="mark"``), the job crashes; the restart must load the newest
  finite step and train on from it;
- ``outage``: the bucket answers every request with 503 for a few seconds while training
  goes on; afterwards a newer step must commit on the bucket.

What must hold, and is reported: after every restart the job resumes from a step no older
than the newest step it had committed (the newest whose save returned on every rank, and the
bucket's newest), every rank's restored state is exactly the state saved at that step
(hashes logged before each save) and finite. A step the drill itself made unloadable (every
copy damaged, or saved holding NaN) is no step the library promised: it is not expected,
not counted as lost, and listed apart; resuming from it is a failure. A restart that restores
a wrong or non-finite state with no error and no warning naming the step it restored is a
*silent escape*, counted on its own (``silent escapes: N``). The report gives each fault's
recovery time (fault to state restored) and load time, and what a bucket outage did to the
loop. Every save compares the ranks' copies of the replicated items (the optimizer's step
counts: ``on_replica_mismatch``); the drill corrupts none, so any disagreement the job
recorded is a false report and fails the drill (``replica disagreements``), and a suspect
node (``metrics.scores.suspects``) is listed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .local_servers import free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from concurrent.futures import Future

    from ..config import TieredConfig
    from ..storage.format import Marker

WORLD = 2  # ranks, one per simulated node
HIDDEN = 256
PAUSE = (2.0, 5.0)  # seconds of training between faults, drawn in this range
RESUME_TIMEOUT = 180.0  # seconds a restarted job may take to restore its state
COMMAND_TIMEOUT = 60.0  # seconds the job may take to carry out a command (halt after a save...)
SURVIVOR_TIMEOUT = 60.0  # seconds the ranks left may take to fail once a peer died mid-save
_OWN_FILES = (
    *("stop", "progress.", "truth.", "steps.", "resume.", "stderr.", "tiers.toml", "fake-gcs-server"),
    *("command.json", "halted.", "killed.", "error."),
)


# ----------------------------------------------------------------------------- config


def write_config(workdir: str, ram: str, bucket: str, storage_options: dict) -> str:
    """The drill's tiers as a TOML file (``jobconfig``): the workers and the operator share it."""
    lines = [
        'namespace = "drill"',
        "replication_factor = 2",
        "replication_jump = 1",
        "peer_timeout = 20.0",
        "",
    ]
    tiers = [
        {"path": f"{ram}/{{node}}", "every": 1, "keep": 2},
        {"path": f"{workdir}/ssd/{{node}}", "every": 3, "keep": 2},
        {"path": bucket, "every": 5, "keep": 3, "compression": "zstd"},
    ]
    if "://" not in bucket:
        tiers[2]["shared"] = True
    for t in tiers:
        lines.append("[[tiers]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in t.items()]
        if t["path"] is bucket and storage_options:
            lines.append("[tiers.storage_options]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in storage_options.items()]
        lines.append("")
    path = f"{workdir}/tiers.toml"
    Path(path).write_text("\n".join(lines))
    return path


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Resume from the newest step that loads (``load_latest``), then train and save until told
    to stop, carrying out the operator's commands (``command.json``) on the way."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .. import shutdown
    from .demo import _build, _train_step
    from .jobconfig import load_job_config

    dist.init_process_group("gloo")
    ckpt_pg = dist.new_group(backend="gloo")  # the async saves' collectives run beside FSDP's
    rank = dist.get_rank()
    cfg = load_job_config(args.config)
    warned = _keep_warnings()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = _build(mesh, HIDDEN)
    _train_step(model, opt, 0)  # materialise optimizer state so there is something to load into
    job = _DrillRank(args, cfg, rank, model, opt, ckpt_pg)
    job.train(job.resume(warned))
    shutdown(wait=False)
    dist.barrier()
    dist.destroy_process_group()


class _DrillRank:
    """One rank of the drill's job: its resume, then its training and saves, doing what the
    operator's command says, with what it was doing kept for the report of a failure."""

    def __init__(
        self, args: argparse.Namespace, cfg: TieredConfig, rank: int, model: Any, opt: Any, ckpt_pg: Any
    ) -> None:
        self.args, self.cfg, self.rank = args, cfg, rank
        self.model, self.opt, self.ckpt_pg = model, opt, ckpt_pg
        self.d = Path(args.dir)
        self.pending: Future | None = None  # the save in flight
        self.cmd: dict | None = None  # the operator's command, once every rank has seen it
        self.doing = "training"

    def resume(self, warned: list[str]) -> int:
        """Load the newest step that loads and write the report the drill polls for; the step."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .. import NoCheckpointError, load_latest
        from .demo import _state, _state_hash

        cfg, rank, d = self.cfg, self.rank, self.d
        report: dict = {
            "rank": rank,
            "attempt": self.args.attempt,
            "step": 0,
            "boot_s": time.time() - self.args.born,
        }
        t0 = time.perf_counter()
        sd = _state(self.model, self.opt, -1)
        start = 0
        try:
            start = load_latest(sd, cfg)  # the resume call: the newest step that loads, every rank the same
        except NoCheckpointError as e:
            report["no_checkpoint"] = str(e).splitlines()[0]
        if "no_checkpoint" not in report:
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            restored = _state(self.model, self.opt, start)
            report.update(
                step=start,
                tiers=_load_tiers(cfg, rank, start),
                load_s=time.perf_counter() - t0,
                match=sd["step"] == start and _truth(d, rank).get(start) == _state_hash(restored),
                finite=_finite(restored),
                quarantined=_quarantined(cfg, rank),
            )
        report["warnings"] = list(warned)  # what the library said while resuming
        report["time"] = time.time()
        _write_json(d / f"resume.{self.args.attempt}.rank{rank}.json", report)  # the drill polls for it
        return start

    def train(self, start: int) -> None:
        """Train and save from ``start`` on until told to stop; a failure (a peer died) is
        reported with what this rank was doing and what became of its save in flight."""
        step = start
        try:
            while not (self.d / "stop").exists():
                step += 1
                self._step(step)
            if self.pending is not None:
                self.doing = f"waiting for save {step}"
                self.pending.result()
        except BaseException as e:
            # the save fails once a wait of it for the dead rank ends (peer_timeout after that
            # wait began: when depends on the machine's pace); reported before the operator's
            # deadline for the survivors, so a save that would never end is seen as such
            save = _outcome(self.pending, SURVIVOR_TIMEOUT - 10)
            error = {"error": _first_line(e), "during": self.doing, "save": save}
            _write_json(self.d / f"error.{self.args.attempt}.rank{self.rank}.json", error)
            raise

    def _step(self, step: int) -> None:
        """Train ``step``, start its save, and carry out the operator's command."""
        import torch

        from .demo import _state, _state_hash, _train_step

        self.doing = f"training step {step}"
        _train_step(self.model, self.opt, step)
        self.cmd = cmd = self.cmd or _agreed_command(self.d)
        halt = self._halts(step)
        if halt and cmd is not None and cmd["do"] == "nan" and self.rank == cmd["rank"]:
            with torch.no_grad():  # the training state goes bad on this rank
                next(iter(self.model.parameters())).to_local().view(-1)[0] = float("nan")
        sd = _state(self.model, self.opt, step)
        with open(self.d / f"truth.rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "hash": _state_hash(sd)}) + "\n")
        fut = self._save(step, sd)
        if cmd is not None and cmd["do"] == "kill" and self.rank == cmd["rank"]:
            time.sleep(cmd["delay"])
            if not fut.done():  # mid-save: this rank dies with its save in flight
                _write_json(
                    self.d / f"killed.{self.args.attempt}.json", {"step": step, "delay": cmd["delay"]}
                )
                os.kill(os.getpid(), signal.SIGKILL)
        if halt:
            self._halt(step, fut)

    def _halts(self, step: int) -> bool:
        """Whether the job halts after saving ``step`` ("nan", or "halt" at a step only the
        first tier takes)."""
        cmd = self.cmd
        if cmd is None or cmd["do"] not in ("nan", "halt"):
            return False
        return cmd["do"] != "halt" or self.cfg.tiers_for(step) == [0]

    def _save(self, step: int, sd: dict) -> Future:
        """Start the async save of ``step`` once the previous one is committed; record its stall."""
        import torch.distributed.checkpoint as dcp

        from .. import TieredWriter

        t = time.perf_counter()
        if self.pending is not None:
            self.doing = f"waiting for save {step - 1}"
            self.pending.result()  # save N is committed before save N+1 starts
        self.doing = f"starting save {step}"
        fut = dcp.async_save(sd, storage_writer=TieredWriter(self.cfg, step=step), process_group=self.ckpt_pg)
        stall = time.perf_counter() - t
        self.pending = fut
        tmp = self.d / f".progress.rank{self.rank}.tmp"  # replaced whole: a reader never sees it empty
        tmp.write_text(str(step))  # save `step` is under way; save `step - 1` is committed on every rank
        os.replace(tmp, self.d / f"progress.rank{self.rank}")
        with open(self.d / f"steps.rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), "stall": stall}) + "\n")
        return fut

    def _halt(self, step: int, fut: Future) -> None:
        """Wait for the save of ``step``, say so, and wait for the operator to crash the job."""
        self.doing = f"waiting for save {step}"
        fut.result()
        self.pending = None
        _write_json(self.d / f"halted.{self.args.attempt}.rank{self.rank}.json", {"step": step})
        while not (self.d / "stop").exists():  # the operator crashes the job here
            time.sleep(0.05)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp")  # replaced whole: a reader never sees it half-written
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _first_line(e: BaseException) -> str:
    """An exception as its qualified type and the first line of its message."""
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__module__}.{type(e).__qualname__}: {lines[0]}"


def _outcome(save: Future | None, timeout: float) -> str:
    """What became of a save in flight when its rank failed (waiting up to ``timeout`` s)."""
    if save is None:
        return "none in flight"
    try:
        e = save.exception(timeout=timeout)
    except TimeoutError:
        return f"still in flight {timeout:.0f} s later"
    return "it completed" if e is None else f"it failed: {_first_line(e)}"


def _agreed_command(d: Path) -> dict | None:
    """The operator's command, seen by every rank at the same step (one MAX over the ranks)."""
    import torch
    import torch.distributed as dist

    seen = torch.tensor([int((d / "command.json").exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return json.loads((d / "command.json").read_text()) if seen.item() else None


def _keep_warnings() -> list[str]:
    """The library's warnings from now on, kept (and still printed to stderr)."""
    import logging

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    log = logging.getLogger("tiered_dcp")
    log.addHandler(Keep(logging.WARNING))
    log.addHandler(logging.StreamHandler())
    return kept


def _truth(d: Path, rank: int) -> dict[int, str]:
    """step -> the hash of the state this rank saved at that step (its last save of it)."""
    truth = {}
    with contextlib.suppress(FileNotFoundError), open(d / f"truth.rank{rank}.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            truth[rec["step"]] = rec["hash"]
    return truth


def _finite(state: object) -> bool:
    """Whether every floating tensor in ``state`` (this rank's shards) holds no NaN/Inf."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, DTensor):
        state = state.to_local()
    return (
        not isinstance(state, torch.Tensor) or not state.is_floating_point() or bool(state.isfinite().all())
    )


def _load_tiers(cfg: TieredConfig, rank: int, step: int) -> list[int]:
    """The tiers holding ``step`` complete when this rank loaded it (the load's record)."""
    from ..writer_process.timings import Kind, read_records

    loads = [r for r in read_records(cfg, Kind.LOAD, tail_bytes=1 << 16) if (r.rank, r.step) == (rank, step)]
    return list(loads[-1].tiers or ()) if loads else []


def _quarantined(cfg: TieredConfig, rank: int) -> list[list]:
    """[step, ident] of the quarantine marks in this rank's own root of each node-local tier."""
    from ..config import node_of
    from ..steps.catalog import TierView
    from ..storage.format import parse_quarantine

    marks = set()
    for i in range(len(cfg.tiers)):
        view = TierView(cfg, i, node_of(rank), rank)
        if view.placement.node_owned:
            for name in view.own.list(cfg.namespace):
                mark = parse_quarantine(name)
                if mark is not None:
                    marks.add(mark)
    return [[s, f"{ident:016x}"] for s, ident in sorted(marks)]


# ----------------------------------------------------------------------------- launcher


@dataclass
class Event:
    """One fault and what became of it."""

    fault: str
    at: float  # seconds into the drill
    detail: str = ""
    expected: int | None = None  # the newest committed step before the fault, but for `unloadable`
    # steps the drill itself made unloadable (every copy damaged, or saved holding NaN): no
    # promise of the library's covers them, so they are not expected, and not counted as lost
    unloadable: dict[int, str] = field(default_factory=dict)
    resumed: int | None = None
    tiers: list[int] = field(default_factory=list)  # holding the step complete when it was loaded
    match: bool | None = None
    finite: bool | None = None  # the restored state holds no NaN/Inf, on every rank
    warnings: list[str] = field(default_factory=list)  # what the library said while resuming
    errors: list[str] = field(default_factory=list)  # what the ranks that survived a kill raised
    # a wrong or non-finite state restored without a word: no error, and no warning naming that step
    silent: bool = False
    recovery_s: float | None = None  # fault to state restored (restart included)
    load_s: float | None = None  # the load alone (slowest rank)
    boot_s: float | None = None  # process start to ready to load: imports, process group, model
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> bool:
        return bool(self.problems)


@dataclass
class DrillReport:
    seconds: float
    steps: int  # saves started, over all attempts
    events: list[Event]
    bucket: str
    notes: list[str] = field(default_factory=list)
    # the job's records of replicas that disagreed (the drill corrupts none: each is a false
    # report), and the ranks they made suspects
    replica_reports: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)

    @property
    def silent_escapes(self) -> int:
        """Restarts that restored a wrong or non-finite state with no error and no warning
        naming the step restored."""
        return sum(e.silent for e in self.events)

    @property
    def ok(self) -> bool:
        return not any(e.lost for e in self.events) and not self.silent_escapes and not self.replica_reports

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["silent_escapes"] = self.silent_escapes
        d["lost"] = [asdict(e) for e in self.events if e.lost]
        return d


class Drill:
    def __init__(
        self,
        workdir: str,
        ram: str,
        seconds: float,
        seed: int,
        faults: list[str],
        pause: tuple[float, float] = PAUSE,
        start: Callable[..., subprocess.Popen] = subprocess.Popen,
    ) -> None:
        self.dir, self.ram, self.seconds, self.pause = workdir, ram, seconds, pause
        self.start = start
        self.rng = random.Random(seed)
        self.faults = faults
        self.procs: list[subprocess.Popen] = []
        self.attempt = 0
        self.reports: list[dict] = []  # the ranks' resume reports of the last restart
        # every step the drill made unloadable so far: a resumed job saves that number again,
        # and a fault that comes while that save is in flight finds the broken one committed
        self.broken: dict[int, str] = {}
        self.emulator = self.proxy = None
        self.notes: list[str] = []
        self.t0 = time.monotonic()

    # -- set-up

    def start_bucket(self) -> tuple[str, dict]:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
        try:
            from .local_servers import Emulator, FaultProxy

            self.emulator = Emulator(log_path=f"{self.dir}/fake-gcs-server.log").start()
            self.emulator.create_bucket("drill")
            self.proxy = FaultProxy(self.emulator.url, lifetime=self.seconds + 600)
        except (RuntimeError, OSError) as e:
            self.notes.append(f"no fake-gcs-server ({e}): the bucket is a shared directory, no outages")
            if "outage" in self.faults:
                self.faults = [f for f in self.faults if f != "outage"] or ["kill"]
            return f"{self.dir}/bucket", {}
        opts = {**self.emulator.storage_options(self.proxy.url), "retry_timeout": 3.0, "idle_timeout": 5.0}
        return "gs://drill/ckpt", opts

    def stop_bucket(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.emulator is not None:
            self.emulator.stop()

    # -- the job

    def launch(self) -> None:
        port = free_port()
        self.procs = []
        for rank in range(WORLD):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            cmd = [sys.executable, "-m", "tiered_dcp.cli.drill", "--worker", "--dir", self.dir]
            cmd += ["--config", self.config_path, "--attempt", str(self.attempt)]
            with open(f"{self.dir}/stderr.{self.attempt}.rank{rank}", "wb") as err:
                self.procs.append(self.start(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))

    def crash(self, first: int | None = None) -> None:
        """SIGKILL the ranks (``first`` before the others), as a crash and torchrun's stop."""
        order = list(range(WORLD)) if first is None else [first] + [r for r in range(WORLD) if r != first]
        for r in order:
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def died(self, ranks: list[int] | None = None) -> str | None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None and (ranks is None or r in ranks):
                err = Path(f"{self.dir}/stderr.{self.attempt}.rank{r}").read_text(errors="replace")
                return f"rank {r} exited with {p.returncode} unasked:\n{err[-3000:]}"
        return None

    def wait(self, event: Event, done: Callable[[], bool], what: str, ranks: list[int] | None = None) -> bool:
        """Wait until ``done()``; False, with the problem in ``event``, if one of ``ranks`` (default:
        all) died unasked first or ``COMMAND_TIMEOUT`` passed."""
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not done():
            why = self.died(ranks)
            if why or time.monotonic() > deadline:
                event.problems.append(why or f"the job did not {what} within {COMMAND_TIMEOUT:.0f} s")
                return False
            time.sleep(0.02)
        return True

    def command(self, cmd: dict) -> None:
        """Tell the ranks what to do (``worker``): every rank sees it at the same step."""
        _write_json(Path(self.dir) / "command.json", cmd)

    def halted(self, event: Event) -> int | None:
        """Wait until every rank has halted after the save its command asked for; that step."""
        paths = [Path(f"{self.dir}/halted.{self.attempt}.rank{r}.json") for r in range(WORLD)]
        if not self.wait(event, lambda: all(p.exists() for p in paths), "halt after a save"):
            return None
        steps = {json.loads(p.read_text())["step"] for p in paths}
        if len(steps) > 1:
            event.problems.append(f"the ranks halted after different saves {sorted(steps)}")
        return min(steps)

    def progress(self, rank: int) -> int:
        try:
            return int(Path(f"{self.dir}/progress.rank{rank}").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def committed(self, passed: Collection[int] = ()) -> int:
        """The newest step whose save returned on every rank (0: none), or the bucket's newest;
        ``passed``: steps not to count (the drill made them unloadable itself), as are those
        it broke in an earlier event."""
        from ..api import status
        from ..steps.status import StepStatus

        passed = {*passed, *self.broken}

        saved = min(self.progress(r) for r in range(WORLD)) - 1
        while saved in passed:
            saved -= 1  # saves are sequential: the one before was committed too
        bucket = [
            r.step
            for r in status(self.cfg)
            if r.tier_index == 2 and r.state is StepStatus.COMMITTED and r.step not in passed
        ]
        return max([saved, *bucket, 0])

    def marker(self, step: int) -> Marker | None:
        """``step``'s commit marker on node 0's RAM tier."""
        from ..steps.catalog import TierView

        view = TierView(self.cfg, 0, 0, 0)
        return view.read_marker(view.own, step)

    def wait_resumed(self, event: Event, fault_time: float) -> None:
        """Wait for every rank's resume report of this attempt; check it against ``event.expected``."""
        deadline = time.monotonic() + RESUME_TIMEOUT
        paths = [Path(f"{self.dir}/resume.{self.attempt}.rank{r}.json") for r in range(WORLD)]
        while not all(p.exists() for p in paths):
            why = self.died()
            if why or time.monotonic() > deadline:
                event.problems.append(why or f"the restarted job did not resume in {RESUME_TIMEOUT:.0f} s")
                return
            time.sleep(0.05)
        reports = self.reports = [json.loads(p.read_text()) for p in paths]
        event.resumed = min(r["step"] for r in reports)
        event.tiers = sorted({t for r in reports for t in r.get("tiers", [])})
        event.match = all(r.get("match", r["step"] == 0) for r in reports)
        event.finite = all(r.get("finite", True) for r in reports)
        event.warnings = list(dict.fromkeys(w for r in reports for w in r.get("warnings", [])))
        said = [w for w in event.warnings if re.search(rf"\bstep {event.resumed}\b", w)]
        event.silent = not (event.match and event.finite) and not said  # no word on the step restored
        event.recovery_s = round(max(r["time"] for r in reports) - fault_time, 3)
        event.load_s = round(max(r.get("load_s", 0.0) for r in reports), 3)
        event.boot_s = round(max(r["boot_s"] for r in reports), 3)
        if len({r["step"] for r in reports}) > 1:
            event.problems.append(f"ranks resumed from different steps {[r['step'] for r in reports]}")
        if event.expected and any("no_checkpoint" in r for r in reports):
            why = next(r["no_checkpoint"] for r in reports if "no_checkpoint" in r)
            event.problems.append(f"load_latest found nothing to load: {why}")
        if event.expected is not None and event.resumed < event.expected:
            event.problems.append(
                f"resumed from step {event.resumed}, older than committed step {event.expected}"
            )
        if event.resumed in event.unloadable:
            why = event.unloadable[event.resumed]
            event.problems.append(f"resumed from step {event.resumed}, which cannot load right ({why})")
        if not event.match:
            event.problems.append(f"the state restored at step {event.resumed} differs from the one saved")
        if not event.finite:
            event.problems.append(f"the state restored at step {event.resumed} holds NaN/Inf")

    def restart(self, event: Event, fault_time: float) -> None:
        Path(self.dir, "command.json").unlink(missing_ok=True)  # done with: the new job does not see it
        self.attempt += 1
        self.launch()
        self.wait_resumed(event, fault_time)

    # -- faults

    def run(self) -> DrillReport:
        from .jobconfig import load_job_config

        bucket, opts = self.start_bucket()
        self.config_path = write_config(self.dir, self.ram, bucket, opts)
        self.cfg = load_job_config(self.config_path)
        events: list[Event] = []
        cycle: list[str] = []
        try:
            self.launch()
            first = Event("start", 0.0)
            self.wait_resumed(first, time.time())
            if first.problems:
                events.append(first)
                return self.report(events, bucket)
            self.t0 = time.monotonic()  # the faults' clock starts once the job trains
            ran: set[str] = set()
            while time.monotonic() - self.t0 < self.seconds or not ran.issuperset(self.faults):
                pause = time.monotonic() + self.rng.uniform(*self.pause)
                while time.monotonic() < pause:
                    why = self.died()
                    if why:
                        events.append(Event("none", time.monotonic() - self.t0, problems=[why]))
                        return self.report(events, bucket)
                    time.sleep(0.05)
                if not cycle:
                    cycle = self.rng.sample(self.faults, len(self.faults))
                event = Event(cycle.pop(), round(time.monotonic() - self.t0, 1))
                _FAULT_RUNS[event.fault](self, event)
                events.append(event)
                ran.add(event.fault)
                _print_event(event)
                if any(e.problems for e in events if e.fault != "outage" and e.resumed is None):
                    break  # the job is not running: nothing more to drill
            Path(f"{self.dir}/stop").touch()
            deadline = time.monotonic() + 60
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.stop_bucket()
        return self.report(events, bucket)

    def report(self, events: list[Event], bucket: str) -> DrillReport:
        steps = 0
        for r in range(WORLD):
            with contextlib.suppress(OSError), open(f"{self.dir}/steps.rank{r}.jsonl") as f:
                steps = max(steps, sum(1 for _ in f))
        report = DrillReport(round(time.monotonic() - self.t0, 1), steps, events, bucket, self.notes)
        cfg = getattr(self, "cfg", None)
        if cfg is not None:
            report.replica_reports, report.suspects = _replica_reports(cfg)
        return report


def _fault_kill(drill: Drill, event: Event) -> None:
    victim = drill.rng.randrange(WORLD)
    event.detail = f"rank {victim} SIGKILLed at step {drill.progress(victim)}"
    fault_time = time.time()
    drill.crash(first=victim)
    event.expected = drill.committed()
    drill.restart(event, fault_time)


def _fault_kill_save(drill: Drill, event: Event) -> None:
    """A rank SIGKILLs itself while its save is in flight; the others fail by themselves."""
    from ..ops.verify import verify_step

    victim = drill.rng.randrange(WORLD)
    others = [r for r in range(WORLD) if r != victim]
    delay = round(drill.rng.uniform(0.0, 0.05), 3)
    fault_time = time.time()
    drill.command({"do": "kill", "rank": victim, "delay": delay})
    if not drill.wait(event, lambda: drill.procs[victim].poll() is not None, "kill a rank mid-save", others):
        drill.crash()
        return
    killed = Path(f"{drill.dir}/killed.{drill.attempt}.json")
    if not killed.exists():
        event.problems.append(drill.died([victim]) or f"rank {victim} died, not by the drill's kill")
        drill.crash()
        return
    step = json.loads(killed.read_text())["step"]
    deadline = time.monotonic() + SURVIVOR_TIMEOUT
    while any(drill.procs[r].poll() is None for r in others) and time.monotonic() < deadline:
        time.sleep(0.02)
    waited = time.monotonic() - deadline + SURVIVOR_TIMEOUT
    hung = [r for r in others if drill.procs[r].poll() is None]
    drill.crash()  # torchrun stops what is left
    for r in others:
        path = Path(f"{drill.dir}/error.{drill.attempt}.rank{r}.json")
        if path.exists():
            e = json.loads(path.read_text())
            event.errors.append(f"rank {r}, {e['during']}: {e['error']}")
            event.errors.append(f"rank {r}, its save in flight: {e['save']}")
        elif r not in hung:
            event.problems.append(f"rank {r} exited ({drill.procs[r].returncode}) with no error recorded")
        said = Path(f"{drill.dir}/stderr.{drill.attempt}.rank{r}")
        text = said.read_text(errors="replace") if said.exists() else ""
        lost = [ln for ln in text.splitlines() if "stopped answering" in ln]
        event.errors += [f"rank {r}, tiered-dcp said: {ln}" for ln in lost[:1]]
    event.detail = f"rank {victim} SIGKILLed {delay * 1000:.0f} ms into save {step}, still in flight; " + (
        f"rank(s) {hung} still running {waited:.1f} s later"
        if hung
        else f"the others failed and exited within {waited:.1f} s"
    )
    if hung:
        event.problems.append(
            f"rank(s) {hung} did not fail within {SURVIVOR_TIMEOUT:.0f} s of their peer's death"
        )
    # nothing half-written may be reported committed: a root that committed it must hold it
    # whole. A copy loads pass over is not reported committed: an earlier save of this step
    # number that the drill damaged (and the load quarantined), still there when the job,
    # resumed from the step before, had not saved this one again yet
    checks = [c for node in range(WORLD) for c in verify_step(drill.cfg, step, node, node)]
    loadable = [c for c in checks if c.passed_over is None]
    bad = [f"tier {c.tier_index}: {'; '.join(c.problems)}" for c in loadable if not c.ok]
    committed = sorted({c.tier_index for c in loadable})
    event.detail += (
        f"; save {step} committed on tier(s) {committed} (verified whole)"
        if committed
        else (f"; save {step} committed nowhere")
    )
    if bad:
        event.problems.append(f"save {step} is committed but not whole: {' | '.join(bad)}")
    event.expected = drill.committed()
    drill.restart(event, fault_time)


def _fault_nan(drill: Drill, event: Event) -> None:
    """The state goes NaN on one rank; that step is saved (marked), then the job crashes."""
    victim = drill.rng.randrange(WORLD)
    fault_time = time.time()
    drill.command({"do": "nan", "rank": victim})
    step = drill.halted(event)
    drill.crash()
    if step is None:
        return
    marker = drill.marker(step)
    marked = marker is not None and not marker.finite
    event.unloadable = {step: f"saved holding NaN on rank {victim}"}
    drill.broken.update(event.unloadable)
    event.detail = (
        f"a weight of rank {victim} set to NaN before save {step}; the save committed "
        f"({'marked non-finite' if marked else 'NOT marked non-finite'}), then the job crashed"
    )
    if not marked:
        event.problems.append(f"step {step}'s commit marker does not mark it non-finite")
    event.expected = drill.committed(passed=event.unloadable)
    drill.restart(event, fault_time)


def _fault_damage(drill: Drill, event: Event) -> None:
    """Every copy of a part (or the metadata) of the newest step, on the RAM tier only, damaged."""
    from ..storage.format import metadata_key, part_key

    fault_time = time.time()
    drill.command({"do": "halt"})  # after the next step that only the RAM tier takes
    step = drill.halted(event)
    drill.crash()
    if step is None:
        return
    marker = drill.marker(step)
    victim = drill.rng.randrange(WORLD)
    what, key = drill.rng.choice(
        [
            (f"rank {victim}'s part", part_key(drill.cfg.namespace, step, victim)),
            ("its metadata", metadata_key(drill.cfg.namespace, step)),
        ]
    )
    roots = [Path(drill.cfg.tiers[0].root(n, n)) for n in range(WORLD)]
    damaged = [_flip(root / key) for root in roots if (root / key).exists()]
    event.unloadable = {step: f"every copy of {what} damaged by the drill"}
    drill.broken.update(event.unloadable)
    event.detail = (
        f"step {step}, held by the RAM tier only: a byte flipped in each of the {len(damaged)} "
        f"copies of {what}; the job crashed"
    )
    event.expected = drill.committed(passed=event.unloadable)
    drill.restart(event, fault_time)
    if event.resumed is None or marker is None:
        return
    marks = {(s, ident) for r in drill.reports for s, ident in r.get("quarantined", [])}
    quarantined = (step, f"{marker.metadata_xxh3:016x}") in marks
    event.detail += f"; quarantined: {quarantined}"
    if not quarantined:
        event.problems.append(f"the damaged step {step} was not quarantined")


def _fault_wipe(drill: Drill, event: Event) -> None:
    from tiered_dcp.storage.owners import pid_alive

    from ..steps.placement import placement_for
    from ..writer_process.run_dir import RunDir

    node = drill.rng.randrange(WORLD)  # one rank per node: the node's rank is `node`
    fault_time = time.time()
    drill.crash()
    event.expected = drill.committed()
    rd = RunDir.of(drill.cfg, node)
    pid = rd.writer.pid()
    if pid is not None and pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the node's writer process dies with it
    for tier in drill.cfg.tiers:
        if placement_for(tier).node_owned:
            shutil.rmtree(tier.root(node, node), ignore_errors=True)
    shutil.rmtree(rd.path, ignore_errors=True)
    event.detail = f"node {node} lost (ranks killed, its writer killed, its RAM and SSD roots wiped)"
    drill.restart(event, fault_time)


def _fault_flip(drill: Drill, event: Event) -> None:
    from ..ops.verify import verify_step
    from ..steps.catalog import TierView
    from ..storage.format import part_key

    fault_time = time.time()
    drill.crash()
    event.expected = drill.committed()
    view = TierView(drill.cfg, 0, 0, 0)
    steps = sorted(view.committed())
    if not steps:
        event.detail = "nothing committed on node 0's RAM tier to damage"
        drill.restart(event, fault_time)
        return
    step = steps[-1]
    path = Path(drill.cfg.tiers[0].root(0, 0)) / part_key(drill.cfg.namespace, step, 0)
    size = os.path.getsize(_flip(path))
    checks = verify_step(drill.cfg, step, 0, 0)
    seen = any(not c.ok for c in checks if c.tier_index == 0)
    event.detail = (
        f"byte {size // 2} of step {step}'s part on node 0's RAM tier flipped; verify saw it: {seen}"
    )
    if not seen:
        event.problems.append(f"verify did not see the flipped byte in {path}")
    drill.restart(event, fault_time)


def _fault_outage(drill: Drill, event: Event) -> None:
    from ..api import status
    from ..steps.status import StepStatus

    def bucket_newest() -> int:
        return max(
            [r.step for r in status(drill.cfg) if r.tier_index == 2 and r.state is StepStatus.COMMITTED] + [0]
        )

    length = drill.rng.uniform(3, 6)
    before = min(drill.progress(r) for r in range(WORLD))
    drill.proxy.inject(("503", 1))
    start = time.time()
    while time.time() - start < length and not drill.died():
        time.sleep(0.05)
    drill.proxy.inject()
    end = time.time()
    during = min(drill.progress(r) for r in range(WORLD)) - before
    newest = bucket_newest()
    event.detail = (
        f"bucket answered 503 to every request for {length:.1f} s; {during} steps trained meanwhile"
    )
    deadline = time.monotonic() + 90
    while bucket_newest() <= newest:
        why = drill.died()
        if why or time.monotonic() > deadline:
            event.problems.append(why or "no newer step committed on the bucket within 90 s of the outage")
            return
        time.sleep(0.1)
    event.recovery_s = round(time.time() - end, 3)
    stalls, before_it = [], []
    for r in range(WORLD):
        with contextlib.suppress(OSError), open(f"{drill.dir}/steps.rank{r}.jsonl") as f:
            for line in f:
                rec = json.loads(line)
                if start <= rec["time"] <= end + 1:
                    stalls.append(rec["stall"])
                elif start - 10 <= rec["time"] < start:
                    before_it.append(rec["stall"])
    if stalls:
        event.detail += f"; the loop's longest save wait meanwhile {max(stalls):.2f} s"
        if before_it:
            event.detail += f" (median {sorted(before_it)[len(before_it) // 2]:.2f} s in the 10 s before)"


# -- the run


# each fault kind's run: what it breaks, how the job comes back, what the event records
_FAULT_RUNS: dict[str, Callable[[Drill, Event], None]] = {
    "kill": _fault_kill,
    "kill-save": _fault_kill_save,
    "wipe": _fault_wipe,
    "flip": _fault_flip,
    "damage": _fault_damage,
    "nan": _fault_nan,
    "outage": _fault_outage,
}
FAULTS = tuple(_FAULT_RUNS)  # the kinds, in the order the drill names them


def _replica_reports(cfg: TieredConfig) -> tuple[list[str], list[str]]:
    """What the job recorded of replicas that disagreed, and the suspect nodes it made."""
    from ..metrics.scores import suspects
    from ..writer_process.timings import Kind, read_records

    recs = read_records(cfg, Kind.REPLICAS)
    said = [f"step {r.step}: {r.item!r}, odd copies on rank(s) {list(r.odd or ())}" for r in recs]
    named = [f"rank {s.rank} (node {s.node}) at steps {s.steps}" for s in suspects(recs)]
    return said, named


def _flip(path: Path) -> Path:
    """Flip the bits of the byte in the middle of the file at ``path``."""
    with open(path, "r+b") as f:
        middle = f.seek(0, os.SEEK_END) // 2
        f.seek(middle)
        b = f.read(1)
        f.seek(middle)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def _print_event(e: Event) -> None:
    verdict = "LOST: " + "; ".join(e.problems) if e.problems else "ok"
    if e.silent:
        verdict = "SILENT ESCAPE (a wrong or non-finite state restored without a word); " + verdict
    line = f"  [{e.at:6.1f}s] {e.fault:<9} {e.detail}"
    for err in e.errors:
        line += f"\n           survivor: {_clip(err, 160)}"
    if e.resumed is not None:
        line += (
            f"\n           resumed from step {e.resumed} (committed: {e.expected}"
            + "".join(f"; step {s} not counted: {why}" for s, why in e.unloadable.items())
            + f") off tier(s) {e.tiers}, state {'exact' if e.match else 'DIFFERENT'}"
            + ("" if e.finite else " and NON-FINITE")
            + f"; recovered in {e.recovery_s:.1f} s (process start {e.boot_s:.1f} s, load {e.load_s:.2f} s)"
        )
        for w in e.warnings:
            line += f"\n           the library warned: {_clip(w)}"
    elif e.recovery_s is not None:
        line += f"\n           a newer step committed on the bucket {e.recovery_s:.1f} s after the outage"
    print(f"{line}\n           {verdict}", flush=True)


def _clip(text: str, width: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def run_drill(
    seconds: float,
    workdir: str | None = None,
    seed: int | None = None,
    faults: list[str] | None = None,
    pause: tuple[float, float] = PAUSE,
    start: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> DrillReport:
    """Run the drill for ``seconds`` of faults, each kind once at least, and return its report
    (``report.ok``: nothing lost, no silent escape). ``pause``: seconds of training between
    faults, drawn in this range. ``start``: how each rank's process is started from its
    ``python`` command line (``subprocess.Popen``'s signature; a test passes one that forks an
    interpreter that has imported torch already)."""
    from ..api import writer_status
    from ..writer_process.run_dir import RunDir, job_dir
    from .jobconfig import load_job_config

    faults = list(faults or FAULTS)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; choose from {list(FAULTS)}")
    seed = seed if seed is not None else random.randrange(1 << 30)
    own_dir = workdir is None
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="tiered-dcp-drill-"))
    os.makedirs(workdir, exist_ok=True)
    for stale in Path(workdir).iterdir():  # a previous drill's tiers, logs and stop file
        if stale.name in ("ram", "ssd", "bucket") or stale.name.startswith(_OWN_FILES):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    ram = f"{workdir}/ram"
    if own_dir and os.access("/dev/shm", os.W_OK):
        ram = tempfile.mkdtemp(prefix="tiered-dcp-drill-", dir="/dev/shm")
    drill = Drill(workdir, ram, seconds, seed, faults, pause, start)
    for bucket in ("gs://drill/ckpt", f"{workdir}/bucket"):  # a previous drill's queues and records
        old = load_job_config(write_config(workdir, ram, bucket, {}))
        if not any(rd.writer.running() for rd in RunDir.all_of(old)):
            shutil.rmtree(job_dir(old), ignore_errors=True)
    print(
        f"tiered-dcp drill: {WORLD} ranks on 2 simulated nodes, {seconds:.0f} s of faults {faults}, "
        f"seed {seed}"
    )
    try:
        report = drill.run()
    finally:
        cfg = getattr(drill, "cfg", None)
        if cfg is not None:
            deadline = time.time() + 15  # the writers exit once their trainers are gone
            while any(w.running for w in writer_status(cfg)) and time.time() < deadline:
                time.sleep(0.05)
            for w in writer_status(cfg):  # still running: a writer stuck on a dead bucket
                if w.running and w.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGKILL)
            if own_dir:
                shutil.rmtree(job_dir(cfg), ignore_errors=True)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)
    report.notes.append(f"seed {seed}")
    return report


def print_report(report: DrillReport) -> None:
    faults = [e for e in report.events if e.fault != "none"]
    restarts = [e for e in faults if e.recovery_s is not None and e.resumed is not None]
    print(
        f"\n  {len(faults)} faults in {report.seconds:.0f} s, {report.steps} saves (bucket: {report.bucket})"
    )
    for kind in FAULTS:
        es = [e for e in restarts if e.fault == kind]
        if es:
            rec = sorted(e.recovery_s for e in es)  # type: ignore[type-var]
            print(
                f"    {kind:<9} x{len(es)}: recovery {rec[0]:.1f}-{rec[-1]:.1f} s (fault to state restored)"
            )
    outages = sorted(e.recovery_s for e in faults if e.fault == "outage" and e.recovery_s is not None)
    if outages:
        print(
            f"    outage    x{len(outages)}: a newer step committed on the bucket "
            f"{outages[0]:.1f}-{outages[-1]:.1f} s after"
        )
    unloadable = {s: why for e in report.events for s, why in e.unloadable.items()}
    if unloadable:
        print(
            "  steps the drill made unloadable itself, not counted as lost (restarts must pass them over): "
            + "; ".join(f"step {s}: {why}" for s, why in unloadable.items())
        )
    for note in report.notes:
        print(f"  note: {note}")
    print(f"\n  silent escapes: {report.silent_escapes}")
    print(f"  replica disagreements: {len(report.replica_reports)} (none corrupted: each is a false report)")
    for line in report.replica_reports[:8]:
        print(f"    {line}")
    for s in report.suspects:
        print(f"  suspect node: {s}")
    lost = [e for e in report.events if e.lost]
    if lost or report.replica_reports:
        failures = [f"{e.fault} at {e.at:.0f}s: {'; '.join(e.problems)}" for e in lost]
        if report.replica_reports:
            failures.append(f"{len(report.replica_reports)} false replica report(s)")
        print("\n  FAILED: " + " | ".join(failures))
    else:
        print(
            "\n  OK: nothing committed was lost; every restart restored exactly the state saved at a step "
            "no older than the newest committed one (but for the steps listed above), and finite"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0, help="how long to inject faults (default 5)")
    p.add_argument("--seconds", type=float, help="the same in seconds (overrides --minutes)")
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"which, comma-separated (default {','.join(FAULTS)})"
    )
    p.add_argument("--seed", type=int, help="the schedule's random seed (default: a fresh one, printed)")
    p.add_argument("--dir", help="where the tiers go (default: a temporary directory, RAM tier in /dev/shm)")
    p.add_argument("--json", action="store_true", help="print the report as JSON at the end")


def command(args: argparse.Namespace) -> int:
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    report = run_drill(seconds, args.dir, args.seed, [f for f in args.faults.split(",") if f])
    print_report(report)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    return 0 if report.ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description="tiered-dcp drill worker (started by `tiered-dcp drill`)")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--attempt", type=int, required=True)
    born = time.time()  # before torch is imported: the restart's own cost is reported
    from .demo import run_worker

    def work() -> None:
        args = p.parse_args()
        args.born = born
        worker(args)

    run_worker(work)


if __name__ == "__main__":
    main()
