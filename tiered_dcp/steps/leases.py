"""Reader leases and save-owner records: who still needs a step that retention would remove.

A reader writes a *lease* into every root it reads a step from (``format.lease_key``), and
removes it when the read is done. Retention skips a step with a live lease, so a training
job's ``keep`` never pulls a step from under an evaluation or an export; at most one extra
step per live reader is kept. A lease is live while its reader runs: on the reader's own
host, while its pid is alive (a SIGKILLed reader frees the step at once); seen from another
host (a shared tier), until the expiry it carries, which the reader renews every
``LEASE_TTL / 3`` seconds (a dead reader frees it ``LEASE_TTL`` seconds later at most).

Pins (``format.pin_key``: a writer process still has to copy the step) carry the same owner
record; a pin is void once its step can never be committed (the save failed or its process
died), so a failed save does not keep its directory forever. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

from tiered_dcp.storage import Storage, owners
from tiered_dcp.storage.format import is_lease, lease_key, marker_key, step_dir
from tiered_dcp.storage.owners import HOST
from tiered_dcp.storage.records import NOTE_LIMIT

log = logging.getLogger(__name__)

LEASE_TTL = float(os.environ.get("TIERED_DCP_LEASE_TTL", "120"))


def owner_record(ttl: float = LEASE_TTL) -> bytes:
    """Who wrote a lease or pin, and until when it holds when its pid cannot be checked."""
    return owners.owner_record(ttl)


def owner_alive(data: bytes) -> bool:
    """Whether the process that wrote this owner record still holds what it wrote.

    A record from before owners were recorded (empty) or being written (unparsable) counts
    as alive: better a step kept one more round than one removed under its reader.
    """
    return owners.owner_alive(data, unreadable=True)


def leased(store: Storage, namespace: str, step: int, names: list[str] | None = None) -> bool:
    """Whether a live lease holds ``step`` in ``store`` (``names``: its directory, if already
    listed). Stops at the first live one: one read in the usual case, however many readers."""
    sdir = step_dir(namespace, step)
    for name in names if names is not None else store.list(sdir):
        if not is_lease(name):
            continue
        try:
            data = store.read(f"{sdir}/{name}", 0, NOTE_LIMIT)
        except OSError:
            continue  # released while we looked, or no file to read
        if owner_alive(data):
            return True
    return False


class Leases:
    """The leases one reader holds on one step, renewed while held, released when done."""

    def __init__(self, namespace: str, step: int) -> None:
        self.namespace, self.step = namespace, step
        self.holder = f"{HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.key = lease_key(namespace, step, self.holder)
        self.stores: dict[str, Storage] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a renewal never rewrites a lease being released
        self._renewer: threading.Thread | None = None

    def take(self, store: Storage) -> bool:
        """Lease the step in ``store``; True when the step is still committed there.

        The lease is written before the marker is looked at: retention that removes the
        marker after that sees the lease and puts the marker back (``retention.drop``), so a step
        whose marker is found here stays until the lease is released. A root without the
        marker keeps no lease. A lease that cannot be written (a read-only tier; the step's
        directory removed as it went in) holds nothing: True only while the marker is there.
        """
        if store.url in self.stores:
            return True
        marker = marker_key(self.namespace, self.step)
        if not store.exists(marker):
            return False  # not (or no longer) committed here: no lease, and no directory made for one
        try:
            store.write(self.key, [owner_record()])
        except OSError as e:  # a read-only tier, say: read without a lease, as before; or
            # retention removed the step (its directory with it) as the lease went in
            log.debug("no lease on step %d in %s: %s", self.step, store.url, e)
            try:
                return store.exists(marker)
            except OSError:  # a failing bucket: read without a lease, as before
                return True
        if not store.exists(marker):
            with contextlib.suppress(OSError):
                store.delete(self.key)
            return False
        with self._lock:
            self.stores[store.url] = store
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew, daemon=True, name="tiered-dcp-lease")
            self._renewer.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_TTL / 3):
            with self._lock:
                for store in self.stores.values():
                    with contextlib.suppress(OSError):
                        store.write(self.key, [owner_record()])

    def release(self) -> None:
        """Give every lease back (idempotent); the step goes at its tier's next retention."""
        self._stop.set()
        with self._lock:
            for store in self.stores.values():
                with contextlib.suppress(OSError):
                    store.delete(self.key)
            self.stores.clear()
