"""Tier backends behind one small interface, their errors, the scheme registry, the chunk codec."""

from __future__ import annotations

from typing import Any

from .base import Storage
from .errors import PermanentStorageError, StorageError, TransientStorageError, classify

# Importing a backend module registers it (registry.py): one import per built-in backend,
# or its name in ON_DEMAND for one imported when a URL first needs it.
from .fsspec_store import FsspecStorage
from .local import LocalStorage
from .registry import ANY_SCHEME, ON_DEMAND, backend_for, check_url, open_storage, register_backend

ON_DEMAND.append(f"{__name__}.gcs_store")


def __getattr__(name: str) -> Any:
    if name == "GCSStorage":  # its module once asked for
        from .gcs_store import GCSStorage

        return GCSStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ANY_SCHEME",
    "FsspecStorage",
    "GCSStorage",
    "LocalStorage",
    "PermanentStorageError",
    "Storage",
    "StorageError",
    "TransientStorageError",
    "backend_for",
    "check_url",
    "classify",
    "open_storage",
    "register_backend",
]
