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
from typing import TYPE_CHECKING, Any

from .config import Tier, TieredConfig
from .errors import (
    CheckpointCorruptError,
    NoCheckpointError,
    NonFiniteStateError,
    PeerLostError,
    SnapshotError,
    TieredCheckpointError,
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
    from .hostmem import HostMemory
    from .planners.tiered_save import TieredSavePlanner
    from .preemption import on_preemption, preemption_requested
    from .reader import TieredReader
    from .resume import load_latest
    from .step_status import StepState
    from .writer import TieredWriter

_LAZY = {
    "HostMemory": ".hostmem",
    "StepState": ".step_status",
    "TieredReader": ".reader",
    "TieredSavePlanner": ".planners.tiered_save",
    "TieredWriter": ".writer",
    "WriterInfo": ".api",
    "export": ".api",
    "host_memory": ".api",
    "import_dcp": ".api",
    "latest_step": ".api",
    "load_latest": ".resume",
    "on_preemption": ".preemption",
    "preemption_requested": ".preemption",
    "shutdown": ".api",
    "status": ".api",
    "wait_for": ".api",
    "writer_status": ".api",
}

__all__ = [
    "CheckpointCorruptError",
    "HostMemory",
    "NoCheckpointError",
    "NonFiniteStateError",
    "PeerLostError",
    "SnapshotError",
    "StepState",
    "Tier",
    "TieredCheckpointError",
    "TieredConfig",
    "TieredReader",
    "TieredSavePlanner",
    "TieredWriter",
    "WriterInfo",
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
