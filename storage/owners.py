"""Who wrote a lease or a pin, and whether it still holds: one record, one rule.

Reader leases and writer pins (``tiered_dcp.steps.leases``) and the block GC's lease
(``blocks``) all carry ``{"host", "pid", "expires"}``. Seen from the writer's own host the
record holds while its pid runs (a SIGKILLed process frees what it held at once); seen
from another host (a shared tier), until ``expires``, which a long holder renews.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

HOST = socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def owner_record(ttl: float) -> bytes:
    """This process as the owner of what it writes, holding for ``ttl`` seconds elsewhere."""
    return json.dumps({"host": HOST, "pid": os.getpid(), "expires": time.time() + ttl}).encode()


def owner_alive(data: bytes, unreadable: bool) -> bool:
    """Whether the owner record ``data`` still holds; ``unreadable``: the answer for a record
    that cannot be parsed (empty from an older version, or torn by a crash)."""
    try:
        rec = json.loads(data)
        host, pid, expires = rec["host"], int(rec["pid"]), float(rec["expires"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return unreadable
    if not 0 < pid < 1 << 31:  # no process has it (and the kernel would refuse to look)
        return unreadable
    if host == HOST:
        return pid_alive(pid)
    return expires > time.time()
