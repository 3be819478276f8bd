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
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
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


# Module paths the docs named before the library was grouped into sub-packages: each still
# imports, as the very module at its new path (one module object: its classes stay the same).
MOVED = {
    "tiered_dcp.goodput": "tiered_dcp.metrics.goodput",
    "tiered_dcp.hostmem": "tiered_dcp.save.host_memory",
    "tiered_dcp.private_dir": "tiered_dcp.writer_process.private_dir",
    "tiered_dcp.scores": "tiered_dcp.metrics.scores",
    "tiered_dcp.tools": "tiered_dcp.cli",
    "tiered_dcp.tools.drill": "tiered_dcp.cli.drill",
    "tiered_dcp.verify": "tiered_dcp.ops.verify",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path in ``MOVED`` (or below one) to the module at its new one."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = next((o for o in MOVED if fullname == o or fullname.startswith(o + ".")), None)
        if old is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=MOVED[old] + fullname[len(old) :])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to ours next
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own again: relative imports work
        # nothing to run: the module ran under its own name


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finders: one module object


def __getattr__(name: str) -> Any:
    if f"{__name__}.{name}" in MOVED:  # tiered_dcp.verify.verify_step after a bare import
        return importlib.import_module(MOVED[f"{__name__}.{name}"])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
