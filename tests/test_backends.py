"""The storage contract: error kinds from real failures, close(), the scheme registry.

Real failures only: a full and a read-only tmpfs (mounting needs root; skipped without),
a refused loopback connection, and a loopback HTTP server answering 403/404/429/503.
"""

import errno
import http.server
import os
import socket
import subprocess
import threading

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import pytest
import requests
import torch
import torch.distributed.checkpoint as dcp
from gcsfs.retry import HttpError
from tiered_dcp.storage import (
    FsspecStorage,
    GCSStorage,
    LocalStorage,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    backend_for,
    classify,
    open_storage,
    register_backend,
)

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter

MiB = 1 << 20


# ---- the one classification -------------------------------------------------------------


def _caused(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(
    "exc, kind",
    [
        (OSError(errno.ENOSPC, "No space left on device"), PermanentStorageError),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), PermanentStorageError),
        (OSError(errno.EROFS, "Read-only file system"), PermanentStorageError),
        (PermissionError(errno.EACCES, "Permission denied"), PermanentStorageError),
        (PermissionError(errno.EPERM, "Operation not permitted"), PermanentStorageError),
        (OSError(errno.EIO, "Input/output error"), TransientStorageError),
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), TransientStorageError),
        (ConnectionResetError(errno.ECONNRESET, "reset"), TransientStorageError),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), TransientStorageError),
        (TimeoutError("timed out"), TransientStorageError),
        (HttpError({"code": 503, "message": "unavailable"}), TransientStorageError),
        (HttpError({"code": "429", "message": "slow down"}), TransientStorageError),
        (HttpError({"code": 403, "message": "forbidden"}), PermanentStorageError),
        (HttpError({"code": 401, "message": "no credentials"}), PermanentStorageError),
        (HttpError({"code": 409, "message": "conflict"}), None),
        (OSError("Forbidden: b/x\nno access"), PermanentStorageError),  # gcsfs's 403
        (requests.exceptions.ConnectionError("refused"), TransientStorageError),
        (requests.exceptions.ReadTimeout("slow"), TransientStorageError),
        (FileNotFoundError(errno.ENOENT, "No such file"), None),  # a missing key
        (
            _caused(FileNotFoundError("http://x"), ConnectionRefusedError(111, "refused")),
            TransientStorageError,
        ),
        (OSError(errno.EEXIST, "File exists"), None),
        (OSError("something else"), None),
        (ValueError("bad"), None),
        (TransientStorageError("already"), TransientStorageError),
    ],
)
def test_classify(exc, kind):
    assert classify(exc) is kind


# ---- permanent: a real full and a real read-only file system ---------------------------


def _mount_tmpfs(path, options: str):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    return path


@pytest.fixture
def full_disk(tmp_path):
    """A real 1 MiB tmpfs."""
    yield _mount_tmpfs(tmp_path / "tiny", "size=1m")
    subprocess.run(["umount", "-l", str(tmp_path / "tiny")])


@pytest.fixture
def read_only(tmp_path):
    """A real tmpfs mounted read-only (root ignores permission bits, not a read-only mount)."""
    yield _mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    subprocess.run(["umount", "-l", str(tmp_path / "ro")])


def _backends(root) -> list:
    return [LocalStorage(str(root)), FsspecStorage(f"file://{root}")]


def _assert_translated(err: OSError, code: int, store, key: str) -> None:
    assert isinstance(err, OSError) and err.errno == code  # every `except OSError` still sees it
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == code  # the native error
    assert store.describe(key) in str(err) and os.strerror(code) in str(err)


def test_full_file_system_is_permanent(full_disk):
    for store in _backends(full_disk / "root"):
        with pytest.raises(PermanentStorageError) as e:
            store.write("d/part", [b"x" * (2 * MiB)])
        _assert_translated(e.value, errno.ENOSPC, store, "d/part")
        if isinstance(store, LocalStorage):
            assert store.list("d") == []  # no dirty leftover (fsspec renames nothing: see base.py)
    store = LocalStorage(str(full_disk / "root"))
    store.delete("d")
    with pytest.raises(PermanentStorageError) as e:  # a mapped file claims its blocks up front:
        store.reserve("d/replica", 2 * MiB)  # ENOSPC here, not SIGBUS when it is filled
    _assert_translated(e.value, errno.ENOSPC, store, "d/replica")
    assert store.list("d") == []


def test_read_only_file_system_is_permanent(read_only):
    for store in _backends(read_only / "root"):
        with pytest.raises(PermanentStorageError) as e:
            store.write("d/part", [b"x"])
        _assert_translated(e.value, errno.EROFS, store, "d/part")
        # absent keys read as before
        assert store.size("d/part") is None and store.list("d") == []
        with pytest.raises(FileNotFoundError):
            store.read("d/part")


# ---- transient: a refused connection, and HTTP status codes from a real server ----------


@pytest.fixture
def refusing_port():
    """A loopback port bound but not listening: every connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_refused_connection_is_transient(refusing_port):
    store = open_storage(f"http://127.0.0.1:{refusing_port}/root")
    assert isinstance(store, FsspecStorage)
    with pytest.raises(TransientStorageError) as e:
        store.read("step/part")
    assert e.value.errno == errno.ECONNREFUSED and "step/part" in str(e.value)
    assert e.value.__cause__ is not None
    # fsspec's HTTP info() says FileNotFoundError for a refused connection: size() must not
    # report a missing key when the store did not answer
    with pytest.raises(TransientStorageError):
        store.size("step/part")


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    """GET/HEAD /<status>/...: answers that status; /200/... answers b'hello'."""

    def _answer(self, body: bool) -> None:
        status = int(self.path.strip("/").split("/")[-2])
        self.send_response(status)
        self.send_header("Content-Length", "5")
        self.end_headers()
        if body:
            self.wfile.write(b"hello")

    def do_GET(self) -> None:
        self._answer(True)

    def do_HEAD(self) -> None:
        self._answer(False)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def status_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "status, kind", [(503, TransientStorageError), (429, TransientStorageError), (403, PermanentStorageError)]
)
def test_http_status_is_classified(status_server, status, kind):
    store = open_storage(f"{status_server}/root")
    assert store.read("200/x") == b"hello"
    with pytest.raises(kind) as e:
        store.read(f"{status}/x")
    assert store.describe(f"{status}/x") in str(e.value) and e.value.__cause__ is not None


def test_http_missing_key_is_file_not_found(status_server):
    store = open_storage(f"{status_server}/root")
    with pytest.raises(FileNotFoundError) as e:
        store.read("404/x")
    assert not isinstance(e.value, StorageError)
    assert store.size("404/x") is None


# ---- missing keys, close() -------------------------------------------------------------


@pytest.fixture(params=["local", "fsspec-file", "fsspec-memory"])
def store(request, tmp_path):
    url = {
        "local": str(tmp_path / "root"),
        "fsspec-file": f"file://{tmp_path}/root",
        "fsspec-memory": f"memory://tdcp-backends-{os.getpid()}-{tmp_path.name}/root",
    }[request.param]
    s = LocalStorage(url) if request.param == "local" else FsspecStorage(url)
    yield s
    s.delete("")


def test_missing_keys_are_file_not_found(store):
    with pytest.raises(FileNotFoundError) as e:
        store.read("no/such/key")
    assert not isinstance(e.value, StorageError)
    with pytest.raises(FileNotFoundError):
        store.read_into("no/such/key", 0, memoryview(bytearray(4)))
    assert store.size("no/such/key") is None and store.list("no/such") == []
    store.delete("no/such/key")


def test_close_is_idempotent_and_a_context_manager(store):
    with store as s:
        assert s is store
        s.write("k", [b"v"])
    store.close()  # again: no error


def test_context_manager_closes_on_error(tmp_path):
    closed = []

    class Tracked(LocalStorage):
        def close(self) -> None:
            closed.append(self.root)

    with pytest.raises(RuntimeError), Tracked(str(tmp_path)):
        raise RuntimeError("boom")
    assert closed == [str(tmp_path)]


# ---- the registry ------------------------------------------------------------------------


@register_backend("tdcptest")
class _TestBackend(LocalStorage):
    """A backend of this test file: tdcptest://<dir> stores in <dir>, counting its opens."""

    opened: list = []

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url.removeprefix("tdcptest://"))
        self.url = url
        self.options = storage_options
        _TestBackend.opened.append(url)


@pytest.mark.parametrize(
    "url, cls",
    [
        ("/some/dir", LocalStorage),
        ("relative/dir", LocalStorage),
        ("file:///some/dir", LocalStorage),
        ("memory://bucket/x", FsspecStorage),
        ("gs://bucket/x", GCSStorage),
        ("gcs://bucket/x", GCSStorage),
        ("simplecache::gs://bucket/x", FsspecStorage),
        ("tdcptest:///x", _TestBackend),
        ("TDCPTEST:///x", _TestBackend),
    ],
)
def test_registry_picks_backend_by_scheme(url, cls):
    assert backend_for(url) is cls


def test_backend_registered_elsewhere_serves_its_scheme(tmp_path):
    store = open_storage(f"tdcptest://{tmp_path}/a", {"opt": 1})
    assert type(store) is _TestBackend and store.options == {"opt": 1}
    store.write("k", [b"v"])
    assert (tmp_path / "a" / "k").read_bytes() == b"v"
    # and the whole library saves and loads through it
    _TestBackend.opened.clear()
    cfg = TieredConfig("reg", [Tier(f"tdcptest://{tmp_path}/tier")])
    state = {"w": torch.arange(10.0), "step": 3}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=3))
    target = {"w": torch.zeros(10), "step": -1}
    dcp.load(target, storage_reader=TieredReader(cfg))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 3
    assert _TestBackend.opened and (tmp_path / "tier" / "reg").is_dir()


def test_unknown_scheme_is_a_clear_value_error():
    with pytest.raises(ValueError, match="'nosuchscheme'"):
        backend_for("nosuchscheme://bucket/x")  # a URL can be checked before it is opened
    with pytest.raises(ValueError, match="'nosuchscheme'"):
        open_storage("nosuchscheme://bucket/x")
    with pytest.raises(ValueError, match="'simplecache::nosuchscheme'"):
        open_storage("simplecache::nosuchscheme://bucket/x")


def test_a_scheme_has_one_backend():
    with pytest.raises(ValueError, match="'tdcptest' already served"):
        register_backend("tdcptest")(type("Other", (LocalStorage,), {}))
