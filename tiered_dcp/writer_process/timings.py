"""The job's measured costs: one JSON line per save, copy and load, per rank, on this node.

The trainer (``TieredWriter``: stall, part write, commit), the writer process (``persist``:
the copy to each slower tier) and ``TieredReader`` (a load's duration and the tiers it read)
each append one line to their rank's file, so that ``goodput --from-job`` and the save-time
scores (``scores``) work from what a real run measured::

    <job_dir>/records/rank_<rank>.jsonl      (rotated to .1 past 1 MiB)

Lines (every one has ``kind``, ``rank``, ``node``, ``step``, ``time``):

- ``save``: ``tier`` (the fastest tier taking the step), ``bytes`` (this rank's part),
  ``call_s`` (the ``dcp.async_save`` call as the training loop saw it, ``SaveCall``; absent
  for a sync save), ``call_wait_s`` (of it, waits for a writer that fell behind), ``stage_s``
  (of it, the copy itself; absent for a sync save), ``slot_wait_s``
  (the staging's wait for a staging slot that earlier saves still held: saves coming faster
  than the host side commits them wait there, their memory bounded), ``write_s`` (the
  part written to that tier), ``commit_s`` (``write_data`` to the step's commit there, or to
  the part being written on a shared tier), ``handoff_s`` (waits for a writer that fell behind),
  ``sent`` (bytes sent to clique peers for their replicas: part files and the blocks they lacked),
  ``staged`` (the host memory the trainer's staging buffers held once the step was staged:
  0 when it staged into the RAM tier's part file, which the tier's figure counts),
  ``every`` and ``keep`` (each tier's schedule, fastest first: what ``goodput`` assumes
  when it is given the tiers' paths alone);
- ``persist``: ``tier`` (the slower tier), ``bytes``, ``write_s`` (this rank's parts copied),
  ``latency_s`` (from the save's hand-off to the outcome), ``state``;
- ``load``: ``tiers`` (read from), ``seconds`` (reader constructed to last item read),
  ``open_s`` (of which choosing the step: with a process group, the ranks' agreement),
  ``read_own`` / ``read_peer`` / ``read_shared`` (the stored bytes of the items this rank
  read from its own roots, received from other ranks, read from shared tiers: a bucket's
  bytes over the job are the sum of ``read_shared``);
- ``replicas``: one line per item whose data-parallel replicas disagreed at a save, written
  by the save's coordinator (``rank``, ``node`` are its): ``item`` (its fqn), ``holders``
  (the ranks holding a copy), ``odd`` (the ranks whose copy was the odd one out; with two
  copies, both) and ``odd_nodes`` (their nodes). ``scores.suspects`` reads them.

Lines are read back as ``TimingRecord`` (``read_records``), the one reader of their JSON:
``scores`` and ``goodput`` use its attributes. A line that is not a well-formed record (cut
by a crash, from a version that wrote another kind) is skipped.

A save's line is written once both its halves are in (``SaveCall``): ``write_data``'s
figures, on DCP's upload thread, and the end of the ``async_save`` call, on the loop's.

Recording never fails a save or a load: an unwritable directory is logged once and ignored.
The directory lives with the writer processes' runtime dirs (``run_dir.job_dir``), outside
the ``rank_*`` dirs that ``shutdown`` tidies up. Appends are single ``write`` calls of one
short line, so the trainer and its writer process can append to one file at once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import StrEnum, TieredConfig, node_of
from .private_dir import mkdir_private
from .run_dir import is_int, is_number, is_str, job_dir, one_of, optional, valid_record

log = logging.getLogger(__name__)

ROTATE_BYTES = 1 << 20
_warned = False


class Kind(StrEnum):
    """What a line measured (its ``kind``)."""

    SAVE = "save"  # the trainer's save of a step to its fastest tier
    PERSIST = "persist"  # the writer process's copy of it to a slower tier
    LOAD = "load"
    REPLICAS = "replicas"  # an item whose replicas disagreed at a save (the coordinator's line)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def _at_least_1(n: Any) -> bool:
    return is_int(n) and n >= 1


@dataclass(frozen=True)
class TimingRecord:
    """One line: what every line has, then the fields of its kind (None where absent)."""

    kind: Kind
    rank: int
    node: int
    step: int
    time: float  # time.time() when it was recorded
    tier: int | None = None  # save: the fastest tier taking the step; persist: the slower tier
    bytes: int | None = None  # this rank's part(s)
    write_s: float | None = None
    call_s: float | None = None  # save: the async_save call as the loop saw it (absent: a sync save)
    call_wait_s: float | None = None  # save: of call_s, the waits for a writer that fell behind
    stage_s: float | None = None  # save: of call_s, the copy (absent: a sync save)
    slot_wait_s: float | None = None  # save: the staging's wait for a slot earlier saves held
    commit_s: float | None = None  # save
    handoff_s: float | None = None  # save: waits for a writer that fell behind
    sent: int | None = None  # save: bytes sent to clique peers
    staged: int | None = None  # save: bytes in the trainer's staging buffers
    latency_s: float | None = None  # persist: hand-off to outcome
    state: str | None = None  # persist: the outcome's state (``run_dir.OutcomeState``'s strings)
    tiers: tuple[int, ...] | None = None  # load: the tiers read from
    seconds: float | None = None  # load: reader constructed to last item read
    open_s: float | None = None  # load: of ``seconds``, choosing the step (the agreement)
    read_own: int | None = None  # load: bytes from this rank's own roots
    read_peer: int | None = None  # load: bytes from other ranks (peer exchange, spread)
    read_shared: int | None = None  # load: bytes from shared tiers
    every: tuple[int, ...] | None = None  # save: each tier's every=, fastest first
    keep: tuple[int | None, ...] | None = None  # save: each tier's keep= (None: all)
    item: str | None = None  # replicas: the item whose copies differed
    holders: tuple[int, ...] | None = None  # replicas: the ranks holding a copy
    odd: tuple[int, ...] | None = None  # replicas: the ranks whose copy was odd (two copies: both)
    odd_nodes: tuple[int, ...] | None = None  # replicas: their nodes

    _CHECKS = {
        "kind": one_of(Kind),
        "rank": is_int,
        "node": is_int,
        "step": is_int,
        "time": is_number,
        "tier": optional(is_int),
        "bytes": optional(is_int),
        "write_s": optional(is_number),
        "call_s": optional(is_number),
        "call_wait_s": optional(is_number),
        "stage_s": optional(is_number),
        "slot_wait_s": optional(is_number),
        "commit_s": optional(is_number),
        "handoff_s": optional(is_number),
        "sent": optional(is_int),
        "staged": optional(is_int),
        "latency_s": optional(is_number),
        "state": optional(is_str),
        "tiers": optional(_ints),
        "seconds": optional(is_number),
        "open_s": optional(is_number),
        "read_own": optional(is_int),
        "read_peer": optional(is_int),
        "read_shared": optional(is_int),
        "every": optional(lambda v: isinstance(v, list) and all(map(_at_least_1, v))),
        "keep": optional(lambda v: isinstance(v, list) and all(n is None or _at_least_1(n) for n in v)),
        "item": optional(is_str),
        "holders": optional(_ints),
        "odd": optional(_ints),
        "odd_nodes": optional(_ints),
    }

    @classmethod
    def from_dict(cls, d: Any) -> TimingRecord | None:
        """The record one line holds; None if it is not one (keys it does not know are ignored)."""
        if not valid_record(d, cls._CHECKS, {"kind", "rank", "node", "step", "time"}):
            return None
        known = {k: d[k] for k in cls._CHECKS if k in d}
        known["kind"] = Kind(d["kind"])
        for key in ("tiers", "every", "keep", "holders", "odd", "odd_nodes"):
            if known.get(key) is not None:
                known[key] = tuple(known[key])
        return cls(**known)


def records_dir(config: TieredConfig) -> Path:
    return job_dir(config) / "records"


def record(
    config: TieredConfig, kind: Kind, rank: int, step: int, *, at: float | None = None, **fields: Any
) -> None:
    """Append one measurement for ``rank`` (best effort: never raises).

    ``fields``: the optional fields of ``TimingRecord`` that ``kind`` has, written in the
    order given (the line is the JSON of a plain dict, as it always was); a save's line
    also has the tiers' schedule. ``at``: its ``time`` (default: now).
    """
    global _warned
    line = {
        "kind": str(kind),
        "rank": rank,
        "node": node_of(rank),
        "step": step,
        "time": time.time() if at is None else at,
        **fields,
    }
    if kind is Kind.SAVE:
        line.update(every=[t.every for t in config.tiers], keep=[t.keep for t in config.tiers])
    path = records_dir(config) / f"rank_{rank:05d}.jsonl"
    try:
        mkdir_private(path.parent)  # the runtime directory's rule: 0700, files 0600
        try:
            if path.stat().st_size > ROTATE_BYTES:
                os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        if not _warned:
            _warned = True
            log.warning("cannot record save/load timings in %s: %s", path.parent, e)


class SaveCall:
    """The ``dcp.async_save`` call as the training loop sees it, timed from inside the
    library (``TieredWriter``), and the save's line, written once both halves are in.

    It starts at the entry of ``TieredWriter.stage``, DCP's first call into the writer:
    before it, ``async_save`` has only checked its arguments and called ``state_dict()`` on
    the ``Stateful`` values of the state. It ends where DCP's last call on the loop's
    thread is: ``synchronize_staging``, which ``async_save`` calls after it has handed the
    staged copy to its upload (in THREAD mode a new thread, whose start the loop waits for,
    and which then takes the GIL from it): all of the call but DCP's ``return``. Where DCP
    makes no such call, or its upload runs elsewhere, the call ends at ``stage``'s return
    (``staged(..., hooked=False)``): with ``background_staging`` (a future is returned), in
    DCP's PROCESS mode (the writer is pickled after ``stage``), and for a ``stage`` called
    outside ``async_save``. The waits for a writer that fell behind inside the call are
    ``wait_s`` (``goodput`` gives them to the slower tiers).
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.wait_s = 0.0
        self._shipped = False  # a copy in DCP's process: its end is the trainer's
        self._lock = threading.Lock()
        self._line: tuple[TieredConfig, int, int, float, dict[str, Any]] | None = None

    def staged(self, wait_s: float, hooked: bool) -> None:
        """At ``stage``'s return: the waits in it; the end, unless DCP's hook is to come."""
        self.wait_s = wait_s
        if not hooked:
            self.end()

    def end(self) -> None:
        """The call's end (once); the save's line, if ``write_data`` gave it already."""
        with self._lock:
            if self.seconds is None:
                self.seconds = time.perf_counter() - self.started
            line, self._line = self._line, None
        if line is not None:
            self._write(*line)

    def record(self, config: TieredConfig, rank: int, step: int, fields: dict[str, Any]) -> None:
        """``write_data``'s figures: written now if the call has ended, else at its end."""
        at = time.time()
        with self._lock:
            if self.seconds is None and not self._shipped:
                self._line = (config, rank, step, at, fields)
                return
        self._write(config, rank, step, at, fields)

    def _write(self, config: TieredConfig, rank: int, step: int, at: float, fields: dict[str, Any]) -> None:
        call = {}
        if self.seconds is not None:
            call = {"call_s": round(self.seconds, 6), "call_wait_s": round(self.wait_s, 6)}
        record(config, Kind.SAVE, rank, step, at=at, **call, **fields)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its writer (DCP's PROCESS mode, after ``stage``: the call has ended)."""
        return {"started": self.started, "seconds": self.seconds, "wait_s": self.wait_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _shipped=True, _lock=threading.Lock(), _line=None)


def record_save(
    config: TieredConfig, rank: int, step: int, fields: dict[str, Any], call: SaveCall | None
) -> None:
    """A save's line: at once for a sync save, else once its ``async_save`` call has ended."""
    if call is None:
        record(config, Kind.SAVE, rank, step, **fields)
    else:
        call.record(config, rank, step, fields)


def _read(path: Path, tail_bytes: int | None) -> str:
    with open(path, "rb") as f:
        if tail_bytes is not None:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
        return f.read().decode(errors="replace")


def read_records(
    config: TieredConfig, kind: Kind | None = None, tail_bytes: int | None = None
) -> list[TimingRecord]:
    """The recorded lines of the job on this node (all ranks), oldest first.

    ``tail_bytes``: only the newest lines of each rank's file (its rotated half not read).
    """
    out: list[TimingRecord] = []
    rdir = records_dir(config)
    if not rdir.is_dir():
        return out
    paths = sorted(rdir.glob("rank_*.jsonl" if tail_bytes is not None else "rank_*.jsonl*"))
    for path in paths:
        try:
            text = _read(path, tail_bytes)
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = TimingRecord.from_dict(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash
            if rec is not None and (kind is None or rec.kind == kind):
                out.append(rec)
    out.sort(key=lambda r: r.time)
    return out
