"""Any fsspec URL (gs://, memory://, s3://, file://...) through one file system object.

Object stores have no rename, so objects are written under their final key: an upload
appears whole or not at all on real object stores, and on stores where a half-written
object can be seen (file://) the commit marker written last is what readers trust.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
from fsspec.registry import known_implementations, registry

from .base import Buffer, Storage
from .errors import PermanentStorageError, classify
from .registry import ANY_SCHEME, register_backend


def _missing(e: OSError) -> bool:
    """A key that is not there, as opposed to a store that did not answer."""
    return isinstance(e, (FileNotFoundError, NotADirectoryError)) and classify(e) is None


@register_backend(ANY_SCHEME)
class FsspecStorage(Storage):
    @classmethod
    def serves(cls, scheme: str) -> bool:
        """Every protocol of the (possibly chained) scheme is one fsspec knows, installed or not
        (a missing implementation raises fsspec's ImportError, which names the package)."""
        known = fsspec.available_protocols()
        return all(p in known for p in scheme.split("::"))

    @classmethod
    def missing(cls, scheme: str) -> str | None:
        """The package of an fsspec implementation the scheme needs that is not installed."""
        for protocol in scheme.split("::"):
            if protocol in registry:  # registered by an import already
                continue
            impl = known_implementations.get(protocol, {})
            package = impl.get("class", "").split(".")[0]
            if package and importlib.util.find_spec(package) is None:
                return f"{impl.get('err') or f'{protocol}:// needs {package}'} (pip install {package})"
        return None

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        total = 0
        with self.errors(key):
            try:
                self.fs.makedirs(parent, exist_ok=True)
                with self.fs.open(path, "wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
                        total += memoryview(chunk).nbytes
            except FileNotFoundError as e:
                if not _missing(e):
                    raise
                # a write needs no key to exist: what is missing is the bucket (or directory)
                raise PermanentStorageError(
                    errno.ENOENT, "no such bucket or directory", self.describe(key)
                ) from e
            self.fs.invalidate_cache(parent)
        return total

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else offset + length
        with self.errors(key):
            return self.fs.cat_file(self._path(key), start=offset, end=end)

    def size(self, key: str) -> int | None:
        with self.errors(key):
            try:
                info = self.fs.info(self._path(key))
            except OSError as e:
                if _missing(e):
                    return None
                raise
        return None if info.get("type") == "directory" else int(info["size"])

    def _ls(self, prefix: str, detail: bool) -> tuple[str, list]:
        """(the prefix's path, its fresh listing: empty when it does not exist)."""
        path = self._path(prefix)
        self.fs.invalidate_cache(path)
        with self.errors(prefix):
            try:
                return path, self.fs.ls(path, detail=detail)
            except OSError as e:
                if _missing(e):
                    return path, []
                raise

    def list(self, prefix: str) -> list[str]:
        path, entries = self._ls(prefix, detail=False)
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path})

    def list_pages(self, prefix: str) -> Iterator[dict[str, int]]:
        """One listing with details (gcsfs, s3fs: one request a page, sizes included)."""
        path, entries = self._ls(prefix, detail=True)
        files = ((e["name"].rstrip("/"), e) for e in entries if e.get("type") != "directory")
        yield dict(sorted((name.rsplit("/", 1)[-1], int(e["size"])) for name, e in files if name != path))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self.errors(key):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    def close(self) -> None:
        """Drop the file system's cached listings under this root. The file system object
        itself is shared through fsspec's instance cache with every store of the same
        options, so its connections are left to it."""
        self.fs.invalidate_cache(self.root)
