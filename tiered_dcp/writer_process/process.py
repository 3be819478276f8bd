"""The writer process: copies committed steps from their fast tier down to the slower tiers.

One per rank, started by the trainer on first use (``client.WriterHandle``) and reused by
every later save. For each queued (step, tier) it waits until the step is committed on the
tier the save wrote (its source), streams this rank's part from there (every chunk
verified, recompressed when the tiers differ), writes it under a dirty name, renames it
clean and writes this rank's index next to it. Whichever rank's writer finds the target
root holding everything it should (``placement``) commits the step there (``commit.commit_copy``:
metadata, marker, retention): no collective with the trainers, which may be busy or dead.

Each slower tier has a health the writer judges and publishes (``run_dir.TierHealth``):
*failing* after a write to it failed, *stalled* while a write makes no progress for
``tier_timeout``, *healthy* again once a write succeeds. Saves wait for a healthy tier that
is merely slow; for one that is not, they go on, and the queue for it keeps only the newest
step (the others are recorded as skipped), so that step is the next to reach it once it
answers again.

A step that leaves the keep window of a RAM tier it is copied from, while its copy is under
way or still queued, is dropped there all the same (``on_lagging_tier="skip"``,
``part_file.drops_pinned``): its copy fails (the file is gone, or a chunk read from the
file a newer save reuses fails its checksum, so nothing torn is ever written) and is
recorded as skipped; the tier takes the next step queued, the newest.

It outlives its trainer: once the trainer is gone it goes on with what it was handed for
``writer_drain_timeout`` seconds at most, then records what it could not write and exits.
Run as ``python -m tiered_dcp.writer_process.process RUNDIR``; what it reads and writes
there is ``run_dir``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from tiered_dcp.storage import Storage, direct_io
from tiered_dcp.storage.codec import Encoder, iter_raw_chunks
from tiered_dcp.storage.errors import PermanentStorageError, classify
from tiered_dcp.storage.format import PartIndex, part_key, pin_key, step_dir, write_index
from tiered_dcp.storage.owners import pid_alive
from tiered_dcp.storage.records import records_limit

from ..config import TieredConfig
from ..ranks.cliques import Layout
from ..steps import dedup, part_file
from ..steps.catalog import StepCopy, TierView
from ..steps.commit import commit_copy
from ..steps.placement import nodes_of
from ..steps.retention import apply_retention
from .run_dir import POLL, Job, Outcome, OutcomeState, RunDir, TierHealth, TierState
from .timings import Kind, record

log = logging.getLogger(__name__)

ATTEMPTS = 3  # tries per (step, tier) before the step is reported failed on that tier
OWNER_GRACE = 30.0  # seconds to wait for a commit once the trainer is gone
MARKER_TIMEOUT = 600.0  # seconds to wait for a step to be committed on its source tier
KEEP_RESULTS = 100  # outcomes remembered per tier (status shows failures among them)
FAILING_AFTER = 2.0  # seconds of requests failing with no success before a tier counts as failing
IDLE_EXIT = float(os.environ.get("TIERED_DCP_WRITER_IDLE_EXIT", "3600"))


class Abandoned(Exception):
    """The step will never be committed on its source tier, so it is not copied further."""


class Skipped(Exception):
    """The step left its source tier's keep window before its copy was done
    (``on_lagging_tier="skip"``): the copy is abandoned, a newer step goes in its place."""


def _throttle() -> float | None:
    mbps = os.environ.get("TIERED_DCP_WRITER_MBPS")
    return float(mbps) * 1e6 if mbps else None


def _no_progress() -> None:
    return None


def _each_after(chunks: Iterable[bytes], pause: Callable[[], None]) -> Iterator[bytes]:
    """``chunks``, each read only once ``pause`` has returned."""
    it = iter(chunks)
    while True:
        pause()
        raw = next(it, None)  # a chunk is bytes, never None
        if raw is None:
            return
        yield raw


def copy_part(
    src: TierView,
    dst: TierView,
    step: int,
    index: PartIndex,
    progress: Callable[[], None] = _no_progress,
    pause: Callable[[], None] = _no_progress,
) -> PartIndex:
    """Stream one part of ``step`` from ``src``'s own root to ``dst``'s; return its index there.

    Every chunk is verified as it is read and re-encoded for the target's codec; an item
    whose record points into another file lands in this part like the rest. ``progress``
    is called whenever a chunk is handed to the target, ``pause`` before each is read (the
    trainer's staging goes first: ``run_dir.StagingLock``).
    """
    enc = Encoder(dst.tier.compression)
    out_key = part_key(dst.config.namespace, step, index.rank)
    records = {}
    new_blocks = 0
    if dst.config.dedup:  # blocks the target holds are neither read nor written
        blocked = {k: r for k, r in index.records.items() if r.blocks is not None}
        if blocked:
            records, put = dedup.copy_items(src, dst, step, index.rank, blocked, pause)
            new_blocks = put.written_bytes
    rate = _throttle()
    started = time.monotonic()

    def chunks():
        offset, sent = 0, 0
        for key, rec in index.in_file_order():
            if key in records:
                continue  # stored as blocks
            lengths, codecs = [], []  # one chunk in memory at a time, however large the item
            for raw in _each_after(iter_raw_chunks(src.own, rec), pause):
                codecs.append(enc.choose(memoryview(raw), rec.info.dtype))
                stored = enc.encode_as(memoryview(raw), codecs[-1])
                lengths.append(memoryview(stored).nbytes)
                yield stored
                progress()
                sent += lengths[-1]
                if rate:  # a slow tier, but a healthy one: it shows progress while it waits
                    while (ahead := sent / rate - (time.monotonic() - started)) > 0:
                        time.sleep(min(ahead, 1.0))
                        progress()
            codec = codecs[0] if codecs else enc.codec
            mixed = any(c != codec for c in codecs)
            records[key] = dataclasses.replace(
                rec,
                file=out_key,
                offset=offset,
                codec=codec,
                stored=tuple(lengths),
                codecs=tuple(codecs) if mixed else None,
                blocks=None,
            )
            offset += records[key].length

    size = dst.own.write(out_key, chunks())
    return PartIndex(index.rank, size, records, written=size + new_blocks)


@dataclasses.dataclass
class Health:
    """The writer's view of one slower tier (its verdict published as ``run_dir.TierHealth``)."""

    state: TierState = TierState.HEALTHY
    since: float = dataclasses.field(default_factory=time.time)
    error: str | None = None
    writing: int | None = None  # the step a write to the tier is under way for
    progress: float = 0.0  # time.monotonic() of that write's last progress
    store: Storage | None = None  # the tier's store being written (it may see progress too)

    def last_progress(self) -> float:
        seen = self.store.activity() if self.store is not None else None
        return max(self.progress, seen or 0.0)


class Persister:
    """The writer process's main loop: one worker thread per slower tier with work queued.

    Built from what it was given (``open`` reads them from the run directory)."""

    def __init__(self, rd: RunDir, config: TieredConfig) -> None:
        self.rd = rd
        self.config = config
        self.threads: dict[int, threading.Thread] = {}
        self.owner_gone_since: float | None = None
        self.lock = threading.Lock()  # the queue: a tier thread taking a job vs the trimmer
        self.active: dict[int, Job] = {}  # tier -> the job its thread works on
        self.health: dict[int, Health] = {}

    @classmethod
    def open(cls, rd: RunDir) -> Persister:
        """The loop for ``rd``'s rank: its config read, a former writer's tier verdicts
        cleared (judged anew)."""
        persister = cls(rd, rd.read_config())
        rd.health.clear()
        return persister

    def owner_alive(self) -> bool:
        owner = self.rd.owner()
        alive = owner is not None and pid_alive(owner)
        if alive:
            self.owner_gone_since = None
        elif self.owner_gone_since is None:
            self.owner_gone_since = time.monotonic()
        return alive

    def run(self) -> None:
        idle_since = time.monotonic()
        while True:
            self.watch()
            jobs = self.rd.queue.jobs()
            for target in sorted({j.target for j in jobs}):
                t = self.threads.get(target)
                if t is None or not t.is_alive():
                    t = threading.Thread(target=self.tier_loop, args=(target,), daemon=True)
                    self.threads[target] = t
                    t.start()
            owner = self.owner_alive()
            gone = None if self.owner_gone_since is None else time.monotonic() - self.owner_gone_since
            if gone is not None and gone > self.config.writer_drain_timeout and jobs:
                self.give_up(gone)
                return
            if jobs or any(t.is_alive() for t in self.threads.values()):
                idle_since = time.monotonic()
            elif not owner or self.rd.writer.stop_requested() or time.monotonic() - idle_since > IDLE_EXIT:
                log.info(
                    "writer %s: queue empty and %s; exiting",
                    self.rd.path.name,
                    "trainer gone" if not owner else "done",
                )
                return
            time.sleep(POLL)  # a job queued now starts within 50 ms

    def tier_loop(self, target: int) -> None:
        while True:
            with self.lock:
                jobs = self.rd.queue.jobs(target)
                if not jobs:
                    self.active.pop(target, None)
                    direct_io.release_idle()  # nothing for this tier: its buffers' pages go back
                    return
                self.active[target] = jobs[0]
            self.process(jobs[0])

    # -- tier health ----------------------------------------------------------------------

    def judge(self, target: int, state: TierState, error: str | None = None) -> None:
        """Record (and publish, on a change) the health of ``target``."""
        h = self.health.setdefault(target, Health())
        if h.state == state and h.error == error:
            return
        if h.state != state:
            h.since = time.time()
            level = logging.INFO if state is TierState.HEALTHY else logging.WARNING
            log.log(
                level, "tier %s is %s%s", self.config.tiers[target].path, state, f": {error}" if error else ""
            )
        h.state, h.error = state, error
        self.rd.health.write(TierHealth(target, state, h.since, error))

    def writing(self, target: int, step: int | None, store: Storage | None = None) -> None:
        """A write to ``target`` starts (for ``step``) or ends (None)."""
        h = self.health.setdefault(target, Health())
        h.writing, h.store, h.progress = step, store, time.monotonic()

    def progressed(self, target: int) -> None:
        self.health[target].progress = time.monotonic()

    def watch(self) -> None:
        """Mark stalled the tiers whose write made no progress for ``tier_timeout``, failing
        those whose requests have failed for ``FAILING_AFTER`` seconds with no success (a
        bucket that is down, while its backend still retries), and keep only the newest
        waiting step queued for every tier that is not healthy."""
        bound = self.config.tier_timeout
        for target, h in list(self.health.items()):
            idle = time.monotonic() - h.last_progress()
            failing = h.store.failing() if h.store is not None else None
            if h.writing is not None and h.state is TierState.HEALTHY and idle > bound:
                why = f"writing step {h.writing} made no progress for {idle:.0f} s"
                self.judge(target, TierState.STALLED, why)
            elif h.writing is not None and h.state is TierState.HEALTHY and failing is not None:
                failed_for = time.monotonic() - failing[0]
                if failed_for > FAILING_AFTER:  # a bucket that is down, not one failing now and then
                    why = f"requests failing for {failed_for:.0f} s: {failing[1]}"
                    self.judge(target, TierState.FAILING, why)
            if h.state is not TierState.HEALTHY:
                self.trim(target)

    def trim(self, target: int) -> None:
        """Skip every step waiting for ``target`` but the newest (the one under way stays)."""
        with self.lock:
            active = self.active.get(target)
            waiting = [j for j in self.rd.queue.jobs(target) if active is None or j.step != active.step]
            for job in waiting[:-1]:
                h = self.health[target]
                why = f"skipped: tier {h.state} ({h.error}); step {waiting[-1].step} is queued in its place"
                self.finish(job, OutcomeState.SKIPPED, why)

    def give_up(self, gone: float) -> None:
        """The trainer is gone and the drain time is over: record every unwritten step."""
        why = (
            f"not written: the writer gave up {gone:.0f} s after its trainer exited "
            f"(writer_drain_timeout={self.config.writer_drain_timeout:g} s)"
        )
        with self.lock:
            jobs = self.rd.queue.jobs()
            for job in jobs:
                self.finish(job, OutcomeState.FAILED, why)
        log.error("%s; %d step(s) not persisted: %s", why, len(jobs), [(j.step, j.target) for j in jobs])

    def process(self, job: Job) -> None:
        started = time.monotonic()
        src = TierView(self.config, job.source, job.node, job.rank)
        dst = TierView(self.config, job.target, job.node, job.rank)
        timing: dict[str, float] = {}  # the copy's write_s and bytes, once it got that far
        state, error = OutcomeState.FAILED, None
        for attempt in range(1, ATTEMPTS + 1):
            try:
                state = self.persist(src, dst, job, timing)
                self.judge(job.target, TierState.HEALTHY)
                break
            except Abandoned as e:
                state, error = OutcomeState.FAILED, f"abandoned: {e}"
                break
            except Skipped as e:
                state, error = OutcomeState.SKIPPED, f"skipped: {e}"
                break
            except Exception as e:
                if self.left_window(src, job):
                    state, error = OutcomeState.SKIPPED, f"skipped: {self.why_skipped(src, job)}"
                    break
                log.warning("step %d to tier %s, attempt %d: %r", job.step, dst.tier.path, attempt, e)
                state, error = OutcomeState.FAILED, f"{type(e).__name__}: {e}"
                self.judge(job.target, TierState.FAILING, error)
                if classify(e) is PermanentStorageError:
                    break  # a full, read-only or forbidden tier: trying again changes nothing
                if attempt < ATTEMPTS:
                    time.sleep(0.5 * 4 ** (attempt - 1))
            finally:
                self.writing(job.target, None)
        seconds = round(time.monotonic() - started, 3)
        if state is OutcomeState.FAILED:
            log.error("step %d NOT written to tier %s: %s", job.step, dst.tier.path, error)
        else:
            log.info("step %d -> tier %s: %s in %.2f s", job.step, dst.tier.path, state, seconds)
        with self.lock:
            self.finish(job, state, error, seconds, timing, src)

    def finish(
        self,
        job: Job,
        state: OutcomeState,
        error: str | None,
        seconds: float = 0.0,
        timing: dict[str, float] | None = None,
        src: TierView | None = None,
    ) -> None:
        """Record what became of ``job``, unpin its step on the source tier, dequeue it.

        ``error`` is kept even when a later attempt succeeded (the outcome says what went
        wrong on the way); ``timing``: the copy's ``write_s`` and ``bytes``, when it got that far.
        """
        timing = timing or {}
        outcome = Outcome(
            step=job.step,
            target=job.target,
            rank=job.rank,
            state=state,
            error=error,
            seconds=seconds,
            write_s=timing.get("write_s"),
            bytes=None if timing.get("bytes") is None else int(timing["bytes"]),
            finished=time.time(),
        )
        if state is OutcomeState.SKIPPED:
            log.warning(
                "step %d NOT written to tier %s: %s",
                job.step,
                self.config.tiers[job.target].path,
                error,
            )
        self.rd.results.write(outcome)
        latency = round(outcome.finished - job.enqueued, 3)
        record(
            self.config,
            Kind.PERSIST,
            job.rank,
            job.step,
            tier=job.target,
            state=state.value,
            latency_s=latency,
            **timing,
        )
        self.rd.results.prune(job.target, KEEP_RESULTS)
        src = src or TierView(self.config, job.source, job.node, job.rank)
        try:
            src.own.delete(pin_key(self.config.namespace, job.step, job.rank, job.target))
            newest = max(src.committed(), default=job.step)
            # the source tier's retention skipped this step while pinned; with
            # on_lagging_tier="skip" it skipped nothing for a pin, and a retention here would
            # delete the spare part files the trainer's next save is about to stage into
            if newest > job.step and not part_file.drops_pinned(self.config, src.own):
                apply_retention(src, newest)
        except OSError as e:
            log.warning("could not unpin step %d on %s: %s", job.step, src.tier.path, e)
        self.rd.queue.remove(job)

    def wait_for_source(self, src: TierView, job: Job) -> StepCopy:
        """The step's commit on the tier its save wrote; raises Abandoned if it never comes."""
        while True:
            marker = src.read_marker(src.own, job.step)
            if marker is not None:
                return StepCopy(src.index, job.step, marker, src.own)
            if self.left_window(src, job):
                raise Skipped(self.why_skipped(src, job))
            if not src.own.list(step_dir(self.config.namespace, job.step)):
                raise Abandoned(f"step {job.step} is gone from tier {src.tier.path} (its save failed)")
            if any(s > job.step for s in src.committed()):
                raise Abandoned(
                    f"a newer step was committed on {src.tier.path} while step {job.step} never was"
                )
            self.owner_alive()
            if self.owner_gone_since is not None and time.monotonic() - self.owner_gone_since > OWNER_GRACE:
                raise Abandoned(f"the trainer died before step {job.step} was committed on {src.tier.path}")
            if time.time() - job.enqueued > MARKER_TIMEOUT:
                raise Abandoned(
                    f"step {job.step} was not committed on {src.tier.path} within {MARKER_TIMEOUT:.0f} s"
                )
            time.sleep(POLL)

    def left_window(self, src: TierView, job: Job) -> bool:
        """Whether the source's retention dropped the step while it was queued or copied
        (``part_file.drops_pinned``): no marker, a newer step committed there."""
        if not part_file.drops_pinned(self.config, src.own):
            return False
        if src.read_marker(src.own, job.step) is not None:
            return False
        return any(s > job.step for s in src.committed())

    def why_skipped(self, src: TierView, job: Job) -> str:
        return (
            f"step {job.step} left the keep window of tier {src.tier.path} (keep={src.tier.keep}) "
            "before its copy was done (on_lagging_tier='skip'); the newest step is copied instead"
        )

    def persist(
        self, src: TierView, dst: TierView, job: Job, timing: dict[str, float] | None = None
    ) -> OutcomeState:
        """Copy this rank's share of the step (its part and, on a node-local tier, the replicas
        its root took) to ``dst``; commit ``dst``'s root when the placement says it is whole.
        ``timing`` receives the copy's ``write_s`` and ``bytes`` (for ``timings``)."""
        copy = self.wait_for_source(src, job)
        ns, step = self.config.namespace, job.step
        self.writing(job.target, step, dst.own)  # from here on, a write that makes no progress stalls
        nodes = nodes_of(copy.marker)
        started, size = time.monotonic(), 0

        def progress() -> None:
            self.progressed(job.target)

        def pause() -> None:  # the trainer's copy first; a wait for it is progress too
            self.rd.writer.staging.wait(progress)

        for rank in dst.placement.parts_written_by(job.rank, nodes, Layout.of_marker(copy.marker)):
            limit = records_limit(copy.marker.metadata_size)
            index = src.indexes.get(src.own, ns, step, rank, limit)  # BadIndex: damaged (a name included)
            if index is None:
                raise FileNotFoundError(
                    f"step {step}: no readable index of rank {rank}'s part in {src.own.url}"
                    + ("" if copy.marker.has_indexes else " (a format 1/2 step the writer cannot copy)")
                )
            written = copy_part(src, dst, step, index, progress, pause)
            write_index(dst.own, ns, step, written)
            size += written.size
        if timing is not None:
            timing.update(write_s=round(time.monotonic() - started, 6), bytes=size)
        if not commit_copy(src, dst, copy):  # until the root's last writer
            return OutcomeState.CLEAN
        return OutcomeState.COMMITTED


def main(argv: list[str]) -> int:
    rd = RunDir(argv[0])
    os.umask(0o077)  # its lock, pid, log and outcomes: this user's alone
    lock = rd.writer.take_lock(attempts=40, poll=POLL)  # held for the process's lifetime
    if lock is None:
        return 0  # another writer already serves this rank
    handler = logging.handlers.RotatingFileHandler(rd.writer.log_path, maxBytes=1 << 20, backupCount=1)
    handler.setFormatter(logging.Formatter(f"%(asctime)s writer[{os.getpid()}] %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.raiseExceptions = False
    rd.writer.set_pid(os.getpid())
    with contextlib.suppress(OSError):
        os.nice(5)  # the trainer's own work comes first
    try:
        Persister.open(rd).run()
    finally:
        rd.writer.clear_pid()
        logging.shutdown()
    os._exit(0)  # a tier thread may still hang in a call to a dead tier: do not wait for it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
