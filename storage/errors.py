"""The errors a storage backend raises, and the one place that sorts native errors into them.

A caller that retries (the writer process) asks one question of a failure: can trying
again help? ``TransientStorageError`` says yes (a dropped or refused connection, a timeout,
HTTP 429/5xx, EIO/EAGAIN), ``PermanentStorageError`` says no (a full, read-only or
forbidden tier, HTTP 401/403, a bucket that does not exist). Client libraries' own errors
(aiohttp, requests, gcsfs, botocore under s3fs) are recognised without importing them.
Both are ``OSError``s that keep the native errno where there is one, so every
``except OSError`` keeps working, and the native exception stays their ``__cause__``. A
missing key stays ``FileNotFoundError``; errors of no known kind pass through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Iterator

TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENETRESET,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
    }
)
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
PERMANENT_HTTP = frozenset({401, 403})


def transient_http(status: int) -> bool:
    """Request timeout, too many requests, and every server-side error."""
    return status in (408, 429) or 500 <= status <= 599


class StorageError(OSError):
    """Base of the errors a backend raises on purpose."""


class TransientStorageError(StorageError):
    """Worth a retry: the same call may succeed later."""


class PermanentStorageError(StorageError):
    """Not worth a retry: the tier refuses (full, read-only, forbidden, no such bucket)."""


StorageErrorKind = type[TransientStorageError] | type[PermanentStorageError]


class NotAnObject(FileNotFoundError):
    """What a key leads to is no object of the tier: in a local root, a link on the way or at
    the end (whoever can write the tier could point it anywhere), a FIFO, a device, or a name
    that would leave the root. It is never opened, and counts as missing: a copy that needs
    it is damaged, and read from elsewhere."""


def classify(exc: BaseException) -> StorageErrorKind | None:
    """Transient, permanent, or None: a missing key, or an error of no known kind.

    An error of no known kind takes the kind of its ``__cause__`` (fsspec's HTTP file
    system, for one, reports a refused connection as a FileNotFoundError caused by it).
    """
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        kind = _own_kind(cur)
        if kind is not None:
            return kind
        cur, seen = cur.__cause__, seen + 1
    return None


def _own_kind(exc: BaseException) -> StorageErrorKind | None:
    if isinstance(exc, TransientStorageError):
        return TransientStorageError
    if isinstance(exc, PermanentStorageError):
        return PermanentStorageError
    if _s3_code(exc) == "NoSuchBucket":
        return PermanentStorageError  # s3fs raises it as a FileNotFoundError caused by this
    if isinstance(exc, FileNotFoundError):
        return None
    status = _http_status(exc)
    if status is not None:
        if status in PERMANENT_HTTP:
            return PermanentStorageError
        return TransientStorageError if transient_http(status) else None
    if isinstance(exc, PermissionError):
        return PermanentStorageError  # s3fs raises HTTP 403 as PermissionError(message), no errno
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in PERMANENT_ERRNOS:
            return PermanentStorageError
        if exc.errno in TRANSIENT_ERRNOS:
            return TransientStorageError
    if isinstance(exc, (ConnectionError, TimeoutError)) or _is(exc, "asyncio", "TimeoutError"):
        return TransientStorageError
    if (
        _is(exc, "aiohttp", "ClientError")
        or _is(exc, "requests.exceptions", "ConnectionError", "Timeout", "ChunkedEncodingError")
        or _is(exc, "botocore.exceptions", "HTTPClientError", "ConnectionError")  # s3fs: timeouts, refused
    ):
        return TransientStorageError  # a connection-level failure: no answer came back
    if type(exc) is OSError and exc.errno is None and str(exc).startswith("Forbidden"):
        return PermanentStorageError  # gcsfs raises HTTP 403 as OSError("Forbidden: <path>")
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec client error carries (aiohttp, gcsfs, requests)."""
    if _is(exc, "aiohttp", "ClientResponseError"):
        status = exc.status  # type: ignore[attr-defined]
    elif _is(exc, "gcsfs.retry", "HttpError"):
        status = exc.code  # type: ignore[attr-defined]  # an int, sometimes a str
    elif _is(exc, "requests.exceptions", "HTTPError") and getattr(exc, "response", None) is not None:
        status = exc.response.status_code  # type: ignore[attr-defined]
    elif _is(exc, "botocore.exceptions", "ClientError"):  # s3fs's errors are caused by these
        status = (exc.response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")  # type: ignore[attr-defined]
    else:
        return None
    try:
        return int(status)
    except (TypeError, ValueError):
        return None


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code ("NoSuchBucket", "SlowDown"...) of a botocore ClientError."""
    if not _is(exc, "botocore.exceptions", "ClientError"):
        return None
    return (exc.response or {}).get("Error", {}).get("Code")  # type: ignore[attr-defined]


def _is(exc: BaseException, module: str, *names: str) -> bool:
    """isinstance against a client library's classes, without importing it: an exception
    of a library that was never imported cannot exist."""
    mod = sys.modules.get(module)
    return mod is not None and any(isinstance(exc, getattr(mod, n, ())) for n in names)


def as_storage_error(exc: BaseException, where: str) -> StorageError | None:
    """``exc`` as the storage error of its kind naming ``where``; None when it has no kind
    or already is one."""
    kind = classify(exc)
    if kind is None or isinstance(exc, kind):
        return None
    if isinstance(exc, OSError) and exc.errno is not None:
        return kind(exc.errno, exc.strerror or str(exc), where)
    if isinstance(exc, FileNotFoundError):  # a missing bucket (s3fs gives no errno)
        return kind(errno.ENOENT, str(exc), where)
    if isinstance(exc, PermissionError):  # s3fs's HTTP 403 (no errno either)
        return kind(errno.EACCES, f"access denied: {exc}", where)
    return kind(f"{where}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def translated(where: str) -> Iterator[None]:
    """Re-raise a native error of a known kind as its storage error, the native one as cause."""
    try:
        yield
    except Exception as e:
        err = as_storage_error(e, where)
        if err is None:
            raise
        raise err from e
