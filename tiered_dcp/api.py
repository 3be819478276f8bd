"""Job-level helpers: the newest step, status, waiting for the writers, export.

Torch is imported by ``export`` only, so ``tiered-dcp ls`` and a status poll start fast.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tiered_dcp.storage import blocks, open_storage
from tiered_dcp.storage.format import parse_step_dir, step_dir

from .config import Tier, TieredConfig, here, is_namespace
from .errors import TieredCheckpointError
from .save.host_memory import HostMemory, held
from .steps.catalog import TierView, abandoned, views
from .steps.choice import newest_loadable
from .steps.retention import committed_and_bad, drop, kept_and_doomed
from .steps.status import StepState, StepStatus, tier_states
from .writer_process import client
from .writer_process.run_dir import OutcomeState, RunDir, TierState


def latest_step(config: TieredConfig) -> int | None:
    """The newest good step complete on some tier, as seen from this process (no collectives):
    quarantined and non-finite steps are passed over, as ``TieredReader(config)`` does.

    Args:
        config: the job's configuration; node-local tiers are read as this process's node.

    Returns:
        The step, or None when no tier holds a good complete step of ``config.namespace``.
    """
    return newest_loadable(views(config, *here()))


@dataclass
class WriterInfo:
    """One rank's writer process, as its runtime directory on this node shows it."""

    rank: int
    pid: int | None
    running: bool
    queue: list[tuple[int, int]] = field(default_factory=list)  # (step, tier) waiting, oldest first
    failed: list[tuple[int, int, str]] = field(default_factory=list)  # (step, tier, why)
    log: str = ""
    skipped: list[tuple[int, int, str]] = field(default_factory=list)  # (step, tier, why): tier unhealthy
    unhealthy: dict[int, dict] = field(default_factory=dict)  # tier -> {state, since, error}


def writer_status(config: TieredConfig) -> list[WriterInfo]:
    """The writer processes of this job's ranks on this node, with their queues and failures.

    Args:
        config: the job's configuration (its namespace and tiers name the run directories).

    Returns:
        One ``WriterInfo`` per rank that ran a writer on this node, by rank.
    """
    out = []
    for rd in RunDir.all_of(config):
        outcomes = rd.results.all().values()
        failed, skipped = (
            [(o.step, o.target, o.error or "") for o in outcomes if o.state is state]
            for state in (OutcomeState.FAILED, OutcomeState.SKIPPED)
        )
        health = (rd.health.of(t) for t in range(len(config.tiers)))
        out.append(
            WriterInfo(
                rank=rd.rank,
                pid=rd.writer.pid(),
                running=rd.writer.running(),
                queue=[(j.step, j.target) for j in rd.queue.jobs()],
                failed=failed,
                log=str(rd.writer.log_path),
                skipped=skipped,
                unhealthy={h.tier: h.to_dict() for h in health if h.state is not TierState.HEALTHY},
            )
        )
    return out


@dataclass(frozen=True)
class NamespaceInfo:
    """A namespace a tier's root holds: its committed steps there, the newest, their size."""

    namespace: str
    tier_index: int
    tier: str
    steps: int
    newest: int | None
    size_bytes: int


def namespaces(tiers: list[Tier]) -> list[NamespaceInfo]:
    """The namespaces in the roots of ``tiers`` (as this process sees them): every directory
    holding step directories, with what each tier holds of it, by namespace then tier."""
    node, rank = here()
    out = []
    for i, tier in enumerate(tiers):
        store = open_storage(tier.root(node, rank), tier.storage_options)
        for name in store.list(""):
            if is_namespace(name) and any(parse_step_dir(d) is not None for d in store.list(name)):
                rows = [r for r in status(TieredConfig(name, [tier])) if r.state is StepStatus.COMMITTED]
                newest = max((r.step for r in rows), default=None)
                size = sum(r.size_bytes for r in rows)
                out.append(NamespaceInfo(name, i, tier.path, len(rows), newest, size))
    return sorted(out, key=lambda n: (n.namespace, n.tier_index))


@dataclass(frozen=True)
class Removal:
    """What ``remove_steps`` or ``prune`` did with one step on one tier."""

    tier_index: int
    tier: str
    step: int
    removed: bool
    why: str = ""  # why it stays


def remove_steps(
    config: TieredConfig, steps: Iterable[int], *, tiers: Iterable[int] | None = None, force: bool = False
) -> list[Removal]:
    """Remove ``steps`` from ``tiers`` (default: all), in the roots this process sees (on a
    node-local tier: this node's). The newest committed step and the newest good one (not
    quarantined, not saved non-finite: what a resume loads) stay unless ``force``; a step
    a writer process still copies or a reader reads stays whatever ``force`` says, and so
    does one whose save is still under way. The marker goes first (``retention.drop``)."""
    wanted = set(steps)
    tier_views = views(config, *here())
    picked = set(range(len(config.tiers)) if tiers is None else tiers)
    found = {v.index: committed_and_bad(v, v.step_dirs(v.own)) for v in tier_views}
    committed = {i: set(c) for i, (c, _) in found.items()}
    newest = max((s for c in committed.values() for s in c), default=None)
    newest_good = max((s for c, bad in found.values() for s in c if s not in bad), default=None)
    out = []
    for v in (v for v in tier_views if v.index in picked):
        store, removed = v.own, False
        for step in sorted(wanted & set(v.step_dirs(store))):
            why = ""
            if step not in committed[v.index]:
                if abandoned(config.namespace, store, step):  # a save that failed or died: its leftovers
                    store.delete(step_dir(config.namespace, step))
                else:
                    why = "not committed, and its save may still be under way"
            elif step == newest and not force:
                why = "the newest committed step (force it to remove it)"
            elif step == newest_good and not force:
                why = "the newest good step, the one a resume loads (force it to remove it)"
            elif not drop(v, step):
                why = "a writer process still copies it, or a reader reads it"
            out.append(Removal(v.index, v.tier.path, step, not why, why))
            removed = removed or not why
        if removed:
            blocks.collect(store, config.namespace)  # the blocks no step uses any more (dedup)
    return out


def prune(config: TieredConfig, keep: int, *, tiers: Iterable[int] | None = None) -> list[Removal]:
    """Keep the newest ``keep`` good steps of each of ``tiers`` (default: all), by the rule
    retention applies after each commit (``retention.kept_and_doomed``: quarantined and
    non-finite steps take no place); remove the others as ``remove_steps`` does."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune: keep={keep!r} must be an integer >= 1")
    out = []
    for v in views(config, *here()):
        if tiers is None or v.index in set(tiers):
            committed, bad = committed_and_bad(v, v.step_dirs(v.own))
            _, doomed = kept_and_doomed(v, committed, bad, keep, max(committed, default=0))
            out += remove_steps(config, doomed, tiers=[v.index]) if doomed else []
    return out


def host_memory(config: TieredConfig) -> HostMemory:
    """The host memory ``config``'s namespace holds on this node: its files on each tier in
    memory (steps, and spare part files kept for the next saves to stage into), and each
    rank's staging buffers as its newest save left them.

    Args:
        config: the job's configuration.

    Returns:
        A ``HostMemory`` (bytes per tier and per rank, and the host's total).
    """
    return held(config)


def status(config: TieredConfig) -> list[StepState]:
    """Every step on every tier: queued, writing, clean, committed, incomplete, failed or skipped.

    ``queued``, ``failed`` and ``skipped`` (a newer step took its place in the queue of a tier
    that was down) come from the writer processes of this node's ranks. A shared tier that
    does not answer within ``tier_timeout`` shows no rows (a warning says so).

    Args:
        config: the job's configuration; node-local tiers are read as this process's node.

    Returns:
        One ``StepState`` per (tier, step), by tier then step. ``tiered-dcp status`` prints them.
    """
    node, rank = here()
    rows = {(r.tier_index, r.step): r for v in views(config, node, rank) for r in tier_states(v)}
    for w in writer_status(config):
        for step, tier in w.queue:
            rows.setdefault(
                (tier, step), StepState(tier, config.tiers[tier].path, step, StepStatus.QUEUED, 0, None)
            )
        for state, outcomes in ((StepStatus.FAILED, w.failed), (StepStatus.SKIPPED, w.skipped)):
            for step, tier, why in outcomes:
                row = rows.get((tier, step))
                if row is None or row.state is not StepStatus.COMMITTED:
                    size = row.size_bytes if row else 0
                    rows[(tier, step)] = StepState(
                        tier, config.tiers[tier].path, step, state, size, None, why
                    )
    return [rows[k] for k in sorted(rows)]


def _tier_index(config: TieredConfig, tier: int | str) -> int:
    if (
        isinstance(tier, int)
        and not isinstance(tier, bool)
        and -len(config.tiers) <= tier < len(config.tiers)
    ):
        return tier % len(config.tiers)
    paths = [t.path for t in config.tiers]
    if isinstance(tier, str) and tier in paths:
        return paths.index(tier)
    raise ValueError(f"unknown tier {tier!r}: give an index below {len(paths)} or one of {paths}")


def wait_for(
    config: TieredConfig,
    step: int,
    tier: int | str | None = None,
    timeout: float | None = None,
    *,
    emergency: bool = False,
) -> None:
    """Wait until ``step`` is committed (and complete) on ``tier`` (default: every tier taking it).

    Args:
        config: the job's configuration.
        step: the step saved.
        tier: a tier's index or path; None: every tier whose ``every`` takes ``step``.
        timeout: seconds to wait at most; None: until it is there or fails.
        emergency: the step was an emergency save, which every tier takes.

    Raises:
        ValueError: ``tier`` is unknown, or never takes ``step`` (its ``every`` does not
            divide it): such a step would never come, so it is not waited for.
        TimeoutError: ``timeout`` passed first.
        TieredCheckpointError: a writer process reported it could not write the step to
            one of those tiers (at once, naming the rank and its log).
    """
    if tier is not None:
        targets = [_tier_index(config, tier)]
    else:
        targets = list(range(len(config.tiers))) if emergency else config.tiers_for(step)
    for t in targets:
        if not emergency and not config.tiers[t].takes(step):
            raise ValueError(
                f"tier {config.tiers[t].path} (every={config.tiers[t].every}) never takes step {step}"
            )
    node, rank = here()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:  # fresh views each time: what they read (indexes) is cached per view
        waiting = [v for v in (TierView(config, t, node, rank) for t in targets) if step not in v.complete()]
        if not waiting:
            return
        for w in writer_status(config):
            for s, t, why in w.failed:
                if s == step and t in [v.index for v in waiting]:
                    raise TieredCheckpointError(
                        f"step {step} will not reach tier {config.tiers[t].path}: rank {w.rank}'s writer "
                        f"failed: {why} (log: {w.log})"
                    )
        if deadline is not None and time.monotonic() > deadline:
            names = ", ".join(v.tier.path for v in waiting)
            raise TimeoutError(f"step {step} not committed on {names} after {timeout} s")
        time.sleep(0.05)


def shutdown(wait: bool = True, timeout: float | None = None) -> bool:
    """Free this process's staging buffers and let its writer processes exit.

    Not required: a writer process finishes what it was handed and exits by itself when its
    trainer is gone. Call it at the end of training to free the staging memory at once and,
    with ``wait``, to know the slower tiers are filled before the job reports success.

    Args:
        wait: block until the writers have written everything queued, then remove their
            runtime directories unless a failure is recorded there. Without it they finish
            their queues in the background, then exit.
        timeout: seconds to wait at most (None: no bound).

    Returns:
        False when ``timeout`` passed with work still queued, else True.
    """
    staging = sys.modules.get("tiered_dcp.save.staging")  # not imported: this process staged nothing
    if staging is not None:
        staging.POOL.close()
    ok = True
    for handle in client.handles():
        ok = handle.stop(wait, timeout) and ok
    return ok


def export(
    config: TieredConfig,
    step: int | None,
    dest: str | os.PathLike,
    *,
    format: str = "dcp",
    only: str | None = None,
    max_shard_size: int | None = None,
) -> str:
    """Write ``step`` (None: the newest that loads, as ``load_latest`` picks it) into the local
    directory ``dest``; return ``dest``.

    ``format="dcp"``: a stock DCP directory torch's ``FileSystemReader`` loads (held whole in
    memory while it is written). ``format="safetensors"``: Hugging Face safetensors, every
    tensor whole (consolidated from every rank's shards), in files of at most
    ``max_shard_size`` bytes (default 5 GB), one file's tensors in memory at a time.
    ``only="model"``: just the items named ``model.*``, named without that prefix
    (``model.l.weight`` -> ``l.weight``). ``dest`` is left as it was on any failure. See
    ``ops.export``.

    Args:
        config: the job's configuration.
        step: the step to export; None: the newest that loads.
        dest: the local directory to write (made; an existing non-empty one is refused).
        format: ``"dcp"`` or ``"safetensors"``.
        only: a top-level key whose items alone are exported (``"model"``), or None: all.
        max_shard_size: safetensors only: bytes per file at most (default 5 GB).

    Returns:
        ``dest``, as a string.

    Raises:
        NoCheckpointError: no such step (the message names every tier searched).
        CheckpointCorruptError: some item has no good copy left.
        ValueError: an unknown format, or an option the format does not take.
    """
    from .ops.export import format_named, run_export

    return run_export(config, step, dest, format_named(format, max_shard_size), only).dest


def import_dcp(
    config: TieredConfig,
    source: str | os.PathLike,
    step: int,
    *,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Store the stock DCP checkpoint directory ``source`` (a path or fsspec URL, opened with
    ``storage_options`` as a tier's are) as ``step``
    of ``config``'s tiers, written, checksummed and committed as a save of this process is
    (``TieredWriter``): ``TieredReader(config)`` then loads it, with any world size or
    sharding. A step number already committed is refused (``ValueError``); a source that is
    no checkpoint raises ``NoCheckpointError``, one whose files are missing, cut short or
    fail their CRC-32 ``CheckpointCorruptError``, each naming it.

    Runs in one process. From a local directory into a first tier that is a local directory
    storing raw chunks without dedup, the tensors are copied by the kernel into the step's
    part file and checked there, never held in this process's memory; anything else (the
    non-tensor values, any URL source, a first tier that compresses, dedups or is a bucket)
    is read into memory whole first (see ``ops.import_dcp``). On node-local tiers the step lands
    in this node's roots (the slower tiers taking it get it from this node's writer
    process). One process has no clique peers: with ``replication_factor`` > 1 the step is
    stored unreplicated (one copy in this node's roots, plus the slower tiers'), which a
    replicated job loads like any step whose replicas are gone.

    Args:
        config: the job's configuration: the tiers the step is stored on.
        source: the DCP checkpoint directory (a path or fsspec URL).
        step: the step number to store it as.
        storage_options: fsspec options for a URL ``source``.

    Returns:
        ``step``, the step imported.

    Raises:
        ValueError: ``step`` is already committed.
        NoCheckpointError: ``source`` holds no DCP checkpoint.
        CheckpointCorruptError: a file of ``source`` is missing, cut short or fails its CRC.
    """
    from .ops.import_dcp import run_import

    if any(step in v.committed() for v in views(config, *here())):
        raise ValueError(f"step {step} of {config.namespace!r} exists: remove it first (tiered-dcp rm)")
    return run_import(config, os.fspath(source), step, storage_options or {})
