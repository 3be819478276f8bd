"""tiered-dcp: a tiered storage backend for torch.distributed.checkpoint.

dcp.save(state, storage_writer=TieredWriter(config, step=step))
dcp.load(state, storage_reader=TieredReader(config))
"""

from .api import WriterInfo, export, latest_step, shutdown, status, wait_for, writer_status
from .catalog import StepState
from .config import Tier, TieredConfig
from .errors import CheckpointCorruptError, NoCheckpointError, SnapshotError, TieredCheckpointError
from .reader import TieredReader
from .writer import TieredWriter

__all__ = [
    "CheckpointCorruptError",
    "NoCheckpointError",
    "SnapshotError",
    "StepState",
    "Tier",
    "TieredCheckpointError",
    "TieredConfig",
    "TieredReader",
    "TieredWriter",
    "WriterInfo",
    "export",
    "latest_step",
    "shutdown",
    "status",
    "wait_for",
    "writer_status",
]
__version__ = "0.1.0"
