"""A new user's first hour with the command line, on a checkpoint laid out as the README's
quickstart lays it out (``ckpt/ram/{node}``, ``ckpt/ssd/{node}``, namespace "quickstart"):
a mistyped tier path or namespace, an unknown flag, ``status``, and how long a look takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter, wait_for

RAM, SSD = "ckpt/ram/{node}", "ckpt/ssd/{node}"


def tdcp(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``tiered-dcp ARGS`` run from ``cwd``, as the quickstart's user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tiered_dcp", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """A directory holding the quickstart's tiers: steps 1-5 on RAM, step 5 on the SSD."""
    where = tmp_path_factory.mktemp("quickstart")
    cfg = TieredConfig(
        "quickstart",
        [Tier(str(where / RAM), every=1, keep=2), Tier(str(where / SSD), every=5, keep=3)],
    )
    for step in range(1, 6):
        state = {"model": {"w": torch.full((64, 32), float(step))}, "step": step}
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, 5, timeout=120)
    return where


# -------------------------------------------------------------------------- tier paths


def test_a_mistyped_tier_path_is_named_with_what_is_there(quickstart):
    r = tdcp(quickstart, "ls", "-n", "quickstart", RAM, "ckpt/sdd/{node}")
    want = (
        "tier 1 (ckpt/sdd/{node}): ckpt/sdd does not exist; ckpt holds: ram, ssd "
        "(did you mean 'ckpt/ssd/{node}'?)"
    )
    assert want in r.stderr, r.stderr
    assert r.stdout.startswith("step"), r.stdout  # the tier that is there is still shown
    for cmd in (["status"], ["verify"], ["export", "--to", str(quickstart / "out")], ["rm", "--step", "1"]):
        r = tdcp(quickstart, *cmd, "-n", "quickstart", RAM, "ckpt/sdd/{node}")
        assert f"tiered-dcp {cmd[0]}: {want}" in r.stderr, (cmd, r.stderr)


def test_a_tier_path_that_does_not_exist_is_not_an_empty_tier(quickstart):
    r = tdcp(quickstart, "ls", "-n", "quickstart", "ckpt/nope/{node}")
    assert r.returncode == 1
    assert r.stderr == (
        "tiered-dcp ls: tier 0 (ckpt/nope/{node}): ckpt/nope does not exist; ckpt holds: ram, ssd\n"
    ), r.stderr
    r = tdcp(quickstart, "ls", "ckpt/nope")  # the namespaces a path holds: the same line
    assert r.returncode == 1 and "ckpt/nope does not exist; ckpt holds: ram, ssd" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", ["ls", "status", "verify", "export", "rm", "prune", "import", "goodput"])
def test_a_path_of_node_directories_asks_for_node(quickstart, cmd):
    extra = {
        "export": ["--to", str(quickstart / "x")],
        "rm": ["--step", "1"],
        "prune": ["--keep", "1"],
        "import": ["--from", str(quickstart / "x"), "--step", "9"],
        "goodput": ["--from-job"],
    }.get(cmd, [])
    r = tdcp(quickstart, cmd, "-n", "quickstart", "ckpt/ram", *extra)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        f"tiered-dcp {cmd}: tier 0 (ckpt/ram): ckpt/ram holds node directories 0: "
        "did you mean 'ckpt/ram/{node}'?\n"
    ), r.stderr


def test_a_namespace_s_own_directory_as_a_tier_is_named_so(quickstart):
    r = tdcp(quickstart, "ls", "-n", "quickstart", "ckpt/ram/0/quickstart")
    assert r.returncode == 2
    assert "ckpt/ram/0/quickstart holds steps: it is the directory of namespace 'quickstart'" in r.stderr
    assert "give its parent 'ckpt/ram/0' as the tier, with -n quickstart" in r.stderr, r.stderr


# -------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize("cmd", ["ls", "status", "verify", "export", "rm", "prune"])
def test_every_command_says_the_same_of_a_mistyped_namespace(quickstart, cmd):
    extra = {"export": ["--to", str(quickstart / "x")], "rm": ["--step", "1"], "prune": ["--keep", "1"]}
    r = tdcp(quickstart, cmd, "-n", "quickstrat", RAM, SSD, *extra.get(cmd, []))
    assert r.returncode == 1
    assert r.stderr == (
        f"tiered-dcp {cmd}: no namespace 'quickstrat' on these tiers; did you mean 'quickstart'? "
        "(namespaces there: quickstart)\n"
    ), r.stderr


# -------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "args, close",
    [
        (["ls", "--wde"], "--wide"),
        (["verify", "--stpe", "3"], "--step"),
        (["export", "--formt", "dcp"], "--format"),
        (["status", "--jsn"], "--json"),
        (["goodput", "--step-tme", "1"], "--step-time"),
        (["drill", "--minuts", "1"], "--minutes"),
        (["demo", "--kil-at", "3"], "--kill-at"),
        (["--verison"], "--version"),
    ],
)
def test_an_unknown_flag_gets_the_close_one(tmp_path, args, close):
    r = tdcp(tmp_path, *args)
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].endswith(f"(did you mean {close}?)"), r.stderr


# -------------------------------------------------------------------------- status


def test_status_shows_each_step_on_each_tier_and_the_writers(quickstart):
    r = tdcp(quickstart, "status", "-n", "quickstart", RAM, SSD)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["step", "tier", "state", "size", "age"]
    rows = [line.split()[:4] for line in lines[1:4]]
    assert rows == [
        ["5", "0", "(ckpt/ram/{node})", "committed"],
        ["5", "1", "(ckpt/ssd/{node})", "committed"],
        ["4", "0", "(ckpt/ram/{node})", "committed"],
    ], r.stdout
    doc = json.loads(tdcp(quickstart, "status", "--json", "-n", "quickstart", RAM, SSD).stdout)
    assert [(s["step"], s["tier_index"], s["state"]) for s in doc["steps"]] == [
        (4, 0, "committed"),
        (5, 0, "committed"),
        (5, 1, "committed"),
    ]
    assert "writers" in doc
    assert "status" in tdcp(quickstart, "--help").stdout
