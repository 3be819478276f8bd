"""A real S3 server for the tests and benchmarks: moto's standalone server (``python -m
moto.server``), started as a subprocess on a free loopback port, reached through s3fs.

It keeps every bucket in memory for the life of the process and answers the S3 REST API
over HTTP, so s3fs (aiobotocore) talks to it exactly as to AWS or MinIO with an
``endpoint_url``. ``s3_request_kind`` sorts S3 requests into the kinds a FaultProxy counts
(``tiered_dcp.cli.local_servers.FaultProxy(kind=s3_request_kind)``), the same kinds as GCS's.
"""

from __future__ import annotations

import importlib.util
import sys
import urllib.request
from typing import Any

from tiered_dcp.cli.local_servers import LocalServer

# Credentials of no account: moto accepts any, and given, s3fs looks for no real ones. Flat
# options (no client_kwargs): the CLI's --option KEY=VALUE can pass every one of them.
KEY = SECRET = "testing"


def missing() -> str | None:
    """Why the S3 tests cannot run here (a package to install), or None."""
    for module, package in (("s3fs", "s3fs"), ("moto", "moto[server]"), ("flask", "moto[server]")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install -e '.[test]')"
    return None


class MotoServer(LocalServer):
    """One moto S3 server on a free loopback port; ``url`` is its endpoint."""

    name = "moto server"
    ready_path = "/"  # ListBuckets

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    def start(self, timeout: float = 60) -> MotoServer:
        return super().start(timeout)

    def create_bucket(self, name: str) -> None:
        """CreateBucket in us-east-1 (no location constraint), unsigned: moto accepts it."""
        with urllib.request.urlopen(
            urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=10
        ) as r:
            assert r.status == 200, r.status

    def storage_options(self, endpoint: str | None = None, **config: Any) -> dict[str, Any]:
        """What an s3:// tier on this server needs (``endpoint``: another address in front of
        it, a FaultProxy); ``config``: botocore ``Config`` settings (timeouts, retries)."""
        options: dict[str, Any] = {"key": KEY, "secret": SECRET, "endpoint_url": endpoint or self.url}
        if config:
            options["config_kwargs"] = config
        return options


def s3_request_kind(method: str, target: str) -> str:
    """An S3 REST request's kind, in GCS's terms: list, info, read, write, compose (a
    multipart upload's completion), delete, bucket, other. Path-style addressing
    (``/bucket/key``), as s3fs uses with an ``endpoint_url``."""
    path, _, query = target.partition("?")
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    has_key = "/" in path.strip("/")
    if method == "DELETE" or (method == "POST" and "delete" in params):
        return "delete"
    if method == "PUT" and has_key:
        return "write"  # an object, or one part of a multipart upload
    if method == "POST" and "uploads" in params:
        return "write"  # a multipart upload begins
    if method == "POST" and "uploadId" in params:
        return "compose"  # a multipart upload's parts become the object
    if method == "GET" and has_key:
        return "read"
    if method == "HEAD" and has_key:
        return "info"
    if method == "GET" and ("list-type" in params or "prefix" in params or "delimiter" in params):
        return "list"
    return "bucket" if path.strip("/") else "other"
