"""Preemption: a SIGTERM lets the async saves in flight finish before the process ends.

Installed (in the main thread) by the first async save whose writer has
``handle_sigterm=True``, the default. On SIGTERM it waits up to ``WAIT_SECONDS`` for every
staged save of this process to finish its upload (committed on its fastest tier and
handed to the writer process, which then finishes the slower tiers on its own), then
passes the signal on: to the handler that was there before, or, if that was the default,
by restoring the default and raising the signal again so the process ends exactly as it
would have. A sync ``dcp.save`` runs in the main thread, where the handler runs too, so it
cannot be waited for; the previous step stays loadable.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from .staging import POOL

log = logging.getLogger("tiered_dcp")

WAIT_SECONDS = float(os.environ.get("TIERED_DCP_SIGTERM_WAIT", "300"))

_previous: Any = None
_installed = False


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


def _on_sigterm(signum: int, frame: Any) -> None:
    pending = POOL.in_flight()
    if pending:
        log.warning("SIGTERM: finishing %d checkpoint save(s) in flight before exiting", pending)
        started = time.monotonic()
        if POOL.wait_idle(WAIT_SECONDS):
            log.warning("SIGTERM: in-flight save(s) finished in %.1f s", time.monotonic() - started)
        else:
            log.error("SIGTERM: save(s) still in flight after %.0f s; exiting anyway", WAIT_SECONDS)
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default action: end the process the way SIGTERM would have
        uninstall()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
