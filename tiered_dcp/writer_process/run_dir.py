"""A rank's writer-process run directory: its layout and its records, in one place.

Each (job, rank) has a node-local runtime directory, found by the trainer, the writer
process, the status call and the CLI alike::

    $TIERED_DCP_RUNTIME_DIR (default /dev/shm/tiered-dcp-<uid>, else the temp dir)
      <namespace>-<hash of the namespace and the resolved tier paths>/rank_<rank>/
        config.json       the TieredConfig the writer works for (``TieredConfig.to_dict``), its
                          local tier paths absolute (``TieredConfig.resolved``)
        owner             pid of the trainer the writer serves (each new trainer rewrites it)
        writer.lock       held (flock) by the live writer for its whole life
        staging.lock      held (lockf, exclusive) by the trainer while it copies a save's state;
                          the writer waits on it before each chunk it reads, 5 s at most
                          (``StagingLock``)
        writer.pid        the live writer's pid
        writer.log        the writer's log (``process`` rotates it)
        writer.out        the writer's stdout and stderr (a crash's traceback)
        stop              asks the writer to exit once its queue is empty
        queue/t<tier>_s<step>.json     a step waiting to be written to a slower tier (``Job``)
        results/t<tier>_s<step>.json   what became of it: committed, or failed or skipped and why
                                       (``Outcome``)
        health/t<tier>.json            the writer's verdict on a slower tier: healthy, stalled or
                                       failing, since when and why (``TierHealth``)

The root is private (``private_dir``): created 0700, refused unless it is this user's and
nobody else may write it, its files created 0600; nothing in it is a pickle.

Files, not sockets: any process (the trainer, DCP's upload thread or subprocess) can
enqueue, the queue outlives a crashed writer (its successor resumes it), and the status
call reads it without talking to anyone.

This module is the only code that names these files: ``RunDir`` the directory, its config
and owner, and its parts each their own files (``JobQueue`` queue/, ``Results`` results/,
``HealthRecords`` health/, ``WriterFiles`` the writer's lock, pid, logs and stop, and the
``StagingLock``); ``Job``,
``Outcome`` and ``TierHealth`` are the only code that reads or writes their JSON. A writer of
an older or newer version shares the directory with the trainer, so the format changes here
or nowhere. ``POLL`` is how often either side looks at the directory for a change.
Whatever is read is validated first: a file that is not a well-formed record (cut short,
planted, from another version) is never acted on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any

from ..config import StrEnum, TieredConfig
from .private_dir import ensure_private, mkdir_private, write_private

POLL = 0.05  # seconds between looks at the run directory, by the trainer and by the writer
PAUSE_LIMIT = 5.0  # seconds the writer waits for one staging hold of its trainer's at most
PAUSE_POLL = 0.002  # seconds between the writer's looks at a held staging lock


def runtime_root() -> Path:
    """The runtime root, created if missing and checked private on every call."""
    env = os.environ.get("TIERED_DCP_RUNTIME_DIR")
    if env:
        return ensure_private(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return ensure_private(base / f"tiered-dcp-{os.getuid()}")


def job_dir(config: TieredConfig) -> Path:
    """The job's directory in the runtime root: its ranks' run directories and ``timings``.

    Named from what the job is: its namespace and its tiers' paths as resolved here
    (``TieredConfig.resolved``), so two jobs with the same relative paths in two directories
    never share a writer, and a config and its absolute equivalent (the one the writer
    receives) name the same directory."""
    paths = [t.path for t in config.resolved().tiers]
    key = hashlib.sha1("\n".join([config.namespace, *paths]).encode()).hexdigest()
    return runtime_root() / f"{config.namespace}-{key[:10]}"


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


# -- the records ----------------------------------------------------------------------------


class TierState(StrEnum):
    """The writer's verdict on a slower tier (``health/t<tier>.json``)."""

    HEALTHY = "healthy"
    STALLED = "stalled"  # a write under way made no progress for tier_timeout
    FAILING = "failing"  # a write failed, or its requests have failed for a while


class OutcomeState(StrEnum):
    """What became of a queued step on its target tier (``results/t<tier>_s<step>.json``)."""

    COMMITTED = "committed"  # written, and this rank's writer committed the target's root
    CLEAN = "clean"  # written; another rank's writer commits the root
    FAILED = "failed"
    SKIPPED = "skipped"  # a newer step took its place in the queue of a tier that was down


# Checks of the values a JSON record holds (``timings`` uses them for the timing lines too).


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def one_of(states: type[Enum]) -> Callable[[Any], bool]:
    """A check that a value is the string of one of ``states``."""
    values = {m.value for m in states}
    return lambda v: isinstance(v, str) and v in values


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def valid_record(
    d: Any, checks: dict[str, Callable[[Any], bool]], required: set[str], extra_ok: bool = True
) -> bool:
    """Whether ``d`` is a dict with the ``required`` keys and every known key's value passes
    its check (unknown keys: ignored if ``extra_ok``, else the record is refused)."""
    if not isinstance(d, dict) or not required <= set(d):
        return False
    if not extra_ok and not set(d) <= set(checks):
        return False
    return all(check(d[k]) for k, check in checks.items() if k in d)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a reader never sees half a record), mode 0600."""
    write_private(path, json.dumps(data).encode())


@dataclass(frozen=True)
class Job:
    """One step to be written from its source tier to one slower tier by rank's writer."""

    step: int
    source: int
    target: int
    rank: int
    node: int
    enqueued: float  # time.time() of the hand-off

    _CHECKS = {
        "step": is_int,
        "source": is_int,
        "target": is_int,
        "rank": is_int,
        "node": is_int,
        "enqueued": is_number,
    }

    @classmethod
    def from_dict(cls, d: Any) -> Job | None:
        """The job ``d`` describes; None unless it has exactly a job's fields and types."""
        if not valid_record(d, cls._CHECKS, set(cls._CHECKS), extra_ok=False):
            return None
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Outcome:
    """What became of one job: its state, why (failed, skipped) and what the copy cost."""

    step: int
    target: int
    state: OutcomeState
    rank: int | None = None
    error: str | None = None  # why it failed or was skipped (or an earlier attempt's failure)
    seconds: float | None = None  # the job's time in the writer, attempts included
    write_s: float | None = None  # this rank's parts copied (for ``timings``)
    bytes: int | None = None
    finished: float | None = None  # time.time()

    _CHECKS = {
        "step": is_int,
        "target": is_int,
        "state": one_of(OutcomeState),
        "rank": optional(is_int),
        "error": optional(is_str),
        "seconds": optional(is_number),
        "write_s": optional(is_number),
        "bytes": optional(is_int),
        "finished": optional(is_number),
    }

    @classmethod
    def from_dict(cls, d: Any) -> Outcome | None:
        """The outcome ``d`` records; None if it is not one (keys it does not know are ignored)."""
        if not valid_record(d, cls._CHECKS, {"step", "target", "state"}):
            return None
        known = {k: d[k] for k in cls._CHECKS if k in d}
        return cls(**{**known, "state": OutcomeState(d["state"])})

    def to_dict(self) -> dict[str, Any]:
        """The JSON the writer has always written: absent keys for what is not known."""
        d: dict[str, Any] = {"step": self.step, "target": self.target, "rank": self.rank}
        if self.write_s is not None:
            d["write_s"] = self.write_s
        if self.bytes is not None:
            d["bytes"] = self.bytes
        d["state"] = self.state.value
        if self.error is not None:
            d["error"] = self.error
        if self.seconds is not None:
            d["seconds"] = self.seconds
        if self.finished is not None:
            d["finished"] = self.finished
        return d


@dataclass(frozen=True)
class TierHealth:
    """The writer's verdict on one slower tier. A tier no writer has judged is healthy."""

    tier: int
    state: TierState = TierState.HEALTHY
    since: float | None = None  # time.time() of the last change of state
    error: str | None = None

    _CHECKS = {
        "tier": is_int,
        "state": one_of(TierState),
        "since": optional(is_number),
        "error": optional(is_str),
    }

    @classmethod
    def from_dict(cls, d: Any) -> TierHealth | None:
        """The verdict ``d`` records; None if it is not one (keys it does not know are ignored)."""
        if not valid_record(d, cls._CHECKS, {"tier", "state"}):
            return None
        return cls(d["tier"], TierState(d["state"]), d.get("since"), d.get("error"))

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "state": self.state.value, "since": self.since, "error": self.error}


# -- the directory --------------------------------------------------------------------------


def _job_name(tier: int, step: int) -> str:
    return f"t{tier:02d}_s{step:012d}.json"


def _records(directory: Path, pattern: str) -> list[Any]:
    """The JSON of the files matching ``pattern`` in ``directory``, by name (None: unreadable)."""
    if not directory.is_dir():
        return []
    return [_read_json(p) for p in sorted(directory.glob(pattern))]


class JobQueue:
    """``queue/``: the steps waiting for the writer, one ``Job`` file each."""

    __slots__ = ("dir",)

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, job: Job) -> Path:
        return self.dir / _job_name(job.target, job.step)

    def exists(self) -> bool:
        return self.dir.is_dir()

    def put(self, job: Job) -> None:
        mkdir_private(self.dir)
        _write_json(self.path(job), job.to_dict())

    def remove(self, job: Job) -> None:
        self.path(job).unlink(missing_ok=True)

    def jobs(self, target: int | None = None) -> list[Job]:
        """The jobs waiting (for ``target``, or any tier), by tier then step."""
        jobs = (Job.from_dict(d) for d in _records(self.dir, "t*_s*.json"))
        return [j for j in jobs if j is not None and (target is None or j.target == target)]


class Results:
    """``results/``: what became of each job, one ``Outcome`` file each."""

    __slots__ = ("dir",)

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, target: int, step: int) -> Path:
        return self.dir / _job_name(target, step)

    def write(self, outcome: Outcome) -> None:
        _write_json(self.path(outcome.target, outcome.step), outcome.to_dict())

    def forget(self, target: int, step: int) -> None:
        self.path(target, step).unlink(missing_ok=True)

    def names(self) -> set[str] | None:
        """The names of the outcome files (to notice new ones); None without a results dir."""
        try:
            return set(os.listdir(self.dir))
        except FileNotFoundError:
            return None

    def read(self, name: str) -> Outcome | None:
        """The outcome in file ``name`` (from ``names``); None if it is not one (yet)."""
        return Outcome.from_dict(_read_json(self.dir / name))

    def all(self) -> dict[tuple[int, int], Outcome]:
        """(step, tier) -> outcome, for the steps this rank's writers finished."""
        outcomes = (Outcome.from_dict(d) for d in _records(self.dir, "t*_s*.json"))
        return {(o.step, o.target): o for o in outcomes if o is not None}

    def clear(self) -> None:
        """Forget every outcome (those of a trainer that is gone)."""
        for old in self.dir.glob("*.json"):
            old.unlink(missing_ok=True)

    def prune(self, target: int, keep: int) -> None:
        """Forget all but the newest ``keep`` outcomes of a tier, so the directory stays small."""
        names = sorted(self.dir.glob(f"t{target:02d}_s*.json"))
        for old in names[:-keep]:
            old.unlink(missing_ok=True)


class HealthRecords:
    """``health/``: the writer's verdict on each slower tier, one ``TierHealth`` file each."""

    __slots__ = ("dir",)

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def path(self, tier: int) -> Path:
        return self.dir / f"t{tier:02d}.json"

    def write(self, health: TierHealth) -> None:
        mkdir_private(self.dir)
        _write_json(self.path(health.tier), health.to_dict())

    def of(self, tier: int) -> TierHealth:
        """The writer's verdict on ``tier``; healthy where none (or no valid one) is recorded."""
        return TierHealth.from_dict(_read_json(self.path(tier))) or TierHealth(tier)

    def clear(self) -> None:
        """Forget a former writer's verdicts (a new writer judges every tier anew)."""
        for old in self.dir.glob("*.json"):
            old.unlink(missing_ok=True)


def _nothing() -> None:
    return None


class StagingLock:
    """The trainer's copy of a save's state comes before its writer's reads.

    The trainer holds it (``hold``) while it copies a save's state, and only then; the
    writer looks at it before each chunk it reads (``wait``), so a copy down the tiers
    pauses for as long as the training loop waits for its save: the two do not share the
    cores and the memory bandwidth in that moment (on a 2-core host the writer's first copy
    made the save staged beside it 2-4x a memcpy).

    A POSIX record lock (``lockf``), not ``flock``: it belongs to the process, so a child
    forked meanwhile (a DataLoader worker, a pool, a subprocess before its ``exec``) does not
    inherit it and cannot keep the writer paused after the trainer lets go; and a trainer
    that dies or is killed lets go. Threads of one process share it: the trainer counts its
    holders and locks once. The writer never waits long: a hold that outlasts
    ``PAUSE_LIMIT`` (a SIGSTOPped trainer, a copy of a CPU-offloaded state) is read past,
    and every moment spent waiting counts as the copy's progress, so a paused writer is
    never taken for a stalled tier. ``let_go`` (the SIGTERM handler's) lets the writer run
    while the trainer still holds it."""

    __slots__ = ("path", "_fd", "_opening", "_holders", "_overdue")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None  # kept open for the process's life (closing one unlocks)
        self._opening = threading.Lock()  # the fd's opening; the trainer's count of holders
        self._holders = 0  # the trainer's threads in ``hold`` now
        self._overdue = False  # the writer read past the trainer's current hold

    def _file(self) -> int | None:
        """The lock file, opened once, or None: no run directory (no writer was started), or
        a file it cannot be (a link or a directory planted there, a read-only directory).
        The lock only orders two copies in time; without it both run, and no save fails."""
        if self._fd is None:
            with contextlib.suppress(OSError):
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return self._fd

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The trainer's, around its copy of a save's state (nothing else: no wait)."""
        with self._opening:
            fd = self._file()
            if self._holders == 0 and fd is not None:
                with contextlib.suppress(OSError):
                    fcntl.lockf(fd, fcntl.LOCK_EX)  # the writer holds it shared for an instant
            self._holders += 1
        try:
            yield
        finally:
            with self._opening:
                self._holders -= 1
                if self._holders == 0:
                    self.let_go()

    def let_go(self) -> None:
        """Let the writer run now, while the trainer's copy may go on (a SIGTERM handler's
        wait: the slower tiers need the grace period). Takes no lock: a signal handler may
        call it on the thread that is inside ``hold``."""
        fd = self._fd
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def wait(self, progress: Callable[[], None] = _nothing) -> None:
        """The writer's, before each chunk it reads: until the trainer's copy is done, or
        ``PAUSE_LIMIT`` seconds into a hold (then it reads on until the trainer lets go);
        ``progress`` is called as it waits."""
        with self._opening:
            fd = self._file()
        if fd is None:
            return
        deadline = None
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # held: EACCES or EAGAIN
                if self._overdue:
                    return
                now = time.monotonic()
                deadline = deadline or now + PAUSE_LIMIT
                if now > deadline:
                    self._overdue = True
                    return
                progress()
                time.sleep(PAUSE_POLL)
                continue
            fcntl.lockf(fd, fcntl.LOCK_UN)
            self._overdue = False
            return


class WriterFiles:
    """The writer process's own files: its lock, pid, logs, the request that it stop, and
    the lock its trainer's staging holds (``staging``)."""

    __slots__ = ("dir", "staging")

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.staging = StagingLock(directory / "staging.lock")

    @property
    def lock_path(self) -> Path:
        return self.dir / "writer.lock"

    @property
    def pid_path(self) -> Path:
        return self.dir / "writer.pid"

    @property
    def log_path(self) -> Path:
        return self.dir / "writer.log"

    @property
    def out_path(self) -> Path:
        return self.dir / "writer.out"

    @property
    def stop_path(self) -> Path:
        return self.dir / "stop"

    def running(self) -> bool:
        """Whether a writer process holds this rank's lock."""
        if not self.lock_path.exists():
            return False
        with open(self.lock_path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    def take_lock(self, attempts: int, poll: float) -> IO | None:
        """The lock, held (keep the file open for the writer's life); None if another writer
        holds it. Retried ``attempts`` times: a trainer probing the lock holds it for an instant."""
        lock = open(self.lock_path, "a+")  # noqa: SIM115 - returned open: closing it unlocks
        for _ in range(attempts):
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lock
            except BlockingIOError:
                time.sleep(poll)
        lock.close()
        return None

    def pid(self) -> int | None:
        """The pid the live (or a killed) writer recorded."""
        try:
            return int(self.pid_path.read_text())
        except (OSError, ValueError):
            return None

    def set_pid(self, pid: int) -> None:
        self.pid_path.write_text(str(pid))

    def clear_pid(self) -> None:
        self.pid_path.unlink(missing_ok=True)

    def request_stop(self) -> None:
        """Ask the writer to exit once its queue is empty."""
        self.stop_path.touch(mode=0o600)

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    def stop_requested(self) -> bool:
        return self.stop_path.exists()


class RunDir:
    """One rank's run directory: what the trainer gives its writer (config, owner), and the
    parts each owning its files: ``queue``, ``results``, ``health`` and ``writer``."""

    __slots__ = ("path", "queue", "results", "health", "writer")

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.queue = JobQueue(self.path / "queue")
        self.results = Results(self.path / "results")
        self.health = HealthRecords(self.path / "health")
        self.writer = WriterFiles(self.path)

    @classmethod
    def of(cls, config: TieredConfig, rank: int) -> RunDir:
        """The run directory of ``rank``'s writer for this job on this node (not created)."""
        return cls(job_dir(config) / f"rank_{rank:05d}")

    @classmethod
    def all_of(cls, config: TieredConfig) -> list[RunDir]:
        """The run directories of this job's ranks on this node, by rank."""
        jd = job_dir(config)
        return [cls(p) for p in sorted(jd.glob("rank_*"))] if jd.is_dir() else []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def rank(self) -> int:
        return int(self.path.name.removeprefix("rank_"))

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def owner_path(self) -> Path:
        return self.path / "owner"

    # the directory as a whole

    def exists(self) -> bool:
        return self.path.is_dir()

    def make(self) -> None:
        """Create the directory with its queue and results (mode 0700)."""
        for d in (self.queue.dir, self.results.dir):
            mkdir_private(d)

    def remove(self) -> None:
        """Delete the directory, and the job's directory with it once no rank has one."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()

    def enqueue(self, job: Job) -> None:
        """Queue ``job``, forgetting the outcome of an earlier job for that step and tier."""
        self.results.forget(job.target, job.step)
        self.queue.put(job)

    # config and owner

    def write_config(self, config: TieredConfig) -> None:
        """Give the writer ``config``, its local paths absolute (``TieredConfig.resolved``: the
        writer runs elsewhere); the file is rewritten only when it changes."""
        blob = config_json(config.resolved())
        if not self.config_path.exists() or self.config_path.read_bytes() != blob:
            write_private(self.config_path, blob)

    def read_config(self) -> TieredConfig:
        return TieredConfig.from_dict(json.loads(self.config_path.read_bytes()))

    def owner(self) -> int | None:
        """The pid of the trainer the writer serves; None if none is recorded (or not a pid)."""
        try:
            text = self.owner_path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def set_owner(self, pid: int) -> None:
        write_private(self.owner_path, str(pid).encode())
