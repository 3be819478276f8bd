"""The writer processes' runtime directory is private, and nothing read from it is a pickle.

A second user on the same host must not be able to make a trainer or its writer process run
their code: a runtime directory they made, or could change, is refused before anything is
written; its files are this user's alone; the writer's config and jobs are JSON, validated.
"""

import json
import os
import pickle
import stat
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import settle
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown
from tiered_dcp.writer_process import client
from tiered_dcp.writer_process.private_dir import UnsafeDirectoryError, ensure_private
from tiered_dcp.writer_process.run_dir import Job, RunDir, config_json, runtime_root

NOBODY = 65534


class Payload:
    """Unpickling this touches ``marker``: the proof that a planted pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def two_tiers(tmp_path, namespace="run") -> TieredConfig:
    return TieredConfig(namespace, [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])


def save(cfg: TieredConfig, step: int) -> None:
    dcp.save({"w": torch.arange(10.0) * step, "n": step}, storage_writer=TieredWriter(cfg, step=step))


@pytest.fixture
def runtime_dir(monkeypatch):
    """A runtime root of this test's own (TIERED_DCP_RUNTIME_DIR), under a sticky, world-writable
    parent like /dev/shm; the writers it served are stopped at the end."""
    parent = tempfile.mkdtemp(prefix="tdcp-shm-")
    os.chmod(parent, 0o1777)
    root = os.path.join(parent, "rt")
    monkeypatch.setenv("TIERED_DCP_RUNTIME_DIR", root)
    yield root
    shutdown(wait=True, timeout=60)
    os.system(f"rm -rf {parent}")


# -- the configuration the writer process reads -------------------------------------------


def test_config_travels_as_json_and_is_validated_on_read(tmp_path):
    cfg = TieredConfig(
        "job1",
        [
            Tier(str(tmp_path / "ram" / "{node}"), every=1, keep=2),
            Tier(
                "gs://bucket/ckpt", every=5, keep=None, compression="zstd", storage_options={"token": "anon"}
            ),
            Tier(str(tmp_path / "nfs"), shared=True),
        ],
        replication_factor=2,
        replication_jump=3,
        dedup=True,
        peer_timeout=7.5,
    )
    doc = json.loads(config_json(cfg))
    assert TieredConfig.from_dict(doc) == cfg
    bad = {**doc, "tiers": [{**doc["tiers"][0], "every": 0}]}
    with pytest.raises(ValueError, match="every=0"):
        TieredConfig.from_dict(bad)
    with pytest.raises(ValueError, match="unknown field"):
        TieredConfig.from_dict({**doc, "evil": 1})
    with pytest.raises(ValueError, match="unknown field"):
        Tier.from_dict({**doc["tiers"][0], "__class__": "x"})


def test_a_config_that_is_not_json_data_is_refused_with_a_clear_message(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "a"), storage_options={"creds": object()})])
    with pytest.raises(ValueError, match="storage_options plain values"):
        config_json(cfg)


def test_malformed_job_files_are_never_acted_on(tmp_path):
    q = tmp_path / "queue"
    q.mkdir()
    (q / "t01_s000000000001.json").write_text(json.dumps([1, 2]))
    (q / "t01_s000000000002.json").write_text(json.dumps({"step": "2", "source": 0}))
    (q / "t01_s000000000003.json").write_text(
        json.dumps({"step": 3, "source": 0, "target": 1, "rank": 0, "node": 0, "enqueued": 1.0, "x": 1})
    )
    good = {"step": 4, "source": 0, "target": 1, "rank": 0, "node": 0, "enqueued": 1.5}
    (q / "t01_s000000000004.json").write_text(json.dumps(good))
    assert RunDir(tmp_path).queue.jobs() == [Job(**good)]


# -- the directory ------------------------------------------------------------------------


def test_runtime_dir_is_created_private_and_its_files_are_ours_alone(tmp_path, runtime_dir):
    cfg = two_tiers(tmp_path)
    save(cfg, 1)
    settle(cfg)
    root = runtime_root()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    rd = RunDir.of(cfg, 0).path
    seen = []
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) == 0o700, d
        for f in filenames:
            path = os.path.join(dirpath, f)
            assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, path
            seen.append(f)
    assert {"config.json", "owner", "writer.lock", "writer.log"} <= set(seen), seen
    assert not (rd / "config.pkl").exists()
    assert TieredConfig.from_dict(json.loads((rd / "config.json").read_bytes())) == cfg


def test_a_group_or_world_writable_runtime_dir_fails_the_save_at_once(tmp_path, runtime_dir):
    os.mkdir(runtime_dir, 0o700)
    os.chmod(runtime_dir, 0o777)
    cfg = two_tiers(tmp_path)
    with pytest.raises(CheckpointException) as e:
        save(cfg, 1)
    assert any(isinstance(x, UnsafeDirectoryError) for x in causes(e.value)), causes(e.value)
    msg = "\n".join(map(str, causes(e.value)))
    assert runtime_dir in msg and "drwxrwxrwx" in msg and "0777" in msg and "chmod 700" in msg
    assert not (tmp_path / "ram").exists()  # nothing was written


def test_a_runtime_dir_under_a_non_sticky_world_writable_dir_is_refused(tmp_path, monkeypatch):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)  # anyone may rename what it holds
    monkeypatch.setenv("TIERED_DCP_RUNTIME_DIR", str(parent / "rt"))
    with pytest.raises(UnsafeDirectoryError, match="not sticky"):
        runtime_root()


def test_a_symlink_is_followed_and_its_target_checked(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert ensure_private(tmp_path / "link") == real
    os.chmod(real, 0o770)
    with pytest.raises(UnsafeDirectoryError, match=str(real)):
        ensure_private(tmp_path / "link")


def test_a_leftover_config_pickle_is_never_unpickled(tmp_path, runtime_dir):
    """Even in our own directory: the writer reads config.json, never config.pkl."""
    cfg = two_tiers(tmp_path)
    marker = tmp_path / "pwned"
    rd = RunDir.of(cfg, 0).path
    rd.mkdir(parents=True)
    (rd / "config.pkl").write_bytes(pickle.dumps(Payload(str(marker))))
    save(cfg, 1)
    settle(cfg)
    assert (tmp_path / "ssd" / "run" / "step_000000000001" / "COMMITTED").exists()
    assert not marker.exists()


# -- another user on the host -------------------------------------------------------------


def as_nobody(fn) -> None:
    """Run ``fn`` in a child process with the uid and gid of 'nobody'."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.umask(0)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def plant(root: str, rd_rel: str, payload: bytes, config: bytes, mode: int) -> None:
    """What the other user leaves: the runtime dir, the job's rank dir, a config to feed the writer."""
    os.mkdir(root, mode)
    os.chmod(root, mode)
    rd = os.path.join(root, rd_rel)
    os.makedirs(rd, 0o777)
    for name, data in (("config.pkl", payload), ("config.json", config)):
        with open(os.path.join(rd, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(rd, "queue"), 0o777)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second user")
@pytest.mark.parametrize("mode", [0o777, 0o700], ids=["world-writable", "theirs-0700"])
def test_a_runtime_dir_another_user_created_is_refused_and_nothing_planted_runs(tmp_path, runtime_dir, mode):
    cfg = two_tiers(tmp_path)
    marker = tmp_path / "pwned"
    rd_rel = os.path.relpath(rundir_of(cfg, runtime_dir), runtime_dir)
    evil_cfg = TieredConfig(cfg.namespace, [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "evil"))])
    payload = pickle.dumps(Payload(str(marker)))
    as_nobody(lambda: plant(runtime_dir, rd_rel, payload, config_json(evil_cfg), mode))
    assert os.stat(runtime_dir).st_uid == NOBODY

    with pytest.raises(CheckpointException) as e:
        save(cfg, 1)
    msg = "\n".join(map(str, causes(e.value)))
    assert any(isinstance(x, UnsafeDirectoryError) for x in causes(e.value)), msg
    assert runtime_dir in msg and "uid 65534" in msg
    # what reads the planted files is a writer process, and none was started for them; what
    # this process read of them, it read before the save raised
    assert not [rd.path for rd in client._LAUNCHED if str(rd.path).startswith(runtime_dir)]
    assert not marker.exists()
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "ram").exists()  # refused before a byte was written


def rundir_of(cfg: TieredConfig, root: str) -> str:
    """Where rank 0's runtime dir would be under ``root``, without creating or checking it."""
    probe = tempfile.mkdtemp()
    old = os.environ["TIERED_DCP_RUNTIME_DIR"]
    os.environ["TIERED_DCP_RUNTIME_DIR"] = probe
    try:
        return os.path.join(root, os.path.relpath(RunDir.of(cfg, 0).path, probe))
    finally:
        os.environ["TIERED_DCP_RUNTIME_DIR"] = old
        os.rmdir(probe)


def causes(err: BaseException) -> list[BaseException]:
    """``err`` and what it wraps (DCP keeps each rank's exception in ``failures``)."""
    out = [err]
    for failure in getattr(err, "failures", {}).values():
        out += causes(failure[0] if isinstance(failure, tuple) else failure)
    if err.__cause__ is not None:
        out += causes(err.__cause__)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second user")
def test_a_symlink_another_user_owns_is_refused_even_to_a_private_dir_of_ours(tmp_path, runtime_dir):
    """They could repoint it at any moment; that it points at a private dir now proves nothing."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    os.symlink(ours, runtime_dir)  # as if 'nobody' made it in the sticky, world-writable parent
    os.lchown(runtime_dir, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link .* another user owns") as e:
        runtime_root()
    assert "uid 65534" in str(e.value)
