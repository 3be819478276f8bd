"""How a trainer hands work to its rank's writer process: start it, keep it alive, feed it.

The queue, the outcomes and the tier verdicts the two share live in the rank's run
directory (``run_dir.RunDir``, which owns its layout and its records); this module is the
trainer's side: one ``WriterHandle`` per (job, rank), kept for the process's life.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from tiered_dcp.storage.forks import renew_in_child
from tiered_dcp.storage.owners import pid_alive

from ..config import TieredConfig
from .private_dir import open_private
from .run_dir import POLL, Job, OutcomeState, RunDir, TierState

log = logging.getLogger(__name__)

MAX_PENDING = 2  # steps per slower tier a rank's writer may have queued before a save waits
WAIT_WARNING = 1.0  # seconds a save waits for its writer before that is logged (then every 10 min)
WARNING_EVERY = 600.0  # seconds between two such warnings of one rank
_LAUNCHED: dict[RunDir, subprocess.Popen] = {}  # writers this process started (reaped by a thread)


class WriterHandle:
    """The trainer's side of one rank's writer process: start it, keep it alive, feed it."""

    def __init__(self, config: TieredConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.rd = RunDir.of(config, rank)
        self._prepared: tuple | None = None
        self._seen: set[str] = set()  # outcome files already looked at
        self._next_warning = 0.0  # when a save waiting for the writer is worth a warning again
        self._health: dict[int, tuple] = {}  # tier -> (state, since) last logged

    def ensure(self, owner_pid: int) -> None:
        """Make sure a writer serves this rank, starting one if none is running."""
        if self._prepared != (self.config, owner_pid) or not self.rd.queue.exists():
            self._prepare(owner_pid)
            self._prepared = (self.config, owner_pid)
        self.rd.writer.clear_stop()
        if self.rd.writer.running():
            return
        proc = _LAUNCHED.get(self.rd)
        if proc is not None and proc.returncode is None:  # the reaper thread sets it
            return  # started moments ago and still importing; it takes the lock when ready
        stale = self.rd.writer.pid()
        if stale is not None:
            log.warning(
                "the writer process of rank %d (pid %d) died; starting a new one, which resumes "
                "its %d queued step(s)",
                self.rank,
                stale,
                len(self.rd.queue.jobs()),
            )
            self.rd.writer.clear_pid()
        self._start()

    def _prepare(self, owner_pid: int) -> None:
        self.rd.make()
        self.rd.write_config(self.config)
        previous = self.rd.owner()
        if previous != owner_pid:
            if previous is not None and not pid_alive(previous):
                self.rd.results.clear()  # a past run's outcomes
            self.rd.set_owner(owner_pid)

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "tiered_dcp.writer_process.process", str(self.rd.path)]
        # A session of its own, so a Ctrl-C to the trainer's terminal does not cut a step in
        # half; it exits by itself once its trainer is gone and its queue is empty.
        with open_private(self.rd.writer.out_path) as logf:  # a crash's traceback; the log is log_path
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        _LAUNCHED[self.rd] = proc
        threading.Thread(target=proc.wait, daemon=True, name="tiered-dcp-reaper").start()

    def wait_for_room(
        self,
        step: int,
        lagging: dict[int, int],
        owner_pid: int,
        before: int | None = None,
        below: Iterable[int] = (),
    ) -> float:
        """Wait while the writer has ``lagging[target]`` steps queued for a healthy tier
        ``target`` (the tiers taking ``step``, each with its ``max_pending``), or, given
        ``before``, any step older than that queued for a healthy one of ``below``
        (``on_lagging_tier="wait"``: every slower tier, whether or not it takes ``step``).

        Called before ``step`` is staged or written, so a writer that fell behind makes the
        next save wait and never delays the commit of a step already written. A tier its
        writer judges stalled or failing is not waited for: the writer keeps only the newest
        step queued for it. Returns the seconds waited. The wait is logged once it exceeds
        ``WAIT_WARNING``, then at most every ``WARNING_EVERY``: a slow tier slows every save, one line
        says so.
        """
        started = time.monotonic()
        warn_at = max(started + WAIT_WARNING, self._next_warning)
        window = set(below) if before is not None else set()
        for target in sorted(set(lagging) | window):
            while self._behind(target, lagging.get(target), before if target in window else None) and (
                self.healthy(target)
            ):
                if time.monotonic() > warn_at:
                    warn_at = self._next_warning = time.monotonic() + WARNING_EVERY
                    log.warning(
                        "rank %d: the writer lags on tier %s; step %d has waited %.1f s for it "
                        "(nothing is dropped; a slower tier cannot take steps faster than it "
                        "writes; its log: %s)",
                        self.rank,
                        self.config.tiers[target].path,
                        step,
                        time.monotonic() - started,
                        self.rd.writer.log_path,
                    )
                time.sleep(POLL)
                if not self.rd.writer.running():
                    self.ensure(owner_pid)
        return time.monotonic() - started

    def _behind(self, target: int, max_pending: int | None, before: int | None) -> bool:
        queued = self.rd.queue.jobs(target)
        full = max_pending is not None and len(queued) >= max_pending
        return full or (before is not None and any(j.step < before for j in queued))

    def healthy(self, target: int) -> bool:
        """Whether the writer judges ``target`` healthy; a change is logged once."""
        h = self.rd.health.of(target)
        seen = (h.state, h.since)
        if self._health.get(target, (TierState.HEALTHY, None)) != seen:
            self._health[target] = seen
            path = self.config.tiers[target].path
            if h.state is TierState.HEALTHY:
                log.info("rank %d: tier %s answers again", self.rank, path)
            else:
                log.warning(
                    "rank %d: tier %s is %s (%s); saves go on without waiting for it, and only the "
                    "newest step stays queued for it (older ones are skipped, and recorded as such)",
                    self.rank,
                    path,
                    h.state,
                    h.error,
                )
        return h.state is TierState.HEALTHY

    def enqueue(self, job: Job) -> None:
        """Queue ``job``; ``ensure`` afterwards, so a writer is there to take it."""
        self.rd.enqueue(job)

    def report_failures(self) -> None:
        """Log, once each, the steps this rank's writer could not persist."""
        names = self.rd.results.names()
        if names is None:
            return
        for name in sorted(names - self._seen):
            res = self.rd.results.read(name)
            if res is None:
                continue  # being replaced (or not an outcome); looked at next time
            self._seen.add(name)
            if res.state in (OutcomeState.FAILED, OutcomeState.SKIPPED):
                log.log(
                    logging.ERROR if res.state is OutcomeState.FAILED else logging.WARNING,
                    "step %d was NOT written to tier %s by rank %d's writer: %s",
                    res.step,
                    self.config.tiers[res.target].path,
                    self.rank,
                    res.error,
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
        if not self.rd.exists():
            return True
        self.rd.writer.request_stop()
        if not wait:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.rd.writer.running() or (self.rd.queue.jobs() and self._starting()):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        failed = any(o.state is OutcomeState.FAILED for o in self.rd.results.all().values())
        if not self.rd.queue.jobs() and not failed:  # nothing left worth showing: tidy up
            self.rd.remove()
            self._prepared = None
        return True


_HANDLES: dict[RunDir, WriterHandle] = {}


def writer_handle(config: TieredConfig, rank: int) -> WriterHandle:
    """This process's handle on rank's writer process (one per job and rank), keyed by the
    job's resolved config: its run directory and what its writer receives, one cwd's view."""
    config = config.resolved()
    rd = RunDir.of(config, rank)
    handle = _HANDLES.get(rd)
    if handle is None:
        handle = _HANDLES[rd] = WriterHandle(config, rank)
    handle.config = config
    return handle


@renew_in_child
def _forget_writers() -> None:
    """A forked child starts and feeds writers of its own: its parent's are not its children."""
    _HANDLES.clear()
    _LAUNCHED.clear()


def handles() -> list[WriterHandle]:
    """The handles this process holds (the writers it fed)."""
    return list(_HANDLES.values())
