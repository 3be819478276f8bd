"""Job-level helpers: the newest step, per-tier status, and export to stock DCP."""

from __future__ import annotations

import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .catalog import StepState, complete_steps, views
from .config import TieredConfig, here
from .reader import TieredReader


def latest_step(config: TieredConfig) -> int | None:
    """The newest step complete on some tier, as seen from this process (no collectives)."""
    node, rank = here()
    steps = complete_steps(config, node, rank)
    return max(steps) if steps else None


def status(config: TieredConfig) -> list[StepState]:
    """Every step on every tier with its state (writing / clean / committed / incomplete)."""
    node, rank = here()
    return [row for view in views(config, node, rank) for row in view.states()]


def export(config: TieredConfig, step: int | None, dest: str | os.PathLike) -> str:
    """Write ``step`` (None: the newest) as a stock DCP directory ``FileSystemReader`` loads.

    Runs in one process and holds the whole (unsharded) state in memory while it copies.
    """
    reader = TieredReader(config, step, no_dist=True)
    state: dict = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    dest = os.fspath(dest)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dest), no_dist=True)
    return dest
