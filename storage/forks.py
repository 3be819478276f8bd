"""What a forked child must not inherit: the one registry of tiered-dcp's per-process state.

A child forked from a process that used tiered-dcp (multiprocessing's default start method
on Linux: an evaluation or an export forked from the trainer) gets copies of its thread
pools, locks and counters without the threads behind them: work it queues on a copied pool
never runs, and a lock copied while another thread held it is never released. Every
module that keeps such state registers here how a child makes it anew
(``renew_in_child``, ``ThreadPool``); ``os.register_at_fork`` runs them in the child,
in the order they were registered. A child then saves and loads on its own, with its own
writer process, and never touches or waits for its parent's saves in flight.

Cleanups that act on shared things (a lease file, a directory) run only in the process
that registered them (``finalize``): a child exiting must not release its parent's.

Torch-free (the writer process imports the storage modules that register here), and in
``storage``, the package every other one imports.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_RENEWALS: list[Callable[[], None]] = []


def renew_in_child(renew: Callable[[], None]) -> Callable[[], None]:
    """Run ``renew()`` in every child forked from now on (a decorator: returns ``renew``)."""
    _RENEWALS.append(renew)
    return renew


def _in_child() -> None:
    for renew in _RENEWALS:
        renew()


os.register_at_fork(after_in_child=_in_child)


class ThreadPool:
    """A ``ThreadPoolExecutor`` made at its first use and made anew in a forked child.

    ``workers`` is called at that moment (a rank's share of the cores, say)."""

    def __init__(self, name: str, workers: int | Callable[[], int]) -> None:
        self.name, self.workers = name, workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        renew_in_child(self._forget)

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                n = self.workers() if callable(self.workers) else self.workers
                self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=self.name)
            return self._pool

    def _forget(self) -> None:
        """The parent's pool has no threads here: its queued work is never run, nor waited for."""
        self._pool, self._lock = None, threading.Lock()


def finalize(obj: Any, fn: Callable[..., Any], *args: Any) -> weakref.finalize:
    """``weakref.finalize(obj, fn, *args)`` that does nothing in a forked child (whose exit
    runs every finalizer it inherited): only this process releases what it took."""
    return weakref.finalize(obj, _in_process, os.getpid(), fn, *args)


def _in_process(pid: int, fn: Callable[..., Any], *args: Any) -> None:
    if os.getpid() == pid:
        fn(*args)
