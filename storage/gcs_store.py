"""gs:// and gcs:// tiers: the GCS JSON API, built for checkpoint parts.

gcsfs supplies what it does well: the credentials (application default credentials unless
``storage_options`` say otherwise), the endpoint (``endpoint_url``, ``STORAGE_EMULATOR_HOST``)
and the aiohttp session on fsspec's I/O loop. The requests themselves are made here, because
a checkpoint needs three things gcsfs's file objects do not give it:

- Several transfers in flight. An object of more than ``part_size`` bytes is uploaded as
  pieces of that size, up to ``max_concurrency`` at a time (and no more than
  ``UPLOAD_BUFFER`` bytes of them: a streamed source is held only that far ahead), each an
  object of its own under ``<key>.compose-<id>/``; the pieces are then composed into
  ``<key>`` on the server (no bytes move through the client) and deleted. An object of up
  to ``part_size`` bytes is one request: on fake-gcs-server that measures 2-4x faster than
  pieces and a compose, whose server copies every byte again (benchmarks/bench_gcs.py).
  Nothing is renamed: the key appears whole when its upload or compose returns, and a
  writer that dies half way leaves only pieces under the step's directory, which retention
  removes with it.
- Parallel ranged reads: ``read_into`` splits its range into up to ``max_concurrency``
  ranged GETs, each streamed into its own slice of the destination.
- Failures within a bound. A request that makes no progress (nothing sent or received) for
  ``idle_timeout`` seconds is abandoned; transient failures (HTTP 408, 429, 5xx, refused,
  dropped or reset connections, those timeouts) are retried with jittered exponential
  backoff until ``retry_timeout`` seconds have passed since the first attempt; permanent
  ones (401, 403, a bucket that does not exist, any other 4xx) are raised at once. Both come
  out as the storage errors of ``errors.py``, naming the object and what went wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import importlib.util
import json
import logging
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

from .base import Buffer, Storage
from .errors import PermanentStorageError, TransientStorageError, classify, transient_http
from .registry import register_backend

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_COMPOSE = 32  # source objects one compose request may name (a GCS limit)
MAX_COMPONENTS = 1024  # pieces one composite object may be made of (a GCS limit)
SEND_SLICE = 1 << 20  # request bodies are sent in slices of this size, so progress is seen
MIN_RANGE = 1 << 20  # a ranged read is not split into ranges smaller than this
READ_BUFFER = 1 << 20  # aiohttp's read buffer per response: fewer, larger chunks to copy
UPLOAD_BUFFER = 1 << 30  # the pieces one write holds in flight (and in memory) stay under this
BACKOFF_FIRST, BACKOFF_MAX = 0.2, 4.0  # seconds before the first retry; the longest wait


@dataclasses.dataclass(frozen=True)
class GCSOptions:
    """This backend's own ``storage_options``; every other key goes to ``gcsfs.GCSFileSystem``."""

    max_concurrency: int = 8  # requests in flight for one read, one write's pieces, one deletion
    part_size: int = 256 << 20  # objects up to this size are one request; larger ones, pieces of it
    idle_timeout: float = 30.0  # seconds a request may go without progress
    retry_timeout: float = 60.0  # seconds after a call's first attempt that no retry starts

    @classmethod
    def split(cls, storage_options: dict[str, Any] | None) -> tuple[GCSOptions, dict[str, Any]]:
        """(this backend's options, the rest for gcsfs); values may be strings (the CLI's -o)."""
        rest = dict(storage_options or {})
        own: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in rest:
                value = rest.pop(f.name)
                try:
                    own[f.name] = int(value) if f.type == "int" else float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"GCS storage option {f.name}={value!r} is not a number") from None
        opts = cls(**own)
        if opts.max_concurrency < 1 or opts.part_size < 1 or opts.idle_timeout <= 0 or opts.retry_timeout < 0:
            raise ValueError(
                f"GCS storage options {own}: max_concurrency and part_size must be >= 1, "
                "idle_timeout > 0, retry_timeout >= 0"
            )
        return opts, rest


class _HTTPStatus(Exception):
    """A response with an error status, before it is sorted into a storage error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class _BadAnswer(Exception):
    """An answer that breaks the protocol (more bytes than asked for, a range ignored)."""


class _Progress:
    """When a request last moved a byte (or started); bytes moved are told to its client too
    (``activity``), an error answer only to the request's own watchdog."""

    def __init__(self, now: float, client: _Client) -> None:
        self.last = now
        self.client = client

    def tick(self, moved: bool = True) -> None:
        self.last = asyncio.get_running_loop().time()
        if moved:
            self.client.last_activity = self.last


Attempt = Callable[[_Progress], Awaitable[T]]


class _Client:
    """One bucket's JSON API requests: each watched for progress, retried while its failure is
    transient, its error sorted into a storage error (``errors.py``); and the bridge that runs
    them on gcsfs's I/O loop."""

    def __init__(self, fs: Any, opts: GCSOptions, bucket: str) -> None:
        self.fs, self.opts, self.bucket = fs, opts, bucket
        self._bucket_seen = False  # the bucket answered once: a later 404 is a missing object
        self.last_activity = 0.0  # time.monotonic() when a request of this client last moved a byte
        self.failing: tuple[float, str] | None = None  # since when requests fail (no success since)

    # ---- names and the sync/async bridge

    def where(self, name: str) -> str:
        """The object's URL, as errors and logs name it."""
        return f"gs://{self.bucket}/{name}"

    def bucket_url(self, api: str = "storage") -> str:
        """The bucket in the JSON API: metadata ("storage"), "upload" or "download" paths."""
        path = "storage/v1" if api == "storage" else f"{api}/storage/v1"
        return f"{self.fs._location}/{path}/b/{quote(self.bucket, safe='')}"

    def object_url(self, name: str, api: str = "storage") -> str:
        return f"{self.bucket_url(api)}/o/{quote(name, safe='')}"

    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on gcsfs's I/O loop and wait for it (it bounds itself)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.fs.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    # ---- one request: progress watchdog, retries, error kinds

    async def call(self, what: str, attempt: Attempt[T], *, missing_ok: bool = False) -> T:
        """``attempt`` with retries of transient failures, within ``retry_timeout``.

        ``missing_ok``: a 404 means a missing object (``FileNotFoundError``) once the bucket
        is known to exist; otherwise a 404 is permanent.
        """
        loop = asyncio.get_running_loop()
        start, tries = loop.time(), 0
        while True:
            tries += 1
            try:
                result = await self._watched(attempt)
                self.failing = None  # the bucket answers
                return result
            except Exception as e:
                err = await self._failure(what, e, missing_ok)
                if err is e:
                    raise
                if err is not None:
                    raise err from e
                if self.failing is None:
                    self.failing = (loop.time(), f"{what}: {_describe(e)}")
                delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (tries - 1)) * random.uniform(0.5, 1.0)
                spent = loop.time() - start
                if spent + delay > self.opts.retry_timeout:
                    raise TransientStorageError(
                        errno.ETIMEDOUT
                        if isinstance(e, TimeoutError)
                        else getattr(e, "errno", None) or errno.EIO,
                        f"{_describe(e)}; gave up after {tries} attempt(s) in {spent:.1f}s "
                        f"(retry_timeout={self.opts.retry_timeout:g}s)",
                        what,
                    ) from e
                log.debug("%s: %s; retry %d in %.2fs", what, _describe(e), tries, delay)
                await asyncio.sleep(delay)

    async def _watched(self, attempt: Attempt[T]) -> T:
        """Run one attempt; abandon it once it has made no progress for ``idle_timeout``."""
        loop = asyncio.get_running_loop()
        progress = _Progress(loop.time(), self)
        task = asyncio.ensure_future(attempt(progress))
        try:
            while True:
                left = progress.last + self.opts.idle_timeout - loop.time()
                if left <= 0:
                    raise TimeoutError(f"no progress for {self.opts.idle_timeout:g}s (idle_timeout)")
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _failure(self, what: str, e: Exception, missing_ok: bool) -> BaseException | None:
        """The error to raise for ``e`` (``e`` itself when it has no known kind), or None
        when it is transient: worth another attempt."""
        if isinstance(e, _HTTPStatus):
            if e.status == 404:
                return await self._not_found(what, e, missing_ok)
            return None if transient_http(e.status) else self._refused(what, e)
        if isinstance(e, _BadAnswer):
            return OSError(errno.EIO, f"{what}: {e}")
        kind = classify(e)  # connections refused, reset or dropped, timeouts: transient
        if kind is None:
            return e
        if kind is TransientStorageError:
            return None
        return kind(getattr(e, "errno", None) or errno.EIO, _describe(e), what)

    async def _not_found(self, what: str, e: _HTTPStatus, missing_ok: bool) -> OSError:
        """What a 404 means: a missing object, a missing bucket, or (say, a compose source
        gone) a refusal."""
        exists = await self._bucket_exists()
        if exists is False:
            return PermanentStorageError(
                errno.ENOENT,
                f"bucket {self.bucket!r} does not exist (or these credentials cannot see it)",
                what,
            )
        if missing_ok:
            return FileNotFoundError(errno.ENOENT, "no such object", what)
        return PermanentStorageError(errno.ENOENT, str(e), what)

    def _refused(self, what: str, e: _HTTPStatus) -> PermanentStorageError:
        if e.status in (401, 403):
            return PermanentStorageError(
                errno.EACCES,
                f"access denied (HTTP {e.status}: {e.message}); check the credentials (storage_options "
                f"token=..., else application default credentials) and their roles on bucket {self.bucket!r}",
                what,
            )
        return PermanentStorageError(errno.EINVAL, f"request refused ({e})", what)

    async def _bucket_exists(self) -> bool | None:
        """Whether the bucket is there; None when that cannot be told now. A 403 counts as
        yes: the credentials may read objects without reading the bucket's own metadata."""
        if not self._bucket_seen:
            url = self.bucket_url()
            try:
                await self._watched(lambda p: self.send(p, "GET", url, params={"fields": "name"}))
            except _HTTPStatus as e:
                if e.status == 404:
                    return False
                if e.status != 403:
                    return None
            except Exception:  # noqa: BLE001  (no answer now: the caller's own error stands)
                return None
            self._bucket_seen = True
        return True

    async def send(
        self,
        progress: _Progress,
        method: str,
        url: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        body: list[memoryview] | None = None,
        sink: tuple[int, memoryview] | None = None,
        tail: int | None = None,
    ) -> Any:
        """One HTTP exchange. Returns the parsed JSON answer; with ``sink=(offset, view)``,
        a ranged download into ``view``, the number of bytes it got (fewer where the object
        ends); with ``tail=offset``, the object's bytes from ``offset`` on. Raises
        ``_HTTPStatus`` for an error status."""
        import aiohttp

        session = await self.fs._set_session()
        headers, data = self._request_body(progress, body, sink, tail)
        async with session.request(
            method,
            url,
            params=self.fs._get_params(params or {}),
            json=json_body,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.opts.idle_timeout),
            read_bufsize=READ_BUFFER,
        ) as r:
            progress.tick(moved=r.status < 400)
            if r.status >= 400:
                if r.status == 416 and (sink is not None or tail):
                    return 0 if sink is not None else b""  # the range starts at or after the end
                raise _HTTPStatus(r.status, _message(await r.read()))
            if sink is None:
                return await _read_answer(r, progress, tail)
            return await _read_range(r, progress, *sink)

    def _request_body(
        self,
        progress: _Progress,
        body: list[memoryview] | None,
        sink: tuple[int, memoryview] | None,
        tail: int | None,
    ) -> tuple[dict[str, str], Any]:
        """The headers (authorization, length, range) and the body of a request."""
        headers = self.fs._get_headers(None)  # authorization, user agent
        data: Any = None
        if body is not None:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Length"] = str(sum(b.nbytes for b in body))
            data = _slices(body, progress) if any(b.nbytes for b in body) else b""
        if sink is not None:
            headers["Range"] = f"bytes={sink[0]}-{sink[0] + len(sink[1]) - 1}"
        elif tail:
            headers["Range"] = f"bytes={tail}-"
        return headers, data


@register_backend("gs", "gcs")
class GCSStorage(Storage):
    """Objects under ``gs://bucket/prefix`` through the GCS JSON API: the ``Storage`` calls,
    each made of requests its ``_Client`` makes (a large write: of a ``_PieceUpload``)."""

    @classmethod
    def missing(cls, scheme: str) -> str | None:
        if importlib.util.find_spec("gcsfs") is None:
            return "a gs:// tier needs gcsfs for its credentials and client (pip install gcsfs)"
        return None

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from gcsfs.core import GCSFileSystem  # the plain JSON API client, never the gRPC one

        self.url = url.rstrip("/")
        self.opts, fs_options = GCSOptions.split(storage_options)
        # fsspec's instance cache shares one file system, session and connection pool
        # between every store opened with the same options.
        self.fs = GCSFileSystem(**fs_options)
        path = url.split("://", 1)[1].strip("/")
        self.bucket, _, self.prefix = path.partition("/")
        if not self.bucket:
            raise ValueError(f"{url}: no bucket in the URL")
        self.client = _Client(self.fs, self.opts, self.bucket)

    def activity(self) -> float | None:
        return self.client.last_activity or None

    def failing(self) -> tuple[float, str] | None:
        return self.client.failing

    def _name(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, key.strip("/")) if p)

    # ---- uploads

    async def _upload(self, name: str, body: list[memoryview]) -> None:
        url = f"{self.client.bucket_url('upload')}/o"
        params = {"uploadType": "media", "name": name, "fields": "name"}
        await self.client.call(
            self.client.where(name), lambda p: self.client.send(p, "POST", url, params=params, body=body)
        )

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        with self.errors(key):
            return self._write(self._name(key), chunks)

    def _write(self, name: str, chunks: Iterable[Buffer]) -> int:
        upload: _PieceUpload | None = None
        ready: list[memoryview] | None = None  # a full piece: is there more after it?
        total = 0
        try:
            for piece_no, piece in enumerate(_pieces(chunks, self.opts.part_size)):
                if ready is not None:
                    if upload is None:
                        upload = _PieceUpload(self, name)
                    upload.add(ready)
                ready = piece
                total += sum(b.nbytes for b in piece)
                if piece_no >= MAX_COMPONENTS:
                    raise PermanentStorageError(
                        errno.EFBIG,
                        f"more than {MAX_COMPONENTS} pieces of part_size={self.opts.part_size} bytes",
                        self.client.where(name),
                    )
            if upload is None:
                self.client.run(self._upload(name, ready or []))
                return total
            upload.add(ready or [])
            upload.finish()
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        return total

    # ---- reads

    async def _get_range(self, name: str, offset: int, view: memoryview) -> int:
        """Bytes of ``name`` from ``offset`` into ``view``; fewer where the object ends."""
        url = self.client.object_url(name, "download")
        return await self.client.call(
            self.client.where(name),
            lambda p: self.client.send(p, "GET", url, params={"alt": "media"}, sink=(offset, view)),
            missing_ok=True,
        )

    async def _read_ranges(self, name: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` with up to ``max_concurrency`` ranged GETs at once; the bytes read."""
        n = len(out)
        step = max(MIN_RANGE, -(-n // self.opts.max_concurrency))
        bounds = [(i, min(n, i + step)) for i in range(0, n, step)]
        got = await _all(self._get_range(name, offset + a, out[a:b]) for a, b in bounds)
        for (a, b), g in zip(bounds, got, strict=True):
            if g < b - a:  # the object ends inside this range: nothing after it counts
                return a + g
        return n

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        name = self._name(key)
        with self.errors(key):
            if length is None:  # to the end: one GET, whatever the size
                url = self.client.object_url(name, "download")
                return self.client.run(
                    self.client.call(
                        self.client.where(name),
                        lambda p: self.client.send(p, "GET", url, params={"alt": "media"}, tail=offset),
                        missing_ok=True,
                    )
                )
            if length == 0:
                if self.size(key) is None:
                    raise FileNotFoundError(errno.ENOENT, "no such object", self.client.where(name))
                return b""
            buf = bytearray(length)
            got = self.client.run(self._read_ranges(name, offset, memoryview(buf)))
        del buf[got:]
        return bytes(buf)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if not len(out):
            return
        with self.errors(key):
            got = self.client.run(self._read_ranges(self._name(key), offset, out))
        if got < len(out):  # a damaged object, not a failing bucket: no storage error kind
            raise OSError(errno.EIO, f"{self.describe(key)}: object ends {len(out) - got} bytes early")

    # ---- metadata, listing, deletion

    def size(self, key: str) -> int | None:
        name = self._name(key)
        url = self.client.object_url(name)
        with self.errors(key):
            try:
                info = self.client.run(
                    self.client.call(
                        self.client.where(name),
                        lambda p: self.client.send(p, "GET", url, params={"fields": "size"}),
                        missing_ok=True,
                    )
                )
            except FileNotFoundError:
                return None
        return int(info["size"])

    async def _page(self, prefix: str, delimiter: str | None, token: str | None, sizes: bool = False) -> dict:
        """One page (up to 1,000 names) of the objects under ``prefix``, in name order."""
        url = f"{self.client.bucket_url()}/o"
        fields = "items(name,size)" if sizes else "items(name)"
        params = {"prefix": prefix, "fields": f"{fields},prefixes,nextPageToken", "maxResults": 1000}
        if delimiter:
            params["delimiter"] = delimiter
        if token:
            params["pageToken"] = token
        return await self.client.call(
            self.client.where(prefix), lambda p, q=params: self.client.send(p, "GET", url, params=q)
        )

    async def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        """Object names and (with a delimiter) sub-prefixes under ``prefix``, every page."""
        names: list[str] = []
        prefixes: list[str] = []
        token = None
        while True:
            page = await self._page(prefix, delimiter, token)
            names += [item["name"] for item in page.get("items", [])]
            prefixes += page.get("prefixes", [])
            token = page.get("nextPageToken")
            if not token:
                return names, prefixes

    def list(self, prefix: str) -> list[str]:
        base = self._name(prefix)
        base = f"{base}/" if base else ""
        with self.errors(prefix):
            names, prefixes = self.client.run(self._list(base, "/"))
        found = {n[len(base) :].rstrip("/") for n in [*names, *prefixes]}
        found.discard("")
        return sorted(found)

    def list_pages(self, prefix: str) -> Iterator[dict[str, int]]:
        """One request a page, names and sizes together (no object-info call per object)."""
        base = self._name(prefix)
        base = f"{base}/" if base else ""
        token = None
        while True:
            with self.errors(prefix):
                page = self.client.run(self._page(base, "/", token, sizes=True))
            items = ((item["name"][len(base) :], int(item.get("size", 0))) for item in page.get("items", []))
            yield {n: size for n, size in items if n and "/" not in n}
            token = page.get("nextPageToken")
            if not token:
                return

    async def _delete_object(self, name: str) -> None:
        url = self.client.object_url(name)
        with contextlib.suppress(FileNotFoundError):
            await self.client.call(
                self.client.where(name), lambda p: self.client.send(p, "DELETE", url), missing_ok=True
            )

    async def _delete_tree(self, name: str) -> None:
        """``name`` and every object under ``name/``, ``max_concurrency`` deletions at a time."""
        names, _ = await self._list(f"{name}/" if name else "", None)
        if name:
            names.append(name)
        gate = asyncio.Semaphore(self.opts.max_concurrency)

        async def one(n: str) -> None:
            async with gate:
                await self._delete_object(n)

        await _all(one(n) for n in names)

    def delete(self, key: str) -> None:
        with self.errors(key):
            self.client.run(self._delete_tree(self._name(key)))


class _PieceUpload:
    """The pieces of one object in flight, then their compose into it (``GCSStorage.write``).

    Pieces are uploaded by tasks on gcsfs's loop; only that loop starts, cancels or counts
    them, so ``abort`` can stop them all and know they are over before the pieces are
    deleted (a piece landing after the deletion would be left behind).
    """

    def __init__(self, store: GCSStorage, name: str) -> None:
        self.store, self.name = store, name
        self.scratch = f"{name}.compose-{uuid.uuid4().hex[:12]}"
        self.pieces: list[str] = []
        self.futures: list[concurrent.futures.Future] = []
        self._tasks: set[asyncio.Task] = set()  # touched on the loop only
        self._aborted = False  # set on the loop only

    def add(self, body: list[memoryview]) -> None:
        """Start uploading the next piece once a slot is free: ``max_concurrency`` pieces in
        flight at most, and no more than ``UPLOAD_BUFFER`` bytes of them."""
        opts = self.store.opts
        slots = max(1, min(opts.max_concurrency, UPLOAD_BUFFER // opts.part_size))
        while True:
            running = [f for f in self.futures if not f.done()]
            for f in self.futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            if len(running) < slots:
                break
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        piece = f"{self.scratch}/{len(self.pieces):05d}"
        self.pieces.append(piece)
        self.futures.append(asyncio.run_coroutine_threadsafe(self._piece(piece, body), self.store.fs.loop))

    async def _piece(self, piece: str, body: list[memoryview]) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._aborted:
            return
        self._tasks.add(task)
        try:
            await self.store._upload(piece, body)
        finally:
            self._tasks.discard(task)

    async def _cancel(self) -> None:
        self._aborted = True  # pieces not started yet return at once
        for task in self._tasks:
            task.cancel()

    def finish(self) -> None:
        for f in self.futures:
            f.result()
        self.store.client.run(self._compose(self.pieces))
        self._remove_pieces(bound=None)

    def abort(self) -> None:
        """Stop the pieces in flight, wait until they are over, and delete those uploaded,
        for about ``idle_timeout`` at most: the bucket may be what failed."""
        bound = self.store.opts.idle_timeout
        self.store.client.run(self._cancel())
        concurrent.futures.wait(self.futures, timeout=bound)
        self._remove_pieces(bound=bound)

    def _remove_pieces(self, bound: float | None) -> None:
        """Best effort: pieces left behind lie under the step's directory, which retention
        removes, so a failure here only logs."""
        try:
            self.store.client.run(asyncio.wait_for(self.store._delete_tree(self.scratch), bound))
        except Exception as e:  # noqa: BLE001
            log.warning(
                "%s: could not remove the upload's pieces: %s", self.store.client.where(self.scratch), e
            )

    async def _compose(self, sources: list[str]) -> None:
        """Compose ``sources`` into the object: by groups of ``MAX_COMPOSE`` into objects under
        the scratch prefix, then those, until one request can name them all."""
        level = 0
        while len(sources) > MAX_COMPOSE:
            groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            names = [f"{self.scratch}/c{level}-{j:04d}" for j in range(len(groups))]
            await _all(self._compose_one(g, n) for g, n in zip(groups, names, strict=True))
            sources, level = names, level + 1
        await self._compose_one(sources, self.name)

    async def _compose_one(self, sources: list[str], dest: str) -> None:
        url = f"{self.store.client.object_url(dest)}/compose"
        body = {
            "sourceObjects": [{"name": s} for s in sources],
            "destination": {"contentType": "application/octet-stream"},
        }
        await self.store.client.call(
            self.store.client.where(dest),
            lambda p: self.store.client.send(p, "POST", url, params={"fields": "name"}, json_body=body),
        )


async def _all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await every one; when one fails, cancel the others and wait for them before raising,
    so that none goes on writing into a buffer its caller has given up on."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _pieces(chunks: Iterable[Buffer], size: int) -> Iterator[list[memoryview]]:
    """The bytes of ``chunks`` as pieces of exactly ``size`` bytes (the last one shorter),
    each a list of zero-copy views. Yields nothing for no bytes."""
    piece: list[memoryview] = []
    have = 0
    for chunk in chunks:
        view = memoryview(chunk)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        while len(view):
            take = min(len(view), size - have)
            piece.append(view[:take])
            view, have = view[take:], have + take
            if have == size:
                yield piece
                piece, have = [], 0
    if piece:
        yield piece


async def _read_answer(r: Any, progress: _Progress, tail: int | None) -> Any:
    """A whole answer: the object's bytes from ``tail`` on, else the parsed JSON (None if empty)."""
    if tail and r.status != 206:
        raise _BadAnswer(f"the server ignored the range (HTTP {r.status})")
    raw = bytearray()
    async for data_chunk in r.content.iter_any():
        raw += data_chunk
        progress.tick()
    if tail is not None:
        return bytes(raw)
    return json.loads(raw) if raw else None


async def _read_range(r: Any, progress: _Progress, offset: int, view: memoryview) -> int:
    """A ranged answer streamed into ``view``; the bytes it got (fewer where the object ends)."""
    if r.status != 206 and offset != 0:
        raise _BadAnswer(f"the server ignored the range (HTTP {r.status})")
    got = 0
    async for data_chunk in r.content.iter_any():
        n = len(data_chunk)
        if got + n > len(view):
            raise _BadAnswer(f"the server sent more than the {len(view)} bytes asked for")
        view[got : got + n] = data_chunk
        got += n
        progress.tick()
    return got


async def _slices(body: list[memoryview], progress: _Progress) -> AsyncIterator[memoryview]:
    """A request body sent slice by slice, each slice sent counting as progress."""
    for buf in body:
        for i in range(0, len(buf), SEND_SLICE):
            yield buf[i : i + SEND_SLICE]
            progress.tick()


def _message(raw: bytes) -> str:
    """The error message in a GCS error answer (JSON), else the start of the body."""
    text = raw.decode("utf-8", "replace")
    try:
        err = json.loads(text)["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200] or "(no message)"


def _describe(e: BaseException) -> str:
    text = str(e)
    code = getattr(e, "errno", None)
    if isinstance(code, int) and code > 0 and os.strerror(code) not in text:
        text = f"{os.strerror(code)}: {text}"  # aiohttp's "Cannot connect to host" hides a refusal
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
