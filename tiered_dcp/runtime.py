"""Where a rank's writer process keeps its queue, and how a trainer hands it work.

Each (job, rank) has a node-local runtime directory, found by the trainer, the writer
process, the status call and the CLI alike::

    $TIERED_DCP_RUNTIME_DIR (default /dev/shm/tiered-dcp-<uid>, else the temp dir)
      <namespace>-<hash of the tier paths>/rank_<rank>/
        config.json       the TieredConfig the writer works for (``TieredConfig.to_dict``)
        owner             pid of the trainer the writer serves (each new trainer rewrites it)
        writer.lock       held (flock) by the live writer for its whole life
        writer.pid        the live writer's pid
        stop              asks the writer to exit once its queue is empty
        queue/t<tier>_s<step>.json     a step waiting to be written to a slower tier
        results/t<tier>_s<step>.json   what became of it: committed, or failed or skipped and why
        health/t<tier>.json            the writer's verdict on a slower tier: healthy, stalled or
                                       failing, since when and why

The root is private (``private_dir``): created 0700, refused unless it is this user's and
nobody else may write it, its files created 0600; nothing in it is a pickle.

Files, not sockets: any process (the trainer, DCP's upload thread or subprocess) can
enqueue, the queue outlives a crashed writer (its successor resumes it), and the status
call reads it without talking to anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from tiered_dcp.storage.owners import pid_alive

from .config import TieredConfig
from .private_dir import ensure_private, mkdir_private, open_private, write_private

log = logging.getLogger("tiered_dcp")

MAX_PENDING = 2  # steps per slower tier a rank's writer may have queued before a save waits
WAIT_WARNING = 0.1  # seconds a save waits for its writer before that is logged (then once a minute)
POLL = 0.05
_LAUNCHED: dict[Path, subprocess.Popen] = {}  # writers this process started (reaped by a thread)


def runtime_root() -> Path:
    """The runtime root, created if missing and checked private on every call."""
    env = os.environ.get("TIERED_DCP_RUNTIME_DIR")
    if env:
        return ensure_private(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return ensure_private(base / f"tiered-dcp-{os.getuid()}")


def job_dir(config: TieredConfig) -> Path:
    key = hashlib.sha1("\n".join([config.namespace, *(t.path for t in config.tiers)]).encode()).hexdigest()
    return runtime_root() / f"{config.namespace}-{key[:10]}"


def rundir(config: TieredConfig, rank: int) -> Path:
    return job_dir(config) / f"rank_{rank:05d}"


def job_name(tier: int, step: int) -> str:
    return f"t{tier:02d}_s{step:012d}.json"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that a reader sees the whole file or none of it (mode 0600)."""
    write_private(path, data)


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data).encode())


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def writer_running(rd: Path) -> bool:
    """Whether a writer process holds this rank's lock."""
    lock = rd / "writer.lock"
    if not lock.exists():
        return False
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def writer_pid(rd: Path) -> int | None:
    try:
        return int((rd / "writer.pid").read_text())
    except (OSError, ValueError):
        return None


def config_json(config: TieredConfig) -> bytes:
    """The config as the writer process reads it (``TieredConfig.from_dict``)."""
    try:
        return json.dumps(config.to_dict(), sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"TieredConfig {config.namespace!r}: the writer process receives its config as JSON, and "
            f"this one is not JSON data ({e}); give storage_options plain values (strings, numbers, "
            "lists, dicts), e.g. a credentials file's path rather than a credentials object"
        ) from e


@dataclass
class Job:
    """One step to be written from its source tier to one slower tier by rank's writer."""

    step: int
    source: int
    target: int
    rank: int
    node: int
    enqueued: float

    @classmethod
    def load(cls, path: Path) -> Job | None:
        """The job in ``path``; None if it is not one (malformed files are never acted on)."""
        d = read_json(path)
        kinds = {f.name: f.type for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if not isinstance(d, dict) or not required <= set(d) <= set(kinds):
            return None
        for name, v in d.items():
            number = {"int": int, "float": int | float}.get(kinds[name])
            if number is not None and (isinstance(v, bool) or not isinstance(v, number)):
                return None
        return cls(**d)


HEALTHY = "healthy"


def health_name(tier: int) -> str:
    return f"t{tier:02d}.json"


def tier_health(rd: Path, tier: int) -> dict:
    """The writer's verdict on ``tier``: ``state`` healthy | stalled | failing, ``since``,
    ``error``. A tier no writer has judged is healthy."""
    return read_json(rd / "health" / health_name(tier)) or {"tier": tier, "state": HEALTHY}


def queued(rd: Path, target: int | None = None) -> list[Job]:
    jobs = []
    qdir = rd / "queue"
    if qdir.is_dir():
        for p in sorted(qdir.glob("t*_s*.json")):
            job = Job.load(p)
            if job is not None and (target is None or job.target == target):
                jobs.append(job)
    return jobs


def results(rd: Path) -> dict[tuple[int, int], dict]:
    """(step, tier) -> outcome, for the steps this rank's writers finished."""
    out = {}
    rdir = rd / "results"
    if rdir.is_dir():
        for p in sorted(rdir.glob("t*_s*.json")):
            d = read_json(p)
            if isinstance(d, dict) and isinstance(d.get("step"), int) and isinstance(d.get("target"), int):
                out[(d["step"], d["target"])] = d
    return out


class WriterHandle:
    """The trainer's side of one rank's writer process: start it, keep it alive, feed it."""

    def __init__(self, config: TieredConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.rd = rundir(config, rank)
        self._prepared: tuple | None = None
        self._seen: set[str] = set()  # outcome files already looked at
        self._next_warning = 0.0  # when a save waiting for the writer is worth a warning again
        self._health: dict[int, tuple] = {}  # tier -> (state, since) last logged

    def ensure(self, owner_pid: int) -> None:
        """Make sure a writer serves this rank, starting one if none is running."""
        if self._prepared != (self.config, owner_pid) or not (self.rd / "queue").is_dir():
            self._prepare(owner_pid)
            self._prepared = (self.config, owner_pid)
        (self.rd / "stop").unlink(missing_ok=True)
        if writer_running(self.rd):
            return
        proc = _LAUNCHED.get(self.rd)
        if proc is not None and proc.returncode is None:  # the reaper thread sets it
            return  # started moments ago and still importing; it takes the lock when ready
        stale = writer_pid(self.rd)
        if stale is not None:
            log.warning(
                "the writer process of rank %d (pid %d) died; starting a new one, which resumes "
                "its %d queued step(s)",
                self.rank,
                stale,
                len(queued(self.rd)),
            )
            (self.rd / "writer.pid").unlink(missing_ok=True)
        self._start()

    def _prepare(self, owner_pid: int) -> None:
        for sub in ("queue", "results"):
            mkdir_private(self.rd / sub)
        cfg = self.rd / "config.json"
        blob = config_json(self.config)
        if not cfg.exists() or cfg.read_bytes() != blob:
            write_atomic(cfg, blob)
        owner = self.rd / "owner"
        previous = owner.read_text().strip() if owner.exists() else ""
        if previous != str(owner_pid):
            if previous.isdigit() and not pid_alive(int(previous)):
                for old in (self.rd / "results").glob("*.json"):  # a past run's outcomes
                    old.unlink(missing_ok=True)
            write_atomic(owner, str(owner_pid).encode())

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "tiered_dcp.persist", str(self.rd)]
        # A session of its own, so a Ctrl-C to the trainer's terminal does not cut a step in
        # half; it exits by itself once its trainer is gone and its queue is empty.
        with open_private(self.rd / "writer.out") as logf:  # a crash's traceback; the log is writer.log
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        _LAUNCHED[self.rd] = proc
        threading.Thread(target=proc.wait, daemon=True, name="tiered-dcp-reaper").start()

    def wait_for_room(self, step: int, targets: list[int], owner_pid: int, max_pending: int) -> float:
        """Wait while the writer has ``max_pending`` steps queued for a healthy one of ``targets``.

        Called before ``step`` is staged or written, so a writer that fell behind makes the
        next save wait and never delays the commit of a step already written. A tier its
        writer judges stalled or failing is not waited for: the writer keeps only the newest
        step queued for it. Returns the seconds waited. The wait is logged once it exceeds
        ``WAIT_WARNING``, then at most once a minute: a slow tier slows every save, one line
        says so.
        """
        started = time.monotonic()
        warn_at = max(started + WAIT_WARNING, self._next_warning)
        for target in targets:
            while len(queued(self.rd, target)) >= max_pending and self.healthy(target):
                if time.monotonic() > warn_at:
                    warn_at = self._next_warning = time.monotonic() + 60
                    log.warning(
                        "rank %d: the writer is %d step(s) behind on tier %s; step %d has waited "
                        "%.1f s for it (nothing is dropped; a slower tier cannot take steps faster "
                        "than it writes; its log: %s)",
                        self.rank,
                        max_pending,
                        self.config.tiers[target].path,
                        step,
                        time.monotonic() - started,
                        self.rd / "writer.log",
                    )
                time.sleep(POLL)
                if not writer_running(self.rd):
                    self.ensure(owner_pid)
        return time.monotonic() - started

    def healthy(self, target: int) -> bool:
        """Whether the writer judges ``target`` healthy; a change is logged once."""
        h = tier_health(self.rd, target)
        seen = (h["state"], h.get("since"))
        if self._health.get(target, (HEALTHY, None)) != seen:
            self._health[target] = seen
            path = self.config.tiers[target].path
            if h["state"] == HEALTHY:
                log.info("rank %d: tier %s answers again", self.rank, path)
            else:
                log.warning(
                    "rank %d: tier %s is %s (%s); saves go on without waiting for it, and only the "
                    "newest step stays queued for it (older ones are skipped, and recorded as such)",
                    self.rank,
                    path,
                    h["state"],
                    h.get("error"),
                )
        return h["state"] == HEALTHY

    def enqueue(self, job: Job) -> None:
        """Queue ``job``; ``ensure`` afterwards, so a writer is there to take it."""
        mkdir_private(self.rd / "queue")
        (self.rd / "results" / job_name(job.target, job.step)).unlink(missing_ok=True)
        write_json(self.rd / "queue" / job_name(job.target, job.step), job.__dict__)

    def report_failures(self) -> None:
        """Log, once each, the steps this rank's writer could not persist."""
        rdir = self.rd / "results"
        try:
            names = set(os.listdir(rdir))
        except FileNotFoundError:
            return
        for name in sorted(names - self._seen):
            res = read_json(rdir / name)
            if res is None:
                continue  # being replaced; looked at next time
            self._seen.add(name)
            if res.get("state") in ("failed", "skipped"):
                log.log(
                    logging.ERROR if res["state"] == "failed" else logging.WARNING,
                    "step %d was NOT written to tier %s by rank %d's writer: %s",
                    res["step"],
                    self.config.tiers[res["target"]].path,
                    self.rank,
                    res.get("error"),
                )
        self._seen &= names
        for target in range(1, len(self.config.tiers)):
            self.healthy(target)

    def _starting(self) -> bool:
        """Whether a writer this process launched is alive (maybe still importing, unlocked)."""
        proc = _LAUNCHED.get(self.rd)
        return proc is not None and proc.poll() is None

    def stop(self, wait: bool, timeout: float | None) -> bool:
        """Ask the writer to exit once its queue is empty; with ``wait``, wait for that."""
        if not self.rd.is_dir():
            return True
        (self.rd / "stop").touch(mode=0o600)
        if not wait:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while writer_running(self.rd) or (queued(self.rd) and self._starting()):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        failed = any(r.get("state") == "failed" for r in results(self.rd).values())
        if not queued(self.rd) and not failed:  # nothing left worth showing: tidy up
            shutil.rmtree(self.rd, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.rd.parent.rmdir()  # the job's directory, once no rank has one
            self._prepared = None
        return True


_HANDLES: dict[Path, WriterHandle] = {}


def writer_handle(config: TieredConfig, rank: int) -> WriterHandle:
    """This process's handle on rank's writer process (one per job and rank)."""
    handle = _HANDLES.setdefault(rundir(config, rank), WriterHandle(config, rank))
    handle.config = config
    return handle


def handles() -> list[WriterHandle]:
    """The handles this process holds (the writers it fed)."""
    return list(_HANDLES.values())
