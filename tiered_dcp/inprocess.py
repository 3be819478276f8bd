"""Recovery inside the job: what a training loop that restarts in its processes calls.

NVIDIA's in-process restart (nvidia-resiliency-ext's ``inprocess.Wrapper``), torchft, or a
user's own loop catch a fault, tear down the process groups, build new ones (the world may
have shrunk, or a spare taken a gone rank's place) and call the training function again,
which reloads with ``load_latest``. tiered-dcp keeps what outlives a world (the writer
process, the RAM tier's part files, the staging buffers: the next save faults no page
again) and forgets what belongs to it (``ranks.worlds.World``: group names, store
clients, store keys, the failure domains gathered, the plans' worlds), by itself when the
default process group changes, at once with ``abort``.

``result(future)`` waits for an async save and raises a failed one as an ordinary
exception (DCP's ``CheckpointException`` is a ``BaseException``, which NvRx's Wrapper does
not restart from). ``abort()`` is the plain call; ``Abort`` is the same as an NvRx ``Abort`` hook, composed
with NvRx's own: ``inprocess.Compose(tiered_dcp.inprocess.Abort(), AbortTorchDistributed())``
(the Wrapper runs the last one first: ours after the process groups are torn down). A
job that passes neither still recovers: the first call in the new world starts afresh.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .ranks import worlds

log = logging.getLogger(__name__)

ABORT_WAIT = 1.0  # seconds ``abort`` gives the uploads at work to finish (after a fault most cannot)
POLL = 0.05  # seconds ``result`` waits at a time: an interruption gets in between


def abort(timeout: float = ABORT_WAIT) -> int:
    """Leave the current world: every wait of this process on other ranks ends now, and
    every save or load in flight fails (``AbortedError``, naming the abort) instead of
    waiting for a rank that is gone. Waits up to ``timeout`` seconds for this process's
    saves to stop (``worlds.working``): a plain ``future.result()`` returns by then on every
    rank. Returns how many were still at work (a transfer to a peer that hangs without
    closing its connection ends at ``peer_timeout``). Nothing is committed half: a step
    commits only once every rank agreed, and a rank that leaves marks the agreement it
    waited in, so that no rank commits it. Call it on every rank after a fault, before the
    next world's first save or load; torchrun restarts (fresh processes) need nothing.

    Args:
        timeout: seconds to wait for this process's saves to stop, after cutting them.

    Returns:
        How many saves were still at work after ``timeout``.

    Raises:
        ValueError: a negative ``timeout``.
    """
    if timeout < 0:
        raise ValueError(f"abort: timeout={timeout!r} must be >= 0 seconds")
    worlds.leave_world("tiered_dcp.abort")
    left = worlds.wait_quiet(timeout)
    if left:
        log.warning(
            "tiered-dcp abort: %d async save(s) still at work after %.1f s (a transfer to a peer "
            "that hangs ends at peer_timeout); never committed",
            left,
            timeout,
        )
    return left


def result(save: Any, timeout: float | None = None) -> Any:
    """Wait for an async save (``dcp.async_save``'s future, or its ``AsyncSaveResponse`` with
    background staging) and return its result; a failed save raises
    ``TieredCheckpointError``, an ordinary ``Exception``, from DCP's ``CheckpointException``
    (a ``BaseException``, which NvRx's Wrapper takes as the end of the job, not as a fault to
    restart from). The ranks' own errors are its message and its ``__cause__``'s.

    It waits in slices of ``POLL`` seconds: a plain ``future.result()`` blocks in a lock that
    NvRx's restart (an exception raised in the training thread by its monitor) cannot enter,
    so a save stuck in a collective with a lost rank held the restart until the process
    group's timeout.

    Args:
        save: the future ``dcp.async_save`` returned, or its ``AsyncSaveResponse``.
        timeout: seconds to wait at most (None: until the save ends).

    Returns:
        What the future returns (DCP's ``Metadata`` of the step).

    Raises:
        TieredCheckpointError: the save failed (each rank's error in the message).
        TimeoutError: ``timeout`` passed first (``concurrent.futures.TimeoutError``).
    """
    import concurrent.futures

    from torch.distributed.checkpoint.api import CheckpointException

    from .errors import TieredCheckpointError
    from .load.resume import failures_of

    future = getattr(save, "upload_completion", save)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = POLL if deadline is None else min(POLL, max(deadline - time.monotonic(), 0.0))
            try:
                return future.result(timeout=left)
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
    except CheckpointException as e:
        why = "; ".join(dict.fromkeys(f"{type(f).__name__}: {f}" for f in failures_of(e)))
        raise TieredCheckpointError(f"the async save failed: {why[:2000]}") from e


try:  # an NvRx Abort where NvRx is installed (the Wrapper checks its hooks' types)
    from nvidia_resiliency_ext.inprocess.abort import Abort as _NvRxAbort
except ImportError:  # pragma: no cover - NvRx is optional
    _NvRxAbort = object  # type: ignore[assignment,misc]


class Abort(_NvRxAbort):  # type: ignore[valid-type,misc]
    """``abort`` as an NvRx ``inprocess`` abort hook: called with the Wrapper's frozen
    state, which it returns unchanged.

    Args:
        timeout: as ``abort``'s.
    """

    def __init__(self, timeout: float = ABORT_WAIT) -> None:
        self.timeout = timeout

    def __call__(self, state: Any) -> Any:
        abort(self.timeout)
        return state
