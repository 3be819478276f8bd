"""A new user's first hour with the command line, on a checkpoint laid out as the README's
quickstart lays it out (``ckpt/ram/{node}``, ``ckpt/ssd/{node}``, namespace "quickstart"):
a mistyped tier path or namespace, an unknown flag, ``status``, and how long a look takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter, wait_for

RAM, SSD = "ckpt/ram/{node}", "ckpt/ssd/{node}"


def tdcp(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``tiered-dcp ARGS`` run from ``cwd``, as the quickstart's user runs it."""
    return preloaded.run(
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


# -------------------------------------------------------------------------- a quick look


def test_ls_status_and_verify_import_no_torch(quickstart):
    """torch's import is seconds of a look that takes milliseconds: the steps and storage
    modules import none, and verify reads the metadata into torch-free stand-ins."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import tiered_dcp.steps, tiered_dcp.storage\n"
        "for pkg in (tiered_dcp.steps, tiered_dcp.storage):  # every module of both\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "from tiered_dcp.cli.main import main\n"
        "for cmd in ('ls', 'status', 'verify'):\n"
        f"    assert main([cmd, '-n', 'quickstart', {RAM!r}, {SSD!r}]) == 0, cmd\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "assert not heavy, heavy[:5]\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=quickstart
    )
    assert r.returncode == 0, r.stderr
    assert "step 5: good on all 2 tier(s) holding it" in r.stdout, r.stdout


def _blob(cfg: TieredConfig, step: int) -> bytes:
    from tiered_dcp.steps.catalog import read_metadata_blob, views

    (view,) = views(cfg, 0, 0)
    return read_metadata_blob(view.committed()[step])


def test_the_torch_free_reading_of_metadata_gives_torch_s_facts(tmp_path):
    from conftest import value_kinds

    from tiered_dcp.steps import metadata, plain_metadata

    cfg = TieredConfig("facts", [Tier(str(tmp_path / "t"))])
    state = {
        **value_kinds(3),
        "c64": torch.ones(4, dtype=torch.complex64),
        "u8": torch.ones(3, dtype=torch.uint8),
    }
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    blob = _blob(cfg, 1)
    plain, real = metadata.loads(blob, 1, plain=True), metadata.loads(blob, 1)
    assert type(plain) is plain_metadata.Metadata and type(real).__module__ == metadata.DCP_METADATA
    assert getattr(plain, metadata.CHECKED) == getattr(real, metadata.CHECKED)
    assert [metadata.item_key(i) for i in plain.storage_data] == [
        metadata.item_key(i) for i in real.storage_data
    ]
    assert list(plain.storage_data.values()) == list(real.storage_data.values())


def _forged(build_into: bytes, becomes: str) -> bytes:
    """A pickle that makes ``build_into`` and sets its ``__class__`` to DCP's ``becomes``
    through pickle's slot state (BUILD with ``(None, {"__class__": ...})``)."""
    from tiered_dcp.steps.plain_metadata import DCP

    key = b"__class__"
    return (
        b"\x80\x02"
        + build_into
        + b"N}X"
        + len(key).to_bytes(4, "little")
        + key
        + f"c{DCP}\n{becomes}\n".encode()
        + b"s\x86b."
    )


def test_the_torch_free_reader_refuses_a_record_turned_into_another(tmp_path):
    """A blob may not turn one stand-in into another: a record into a memory format (torch's
    reader calls that blob damaged; the torch-free one must not call it good), or the shared
    memory format values into records (every later read in the process would change)."""
    import io

    from tiered_dcp.steps.plain_metadata import DCP, STRIDED, Layout, MemoryFormat, PlainUnpickler

    record = f"c{DCP}\nChunkStorageMetadata\n".encode() + b")\x81"  # NEWOBJ: no constructor run
    shared = f"c{DCP}\n_MEM_FORMAT_ENCODING\n".encode() + b"K\x00\x85R"  # _MEM_FORMAT_ENCODING(0)
    layout = b"ctorch.serialization\n_get_layout\nX\r\x00\x00\x00torch.strided\x85R"  # STRIDED itself
    forged = [
        _forged(record, "_MEM_FORMAT_ENCODING"),
        _forged(shared, "Metadata"),
        _forged(layout, "_MEM_FORMAT_ENCODING"),  # the two shared values have the same empty layout
    ]
    for blob in forged:
        with pytest.raises(Exception):  # noqa: B017, PT011 - any refusal: torch's reader decides then
            PlainUnpickler(io.BytesIO(blob)).load()
    assert type(MemoryFormat(0)) is MemoryFormat and type(STRIDED) is Layout


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_the_dtype_table_is_torch_s():
    """Each dtype the torch-free reader takes: the name torch pickles it by, its element size."""
    from tiered_dcp.steps.plain_metadata import DTYPE_SIZES

    for name, size in DTYPE_SIZES.items():
        dtype = getattr(torch, name)
        assert dtype.__reduce__() == name and torch.empty(0, dtype=dtype).element_size() == size, name


def test_what_the_torch_free_reader_does_not_take_torch_s_reads(tmp_path):
    """A dtype outside the table: the blob is read by torch's reader, and verify is as good."""
    from tiered_dcp.ops.verify import verify_step
    from tiered_dcp.steps import metadata

    cfg = TieredConfig("rare", [Tier(str(tmp_path / "t"))])
    dcp.save({"w": torch.zeros(8, dtype=torch.float8_e8m0fnu)}, storage_writer=TieredWriter(cfg, step=1))
    md = metadata.loads(_blob(cfg, 1), 1, plain=True)
    assert type(md).__module__ == metadata.DCP_METADATA
    (check,) = verify_step(cfg, 1)
    assert check.ok and check.items == 1, check.problems
