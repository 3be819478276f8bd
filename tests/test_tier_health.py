"""A bucket that fails, stalls or is gone never blocks training, a load, or the writer's exit.

Each test runs on real fake-gcs-server and on moto's S3 server (s3fs), behind a FaultProxy:
``stall`` accepts connections and never answers; a dead endpoint is a bound port nobody
listens on; a missing bucket is a name the server does not have. The backends keep their
default timeouts (GCS: 30 s without progress, 60 s of retries; botocore: 60 s, 4 retries)
unless a test says otherwise (``bucket.quick``): the point is that the trainer and the
reader do not wait for them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

import preloaded
import pytest
import torch.distributed.checkpoint as dcp
from test_writer_process import load_exact, only, small_state
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import (
    NoCheckpointError,
    Tier,
    TieredCheckpointError,
    TieredConfig,
    TieredReader,
    TieredWriter,
    latest_step,
    status,
    wait_for,
    writer_status,
)
from tiered_dcp.writer_process.run_dir import RunDir


def dead_endpoint() -> tuple[socket.socket, str]:
    s = socket.socket()  # bound, not listening: every connection is refused
    s.bind(("127.0.0.1", 0))
    return s, f"http://127.0.0.1:{s.getsockname()[1]}"


def two_tiers(tmp_path, bucket_url: str, options: dict, **config) -> TieredConfig:
    return TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram"), keep=2),
            Tier(f"{bucket_url}/ckpt", keep=2, storage_options=options),
        ],
        **config,
    )


def timed_saves(cfg: TieredConfig, steps) -> list[float]:
    took = []
    for step in steps:
        t0 = time.monotonic()
        dcp.async_save(small_state(step, mib=1), storage_writer=TieredWriter(cfg, step=step)).result()
        took.append(time.monotonic() - t0)
    return took


def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("fault", ["stall", "dead"])
def test_a_bucket_that_does_not_answer_never_blocks_training(bucket, proxy, tmp_path, fault, caplog):
    if fault == "stall":
        proxy.inject(("stall", 1))
        endpoint, closer = proxy.url, None
    else:
        closer, endpoint = dead_endpoint()
    cfg = two_tiers(tmp_path, bucket.url, bucket.via(endpoint), tier_timeout=3.0)
    took = timed_saves(cfg, range(1, 6))
    # Two saves queue at once; the third waits at most until the writer, seeing no progress
    # for tier_timeout (3 s here; 10 s by default), calls the tier stalled; none waits after that.
    assert max(took[:2]) < 3 and max(took) < cfg.tier_timeout + 10 and sum(took[3:]) < 3, took
    # the writer keeps only the newest step queued (plus the one under way), within a moment
    until(lambda: len(writer_status(cfg)[0].queue) <= 2, 5, "the queue trimmed")
    (w,) = writer_status(cfg)
    assert w.unhealthy[1]["state"] in ("stalled", "failing"), w
    queued = {s for s, _ in w.queue}
    skipped = {s for s, t, _ in w.skipped}
    assert 5 in queued and len(queued) <= 2 and skipped and queued | skipped == {1, 2, 3, 4, 5}, w
    assert all("skipped: tier" in why for _, _, why in w.skipped)
    rows = {(r.tier_index, r.step): r.state for r in status(cfg)}
    assert [s for (t, s), state in rows.items() if t == 1 and state == "skipped"] == sorted(skipped)
    assert any("saves go on without waiting" in r.getMessage() for r in caplog.records)
    # a load of the newest step, from RAM, skips the bucket after tier_timeout
    t0 = time.monotonic()
    load_exact(cfg, 5, small_state(5, mib=1))
    assert time.monotonic() - t0 < 60
    assert any("did not answer" in r.getMessage() for r in caplog.records)
    if closer is not None:
        closer.close()
    kill_writers(cfg)  # still retrying the bucket for as long as this process (its trainer) lives


def kill_writers(cfg: TieredConfig) -> None:
    for w in writer_status(cfg):
        if w.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)


def test_a_stalled_tier_gets_the_newest_step_once_it_answers_again(bucket, proxy, tmp_path):
    # on S3 too (s3fs): its upload to a silent endpoint waited forever for "100 Continue"
    cfg = two_tiers(tmp_path, bucket.url, bucket.quick(proxy.url), tier_timeout=2.0)
    proxy.inject(("stall", 1))
    took = timed_saves(cfg, range(1, 5))
    assert max(took) < 2.0 + 5, took  # bounded by tier_timeout, not by the backend's timeouts
    until(lambda: writer_status(cfg)[0].unhealthy, 30, "the bucket judged unhealthy")
    proxy.inject()  # the bucket answers again
    timed_saves(cfg, [6])
    wait_for(cfg, 6, tier=1, timeout=60)
    until(lambda: not writer_status(cfg)[0].unhealthy, 10, "the bucket judged healthy again")
    load_exact(only(cfg, 1), 6, small_state(6, mib=1))
    (w,) = writer_status(cfg)
    assert {s for s, _, _ in w.skipped} <= {1, 2, 3, 4} and w.skipped  # never silently dropped


def test_missing_bucket_is_reported_at_once(bucket, tmp_path, caplog):
    scheme = bucket.url.split("://")[0]
    cfg = two_tiers(tmp_path, f"{scheme}://no-such-bucket-here", bucket.storage_options)
    t0 = time.monotonic()
    timed_saves(cfg, [1])
    with pytest.raises(TieredCheckpointError, match="does not exist"):
        wait_for(cfg, 1, tier=1, timeout=30)
    assert time.monotonic() - t0 < 10  # a permanent error: not retried for minutes
    (w,) = writer_status(cfg)
    assert w.unhealthy[1]["state"] == "failing" and "does not exist" in w.unhealthy[1]["error"]
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", "run", *(t.path for t in cfg.tiers)]
        + [f"--option={k}={v}" for k, v in bucket.storage_options.items()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "tier 1 FAILING" in r.stdout and "does not exist" in r.stdout, r.stdout + r.stderr


def test_a_remote_first_tier_that_is_down_fails_the_save_within_a_bound(bucket):
    closer, endpoint = dead_endpoint()
    cfg = TieredConfig("run", [Tier(f"{bucket.url}/ckpt", storage_options=bucket.quick(endpoint))])
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        dcp.save(small_state(1, mib=1), storage_writer=TieredWriter(cfg, step=1))
    assert time.monotonic() - t0 < 15
    assert "step 1 was not saved" in str(e.value) and "the fastest tier taking it, failed" in str(e.value)
    assert any(why in str(e.value) for why in ("Connection refused", "Could not connect")), e.value
    closer.close()


def test_queries_skip_a_stalled_bucket_and_say_what_they_could_not_search(bucket, proxy, tmp_path):
    options = bucket.quick(proxy.url)
    cfg = TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram"), keep=1),
            Tier(f"{bucket.url}/ckpt", every=2, storage_options=options),
        ],
        tier_timeout=2.0,
    )
    timed_saves(cfg, [1, 2, 3])
    wait_for(cfg, 2, tier=1, timeout=60)
    assert latest_step(cfg) == 3
    proxy.inject(("stall", 1))
    t0 = time.monotonic()
    assert latest_step(cfg) == 3  # RAM's newest; the bucket is skipped after tier_timeout
    assert time.monotonic() - t0 < 8
    with pytest.raises(NoCheckpointError, match=r"(?s)step 2 .*NOT SEARCHED, it did not answer"):
        TieredReader(cfg, step=2)  # only the bucket holds it
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", "run", *(t.path for t in cfg.tiers)]
        + [f"--option={k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "did not answer" in r.stderr and "committed" in r.stdout, r.stdout + r.stderr


TRAINER = """
import json, os, sys
import torch, torch.distributed.checkpoint as dcp
from tiered_dcp import Tier, TieredConfig, TieredWriter
ram, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = TieredConfig("run", [Tier(ram), Tier(url, storage_options=options)], writer_drain_timeout=3.0)
for step in (1, 2):
    dcp.save({"w": torch.full((1000,), float(step))}, storage_writer=TieredWriter(cfg, step=step))
os._exit(0)  # gone without shutdown(): the writer is on its own
"""


def test_the_writer_exits_after_its_trainer_died_with_the_bucket_down(bucket, proxy, tmp_path):
    proxy.inject(("stall", 1))
    url, options = f"{bucket.url}/ckpt", bucket.via(proxy.url)
    r = preloaded.run(
        [sys.executable, "-c", TRAINER, str(tmp_path / "ram"), url, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    cfg = TieredConfig(
        "run", [Tier(str(tmp_path / "ram")), Tier(url, storage_options=options)], writer_drain_timeout=3.0
    )
    rd = RunDir.of(cfg, 0)
    t0 = time.monotonic()
    until(lambda: not writer_status(cfg)[0].queue, 30, "the writer gives up")
    until(lambda: not writer_status(cfg)[0].running, 10, "the writer exits")
    assert time.monotonic() - t0 < 20
    (w,) = writer_status(cfg)
    out = "".join(p.read_text() for p in (rd.writer.log_path, rd.writer.out_path) if p.exists())
    assert {s for s, _, _ in w.failed} == {1, 2}, (w, out)
    assert all("gave up" in why and "writer_drain_timeout=3" in why for _, _, why in w.failed)
    log = rd.writer.log_path.read_text()
    assert "not persisted" in log
    assert os.listdir(tmp_path / "ram" / "run")  # the fast tier keeps its steps
