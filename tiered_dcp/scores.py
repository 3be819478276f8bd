"""Save-time scores per rank: which rank's disk or network slows every save.

For each save and tier, each rank's write throughput (its part's bytes over the seconds it
took to write them, from the job's ``records``: the trainer's write to the fastest tier,
the writer process's copy to each slower one) is scored against the best rank of that save
(``relative``: 1.0 is the best rank, 0.4 writes at 0.4 of its speed) and against the rank's
own best on that tier so far (``individual``: below 1.0, the rank got slower than it was).
As in the straggler detector's scores: ranks write parts of about the same size, so a
rank that stays far below the others has a slow disk, a slow link or a busy node.

A rank below ``THRESHOLD`` for ``PATIENCE`` saves in a row on a tier is logged as a warning
by the lowest rank of its node (once, until it recovers), and ``tiered-dcp ls`` shows the
scores. Saves where even the slowest rank took under ``MIN_SECONDS`` are not scored: at
that size timing noise is all there is to see; nor are parts under ``MIN_SHARE`` of the
save's largest (a rank with little to write, e.g. replicated values only rank 0 writes),
whose fixed costs would pass for slowness. Scores cover the ranks whose records are on
this node (the runtime directory is node-local); on one node that is the whole job.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass

from .config import TieredConfig
from .records import read_records, records_dir

log = logging.getLogger("tiered_dcp")

THRESHOLD = 0.5  # relative score below which a save counts as slow
PATIENCE = 3  # slow saves in a row before a warning
MIN_SECONDS = 0.02  # a save whose slowest rank took less is not scored
MIN_SHARE = 0.25  # a part smaller than this share of the save's largest is not scored
TAIL_BYTES = 64 << 10  # how much of each rank's records the trainer's check reads
_warned: set[tuple[str, int, int]] = set()  # (job, tier, rank) flagged and not yet recovered
_checking = threading.Lock()  # one check at a time per process; a save never waits for one


@dataclass
class RankScore:
    """One rank on one tier: its newest scored save, and its streak of slow ones."""

    rank: int
    node: int
    tier: int
    step: int  # the newest scored save
    relative: float  # at that save: throughput / the best rank's
    individual: float  # at that save: throughput / the rank's own best on this tier
    saves: int  # saves scored on this tier
    slow_streak: int  # newest saves in a row with relative < threshold
    worst: float  # the lowest relative score over the scored saves


def _writes(recs: list[dict]) -> dict[tuple[int, int], dict[int, dict]]:
    """(tier, step) -> rank -> the record of that rank's write of its part."""
    out: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for r in recs:
        if (
            r.get("kind") in ("save", "persist")
            and r.get("write_s") is not None
            and r.get("state") != "failed"
        ):
            out[(r["tier"], r["step"])][r["rank"]] = r
    return out


def score_ranks(recs: list[dict], threshold: float = THRESHOLD) -> list[RankScore]:
    """Every rank's scores per tier from these records (``records.read_records``)."""
    best_own: dict[tuple[int, int], float] = {}
    scores: dict[tuple[int, int], RankScore] = {}
    for (tier, step), ranks in sorted(_writes(recs).items(), key=lambda kv: (kv[0][0], kv[0][1])):
        largest = max(r.get("bytes", 0) for r in ranks.values())
        ranks = {k: r for k, r in ranks.items() if r.get("bytes", 0) >= largest * MIN_SHARE and largest > 0}
        if len(ranks) < 2 or max(r["write_s"] for r in ranks.values()) < MIN_SECONDS:
            continue
        speed = {rank: r["bytes"] / max(r["write_s"], 1e-6) for rank, r in ranks.items()}
        best = max(speed.values())
        for rank, s in speed.items():
            own = best_own[(tier, rank)] = max(best_own.get((tier, rank), 0.0), s)
            rel = s / best
            prev = scores.get((tier, rank))
            streak = (prev.slow_streak if prev else 0) + 1 if rel < threshold else 0
            scores[(tier, rank)] = RankScore(
                rank=rank,
                node=ranks[rank].get("node", 0),
                tier=tier,
                step=step,
                relative=round(rel, 3),
                individual=round(s / own, 3),
                saves=(prev.saves if prev else 0) + 1,
                slow_streak=streak,
                worst=round(min(rel, prev.worst if prev else 1.0), 3),
            )
    return [scores[k] for k in sorted(scores)]


def job_scores(
    config: TieredConfig, threshold: float = THRESHOLD, tail_bytes: int | None = None
) -> list[RankScore]:
    """The scores of this job's ranks whose records are on this node."""
    return score_ranks(read_records(config, tail_bytes=tail_bytes), threshold)


def slow_ranks(
    config: TieredConfig,
    threshold: float = THRESHOLD,
    patience: int = PATIENCE,
    tail_bytes: int | None = None,
) -> list[RankScore]:
    """The ranks below ``threshold`` for ``patience`` saves in a row on some tier."""
    return [s for s in job_scores(config, threshold, tail_bytes) if s.slow_streak >= patience]


def watch_soon(config: TieredConfig, rank: int) -> None:
    """``watch`` in a thread of its own, skipped while the previous one still runs: reading
    every rank's records must not lengthen a save."""
    if _checking.acquire(blocking=False):

        def run() -> None:
            try:
                watch(config, rank)
            finally:
                _checking.release()

        threading.Thread(target=run, daemon=True, name="tiered-dcp-scores").start()


def watch(config: TieredConfig, rank: int) -> list[RankScore]:
    """After a save: the node's lowest rank warns about ranks that stay slow (once each).

    Returns the ranks flagged now. Never raises: a check must not fail a save.
    """
    try:
        ranks = sorted(int(p.name[5:10]) for p in records_dir(config).glob("rank_*.jsonl"))
        if not ranks or rank != ranks[0]:
            return []
        flagged = slow_ranks(config, tail_bytes=TAIL_BYTES)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.debug("save-time scores not checked: %s", e)
        return []
    job = config.namespace
    now = {(job, s.tier, s.rank) for s in flagged}
    for s in flagged:
        if (job, s.tier, s.rank) not in _warned:
            log.warning(
                "rank %d on node %d writes to tier %d (%s) at %.2f of the best rank (%d saves in a row "
                "below %.2f; at %.2f of its own best): check its disk or network",
                s.rank,
                s.node,
                s.tier,
                config.tiers[s.tier].path if s.tier < len(config.tiers) else "?",
                s.relative,
                s.slow_streak,
                THRESHOLD,
                s.individual,
            )
    _warned.difference_update({k for k in _warned if k[0] == job} - now)
    _warned.update(now)
    return flagged
