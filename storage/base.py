"""The one small interface every tier backend implements.

Keys are '/'-separated paths relative to the backend's root. ``write`` is the only way
data lands: the object appears whole under its key or not at all where the medium allows
it (local files: dirty name, fsync, rename); where it does not (a plain ``file://`` via
fsspec), the commit marker written last is what readers trust.

Errors: a backend raises ``FileNotFoundError`` for a missing key, and translates its
native failures at its boundary (``with self.errors(key):``) into the kinds of
``errors.py``: ``TransientStorageError`` (retry) or ``PermanentStorageError`` (don't).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from types import TracebackType

from .errors import translated

Buffer = bytes | bytearray | memoryview


class Reservation:
    """A writable buffer that becomes the object under a key on ``commit`` (else nothing).

    Lets bytes arriving from elsewhere (a peer's replica) land in place, with no copy.
    """

    def __init__(self, store: Storage, key: str, size: int) -> None:
        self.store, self.key = store, key
        self.view = memoryview(bytearray(size))

    def commit(self) -> None:
        self.store.write(self.key, [self.view])

    def discard(self) -> None:
        self.view = memoryview(b"")


class Storage(ABC):
    """Files under one root: put, read a byte range, list, delete.

    A backend is built as ``cls(url, storage_options)`` (see ``registry.py``).
    """

    url: str

    @abstractmethod
    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        """Write the concatenation of ``chunks`` under ``key``; return the byte count."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes at ``offset`` (all of the rest when ``length`` is None)."""

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``key`` at ``offset``; backends override to skip a copy."""
        data = self.read(key, offset, len(out))
        if len(data) != len(out):
            raise OSError(f"{self.describe(key)}: short read ({len(data)} of {len(out)} bytes)")
        out[:] = data

    def read_placed(self, key: str, offset: int, length: int, room: memoryview) -> int | None:
        """Read ``length`` bytes of ``key`` at ``offset`` into ``room`` (``length`` plus
        ``direct_io.PLACE_SPARE`` bytes or more), where the backend places them: their start
        in ``room``. None, with nothing read, where the backend has no better way than
        ``read_into`` (the default): a local disk reads a cold range straight into ``room``."""
        return None

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the object under ``key``, or None when there is none."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (empty when it does not exist)."""

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Objects directly under ``prefix`` with their sizes (sub-directories left out).

        One listing where the backend can (a bucket's answers carry sizes), so that whether a
        step is whole is known without asking after each object in turn."""
        out: dict[str, int] = {}
        for page in self.list_pages(prefix):
            out.update(page)
        return out

    def list_pages(self, prefix: str) -> Iterator[dict[str, int]]:
        """``list_sizes`` page by page, in name order where the backend pages (a bucket: 1,000
        names a page), so a caller looking for a gap can stop at the first page showing one."""
        sizes = ((n, self.size(f"{prefix}/{n}" if prefix else n)) for n in self.list(prefix))
        yield {n: s for n, s in sizes if s is not None}

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` and everything under it; no error when absent."""

    def reserve(self, key: str, size: int) -> Reservation:
        """A ``size``-byte buffer to fill, then commit under ``key``; backends may map the file."""
        return Reservation(self, key, size)

    def activity(self) -> float | None:
        """``time.monotonic()`` when bytes last moved between this process and the store, for
        backends whose calls can run long without returning (a remote store); None: unknown.
        The writer process tells a slow tier (bytes moving) from a stalled one by it."""
        return None

    def failing(self) -> tuple[float, str] | None:
        """(``time.monotonic()`` since when, the latest failure) while this store's requests
        fail and are being retried with no success since; None when they succeed, or for
        backends that retry nothing. Tells the writer a bucket is down before its retries end."""
        return None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def describe(self, key: str) -> str:
        """A human-readable location for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    @classmethod
    def serves(cls, scheme: str) -> bool:
        """Whether this backend can open URLs of ``scheme``: asked of the ``ANY_SCHEME``
        fallback for schemes no backend registered."""
        return True

    @classmethod
    def missing(cls, scheme: str) -> str | None:
        """What must be installed before URLs of ``scheme`` can be opened (a sentence naming
        the package), or None: asked when a tier is configured, so that a missing package is
        a clear error then, not a failed save later. Must not import that package."""
        return None

    def errors(self, key: str) -> AbstractContextManager[None]:
        """Translate native errors raised inside the block into storage errors naming ``key``."""
        return translated(self.describe(key))

    def close(self) -> None:
        """Release what the backend holds (connections, caches); idempotent. The store is
        not used after it."""
        return None  # nothing held by default

    def __enter__(self) -> Storage:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
