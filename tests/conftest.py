import atexit
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

# gcsfs >= 2026.3 probes every bucket over gRPC unless this is off when it is imported:
# against the emulator every call would stall. Set before anything imports gcsfs; rank
# subprocesses and writer processes inherit it.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import pytest  # noqa: E402
import torch  # noqa: E402
from gcs_emulator import Emulator, FaultProxy  # noqa: E402
from s3_server import MotoServer, s3_request_kind  # noqa: E402
from s3_server import missing as s3_missing  # noqa: E402

# Writer-process runtime dirs of this test session: private, removed when it ends.
# Rank subprocesses import this module too: they inherit the session's directory. Each
# pytest-xdist worker has one of its own (a worker inherits the controller's environment).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
OWN_RUNTIME_DIR = "TIERED_DCP_RUNTIME_DIR" not in os.environ or os.environ.get("TDCP_TEST_WORKER") != WORKER
if OWN_RUNTIME_DIR:
    os.environ["TIERED_DCP_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tdcp-runtime-")
    os.environ["TDCP_TEST_WORKER"] = WORKER
    atexit.register(shutil.rmtree, os.environ["TIERED_DCP_RUNTIME_DIR"], True)
RUNTIME_DIR = os.environ["TIERED_DCP_RUNTIME_DIR"]

from tiered_dcp import Tier, TieredConfig, shutdown, writer_status  # noqa: E402


def settle(cfg: TieredConfig, timeout: float = 60) -> None:
    """Wait until the writer processes of ``cfg`` on this machine have nothing queued."""
    deadline = time.monotonic() + timeout
    while any(w.queue for w in writer_status(cfg)):
        assert time.monotonic() < deadline, f"writers still busy: {writer_status(cfg)}"
        time.sleep(0.05)


def live_files(root: Path) -> dict[int, os.stat_result]:
    """The regular files under `root` by inode, as a writer changes the tree: a file renamed or a
    step directory retired while it is listed is skipped (os.walk ignores a vanished directory;
    rglob raises)."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                st = os.stat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[st.st_ino] = st
    return found


def fd_table() -> dict[int, tuple[str, int, int]]:
    """This process's open descriptors: number -> (what it names, device, inode). A number
    closed under its owner, or reused by another file, shows as a changed or missing entry;
    one left open as an extra entry (the listing's own descriptor, closed by then, is not
    in it)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            out[fd] = (os.readlink(f"/proc/self/fd/{fd}"), st.st_dev, st.st_ino)
        except OSError:
            continue
    return out


@pytest.fixture
def tiers3(tmp_path):
    """RAM-like, SSD-like and a shared 'bucket' directory, with different schedules."""
    return TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram" / "{node}"), every=1, keep=2),
            Tier(str(tmp_path / "ssd" / "{node}"), every=2, keep=3),
            Tier(str(tmp_path / "bucket"), every=4, compression="zstd", shared=True),
        ],
    )


@pytest.fixture(scope="session", autouse=True)
def _runtime_dir():
    yield
    shutdown(wait=True, timeout=30)
    if OWN_RUNTIME_DIR:
        shutil.rmtree(RUNTIME_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _quiet_dcp(caplog):
    caplog.set_level(logging.WARNING, logger="tiered_dcp")
    yield
    shutdown(wait=False)  # this test's writers exit once their queues are empty


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """One fake-gcs-server (memory backend) for the session; its log beside the session's
    temporary directories."""
    with Emulator(tmp_path_factory.getbasetemp() / "fake-gcs-server.log") as emulator:
        yield emulator


@dataclass(frozen=True)
class GCSBucket:
    """A fresh bucket on the emulator: ``url`` (gs://name) and the ``storage_options`` a
    tier on it needs (``via``: the same options through another endpoint, a FaultProxy)."""

    url: str
    storage_options: dict
    emulator: Emulator
    kind = "gcs"

    def via(self, endpoint: str) -> dict:
        return self.emulator.storage_options(endpoint)

    def quick(self, endpoint: str) -> dict:
        """Options through ``endpoint`` under which a bucket that does not answer fails a
        call within seconds (the backend's defaults wait 30 s per request, 60 s in all)."""
        return {**self.via(endpoint), "idle_timeout": 1.0, "retry_timeout": 2.0}

    def proxy(self, lifetime: float = 300) -> FaultProxy:
        return FaultProxy(self.emulator.url, lifetime=lifetime)


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket on the moto server, reached through s3fs: like ``GCSBucket``."""

    url: str
    storage_options: dict
    server: MotoServer
    kind = "s3"

    def via(self, endpoint: str) -> dict:
        return self.server.storage_options(endpoint)

    def quick(self, endpoint: str) -> dict:
        """botocore waits 60 s for a connection or an answer and retries 4 times, and s3fs
        tries each call 5 times over: 1 s and one botocore attempt bound a call to ~7 s."""
        return self.server.storage_options(
            endpoint, connect_timeout=1, read_timeout=1, retries={"max_attempts": 1}
        )

    def proxy(self, lifetime: float = 300) -> FaultProxy:
        return FaultProxy(self.server.url, lifetime=lifetime, kind=s3_request_kind)


@pytest.fixture
def shm():
    """A directory in /dev/shm (a real tmpfs: RAM tiers stage into and recycle part files
    there), removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="tdcp-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gcs_bucket(gcs_emulator):
    name = f"t-{uuid.uuid4().hex[:16]}"
    gcs_emulator.create_bucket(name)
    bucket = GCSBucket(f"gs://{name}", gcs_emulator.storage_options(), gcs_emulator)
    yield bucket
    from tiered_dcp.storage import open_storage

    with open_storage(bucket.url, bucket.storage_options) as store:
        store.delete("")  # the emulator keeps everything in memory for the whole session


@pytest.fixture
def fault_proxy(gcs_emulator):
    """A FaultProxy in front of the session's emulator (passing every request until told)."""
    with FaultProxy(gcs_emulator.url, lifetime=300) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One moto S3 server for the session (a real subprocess); its log beside the session's
    temporary directories. Skipped, saying why, only where s3fs or moto is not installed."""
    why = s3_missing()
    if why:
        pytest.skip(why)
    with MotoServer(tmp_path_factory.getbasetemp() / "moto-server.log") as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(name)
    bucket = S3Bucket(f"s3://{name}", s3_server.storage_options(), s3_server)
    yield bucket
    from tiered_dcp.storage import open_storage

    with open_storage(bucket.url, bucket.storage_options) as store:
        store.delete("")  # moto keeps everything in memory for the whole session


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    """A fresh bucket on each real server: fake-gcs-server (gs://, tiered-dcp's own backend)
    and moto (s3://, s3fs through the fsspec backend); the same test runs on both."""
    return request.getfixturevalue(f"{request.param}_bucket")


@pytest.fixture
def proxy(bucket):
    """A FaultProxy in front of ``bucket``'s server, counting requests in its API's kinds."""
    with bucket.proxy() as p:
        yield p


def value_kinds(i: int) -> dict:
    """One of every value kind a state dict may hold, varying with ``i``."""
    return {
        "f32": torch.arange(1000, dtype=torch.float32) + i,
        "nested": {
            "bf16": torch.full((3, 5), float(i), dtype=torch.bfloat16),
            "f16": torch.linspace(0, 1, 7, dtype=torch.float16) * i,
            "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3) * i,
            "bool": torch.tensor([True, False, i % 2 == 0]),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(float(i)),
            "big": torch.full((3, 1 << 20), float(i)),  # 12 MiB: spans two chunks
        },
        "list": [i, "x" * i, torch.ones(2) * i],
        "int": i,
        "str": f"step-{i}",
    }


def zeros_like_state(sd):
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, int):
        return -1
    if isinstance(sd, str):
        return ""
    return sd


def assert_state_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_state_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    else:
        assert a == b
