"""Tier backends behind one small interface, and the chunk codec."""

from __future__ import annotations

from typing import Any

from .base import Storage
from .fsspec_store import FsspecStorage
from .local import LocalStorage


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """Local files for plain paths and file:// (fast path), fsspec for every other URL."""
    if "://" not in url or url.startswith("file://"):
        return LocalStorage(url)
    return FsspecStorage(url, storage_options)


__all__ = ["FsspecStorage", "LocalStorage", "Storage", "open_storage"]
