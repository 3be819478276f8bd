"""What DCP's ``async_save`` does not tell its stager, read off its call; and its
collectives, moved off the group the training uses.

DCP does not tell the stager how the save will upload: in a thread of this process
(THREAD mode) or in a process of DCP's own (PROCESS mode, which pickles the staged copy),
nor on which group. ``async_save_args`` reads them off the running ``async_save``'s frame
(``None`` where there is none, or torch keeps them otherwise): staging takes its first copy
where it will live in PROCESS mode (``ships_to_a_process``), and:

``dcp.async_save`` without a ``process_group`` runs the save's collectives (its planning,
its final gather) on the default group, from a thread of its own, while the training
thread runs its collectives there too (DDP's all-reduces, FSDP's all-gathers): the two
threads' collectives interleave on one group and both wait forever, with no message.

So an async save in DCP's THREAD mode whose collectives would run on the default group is
moved onto a gloo group of tiered-dcp's, over the same ranks in the same order: made once
per world (``worlds.World``), at the first such save, on the thread that calls
``async_save``, where every rank makes it at the same point of its program
(``prepare``); then the save's own thread hands it to the save (``move``), in the save's
first hook, before DCP's first collective of it. A group the caller passed is kept, as is
a save in DCP's PROCESS mode (its process has a group of its own) or a sync ``dcp.save``
(its collectives run in order with the training's, on the training's thread).

DCP keeps the group of a save in its ``_DistWrapper``, built before any hook of the
storage writer runs; ``move`` finds it on the save thread's stack and sets its group.
Where torch keeps it elsewhere (a future release), nothing is moved and a warning says
what to pass instead (``test_torchrun``'s DDP job fails on such a torch).
"""

from __future__ import annotations

import inspect
import logging
import sys
from types import CodeType, FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..ranks import worlds

log = logging.getLogger(__name__)

DEPTH = 12  # frames looked through, from the hook up to DCP's function


_ASYNC_SAVE = inspect.unwrap(state_dict_saver.async_save).__code__
_SAVE = inspect.unwrap(state_dict_saver._save_state_dict).__code__


def async_save_args() -> dict[str, Any] | None:
    """The running ``dcp.async_save``'s ``process_group`` and ``async_checkpointer_type``,
    seen from its stager; None outside one (or where torch keeps them otherwise)."""
    return _locals_of(_ASYNC_SAVE, ("process_group", "async_checkpointer_type"))


def ships_to_a_process() -> bool:
    """Whether the ``dcp.async_save`` staging now uploads in DCP's PROCESS mode, whose
    background process receives the staged copy (``staging.StagedStateDict``)."""
    args = async_save_args()
    return args is not None and args["async_checkpointer_type"] == AsyncCheckpointerType.PROCESS


def calls_back(shipped: bool) -> bool:
    """Whether the running ``dcp.async_save`` calls its stager's ``synchronize_staging`` on
    this thread once it has handed the copy ``stage`` returned to its upload thread: in its
    THREAD mode (``shipped``: PROCESS mode, whose upload pickles the writer first)."""
    return not shipped and async_save_args() is not None


def prepare() -> None:
    """On the thread calling ``dcp.async_save``: this world's save group, made if the save
    runs DCP's collectives on the default group in its THREAD mode."""
    if worlds.size() == 1:
        return
    args = async_save_args()
    if args is not None:
        thread_mode = args["async_checkpointer_type"] == AsyncCheckpointerType.THREAD
        if not (thread_mode and _is_default(args["process_group"])):
            return
    w = worlds.world()
    if w.dcp_group is None:
        w.dcp_group = dist.new_group(backend="gloo", group_desc="tiered_dcp_async_saves")


def move() -> bool:
    """On the save's own thread, in its first hook: the save's collectives onto this
    world's save group (``prepare``), where they would run on the default group. Whether
    they were moved."""
    group = worlds.world().dcp_group if worlds.dist_up() else None
    if group is None:
        return False
    found = _locals_of(_SAVE, ("distW",))
    if found is None or not hasattr(found["distW"], "group"):
        log.warning(
            "this torch keeps an async save's process group where tiered-dcp does not look: "
            "its collectives stay on the default group; pass dcp.async_save(..., "
            "process_group=dist.new_group(backend='gloo')) if the training runs collectives meanwhile"
        )
        return False
    wrapper = found["distW"]
    if not _is_default(wrapper.group):
        return False
    wrapper.group = group
    return True


def _is_default(group: Any) -> bool:
    return group is None or group is distributed_c10d._get_default_group()


def _locals_of(code: CodeType, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The locals ``names`` of the nearest caller frame running ``code``."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            local = frame.f_locals
            return {n: local[n] for n in names} if all(n in local for n in names) else None
        frame = frame.f_back
    return None
