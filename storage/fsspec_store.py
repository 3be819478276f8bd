"""Any fsspec URL (gs://, memory://, s3://, file://...) through one file system object.

Object stores have no rename, so objects are written under their final key: an upload
appears whole or not at all on real object stores, and on stores where a half-written
object can be seen (file://) the commit marker written last is what readers trust.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import fsspec

from .base import Buffer, Storage


class FsspecStorage(Storage):
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        total = 0
        with self.fs.open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                total += memoryview(chunk).nbytes
        self.fs.invalidate_cache(parent)
        return total

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else offset + length
        return self.fs.cat_file(self._path(key), start=offset, end=end)

    def size(self, key: str) -> int | None:
        try:
            info = self.fs.info(self._path(key))
        except (FileNotFoundError, OSError):
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, OSError):
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path})

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])
