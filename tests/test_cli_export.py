"""export() and the tiered-dcp command line, run as a user would."""

import glob
import os
import subprocess
import sys

import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, value_kinds, zeros_like_state
from test_save_load import flip_byte, save

from tiered_dcp import export, wait_for


def cli(*args, check=True):
    r = subprocess.run(
        [sys.executable, "-m", "tiered_dcp.cli", *args], capture_output=True, text=True, timeout=300
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def tier_args(tmp_path):
    return ["-n", "run", str(tmp_path / "ram/{node}"), str(tmp_path / "ssd/{node}"), str(tmp_path / "bucket")]


def test_export_is_loaded_by_the_stock_reader(tiers3, tmp_path):
    for step in range(5):
        save(tiers3, step)
    dest = export(tiers3, 4, tmp_path / "exported")
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(dest))
    assert_state_equal(got, value_kinds(4))


def test_cli_ls_verify_export(tiers3, tmp_path):
    for step in range(5):
        save(tiers3, step)
    wait_for(tiers3, 4, timeout=120)  # the writer processes copy it down: on a busy host, not at once
    out = cli("ls", *tier_args(tmp_path)).stdout
    lines = out.splitlines()
    assert lines[0].startswith("step") and "tier 2:" in lines[0]
    assert lines[1].split()[0] == "4" and lines[1].count("committed") == 3
    assert lines[2].split()[0] == "3" and "-" in lines[2].split()
    r = cli("verify", *tier_args(tmp_path))
    assert r.stdout.count(": OK") == 3, r.stdout
    (part,) = glob.glob(str(tmp_path / "ssd/0/run/step_000000000004/rank_*.part"))
    flip_byte(part, 0.7)
    r = cli("verify", *tier_args(tmp_path), check=False)
    assert r.returncode == 1
    assert "DAMAGED" in r.stdout and part in r.stdout and "nested.big" in r.stdout
    r = cli("export", *tier_args(tmp_path), "--step", "2", "--to", str(tmp_path / "exp"))
    assert "exported to" in r.stdout
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "exp")))
    assert_state_equal(got, value_kinds(2))


def test_cli_errors_are_readable(tmp_path):
    r = cli("ls", "-n", "nothing", str(tmp_path / "t"))
    assert "no steps of namespace 'nothing'" in r.stdout
    r = cli("verify", "-n", "nothing", str(tmp_path / "t"), check=False)
    assert r.returncode == 2 and "no committed step" in r.stderr
    r = cli("export", "-n", "nothing", str(tmp_path / "t"), "--to", str(tmp_path / "x"), check=False)
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr
    r = cli("ls", "-n", "bad/name", str(tmp_path / "t"), check=False)
    assert r.returncode == 2 and "not a safe path component" in r.stderr


def test_demo_runs(tmp_path):
    r = cli("demo", "--dir", str(tmp_path / "demo"), "--steps", "12", "--kill-at", "7")
    assert "rank 1 SIGKILLed while saving step 7" in r.stdout
    assert "OK: the job resumed from step" in r.stdout
    assert os.path.isdir(tmp_path / "demo/bucket/demo/step_000000000010")
    d = tmp_path / "demo"
    for args in (  # every tier of both scenes verifies OK after the demo
        ["-n", "demo", f"{d}/ram/{{node}}", f"{d}/ssd/{{node}}", f"{d}/bucket"],
        ["-n", "demo-nodeloss", f"{d}/ram/nodeloss/{{node}}", f"{d}/nodeloss/bucket"],
    ):
        r = cli("verify", *args)
        assert "DAMAGED" not in r.stdout and ": OK" in r.stdout, r.stdout
