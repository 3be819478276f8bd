"""How often each tier should save, and what goodput a schedule buys: Young/Daly per tier.

Each tier protects against one class of failure: the fastest tier that survives it is the
one a restart loads from (a process crash: the RAM tier; a lost node: peer replicas when
``replication_factor > 1``, else the shared tier; a lost job: the shared tier). For a tier
with save stall ``C`` (seconds the loop waits per save to it), restore time ``R``, commit
latency ``L`` (a save to its commit there) and mean time between its failures ``M``, a
schedule of one save every ``n`` steps of ``t`` seconds (interval ``tau = n t``) gives

    goodput(n) = tau / (tau + C') * (1 - ((tau + C') / 2 + L + R) / M)

where ``C' = C + max(0, L - tau)``: a save cannot start before the previous one is
committed, so a tier saving faster than it commits makes the loop wait. The first factor is
the time not spent stalled, the second the time not lost: each failure costs half an
interval of work on average, the work not yet committed (``L``), and the restore. The best
interval is Daly's (Young's ``sqrt(2 C M)`` with Daly's higher-order correction, which
matters once ``C`` is not small against ``M``), and never shorter than the commit latency.

Torch-free; ``plot`` needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..config import TieredConfig

T = TypeVar("T")


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's optimum (2006): Young's with the higher-order terms; ``M`` once ``C >= 2M``."""
    if cost <= 0:
        return 0.0
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def effective_stall(every: int, step_time: float, stall: float, latency: float = 0.0) -> float:
    """The stall per save, with the wait for a previous save still committing."""
    return stall + max(0.0, latency - every * step_time)


def lost_per_failure(every: int, step_time: float, stall: float, latency: float = 0.0) -> float:
    """Seconds of work redone after a failure, on average: half a period and the uncommitted tail."""
    return (every * step_time + effective_stall(every, step_time, stall, latency)) / 2 + latency


def goodput(
    every: int, step_time: float, stall: float, restore: float, mtbf: float, latency: float = 0.0
) -> float:
    """The expected fraction of time spent on work that is kept (0-1), as in the module doc."""
    tau = every * step_time
    c = effective_stall(every, step_time, stall, latency)
    useful = tau / (tau + c) if tau + c > 0 else 1.0
    loss = (lost_per_failure(every, step_time, stall, latency) + restore) / mtbf
    return max(0.0, useful * (1 - loss))


def best_every(step_time: float, stall: float, mtbf: float, latency: float = 0.0) -> int:
    """Daly's interval in steps (at least 1), and not shorter than the commit latency."""
    n = max(1, round(daly_interval(stall, mtbf) / step_time))
    return max(n, math.ceil(latency / step_time - 1e-9))


@dataclass(frozen=True)
class TierCosts:
    """What one tier costs and protects against, in seconds."""

    name: str
    stall: float
    restore: float
    mtbf: float
    latency: float = 0.0
    every: int | None = None  # the current schedule, if any

    def __post_init__(self) -> None:
        for what in ("stall", "restore", "latency"):
            if not getattr(self, what) >= 0:
                raise ValueError(
                    f"{self.name}: {what}={getattr(self, what)!r} must be a number of seconds >= 0"
                )
        if not self.mtbf > 0:
            raise ValueError(f"{self.name}: mtbf={self.mtbf!r} must be a number of seconds > 0")
        if self.every is not None and self.every < 1:
            raise ValueError(f"{self.name}: every={self.every!r} must be >= 1")


@dataclass
class TierAdvice:
    """The answer for one tier: its best interval and what it and the current one buy."""

    name: str
    best_every: int
    best_interval_s: float
    goodput: float  # at best_every, against this tier's failures alone
    lost_per_failure_s: float  # at best_every
    restore_s: float
    every: int | None = None
    goodput_current: float | None = None
    lost_per_failure_current_s: float | None = None
    costs: dict[str, float] = field(default_factory=dict)


@dataclass
class GoodputReport:
    step_time: float
    tiers: list[TierAdvice]
    goodput: float  # every tier at its best interval, all failure classes together
    goodput_current: float | None  # at the current schedule, when every tier has one

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if len(self.tiers) == 1:  # the single-tier answer at the top level too
            t = self.tiers[0]
            d.update(
                best_every=t.best_every,
                lost_per_failure_s=t.lost_per_failure_s,
                restore_s=t.restore_s,
                every=t.every,
            )
        else:
            d["best_every"] = [t.best_every for t in self.tiers]
        return d


def combined(step_time: float, tiers: list[TierCosts], every: list[int]) -> float:
    """Goodput of a schedule of all tiers: each tier's stalls, and every class of failure.

    Each tier's stall counts as its own (a slower tier's, as the extra it adds to a save).
    """
    overhead = sum(
        effective_stall(n, step_time, t.stall, t.latency) / n for t, n in zip(tiers, every, strict=True)
    )
    per_step = step_time + overhead
    loss = sum(
        ((n * per_step) / 2 + t.latency + t.restore) / t.mtbf for t, n in zip(tiers, every, strict=True)
    )
    return max(0.0, step_time / per_step * (1 - loss))


def analyze(step_time: float, tiers: list[TierCosts]) -> GoodputReport:
    """Per tier: the best interval and the goodput at it and at the current ``every``."""
    if not step_time > 0:
        raise ValueError(f"step_time={step_time!r} must be a number of seconds > 0")
    if not tiers:
        raise ValueError("analyze needs at least one tier's costs")
    out = []
    for t in tiers:
        n = best_every(step_time, t.stall, t.mtbf, t.latency)
        advice = TierAdvice(
            name=t.name,
            best_every=n,
            best_interval_s=n * step_time,
            goodput=goodput(n, step_time, t.stall, t.restore, t.mtbf, t.latency),
            lost_per_failure_s=lost_per_failure(n, step_time, t.stall, t.latency),
            restore_s=t.restore,
            costs={"stall_s": t.stall, "restore_s": t.restore, "mtbf_s": t.mtbf, "latency_s": t.latency},
        )
        if t.every is not None:
            advice.every = t.every
            advice.goodput_current = goodput(t.every, step_time, t.stall, t.restore, t.mtbf, t.latency)
            advice.lost_per_failure_current_s = lost_per_failure(t.every, step_time, t.stall, t.latency)
        out.append(advice)
    best = combined(step_time, tiers, [a.best_every for a in out])
    current = None
    if all(t.every is not None for t in tiers):
        current = combined(step_time, tiers, [t.every for t in tiers])  # type: ignore[misc]
    return GoodputReport(step_time, out, best, current)


# -- measured costs of a real run -------------------------------------------------------------


@dataclass
class Measured:
    """What the job's records (``timings``) say, per tier; None where nothing was measured."""

    step_time: float | None
    stall: list[float | None]
    latency: list[float | None]
    restore: list[float | None]
    saves: int
    loads: int
    stall_s: dict[str, float] = field(default_factory=dict)  # each call as the loop saw it: median, max


@dataclass(frozen=True)
class Schedule:
    """Each tier's ``every``/``keep`` as the job ran, and where that was read."""

    every: list[int]
    keep: list[int | None]
    source: str


def _or(value: T | None, default: T) -> T:
    """A record's optional field, or what its absence counts as."""
    return default if value is None else value


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def loop_stall(r: Any) -> float:
    """What a save stalled the loop for its fastest tier: its ``async_save`` call as the loop
    saw it (``timings.SaveCall``), less the waits for a writer that fell behind (the slower
    tiers' stall); in records without the call, the copy (``stage_s``); a sync save's
    commit (``commit_s``: the loop waits for it whole)."""
    if r.call_s is not None:
        return max(0.0, r.call_s - _or(r.call_wait_s, 0.0))
    return _or(r.stage_s, _or(r.commit_s, 0.0))


def lag_wait(r: Any) -> float:
    """What the loop waited in a save for a writer that fell behind (``handoff_s`` of a
    record without the call: of a sync save, in the loop)."""
    return _or(r.call_wait_s, 0.0) if r.call_s is not None else _or(r.handoff_s, 0.0)


def job_schedule(config: TieredConfig) -> Schedule | None:
    """The tiers' schedule as the job ran with these tiers on this node: its newest save's
    record, else its writer processes' config (``run_dir.write_config``); None if neither."""
    from ..writer_process.run_dir import RunDir
    from ..writer_process.timings import Kind, read_records

    n = len(config.tiers)
    for r in reversed(read_records(config, Kind.SAVE, tail_bytes=1 << 16)):
        if r.every is not None and r.keep is not None and len(r.every) == len(r.keep) == n:
            return Schedule(list(r.every), list(r.keep), "the job's records")
    for rd in RunDir.all_of(config):
        try:
            tiers = rd.read_config().tiers
        except (OSError, ValueError):
            continue
        if len(tiers) == n:
            return Schedule([t.every for t in tiers], [t.keep for t in tiers], "its writer processes' config")
    return None


def measure_job(config: TieredConfig) -> Measured:
    """The stall, commit latency and restore time per tier, and the step time, from the records.

    Per save, the slowest rank counts (the loop waits for it); then the median over saves.
    A slower tier's stall is the wait its writer's backlog added to saves (the save's own
    stall is the fastest tier's); its latency is the fastest tier's commit plus the copy.
    """
    from ..writer_process.run_dir import OutcomeState
    from ..writer_process.timings import Kind, TimingRecord, read_records

    n = len(config.tiers)
    recs = read_records(config)
    saves = [r for r in recs if r.kind is Kind.SAVE]
    by_step: dict[int, list[TimingRecord]] = defaultdict(list)
    for r in saves:
        by_step[r.step].append(r)
    stall: list[list[float]] = [[] for _ in range(n)]
    commit: list[list[float]] = [[] for _ in range(n)]
    handoff: dict[int, float] = {}
    step_stall: dict[int, float] = {}
    for step, rs in by_step.items():
        tier = _or(rs[0].tier, -1)
        s = max(loop_stall(r) for r in rs)
        handoff[step] = max(lag_wait(r) for r in rs)
        step_stall[step] = s + handoff[step]
        if 0 <= tier < n:
            stall[tier].append(s)
            commit[tier].append(max(_or(r.commit_s, 0.0) for r in rs))
    persisted: dict[tuple[int, int], float] = {}
    for r in recs:
        if r.kind is Kind.PERSIST and r.state != OutcomeState.FAILED and 0 <= _or(r.tier, -1) < n:
            key = (_or(r.tier, -1), r.step)
            persisted[key] = max(persisted.get(key, 0.0), _or(r.latency_s, 0.0))
    first_commit = _median([c for cs in commit for c in cs]) or 0.0
    latency: list[float | None] = [_median(c) for c in commit]
    for k in range(n):
        lat = [v for (tier, _), v in persisted.items() if tier == k]
        if lat:
            latency[k] = first_commit + statistics.median(lat)
            if not stall[k]:
                stall[k] = [handoff.get(step, 0.0) for (tier, step) in persisted if tier == k]
    restore: list[list[float]] = [[] for _ in range(n)]
    loads = [r for r in recs if r.kind is Kind.LOAD and r.tiers and r.seconds is not None]
    for r in loads:
        if 0 <= r.tiers[0] < n:
            restore[r.tiers[0]].append(r.seconds)
    # step time: per rank, the gap between consecutive saves less the later one's stall
    gaps: list[float] = []
    per_rank: dict[int, list[TimingRecord]] = defaultdict(list)
    for r in saves:
        per_rank[r.rank].append(r)
    for rs in per_rank.values():
        rs.sort(key=lambda r: r.step)
        for a, b in zip(rs, rs[1:], strict=False):
            if b.step > a.step and b.time > a.time:
                gap = (b.time - a.time - step_stall.get(b.step, 0.0)) / (b.step - a.step)
                if gap > 0:
                    gaps.append(gap)
    stalls = sorted(step_stall.values())
    return Measured(
        step_time=_median(gaps),
        stall=[_median(s) for s in stall],
        latency=latency,
        restore=[_median(r) for r in restore],
        saves=len(by_step),
        loads=len(loads),
        stall_s={"median": statistics.median(stalls), "max": stalls[-1]} if stalls else {},
    )


# -- the picture -------------------------------------------------------------------------------


SHOWN_LOSS = 5  # each curve is drawn where it loses at most this many times its best's loss


def plot(report: GoodputReport, tiers: list[TierCosts], path: str) -> str:
    """Goodput against interval (steps, log scale) per tier, best and current marked; a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'tiered-dcp[plot]'") from e
    fig = figure(report, tiers, plt)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def figure(report: GoodputReport, tiers: list[TierCosts], plt: Any) -> Any:
    """The plot's figure. Each curve is drawn over the intervals where it loses at most
    ``SHOWN_LOSS`` times the time its best interval loses (at least 0.01 of goodput below the
    best; the current interval always), so none runs off the axes and the region that
    matters fills them; the numbers go in the legend, below the axes, so no label covers
    another."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2 + 0.3 * len(tiers)), dpi=100)
    t = report.step_time
    lowest = 1.0
    for costs, advice in zip(tiers, report.tiers, strict=True):
        ends = [advice.best_every] + ([advice.every] if advice.every else [])
        top = max(ends) * 30
        xs = sorted({max(1, round(10 ** (i / 60))) for i in range(int(60 * math.log10(top)) + 1)} | set(ends))
        ys = [goodput(x, t, costs.stall, costs.restore, costs.mtbf, costs.latency) for x in xs]
        floor = advice.goodput - max(0.01, SHOWN_LOSS * (1 - advice.goodput))
        if advice.goodput_current is not None:
            floor = min(floor, advice.goodput_current)
        shown = [(x, y) for x, y in zip(xs, ys, strict=True) if y >= floor and x >= min(ends) / 30]
        label = f"{advice.name}: best every {advice.best_every} ({advice.goodput:.3f})"
        if advice.every is not None and advice.goodput_current is not None:
            label += f", now every {advice.every} ({advice.goodput_current:.3f})"
        (line,) = ax.plot([x for x, _ in shown], [y for _, y in shown], label=label)
        ax.plot([advice.best_every], [advice.goodput], "o", color=line.get_color())
        if advice.every is not None and advice.goodput_current is not None:
            ax.plot([advice.every], [advice.goodput_current], "x", color=line.get_color(), markersize=8)
        lowest = min([lowest] + [y for _, y in shown])
    ax.plot([], [], "o", color="gray", label="best interval (Young/Daly)")
    ax.plot([], [], "x", color="gray", markersize=8, label="current interval (every=)")
    ax.set_xscale("log")
    ax.set_xlabel(f"interval between saves [steps; one step = {t:g} s]")
    ax.set_ylabel("goodput [share of time training]")
    ax.set_title("Goodput against the interval between saves, per tier")
    margin = max(0.002, (1 - lowest) * 0.05)
    ax.set_ylim(max(0.0, lowest - margin), min(1.0, max(a.goodput for a in report.tiers) + margin))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    fig.tight_layout()
    return fig


# -- the command ------------------------------------------------------------------------------


def _floats(text: str | None, what: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError as e:
        raise ValueError(
            f"--{what} wants seconds, one number or one per tier separated by commas: {text!r}"
        ) from e


def _per_tier(values: list | None, n: int, what: str) -> list | None:
    if values is None:
        return None
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"--{what}: {len(values)} values for {n} tier(s); give one, or one per tier")
    return values


def add_arguments(p) -> None:  # an argparse parser, after the config arguments
    p.add_argument("--step-time", type=float, metavar="S", help="seconds per training step")
    p.add_argument("--stall", metavar="S[,S...]", help="seconds a save to the tier stalls the loop")
    p.add_argument("--restore", metavar="S[,S...]", help="seconds to restore from the tier")
    p.add_argument(
        "--mtbf", metavar="S[,S...]", help="mean seconds between the failures the tier protects against"
    )
    p.add_argument("--latency", metavar="S[,S...]", help="seconds from a save to its commit on the tier (0)")
    p.add_argument(
        "--every",
        metavar="N[,N...]",
        help="the current schedule (default: the config's every=; given tier paths, the job's records')",
    )
    p.add_argument(
        "--from-job",
        action="store_true",
        help="take step time, stalls, latencies and restore times from the job's records (needs the job)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw goodput against interval per tier (needs matplotlib)")


def command(args, config: TieredConfig | None, measured: Measured | None = None) -> int:
    """``tiered-dcp goodput``: the flags, else the config and what its job measured
    (``measured``: ``measure_job``'s, with ``--from-job``)."""
    n = len(config.tiers) if config is not None else 1
    if args.from_job and config is None:
        raise ValueError("--from-job needs the job: --config tiers.toml (or -n NAMESPACE TIER...)")
    names = [t.path for t in config.tiers] if config is not None else ["tier"]
    given = {
        what: _per_tier(_floats(getattr(args, what), what), n, what)
        for what in ("stall", "restore", "mtbf", "latency")
    }
    every_text = _floats(args.every, "every")
    every = _per_tier([int(x) for x in every_text] if every_text else None, n, "every")
    schedule = None
    if every is None and config is not None:
        schedule = _schedule(config, bool(args.config))
        every = schedule.every if schedule is not None else None
    step_time = args.step_time or (measured.step_time if measured else None)
    missing = []
    if step_time is None:
        missing.append("--step-time")
    costs = []
    for i in range(n):
        value = {}
        for what in ("stall", "restore", "mtbf", "latency"):
            v = given[what][i] if given[what] is not None else None
            if v is None and measured is not None and what != "mtbf":
                v = getattr(measured, what)[i]
            if v is None and what == "latency":
                v = 0.0
            if v is None:
                recorded = measured is not None and what != "mtbf"  # no record holds a failure rate
                why = " (not in the job's records)" if recorded else ""
                missing.append(f"--{what} for {names[i]}{why}")
            value[what] = v
        costs.append(value)
    if missing:
        raise ValueError("goodput needs " + ", ".join(missing))
    tiers = [
        TierCosts(names[i], every=every[i] if every else None, **costs[i])  # type: ignore[arg-type]
        for i in range(n)
    ]
    report = analyze(step_time, tiers)  # type: ignore[arg-type]
    if args.plot:
        plot(report, tiers, args.plot)
    if args.json:
        doc = report.to_json()
        if measured is not None:
            doc["measured"] = asdict(measured)
        if schedule is not None:
            doc["schedule"] = asdict(schedule)
        import json

        print(json.dumps(doc, indent=1))
        return 0
    if schedule is not None and schedule.source != "the config":
        shown = ", ".join(f"every {e} keep {k}" for e, k in zip(schedule.every, schedule.keep, strict=True))
        print(f"schedule from {schedule.source}: {shown}")
    _print_report(report, measured)
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _schedule(config: TieredConfig, given: bool) -> Schedule | None:
    """The tiers' every/keep: the config's where it is the job's own (``--config``), else
    as the job ran (``job_schedule``); where neither says, one line on stderr, and None."""
    if given:
        return Schedule([t.every for t in config.tiers], [t.keep for t in config.tiers], "the config")
    found = job_schedule(config)
    if found is None:
        print(
            f"tiered-dcp goodput: the tiers' schedule (every=) is not known: no save of namespace "
            f"{config.namespace!r} with these tiers is recorded on this node; give --every N[,N...] "
            "or --config (no current schedule is shown)",
            file=sys.stderr,
        )
    return found


def _print_report(report: GoodputReport, measured: Measured | None) -> None:
    if measured is not None:
        print(f"measured from the job's records: {measured.saves} saves, {measured.loads} loads")
        if measured.stall_s:
            print(
                f"  stall per save, the async_save call as the loop saw it: median "
                f"{measured.stall_s['median']:.3g} s, max {measured.stall_s['max']:.3g} s"
            )
    print(f"step time {report.step_time:.3g} s")
    for t in report.tiers:
        c = t.costs
        print(
            f"{t.name}: stall {c['stall_s']:.3g} s, restore {c['restore_s']:.3g} s, "
            f"commit latency {c['latency_s']:.3g} s, MTBF {c['mtbf_s']:.4g} s"
        )
        print(
            f"  best: every {t.best_every} steps ({t.best_interval_s:.3g} s): goodput {t.goodput:.4f}, "
            f"{t.lost_per_failure_s:.3g} s of work lost per failure (+ {t.restore_s:.3g} s restore)"
        )
        if t.every is not None and t.goodput_current is not None:
            print(
                f"  now:  every {t.every} steps: goodput {t.goodput_current:.4f}, "
                f"{t.lost_per_failure_current_s:.3g} s of work lost per failure"
            )
    if len(report.tiers) > 1:
        now = f"; at the current schedule {report.goodput_current:.4f}" if report.goodput_current else ""
        print(f"all tiers, all failures: goodput at the best schedule {report.goodput:.4f}{now}")
