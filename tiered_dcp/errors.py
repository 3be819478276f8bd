"""Exceptions a user can catch; all derive from TieredCheckpointError."""


class TieredCheckpointError(Exception):
    """Base class of every error tiered-dcp raises on purpose."""


class NoCheckpointError(TieredCheckpointError):
    """No complete checkpoint (or not the requested step) on any tier; names each tier searched."""


class CheckpointCorruptError(TieredCheckpointError):
    """A checksum mismatch with no good copy left; names the file and the item."""


class SnapshotError(TieredCheckpointError, TypeError):
    """``async_save`` staging met a value it cannot snapshot; names its key and type."""
