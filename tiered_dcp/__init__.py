"""tiered-dcp: a tiered storage backend for torch.distributed.checkpoint.

dcp.save(state, storage_writer=TieredWriter(config, step=step))
dcp.save(state, storage_writer=TieredWriter(config, step=step), planner=TieredSavePlanner())
dcp.load(state, storage_reader=TieredReader(config))
step = load_latest(state, config)  # the resume call: the newest step that loads

The public names load on first use (PEP 562), so that a process that needs only the
torch-free parts (the writer process, ``tiered_dcp.storage``) never imports torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from .config import Tier, TieredConfig
from .errors import (
    AbortedError,
    CheckpointCorruptError,
    NoCheckpointError,
    NonFiniteStateError,
    PeerLostError,
    ReplicaMismatchError,
    SnapshotError,
    TieredCheckpointError,
)

# torch's dcp.save/dcp.load warn on every call without a process group that they assume "a
# single process". TieredWriter and TieredReader work without one by design (the quickstart,
# a notebook, export/import): that one message is silenced, matched exactly, for saves and
# loads alike, and no other warning; in this process it is silenced for any storage writer.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is disabled, unavailable or uninitialized, "
    r"assuming the intent is to (save|load) in a single process\.$",
    category=UserWarning,
)

if TYPE_CHECKING:
    from .api import (
        WriterInfo,
        export,
        host_memory,
        import_dcp,
        latest_step,
        shutdown,
        status,
        wait_for,
        writer_status,
    )
    from .inprocess import abort
    from .load.reader import TieredReader
    from .load.resume import load_latest
    from .planners.tiered_save import TieredSavePlanner
    from .save.host_memory import HostMemory
    from .save.preemption import on_preemption, preemption_requested
    from .save.writer import TieredWriter
    from .steps.status import StepState

_LAZY = {
    "HostMemory": ".save.host_memory",
    "StepState": ".steps.status",
    "TieredReader": ".load.reader",
    "TieredSavePlanner": ".planners.tiered_save",
    "TieredWriter": ".save.writer",
    "WriterInfo": ".api",
    "abort": ".inprocess",
    "export": ".api",
    "host_memory": ".api",
    "import_dcp": ".api",
    "latest_step": ".api",
    "load_latest": ".load.resume",
    "on_preemption": ".save.preemption",
    "preemption_requested": ".save.preemption",
    "shutdown": ".api",
    "status": ".api",
    "wait_for": ".api",
    "writer_status": ".api",
}

__all__ = [
    "AbortedError",
    "CheckpointCorruptError",
    "HostMemory",
    "NoCheckpointError",
    "NonFiniteStateError",
    "PeerLostError",
    "ReplicaMismatchError",
    "SnapshotError",
    "StepState",
    "Tier",
    "TieredCheckpointError",
    "TieredConfig",
    "TieredReader",
    "TieredSavePlanner",
    "TieredWriter",
    "WriterInfo",
    "abort",
    "export",
    "host_memory",
    "import_dcp",
    "latest_step",
    "load_latest",
    "on_preemption",
    "preemption_requested",
    "shutdown",
    "status",
    "wait_for",
    "writer_status",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
