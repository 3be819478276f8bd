"""Exceptions a user can catch; all derive from TieredCheckpointError."""


class TieredCheckpointError(Exception):
    """Base class of every error tiered-dcp raises on purpose."""


class NoCheckpointError(TieredCheckpointError):
    """No complete checkpoint (or not the requested step) on any tier; names each tier searched."""


class CheckpointCorruptError(TieredCheckpointError):
    """A checksum mismatch with no good copy left; names the file and the item.

    ``step``: the step that failed (quarantined when found while loading it), where known.
    """

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self) -> tuple:  # DCP sends a rank's failure to the others pickled
        return (type(self), (str(self), self.step))


class PeerLostError(TieredCheckpointError):
    """A peer rank stopped answering during a save or a load (it died, or its node did).

    ``step``: the step being saved or loaded (None: the newest, not chosen yet); ``phase``:
    what the job was doing (the replica exchange, the commit agreement, opening a step...);
    ``ranks``: the ranks that did not answer, where known (empty: unknown). The gloo or store
    error that showed it is chained as ``__cause__``.
    """

    def __init__(self, message: str, step: int | None = None, phase: str = "", ranks: tuple = ()) -> None:
        super().__init__(message)
        self.step, self.phase, self.ranks = step, phase, tuple(ranks)

    def __reduce__(self) -> tuple:  # DCP sends a rank's failure to the others pickled
        return (type(self), (str(self), self.step, self.phase, self.ranks))


class NonFiniteStateError(TieredCheckpointError):
    """A save met NaN/Inf in a floating tensor with ``on_nonfinite="raise"``; names the items."""


class ReplicaMismatchError(TieredCheckpointError):
    """A save found data-parallel replicas of an item that disagree, with
    ``on_replica_mismatch="raise"``: the step is not committed.

    ``step``: the step; ``items``: the items whose copies differ; ``ranks``: the ranks holding
    the odd copies (with two copies, both). The message names each item, the ranks and their
    nodes."""

    def __init__(self, message: str, step: int | None = None, items: tuple = (), ranks: tuple = ()) -> None:
        super().__init__(message)
        self.step, self.items, self.ranks = step, tuple(items), tuple(ranks)

    def __reduce__(self) -> tuple:  # DCP sends a rank's failure to the others pickled
        return (type(self), (str(self), self.step, self.items, self.ranks))


class SnapshotError(TieredCheckpointError, TypeError):
    """``async_save`` staging met a value it cannot snapshot; names its key and type."""


class AbortedError(TieredCheckpointError):
    """A save or load was cut because this process left its world while it waited on other
    ranks (``tiered_dcp.abort``; a SIGTERM that found a rank gone): it is never committed.

    ``step``: the step (None: the newest, not chosen yet); ``phase``: what it was waiting in.
    """

    def __init__(self, message: str, step: int | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.step, self.phase = step, phase

    def __reduce__(self) -> tuple:  # DCP sends a rank's failure to the others pickled
        return (type(self), (str(self), self.step, self.phase))
