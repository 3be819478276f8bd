"""Save-time scores per rank: which rank's disk or network slows every save.

For each save and tier, each rank's write of its part (its bytes over the seconds it took,
from the job's ``records``: the trainer's write to the fastest tier, the writer process's
copy to each slower one) is compared with its peers': the median throughput of the other
ranks of that save. Per save that gives the rank's ``relative`` speed (1.0: as fast as the
typical rank) and its ``excess`` (the seconds it took beyond writing its part at that median
speed). A rank's score is the median of both over its newest ``WINDOW`` scored saves on the
tier, and it is slow when, over ``MIN_SAVES`` saves at least, its relative speed is below
``THRESHOLD`` and its excess is ``FLOOR_SECONDS`` or more. ``individual`` compares the
window's median throughput with the rank's own median over all its scored saves (below 1.0,
the rank got slower than it usually is).

Why medians, and no best rank or deviation score: ranks write parts of about the same size,
so the typical rank is the reference, and a median is one a straggler cannot drag toward
itself (leaving the rank out of its own reference keeps that true on 2 ranks) and one lucky
rank served by the page cache cannot set (against the best rank of a save, every other rank
looked 10x slow). Over saves the median needs most of the window to be slow: one bad save
does not flag a rank, nor one good save clear it. A spread score (median absolute deviation)
would be no better across ranks: on 2 ranks both deviate alike, and on ranks that agree to
the millisecond it turns noise into outliers; a ratio to the median with an absolute floor
holds at both ends. The floor is what a straggler must cost to be worth an operator's look:
below it (tens of ms) the difference is the scheduling and page-cache noise of a busy host,
whatever the ratio says.

A slow rank is logged as a warning by the lowest rank of its node (once, until it recovers),
and ``tiered-dcp ls`` shows the scores. Saves where even the slowest rank took under
``MIN_SECONDS`` are not scored: at that size timing noise is all there is to see; nor are
parts under ``MIN_SHARE`` of the save's largest (a rank with little to write, e.g.
replicated values only rank 0 writes), whose fixed costs would pass for slowness. Scores
cover the ranks whose records are on this node (the runtime directory is node-local); on one
node that is the whole job.

Beside speed, correctness: a rank whose copy of a replicated item was the odd one out at
saves of ``SUSPECT_STEPS`` steps or more (the ``replicas`` lines the save's coordinator
records, so read on its node) is a *suspect*: its memory or its device may corrupt data
(``suspects``; with two copies each disagreement names both, and a third step shows which
one keeps being named). The coordinator warns when a rank becomes one, and ``tiered-dcp ls``
and the drill's report list them.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from statistics import median

from tiered_dcp.storage.forks import renew_in_child

from ..config import TieredConfig
from ..writer_process.run_dir import OutcomeState
from ..writer_process.timings import Kind, TimingRecord, read_records, records_dir

log = logging.getLogger(__name__)

THRESHOLD = 0.5  # a rank slower than this share of its peers' median speed may be slow...
FLOOR_SECONDS = 0.05  # ...if it also takes this much longer than they would for its part
WINDOW = 5  # a rank is judged on the medians over its newest scored saves on a tier
MIN_SAVES = 3  # and on this many at least
MIN_SECONDS = 0.02  # a save whose slowest rank took less is not scored
MIN_SHARE = 0.25  # a part smaller than this share of the save's largest is not scored
TAIL_BYTES = 64 << 10  # how much of each rank's records the trainer's check reads
SUSPECT_STEPS = 2  # a rank with an odd replica at this many steps is a suspect node
_warned: set[tuple[str, int, int]] = set()  # (job, tier, rank) flagged and not yet recovered
_checking = threading.Lock()  # one check at a time per process; a save never waits for one


@renew_in_child
def _renew_checking() -> None:
    global _checking
    _checking = threading.Lock()


@dataclass
class RankScore:
    """One rank on one tier: medians over its newest scored saves (at most ``WINDOW``)."""

    rank: int
    node: int
    tier: int
    step: int  # the newest scored save
    relative: float  # median of throughput / the median of the other ranks' throughputs
    excess_s: float  # median of the seconds taken beyond its part's time at its peers' speed
    individual: float  # median throughput in the window / the rank's median over all saves
    saves: int  # saves scored on this tier
    window: int  # of which the newest this many are the window
    slow: bool  # relative < threshold and excess_s >= FLOOR_SECONDS, over MIN_SAVES saves at least


@dataclass
class _Save:
    step: int
    node: int
    speed: float  # bytes / second
    relative: float
    excess_s: float


def _writes(recs: list[TimingRecord]) -> dict[tuple[int, int], dict[int, TimingRecord]]:
    """(tier, step) -> rank -> the record of that rank's write of its part."""
    out: dict[tuple[int, int], dict[int, TimingRecord]] = defaultdict(dict)
    for r in recs:
        if (
            r.kind in (Kind.SAVE, Kind.PERSIST)
            and r.write_s is not None
            and r.tier is not None
            and r.state != OutcomeState.FAILED
        ):
            out[(r.tier, r.step)][r.rank] = r
    return out


def _saves(recs: list[TimingRecord]) -> dict[tuple[int, int], list[_Save]]:
    """(tier, rank) -> its scored saves, oldest first."""
    out: dict[tuple[int, int], list[_Save]] = defaultdict(list)
    for (tier, step), writes in sorted(_writes(recs).items()):
        size = {rank: r.bytes or 0 for rank, r in writes.items()}
        seconds = {rank: r.write_s or 0.0 for rank, r in writes.items()}  # never None: see _writes
        largest = max(size.values())
        ranks = [k for k in writes if size[k] >= largest * MIN_SHARE and largest > 0]
        if len(ranks) < 2 or max(seconds[k] for k in ranks) < MIN_SECONDS:
            continue
        speed = {rank: size[rank] / max(seconds[rank], 1e-6) for rank in ranks}
        for rank in ranks:
            peers = median(s for k, s in speed.items() if k != rank)
            out[(tier, rank)].append(
                _Save(
                    step,
                    writes[rank].node,
                    speed[rank],
                    speed[rank] / peers,
                    seconds[rank] - size[rank] / peers,
                )
            )
    return out


def score_ranks(recs: list[TimingRecord], threshold: float = THRESHOLD) -> list[RankScore]:
    """Every rank's scores per tier from these records (``timings.read_records``)."""
    scores = []
    for (tier, rank), saves in sorted(_saves(recs).items()):
        window = saves[-WINDOW:]
        relative = median(s.relative for s in window)
        excess = median(s.excess_s for s in window)
        scores.append(
            RankScore(
                rank=rank,
                node=window[-1].node,
                tier=tier,
                step=window[-1].step,
                relative=round(relative, 3),
                excess_s=round(excess, 3),
                individual=round(median(s.speed for s in window) / median(s.speed for s in saves), 3),
                saves=len(saves),
                window=len(window),
                slow=len(window) >= MIN_SAVES and relative < threshold and excess >= FLOOR_SECONDS,
            )
        )
    return scores


def job_scores(
    config: TieredConfig, threshold: float = THRESHOLD, tail_bytes: int | None = None
) -> list[RankScore]:
    """The scores of this job's ranks whose records are on this node."""
    return score_ranks(read_records(config, tail_bytes=tail_bytes), threshold)


def slow_ranks(
    config: TieredConfig, threshold: float = THRESHOLD, tail_bytes: int | None = None
) -> list[RankScore]:
    """The ranks slow on some tier (``RankScore.slow``)."""
    return [s for s in job_scores(config, threshold, tail_bytes) if s.slow]


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
                "rank %d on node %d writes to tier %d (%s) at %.2f of its peers' median speed, %.2f s "
                "behind them per save (medians over its last %d saves; at %.2f of its own usual speed): "
                "check its disk or network",
                s.rank,
                s.node,
                s.tier,
                config.tiers[s.tier].path if s.tier < len(config.tiers) else "?",
                s.relative,
                s.excess_s,
                s.window,
                s.individual,
            )
    _warned.difference_update({k for k in _warned if k[0] == job} - now)
    _warned.update(now)
    return flagged


@dataclass
class Suspect:
    """A rank whose copies of replicated items disagreed with its peers' at several steps."""

    rank: int
    node: int
    steps: list[int]  # the steps at which its copy was odd (or one of two that differed)
    items: list[str]  # the items, first seen first


def suspects(recs: list[TimingRecord], least: int = SUSPECT_STEPS) -> list[Suspect]:
    """The ranks named odd in ``replicas`` records at ``least`` distinct steps or more."""
    named: dict[int, Suspect] = {}
    for r in recs:
        if r.kind is not Kind.REPLICAS or not r.odd:
            continue
        nodes = r.odd_nodes or ()
        for i, rank in enumerate(r.odd):
            s = named.setdefault(rank, Suspect(rank, nodes[i] if i < len(nodes) else -1, [], []))
            if r.step not in s.steps:
                s.steps.append(r.step)
            if r.item is not None and r.item not in s.items:
                s.items.append(r.item)
    return [s for _, s in sorted(named.items()) if len(s.steps) >= least]


def job_suspects(config: TieredConfig) -> list[Suspect]:
    """The suspects among the ranks of this job, from the records on this node."""
    return suspects(read_records(config, Kind.REPLICAS))


def warn_suspects(config: TieredConfig, named: set[int]) -> list[Suspect]:
    """After a disagreement: warn of each rank just ``named`` that is now a suspect. Never
    raises: a check must not fail a save."""
    try:
        found = [s for s in job_suspects(config) if s.rank in named]
    except (OSError, ValueError) as e:
        log.debug("suspect nodes not checked: %s", e)
        return []
    for s in found:
        log.warning(
            "rank %d on node %d held a copy that disagreed with its replicas at steps %s (%s): "
            "node %d is a suspect (its memory or device may corrupt data): check it, or take it "
            "out of the job",
            s.rank,
            s.node,
            ", ".join(map(str, s.steps)),
            ", ".join(s.items[:4]) + (" ..." if len(s.items) > 4 else ""),
            s.node,
        )
    return found
