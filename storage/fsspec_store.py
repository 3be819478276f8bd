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
from typing import TYPE_CHECKING, Any

from .base import Buffer, Storage
from .errors import PermanentStorageError, classify
from .registry import ANY_SCHEME, register_backend

if TYPE_CHECKING:
    import fsspec

# fsspec (and asyncio with it) is imported where a URL is served, not with this module: the
# writer process every rank starts imports the storage package, and for tiers that are all
# local paths fsspec was 40% of its start.

# Buckets have no directories to make: there makedirs asks whether the bucket exists (one
# request more per write) and creates it when it does not (s3fs, gcsfs, adlfs): a mistyped
# bucket name would become a new bucket instead of an error.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _abandon(f: Any) -> None:
    """A write whose source failed leaves no object: an upload under way is aborted (s3fs's
    ``discard`` aborts its multipart upload) and the file is never closed, which would store
    what was written so far under the key. Files that cannot discard (a local file written in
    place) are closed as before: there the commit marker written last is what readers trust."""
    try:
        f.discard()
    except Exception:  # nothing to discard with (autocommit): close what was written
        with contextlib.suppress(Exception):
            f.close()
        return
    with contextlib.suppress(Exception):
        f.closed = True  # an fsspec buffered file: close() (also from __del__) would commit


def _no_expect_continue(fs: Any) -> None:
    """Send S3 uploads without ``Expect: 100-continue``. botocore asks for it on every PUT and
    POST with a body; aiohttp then waits for the server's go-ahead with no timeout at all
    (``read_timeout`` arms only once the body is sent), so an upload to a bucket endpoint that
    accepts connections and never answers hangs forever instead of failing after
    ``read_timeout``. Registered once per client (s3fs makes one per file system object)."""
    client = fs.connect()  # the aiobotocore client; no request is made
    client.meta.events.register("before-call.s3", _drop_expect, unique_id="tiered-dcp-no-expect")


def _drop_expect(params: dict, **kwargs: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _missing(e: OSError) -> bool:
    """A key that is not there, as opposed to a store that did not answer."""
    return isinstance(e, (FileNotFoundError, NotADirectoryError)) and classify(e) is None


@register_backend(ANY_SCHEME)
class FsspecStorage(Storage):
    @classmethod
    def serves(cls, scheme: str) -> bool:
        """Every protocol of the (possibly chained) scheme is one fsspec knows, installed or not
        (a missing implementation raises fsspec's ImportError, which names the package)."""
        import fsspec

        known = fsspec.available_protocols()
        return all(p in known for p in scheme.split("::"))

    @classmethod
    def missing(cls, scheme: str) -> str | None:
        """The package of an fsspec implementation the scheme needs that is not installed."""
        from fsspec.registry import known_implementations, registry

        for protocol in scheme.split("::"):
            if protocol in registry:  # registered by an import already
                continue
            impl = known_implementations.get(protocol, {})
            package = impl.get("class", "").split(".")[0]
            if package and importlib.util.find_spec(package) is None:
                return f"{impl.get('err') or f'{protocol}:// needs {package}'} (pip install {package})"
        return None

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec.core

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        if type(self.fs).__module__.startswith("s3fs"):
            _no_expect_continue(self.fs)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        total = 0
        with self.errors(key):
            try:
                if not _OBJECT_STORES.intersection(_protocols(self.fs)):
                    self.fs.makedirs(parent, exist_ok=True)
                f = self.fs.open(path, "wb")
                try:
                    for chunk in chunks:
                        f.write(chunk)
                        total += memoryview(chunk).nbytes
                except BaseException:
                    _abandon(f)
                    raise
                f.close()
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
            try:
                return self.fs.cat_file(self._path(key), start=offset, end=end)
            except FileNotFoundError as e:
                if not _missing(e):
                    raise
                # s3fs says only "The specified key does not exist.": name the key
                raise FileNotFoundError(errno.ENOENT, "no such object", self.describe(key)) from e
            except OSError as e:
                # S3 refuses a range starting at the end (HTTP 416), an empty object's too:
                # there is nothing to read
                if classify(e) is None and (size := self.size(key)) is not None and size <= offset:
                    return b""
                raise

    def size(self, key: str) -> int | None:
        path = self._path(key)
        # s3fs answers info() from the listing it cached of the parent, if any: an object
        # another process wrote or replaced since then would be missing or keep its old size
        self.fs.invalidate_cache(path)
        with self.errors(key):
            try:
                info = self.fs.info(path)
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
