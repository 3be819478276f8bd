"""The writer process never imports torch; the package imports it only where it is used."""

import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp
from conftest import settle

import tiered_dcp
from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, wait_for, writer_status


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_writer_and_the_torch_free_modules_import_no_torch():
    r = _fresh(
        "import sys, tiered_dcp.writer_process.process\n"
        "assert 'tiered_dcp.writer_process.client' not in sys.modules  # the trainer's side\n"
        "assert 'fsspec' not in sys.modules  # imported once a tier is a URL: 40% of a start\n"
        "assert 'asyncio' not in sys.modules  # with the GCS backend, once a tier is gs://\n"
        "import tiered_dcp.api, tiered_dcp.cli.main, tiered_dcp.storage.format, tiered_dcp.storage.codec\n"
        "import tiered_dcp.writer_process.client, tiered_dcp.writer_process.run_dir\n"
        "import tiered_dcp.writer_process.timings, tiered_dcp.ranks.cliques\n"
        "from tiered_dcp.steps import catalog, choice, commit, leases, part_file\n"
        "from tiered_dcp.steps import placement, retention, status as step_status\n"
        "from tiered_dcp import Tier, TieredConfig, status, latest_step\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m in\n"
        "               ('tiered_dcp.save.writer', 'tiered_dcp.load.reader', 'tiered_dcp.save.replicate'))\n"
        "assert not heavy, heavy\n"
        "from tiered_dcp.storage import FsspecStorage, backend_for\n"
        "assert backend_for('gs://b/x').__name__ == 'GCSStorage' == backend_for('gcs://b').__name__\n"
        "assert backend_for('s3://b/x') is FsspecStorage and 'asyncio' in sys.modules\n"
    )
    assert r.returncode == 0, r.stderr


def test_public_names_load_on_first_use():
    r = _fresh(
        "import sys, tiered_dcp\n"
        "assert 'torch' not in sys.modules\n"
        "from tiered_dcp import TieredWriter, TieredReader, export\n"
        "assert 'torch' in sys.modules and TieredWriter.__module__ == 'tiered_dcp.save.writer'\n"
        "assert all(getattr(tiered_dcp, n) is not None for n in tiered_dcp.__all__)\n"
        "assert set(tiered_dcp.__all__) <= set(dir(tiered_dcp))\n"
        "try:\n    tiered_dcp.nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    assert r.returncode == 0, r.stderr
    assert tiered_dcp.TieredWriter is TieredWriter


def test_a_real_writer_process_maps_no_torch_library(tmp_path):
    cfg = TieredConfig(
        "lean",
        [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "bucket"), compression="zstd", shared=True)],
    )
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 1}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, timeout=60)
    settle(cfg)
    (w,) = writer_status(cfg)
    assert w.running and w.pid
    with open(f"/proc/{w.pid}/maps") as f:
        libraries = {line.split()[-1] for line in f if "/" in line}
    assert any("python" in lib for lib in libraries)  # it is the writer's own map we read
    assert not [lib for lib in libraries if "torch" in os.path.basename(lib) or "/torch/" in lib]
    with open(f"/proc/{w.pid}/cmdline", "rb") as f:
        assert b"tiered_dcp.writer_process.process" in f.read()
    target = {"w": torch.zeros(1 << 20), "step": 0}
    dcp.load(target, storage_reader=TieredReader(TieredConfig("lean", [cfg.tiers[1]]), step=1))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 1
