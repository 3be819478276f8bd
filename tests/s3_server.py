"""A real S3 server for the tests and benchmarks: moto's standalone server (``python -m
moto.server``), started as a subprocess on a free loopback port, reached through s3fs.

It keeps every bucket in memory for the life of the process and answers the S3 REST API
over HTTP, so s3fs (aiobotocore) talks to it exactly as to AWS or MinIO with an
``endpoint_url``. ``s3_request_kind`` sorts S3 requests into the kinds a FaultProxy counts
(``tiered_dcp.tools.fakegcs.FaultProxy(kind=s3_request_kind)``), the same kinds as GCS's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from tiered_dcp.tools.fakegcs import _die_with_parent, free_port

# Credentials of no account: moto accepts any, and given, s3fs looks for no real ones. Flat
# options (no client_kwargs): the CLI's --option KEY=VALUE can pass every one of them.
KEY = SECRET = "testing"


def missing() -> str | None:
    """Why the S3 tests cannot run here (a package to install), or None."""
    for module, package in (("s3fs", "s3fs"), ("moto", "moto[server]"), ("flask", "moto[server]")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install -e '.[test]')"
    return None


class MotoServer:
    """One moto S3 server on a free loopback port; ``url`` is its endpoint."""

    def __init__(self, log_path: str | os.PathLike | None = None) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> MotoServer:
        last = ""
        for _ in range(3):  # the free port may be taken between asking and binding
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
            try:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()
            if self._wait_ready(timeout):
                return self
            last = f"exit code {self.proc.poll()}"
            self.stop()
        raise RuntimeError(f"moto server did not start ({last}); log: {self.log_path or 'none'}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/", timeout=2) as r:  # ListBuckets
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

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

    def __enter__(self) -> MotoServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
