"""``load_latest``: the resume call, which loads the newest step that loads completely.

A resume is where a checkpoint library earns its keep, so it never stops at a bad step
while a good one exists: a step whose load finds an item with no good copy left is
quarantined by that load (``TieredReader``), and the choice is made again without it
(``steps.choice``); quarantined and non-finite steps are passed over from the start.
Every rank sees the same failures (DCP gathers them into one ``CheckpointException``), so
every rank excludes the same steps and the readers agree on the next one.

``resume`` is that loop, for any way of loading the chosen step: ``load_latest`` loads it
with ``dcp.load``, ``tiered_dcp.megatron.load_latest`` through its Megatron checkpoint
directory (and passes over a step that has none).
"""

from __future__ import annotations

import json
import logging
import traceback as tb
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..config import TieredConfig
from ..errors import CheckpointCorruptError, NoCheckpointError, TieredCheckpointError
from ..ranks import transport, worlds
from ..steps.choice import describe_skipped
from .discovery import all_agree, all_gather_bytes
from .reader import TieredReader

log = logging.getLogger(__name__)

T = TypeVar("T")
ERROR_CHARS = 2000  # of a rank's error told to the others: every rank receives every rank's


def load_latest(state_dict: dict[str, Any], config: TieredConfig, **dcp_load_kwargs: Any) -> int:
    """Load the newest step that loads completely into ``state_dict``, on every rank the same
    step, and return it; raise ``NoCheckpointError`` when there is none.

    Steps that are quarantined or non-finite, and steps that fail to load here (no good copy
    of an item on any tier or peer), are passed over; one warning names each, and why.

    It loads in place into the tensors of ``state_dict``, as ``dcp.load`` does: a dict of a
    model's own tensors (``model.state_dict()``) is the model's state once it returns. A dict
    made by ``get_state_dict(model, optimizer)`` still needs ``set_state_dict`` afterwards,
    as with ``dcp.load``: the optimizer's step counters and param groups are values, not
    the optimizer's own tensors.

    Args:
        state_dict: the state to load into, laid out (shapes, sharding) as this job holds
            it now; another world size or sharding than the save's is resharded.
        config: the job's configuration.
        **dcp_load_kwargs: passed to ``dcp.load`` (``planner``, ``process_group``...).

    Returns:
        The step loaded, the same on every rank.

    Raises:
        NoCheckpointError: no step loads (the message names every tier searched and why
            each step there was passed over).
        CheckpointException: DCP's, for an error that is not about the step's data (a
            ``state_dict`` that does not match the checkpoint, say): raised as is.
    """
    step, _ = resume(config, lambda reader: load_planned_alone(state_dict, reader, **dcp_load_kwargs))
    return step


def load_planned_alone(state_dict: dict[str, Any], reader: TieredReader, **dcp_load_kwargs: Any) -> None:
    """``dcp.load`` with ``reader``, each rank planning its own reads: once the ranks agreed
    on the step (``reader.open``), a load needs no global plan unless it is spread over the
    job (``TieredReader.needs_global_plan``), and DCP's gather and scatter of the plans
    through rank 0 (and its all-gather at the end) grow with the job while each rank's
    plan is its own. One all-reduce after it tells every rank whether every rank loaded;
    where one failed, every rank raises DCP's ``CheckpointException`` with every rank's
    error, as ``dcp.load`` does (``resume`` then passes the step over on every rank).
    A ``process_group`` or ``no_dist`` given, a planner with a global plan of its own (DCP's
    default one leaves the ranks' plans as they are), or a spread load, goes through
    ``dcp.load``'s own planning."""
    reader.open()
    planner = dcp_load_kwargs.get("planner")
    if (
        not worlds.dist_up()
        or reader.needs_global_plan()
        or {"process_group", "no_dist"} & set(dcp_load_kwargs)
        or _plans_globally(planner)
    ):
        dcp.load(state_dict, storage_reader=reader, **dcp_load_kwargs)
        return
    error: BaseException | None = None  # this rank's, as DCP wrapped it (alone: its rank 0's)
    try:
        dcp.load(state_dict, storage_reader=reader, no_dist=True, **dcp_load_kwargs)
    except (Exception, CheckpointException) as e:  # every rank learns of it below, and raises it
        error = e
    if all_agree(error is None)[0]:
        return
    own = None if error is None else _wrapped(error)
    mine = {} if own is None else {"type": type(own[0]).__name__, "message": str(own[0])[:ERROR_CHARS]}
    errors = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode())]  # JSON, no pickle
    me = dist.get_rank()
    failures = {  # DCP's shape: (exception, its traceback); this rank's its own
        rank: own if rank == me and own is not None else (_as_error(t, reader.step), tb.StackSummary())
        for rank, t in enumerate(errors)
        if t
    }
    raise CheckpointException("load", failures)


def _plans_globally(planner: object) -> bool:
    """Whether a user's load planner does something across the ranks' plans (DCP's
    ``DefaultLoadPlanner.create_global_plan`` returns them unchanged)."""
    if planner is None:
        return False
    own = getattr(type(planner), "create_global_plan", None)
    return own is not DefaultLoadPlanner.create_global_plan


def _wrapped(error: BaseException) -> tuple[BaseException, tb.StackSummary]:
    """A load's error as DCP keeps it: the (exception, traceback) it wrapped, else its own."""
    if isinstance(error, CheckpointException) and error.failures:
        got = next(iter(error.failures.values()))
        return got if isinstance(got, tuple) else (got, tb.StackSummary())
    return error, tb.extract_tb(error.__traceback__)


def _as_error(sent: dict[str, str], step: int) -> BaseException:
    """Another rank's error, as it sent it: tiered-dcp's data errors keep their class (``resume``
    passes the step over for them); anything else is a ``TieredCheckpointError`` naming it."""
    if sent["type"] == "CheckpointCorruptError":
        return CheckpointCorruptError(sent["message"], step=step)
    if sent["type"] == "NoCheckpointError":
        return NoCheckpointError(sent["message"])
    return TieredCheckpointError(f"{sent['type']}: {sent['message']}")


def resume(
    config: TieredConfig,
    load: Callable[[TieredReader], T],
    *,
    caller: str = "load_latest",
    unusable: Callable[[int], str | None] | None = None,
    no_dist: bool = False,
) -> tuple[int, T]:
    """Choose the newest good step (``TieredReader(config)``), ``load(reader)`` it, and on a
    failure for the step's data exclude it and choose again; return the step loaded and what
    ``load`` returned. ``unusable(step)``, when given, is asked first: a reason passes the
    step over without loading it. Every rank must call this with the same arguments, and
    ``unusable`` must answer the same on every rank (its answer may come from a collective:
    every rank asks about the same steps in the same order). One warning (rank 0, naming
    ``caller``) lists the newer steps passed over; ``NoCheckpointError`` when none loads.
    ``no_dist``: this process alone (``TieredReader``'s), whatever process group there is.
    """
    failed: dict[int, str] = {}  # steps excluded here, and why
    skipped: dict[int, str] = {}
    while True:
        try:
            reader = TieredReader(config, exclude=failed, no_dist=no_dist).open()  # every rank
        except CheckpointCorruptError as e:  # the cluster's metadata of the chosen step is bad
            if e.step is None or e.step in failed:
                raise
            failed[e.step] = str(e)
            continue
        skipped.update(reader.skipped)
        why = unusable(reader.step) if unusable is not None else None
        if why:
            failed[reader.step] = why
            continue
        try:
            with transport.watching_peers(reader.step, "the load"):  # DCP's collectives raise torch's
                loaded = load(reader)
        except (CheckpointException, CheckpointCorruptError, NoCheckpointError) as e:
            why = _data_failure(e)
            if why is None or reader.step in failed:
                raise
            failed[reader.step] = why
            continue
        _warn(caller, reader.step, {**skipped, **failed})
        return reader.step, loaded


def unwrapped(e: CheckpointException) -> CheckpointException | CheckpointCorruptError:
    """Our error about the step's data that DCP wrapped in its ``CheckpointException`` (one
    line, what to do), else ``e`` itself."""
    why = _data_failure(e)
    return e if why is None else CheckpointCorruptError(why)


def failures_of(e: BaseException) -> list[BaseException]:
    """The ranks' exceptions DCP wrapped in its ``CheckpointException`` (else ``[e]``)."""
    failures = getattr(e, "failures", None)  # rank -> exception (torch >= 2.7: (exception, traceback))
    errors = list(failures.values()) if isinstance(failures, dict) and failures else [e]
    return [f[0] if isinstance(f, tuple) and f else f for f in errors]


def _data_failure(e: BaseException) -> str | None:
    """Why the load failed, when it failed for the step's data (another step may load);
    None when it failed for any other reason."""
    ours = [f for f in failures_of(e) if isinstance(f, CheckpointCorruptError | NoCheckpointError)]
    return "; ".join(dict.fromkeys(str(f) for f in ours)) if ours else None


def _warn(caller: str, step: int, passed: dict[int, str]) -> None:
    newer = {s: why for s, why in passed.items() if s > step}
    if newer and (not worlds.dist_up() or dist.get_rank() == 0):
        log.warning("%s loaded step %d, passing over %s", caller, step, describe_skipped(newer))
