"""A step's commit marker: built here, and only here, for the save path and the writer process.

The marker is what makes a step exist in a root (``format.Marker``): written last, after
the metadata and every part it names. Two builders:

- ``build_commit``: the save path's, from the records every rank wrote (their sizes, the
  items saved holding NaN/Inf), with the metadata blob it names;
- ``copied_marker``: the writer process's, for a root it copied a step into, once the
  rule the tier's placement names (``Placement.copy_commit``) says the copy there is whole.

Torch-free at import (the writer process uses ``copied_marker``); ``build_commit`` imports
the torch side of the format when a save calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import (
    NONFINITE_NAMES,
    Marker,
    PartInfo,
    index_key,
    marker_key,
    part_key,
    step_dir,
)

from .catalog import StepCopy, TierView
from .placement import CopyCommit

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .cliques import Layout
    from .metadata import Records

log = logging.getLogger("tiered_dcp")


def build_commit(
    view: TierView, step: int, metadata: Metadata, world: list[int], records: Records, layout: Layout
) -> tuple[bytes, Marker]:
    """The metadata blob (every rank's items) and the marker naming it, for every root.

    The marker records the save's clique ``layout``: loads, the writer process and ``ls``
    find every copy of a part by it, whatever their own config says.

    Items saved holding NaN/Inf (``on_nonfinite="mark"``) are counted and named in the
    marker, so that loads pass the step over; the committer says so once for the job."""
    from .metadata import build_blob  # torch: the save path only

    blob = build_blob(metadata, records)
    sizes = [0] * len(world)
    for rec in records.values():
        sizes[rec.info.rank] += rec.part_length
    cfg = view.config
    bad = sorted(f"{index.fqn}" for index, rec in records.items() if rec.info.nonfinite)
    marker = Marker(
        step,
        cfg.namespace,
        len(world),
        [PartInfo(r, n, sizes[r]) for r, n in enumerate(world)],
        len(blob),
        checksum(blob),
        **layout.marker_fields(),
        nonfinite_items=len(bad),
        nonfinite=bad[:NONFINITE_NAMES],
    )
    if bad:
        log.warning(
            "step %d holds NaN/Inf in %d item(s) %s: saved and marked non-finite; load_latest and "
            "TieredReader(config) pass it over (TieredReader(config, step=%d) loads it anyway)",
            step,
            len(bad),
            bad[:NONFINITE_NAMES],
            step,
        )
    return blob, marker


def copied_marker(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
    """The marker that commits ``dst``'s own root once a writer has copied everything it
    should hold from ``src``; None while something is missing (a later writer commits)."""
    return _COPY_COMMITS[dst.placement.copy_commit](src, dst, copy)


def _every_index(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
    """Every rank's index is in the root: this writer was the last; the sizes are this tier's.

    Learnt from one listing of the step's directory (names and sizes; an index is written
    after its part, so a listed index means its part is whole at the listed size), read
    page by page in name order and given up at the first page that shows a rank's index
    missing: a writer that is not the last usually stops after one page, the last one
    reads ceil(2N / 1000) pages. No index is read, and nothing is polled.
    """
    ns, step = dst.config.namespace, copy.step
    index, part = (lambda r: _name(index_key(ns, step, r))), (lambda r: _name(part_key(ns, step, r)))
    ranks = sorted((p.rank for p in copy.marker.parts), key=index)  # as the listing orders them
    listed: dict[str, int] = {}
    seen = 0
    for page in dst.own.list_pages(step_dir(ns, step)):
        listed.update(page)
        last = max(page, default="")
        while seen < len(ranks) and index(ranks[seen]) <= last:
            if index(ranks[seen]) not in listed:
                return None  # that rank's writer is not done: it (or a later one) commits
            seen += 1
    if any(index(r) not in listed or part(r) not in listed for r in ranks):
        return None
    # Writers finishing together may all see every index: one that finds this save
    # committed already leaves the commit (and its retention) to the writer that did it.
    if _name(marker_key(ns, step)) in listed:
        done = dst.read_marker(dst.own, step)
        if done is not None and done.metadata_xxh3 == copy.marker.metadata_xxh3:
            return None
    parts = [PartInfo(p.rank, p.node, listed[part(p.rank)]) for p in copy.marker.parts]
    return dataclasses.replace(copy.marker, parts=parts, created=time.time())


def _source_parts(src: TierView, dst: TierView, copy: StepCopy) -> Marker | None:
    """The root holds an index of every part its source root holds whole; the metadata and
    marker are the source's, as on every node. Whichever of its writers is last commits."""
    ns, step = dst.config.namespace, copy.step
    held = [p.rank for p in copy.marker.parts if src.part_present(src.own, copy.marker, p.rank)]
    if not all(dst.own.exists(index_key(ns, step, rank)) for rank in held):
        return None
    return dataclasses.replace(copy.marker, created=time.time())


_COPY_COMMITS: dict[CopyCommit, Callable[[TierView, TierView, StepCopy], Marker | None]] = {
    CopyCommit.EVERY_INDEX: _every_index,
    CopyCommit.SOURCE_PARTS: _source_parts,
}


def _name(key: str) -> str:
    """The last component of a key: the name a listing of its directory gives."""
    return key.rsplit("/", 1)[1]
