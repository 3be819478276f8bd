"""Preemption: a SIGTERM lets the async saves in flight finish, then ends the process or
lets the loop take one last (emergency) save; a SIGTERM that meets a broken world ends it
at once.

Installed (in the main thread) by the first async save whose writer has
``handle_sigterm=True``, the default, or by the first ``preemption_requested()`` /
``on_preemption()`` call. On SIGTERM it lets the writer processes run (a copy it
interrupted no longer pauses them: ``run_dir.StagingLock.let_go``) and tells the two
reasons for a SIGTERM apart (``_judge``):

- a preemption: every peer is alive. It waits up to ``WAIT_SECONDS`` for every staged save
  of this process to finish its upload (committed on its fastest tier and handed to the
  writer process, which then finishes the slower tiers on its own), but for a copy the
  signal interrupted on the handler's own thread, which cannot go on while it waits;
- a launcher restarting the job after a fault (torchrun, NvRx's ft_launcher): a rank is
  gone, and a save that needs it can never commit. The saves are abandoned at once
  (``worlds.leave_world``: never committed half) and the process ends, before the
  launcher's own stop timeout would kill it. A rank is gone when its process on this host
  is (the world's processes per host: ``worlds.ranks_on_this_host``), or when a save of
  this process has waited ``GRACE`` seconds on other ranks while not every rank of the
  world has been told to stop (a rank on another host, with its node), or when the job's
  store has not answered for ``GRACE`` seconds while no upload of this process is at work
  (its host is gone, rank 0 under torchrun or NvRx's ft_launcher: the saves' waits on it
  failed, and a failed save stays counted in flight while the loop the signal interrupted
  holds its future).

Then it passes the signal on: to the handler that was there before, or, if that was the
default, by restoring the default and raising the signal again so the process ends exactly
as it would have. A sync ``dcp.save`` runs in the main thread, where the handler runs too,
so it cannot be waited for; the previous step stays loadable.

A loop that asks ``preemption_requested()`` (or registered ``on_preemption``) takes the end
into its own hands: the handler then records the request, runs the callbacks and returns at
once instead of waiting and ending the process, so that the loop can wait for its pending
async save, save its current step at the next step boundary
(``TieredWriter(config, step, emergency=True)``) and exit. Several ranks must
agree on the step that is saved, so ``preemption_requested`` asks the process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tiered_dcp.storage.owners import pid_alive

from ..ranks import worlds
from ..writer_process.client import handles
from .staging import POOL

log = logging.getLogger(__name__)

WAIT_SECONDS = float(os.environ.get("TIERED_DCP_SIGTERM_WAIT", "300"))
ASK_EVERY = 1.0  # seconds between the judge's questions to the job's store (every rank asks it)
GRACE = 2.0  # seconds a save may wait on ranks not all told to stop before the world is judged broken
TOLD = "tiered_dcp/sigterm"  # the world's count of ranks told to stop (the job's store)

_previous: Any = None
_installed = False
_deferred = False  # the loop saves and exits itself: the handler does not end the process
_requested = False
_callbacks: list[Callable[[], None]] = []


def install() -> bool:
    """Install the handler once; False where that is impossible (not the main thread)."""
    global _previous, _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        log.debug("not in the main thread: SIGTERM handler not installed")
        return False
    _previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True
    return True


def uninstall() -> None:
    """Put back the handler that was there before ``install``."""
    global _installed
    if _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        _installed = False


def _local_request(deferred: bool) -> bool:
    """Install the handler (in deferring mode if asked); whether this process got a SIGTERM."""
    global _deferred
    if deferred and not _deferred:
        if not install():
            raise RuntimeError(
                "tiered_dcp: preemption_requested()/on_preemption() must first be called from the main "
                "thread, where Python runs signal handlers"
            )
        _deferred = True
    return _requested


def preemption_requested(group: Any = None) -> bool:
    """True once this job was told to stop (SIGTERM): save the current step and exit.

    The first call installs the SIGTERM handler in deferring mode: a SIGTERM then only
    records the request (the loop waits for its pending async save before the emergency
    save), instead of ending the process. With a process group
    every rank must call this at the same points (e.g. once per step): the answer is agreed
    over ``group`` (default: the default group), so all ranks save the same step.

    Args:
        group: the process group to agree over (a collective); None: the default group.

    Returns:
        Whether any rank was told to stop.

    Raises:
        RuntimeError: the first call is not made from the main thread (where Python runs
            signal handlers).
    """
    mine = _local_request(deferred=True)
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    backend = str(dist.get_backend(group))
    on_cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def on_preemption(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when a SIGTERM arrives.

    It runs in the main thread, inside the signal handler, between two bytecodes of the
    loop: keep it short (set a flag, log). Registering one installs the handler in
    deferring mode, as ``preemption_requested`` does: the process is not ended.

    Args:
        callback: called with no arguments.

    Raises:
        RuntimeError: the first such call is not made from the main thread.
    """
    _local_request(deferred=True)
    _callbacks.append(callback)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _requested
    first = not _requested
    _requested = True
    if _deferred:
        # No wait here: the loop waits for its own async save before the emergency save. The
        # handler may have interrupted the loop inside async_save, holding the staged copy that
        # keeps that save counted in flight, so waiting here could only time out.
        if first:
            log.warning("SIGTERM: preemption requested; the loop saves its step at its next step boundary")
            for callback in _callbacks:
                callback()
        if callable(_previous):
            _previous(signum, frame)
        return
    for handle in handles():  # the writers copy down the tiers throughout the grace period
        handle.rd.writer.staging.let_go()
    here = threading.get_ident()  # a copy this handler interrupted cannot finish meanwhile
    pending = POOL.in_flight(besides=here)
    if pending:
        _finish_or_abandon(pending, here)
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default action: end the process the way SIGTERM would have
        uninstall()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _finish_or_abandon(pending: int, here: int) -> None:
    """Wait for the ``pending`` saves while every peer they need is alive; abandon them at
    once when one is gone (``_judge``). Says in the log which it was."""
    started = time.monotonic()
    judge = _Judge()
    while True:
        if POOL.wait_idle(0.1, besides=here):
            log.warning(
                "SIGTERM (every peer alive): %d checkpoint save(s) in flight finished in %.1f s",
                pending,
                time.monotonic() - started,
            )
            return
        gone = judge.gone(started)
        if gone is not None:
            log.warning(
                "SIGTERM after a fault: %s; the %d save(s) in flight can never commit and are "
                "abandoned (never committed half); exiting now",
                gone,
                pending,
            )
            worlds.leave_world(f"SIGTERM, {gone}")
            worlds.wait_quiet(1.0)  # the saves' threads drop what they wrote
            return
        if time.monotonic() - started > WAIT_SECONDS:
            log.error("SIGTERM: save(s) still in flight after %.0f s; exiting anyway", WAIT_SECONDS)
            return


class _Judge:
    """Whether a rank this process's saves need is gone, asked again as the saves wait.

    This rank counts itself as told to stop in the world's store, once; the store is asked
    on a thread, for at most a second: it lives with rank 0 or the launcher, which may be
    what died (then nothing is told, and the timed rule alone decides)."""

    def __init__(self) -> None:
        self.world = worlds.current()
        self.host: list[tuple[int, int]] = []  # (rank, pid) of the world's ranks on this host
        self.told: int | None = None  # how many ranks were told to stop, as last asked
        self.asked = -ASK_EVERY  # when the store was last asked
        self.silent_since: float | None = None  # since when the store has not answered
        if self.world is not None:
            self._ask(lambda w: w.store.add(TOLD, 1))

    def gone(self, started: float) -> str | None:
        """None while the saves may yet finish; else what is gone, in words."""
        w = self.world
        if w is None:
            return None
        now = time.monotonic()
        if now - self.asked >= ASK_EVERY:  # the store, once a second; the pids at every look
            self.asked = now
            self.host = self._ask(worlds.ranks_on_this_host) or self.host
            self.told = self._ask(lambda w: w.store.add(TOLD, 0))
            self.silent_since = None if isinstance(self.told, int) else self.silent_since or now
        dead = [rank for rank, pid in self.host if not pid_alive(pid)]  # a zombie is gone too
        if dead:
            return f"rank(s) {dead} of this host are gone"
        if self.silent_since is not None and now - self.silent_since >= GRACE and not worlds.wait_quiet(0):
            # no commit is agreed without the store and no upload of ours is at work: what is
            # in flight failed already (its future, held by the interrupted loop, keeps its
            # staged state counted) or can never commit
            return f"the job's store has not answered for {now - self.silent_since:.1f} s (its host is gone)"
        stuck = [x for x in worlds.waits_now() if now - x.since >= GRACE]
        if not stuck or now - started < GRACE:
            return None
        if self.told is not None and self.told >= w.size:
            return None  # every rank was told to stop: a preemption, all alive
        ranks = sorted({r for x in stuck for r in x.ranks})
        who = f"rank(s) {ranks}" if ranks else "a rank"
        waited = f"{now - stuck[0].since:.1f} s during {stuck[0].what}"
        return f"{who} did not answer for {waited}, and not every rank was told to stop"

    def _ask(self, question: Callable[[worlds.World], Any]) -> Any:
        out: list[Any] = []

        def run() -> None:
            with contextlib.suppress(Exception):
                out.append(question(self.world))

        t = threading.Thread(target=run, daemon=True, name="tiered-dcp-sigterm")
        t.start()
        t.join(1.0)
        return out[0] if out else None
