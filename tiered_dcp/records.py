"""The job's measured costs: one JSON line per save, copy and load, per rank, on this node.

The trainer (``TieredWriter``: stall, part write, commit), the writer process (``persist``:
the copy to each slower tier) and ``TieredReader`` (a load's duration and the tiers it read)
each append one line to their rank's file, so that ``goodput --from-job`` and the save-time
scores (``scores``) work from what a real run measured::

    <job_dir>/records/rank_<rank>.jsonl      (rotated to .1 past 1 MiB)

Lines (every one has ``kind``, ``rank``, ``node``, ``step``, ``time``):

- ``save``: ``tier`` (the fastest tier taking the step), ``bytes`` (this rank's part),
  ``stage_s`` (the copy ``async_save`` waits for; absent for a sync save), ``write_s`` (the
  part written to that tier), ``commit_s`` (``write_data`` to the step's commit there, or to
  the part being written on a shared tier), ``handoff_s`` (waits for a writer that fell behind),
  ``sent`` (bytes sent to clique peers for their replicas: part files and the blocks they lacked);
- ``persist``: ``tier`` (the slower tier), ``bytes``, ``write_s`` (this rank's parts copied),
  ``latency_s`` (from the save's hand-off to the outcome), ``state``;
- ``load``: ``tiers`` (read from), ``seconds`` (reader constructed to last item read).

Recording never fails a save or a load: an unwritable directory is logged once and ignored.
The directory lives with the writer processes' runtime dirs (``rundir.job_dir``), outside
the ``rank_*`` dirs that ``shutdown`` tidies up. Appends are single ``write`` calls of one
short line, so the trainer and its writer process can append to one file at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .config import TieredConfig, node_of
from .private_dir import mkdir_private
from .rundir import job_dir

log = logging.getLogger("tiered_dcp")

ROTATE_BYTES = 1 << 20
_warned = False


def records_dir(config: TieredConfig) -> Path:
    return job_dir(config) / "records"


def record(config: TieredConfig, kind: str, rank: int, step: int, **fields: Any) -> None:
    """Append one measurement for ``rank`` (best effort: never raises)."""
    global _warned
    line = {"kind": kind, "rank": rank, "node": node_of(rank), "step": step, "time": time.time(), **fields}
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


def _read(path: Path, tail_bytes: int | None) -> str:
    with open(path, "rb") as f:
        if tail_bytes is not None:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
        return f.read().decode(errors="replace")


def read_records(
    config: TieredConfig, kind: str | None = None, tail_bytes: int | None = None
) -> list[dict[str, Any]]:
    """The recorded lines of the job on this node (all ranks), oldest first.

    ``tail_bytes``: only the newest lines of each rank's file (its rotated half not read).
    """
    out: list[dict[str, Any]] = []
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
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(rec, dict) and (kind is None or rec.get("kind") == kind):
                out.append(rec)
    out.sort(key=lambda r: r.get("time", 0))
    return out
