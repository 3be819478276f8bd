"""Tier backends behind one small interface, their errors, the scheme registry, the chunk codec."""

from __future__ import annotations

from .base import Storage
from .errors import PermanentStorageError, StorageError, TransientStorageError, classify

# Importing a backend module registers it (registry.py): one import per built-in backend.
from .fsspec_store import FsspecStorage
from .gcs_store import GCSStorage
from .local import LocalStorage
from .registry import ANY_SCHEME, backend_for, check_url, open_storage, register_backend

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
