"""The writer process: copies committed steps from their fast tier down to the slower tiers.

One per rank, started by the trainer on first use (``runtime.WriterHandle``) and reused by
every later save. For each queued (step, tier) it waits until the step is committed on the
tier the save wrote (its source), streams this rank's part from there (every chunk
verified, recompressed when the tiers differ), writes it under a dirty name, renames it
clean and writes this rank's index next to it. Whichever rank's writer finds the target
root holding everything it should (``placement``) commits the step there (``TierView.commit``:
metadata, marker, retention): no collective with the trainers, which may be busy or dead.

It outlives its trainer: once the trainer is gone it finishes what it was handed, then
exits. Run as ``python -m tiered_dcp.persist RUNDIR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import logging.handlers
import os
import pickle
import sys
import threading
import time
from pathlib import Path

from tiered_dcp.storage.codec import Encoder, iter_raw_chunks
from tiered_dcp.storage.errors import PermanentStorageError, classify
from tiered_dcp.storage.format import PartIndex, part_key, pin_key, step_dir, write_index

from .catalog import StepCopy, TierView, read_metadata_blob
from .config import TieredConfig
from .placement import nodes_of
from .records import record
from .runtime import POLL, Job, job_name, pid_alive, queued, write_json

log = logging.getLogger("tiered_dcp.writer")

ATTEMPTS = 3  # tries per (step, tier) before the step is reported failed on that tier
OWNER_GRACE = 30.0  # seconds to wait for a commit once the trainer is gone
MARKER_TIMEOUT = 600.0  # seconds to wait for a step to be committed on its source tier
KEEP_RESULTS = 100  # outcomes remembered per tier (status shows failures among them)
IDLE_EXIT = float(os.environ.get("TIERED_DCP_WRITER_IDLE_EXIT", "3600"))


class Abandoned(Exception):
    """The step will never be committed on its source tier, so it is not copied further."""


def _throttle() -> float | None:
    mbps = os.environ.get("TIERED_DCP_WRITER_MBPS")
    return float(mbps) * 1e6 if mbps else None


def copy_part(src: TierView, dst: TierView, step: int, index: PartIndex) -> PartIndex:
    """Stream one part of ``step`` from ``src``'s own root to ``dst``'s; return its index there.

    Every chunk is verified as it is read and re-encoded for the target's codec; an item
    whose record points into another file lands in this part like the rest.
    """
    enc = Encoder(dst.tier.compression)
    out_key = part_key(dst.config.namespace, step, index.rank)
    records = {}
    rate = _throttle()
    started = time.monotonic()

    def chunks():
        offset, sent = 0, 0
        for key, rec in index.in_file_order():
            meta = []  # one chunk in memory at a time, however large the item
            for raw, (_, n, h) in zip(iter_raw_chunks(src.own, rec), rec.chunks, strict=True):
                stored = enc.encode(memoryview(raw))
                meta.append((memoryview(stored).nbytes, n, h))
                yield stored
                sent += meta[-1][0]
                if rate:
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            records[key] = dataclasses.replace(
                rec, file=out_key, offset=offset, codec=enc.codec, chunks=tuple(meta)
            )
            offset += records[key].length

    size = dst.own.write(out_key, chunks())
    return PartIndex(index.rank, size, records)


def prune_results(rdir: Path, target: int, keep: int = KEEP_RESULTS) -> None:
    """Forget all but the newest ``keep`` outcomes of a tier, so the directory stays small."""
    names = sorted(rdir.glob(f"t{target:02d}_s*.json"))
    for old in names[:-keep]:
        old.unlink(missing_ok=True)


class Persister:
    """The writer process's main loop: one worker thread per slower tier with work queued."""

    def __init__(self, rd: Path) -> None:
        self.rd = rd
        self.config: TieredConfig = pickle.loads((rd / "config.pkl").read_bytes())
        self.threads: dict[int, threading.Thread] = {}
        self.owner_gone_since: float | None = None

    def owner_alive(self) -> bool:
        try:
            alive = pid_alive(int((self.rd / "owner").read_text()))
        except (OSError, ValueError):
            alive = False
        if alive:
            self.owner_gone_since = None
        elif self.owner_gone_since is None:
            self.owner_gone_since = time.monotonic()
        return alive

    def run(self) -> None:
        idle_since = time.monotonic()
        while True:
            jobs = queued(self.rd)
            for target in sorted({j.target for j in jobs}):
                t = self.threads.get(target)
                if t is None or not t.is_alive():
                    t = threading.Thread(target=self.tier_loop, args=(target,), daemon=True)
                    self.threads[target] = t
                    t.start()
            owner = self.owner_alive()
            if jobs or any(t.is_alive() for t in self.threads.values()):
                idle_since = time.monotonic()
            elif not owner or (self.rd / "stop").exists() or time.monotonic() - idle_since > IDLE_EXIT:
                log.info(
                    "writer %s: queue empty and %s; exiting",
                    self.rd.name,
                    "trainer gone" if not owner else "done",
                )
                return
            time.sleep(POLL)  # a job queued now starts within 50 ms

    def tier_loop(self, target: int) -> None:
        while True:
            jobs = queued(self.rd, target)
            if not jobs:
                return
            self.process(jobs[0])

    def process(self, job: Job) -> None:
        started = time.monotonic()
        src = TierView(self.config, job.source, job.node, job.rank)
        dst = TierView(self.config, job.target, job.node, job.rank)
        result = {"step": job.step, "target": job.target, "rank": job.rank}
        for attempt in range(1, ATTEMPTS + 1):
            try:
                result["state"] = self.persist(src, dst, job, result)
                break
            except Abandoned as e:
                result.update(state="failed", error=f"abandoned: {e}")
                break
            except Exception as e:
                log.warning("step %d to tier %s, attempt %d: %r", job.step, dst.tier.path, attempt, e)
                result.update(state="failed", error=f"{type(e).__name__}: {e}")
                if classify(e) is PermanentStorageError:
                    break  # a full, read-only or forbidden tier: trying again changes nothing
                if attempt < ATTEMPTS:
                    time.sleep(0.5 * 4 ** (attempt - 1))
        result["seconds"] = round(time.monotonic() - started, 3)
        result["finished"] = time.time()
        if result["state"] == "failed":
            log.error("step %d NOT written to tier %s: %s", job.step, dst.tier.path, result["error"])
        else:
            log.info(
                "step %d -> tier %s: %s in %.2f s",
                job.step,
                dst.tier.path,
                result["state"],
                result["seconds"],
            )
        write_json(self.rd / "results" / job_name(job.target, job.step), result)
        timing = {k: result[k] for k in ("write_s", "bytes") if k in result}
        latency = round(result["finished"] - job.enqueued, 3)
        record(
            self.config,
            "persist",
            job.rank,
            job.step,
            tier=job.target,
            state=result["state"],
            latency_s=latency,
            **timing,
        )
        prune_results(self.rd / "results", job.target)
        try:
            src.own.delete(pin_key(self.config.namespace, job.step, job.rank, job.target))
            newest = max(src.committed(), default=job.step)
            if newest > job.step:  # the source tier's retention skipped this step while pinned
                src.apply_retention(newest)
        except OSError as e:
            log.warning("could not unpin step %d on %s: %s", job.step, src.tier.path, e)
        (self.rd / "queue" / job_name(job.target, job.step)).unlink(missing_ok=True)

    def wait_for_source(self, src: TierView, job: Job) -> StepCopy:
        """The step's commit on the tier its save wrote; raises Abandoned if it never comes."""
        while True:
            marker = src.read_marker(src.own, job.step)
            if marker is not None:
                return StepCopy(src.index, job.step, marker, src.own)
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

    def persist(self, src: TierView, dst: TierView, job: Job, timing: dict | None = None) -> str:
        """Copy this rank's share of the step (its part and, on a node-local tier, the replicas
        its root took) to ``dst``; commit ``dst``'s root when the placement says it is whole.
        ``timing`` receives the copy's ``write_s`` and ``bytes`` (for ``records``)."""
        copy = self.wait_for_source(src, job)
        ns, step = self.config.namespace, job.step
        nodes = nodes_of(copy.marker)
        started, size = time.monotonic(), 0
        for rank in dst.placement.parts_written_by(job.rank, nodes, copy.marker.replication):
            index = src.part_index(src.own, copy.marker, rank)
            if index is None:
                raise FileNotFoundError(
                    f"step {step}: no readable index of rank {rank}'s part in {src.own.url}"
                    + ("" if copy.marker.has_indexes else " (a format 1/2 step the writer cannot copy)")
                )
            written = copy_part(src, dst, step, index)
            write_index(dst.own, ns, step, written)
            size += written.size
        if timing is not None:
            timing.update(write_s=round(time.monotonic() - started, 6), bytes=size)
        marker = dst.placement.copied_marker(src, dst, copy)  # None until the root's last writer
        if marker is None:
            return "clean"
        dst.commit(step, read_metadata_blob(copy), marker)
        return "committed"


def main(argv: list[str]) -> int:
    rd = Path(argv[0])
    lock = open(rd / "writer.lock", "a+")  # noqa: SIM115 - held for the process's lifetime
    for _ in range(40):  # a trainer probing the lock holds it for an instant
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(POLL)
    else:
        return 0  # another writer already serves this rank
    handler = logging.handlers.RotatingFileHandler(rd / "writer.log", maxBytes=1 << 20, backupCount=1)
    handler.setFormatter(logging.Formatter(f"%(asctime)s writer[{os.getpid()}] %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.raiseExceptions = False
    (rd / "writer.pid").write_text(str(os.getpid()))
    with contextlib.suppress(OSError):
        os.nice(5)  # the trainer's own work comes first
    try:
        Persister(rd).run()
    finally:
        (rd / "writer.pid").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
