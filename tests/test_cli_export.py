"""export() and the tiered-dcp command line, run as a user would."""

import contextlib
import glob
import os
import pty
import shlex
import subprocess
import sys

import preloaded
import pytest
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, value_kinds, zeros_like_state
from test_save_load import flip_byte, save

from tiered_dcp import export, wait_for
from tiered_dcp.cli.demo import run_demo


def cli(*args, check=True):
    r = preloaded.run(
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
    assert r.stdout.count(": OK") == 3 and "step 4: good on all 3 tier(s)" in r.stdout, r.stdout
    (part,) = glob.glob(str(tmp_path / "ssd/0/run/step_000000000004/rank_*.part"))
    flip_byte(part, 0.7)
    r = cli("verify", *tier_args(tmp_path), check=False)
    assert r.returncode == 1
    assert "DAMAGED" in r.stdout and part in r.stdout and "nested.big" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("step 4: DAMAGED on tier 1 of 3 tier(s)")
    assert "(replica)" not in r.stdout  # each node-local root holds its own rank's part here
    r = cli("export", *tier_args(tmp_path), "--step", "2", "--to", str(tmp_path / "exp"))
    assert "exported step 2 to" in r.stdout
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "exp")))
    assert_state_equal(got, value_kinds(2))


def test_cli_errors_are_readable(tmp_path):
    """One exit code convention: 0 ok, 1 damage or nothing found, 2 usage or configuration."""
    r = cli("ls", "-n", "nothing", str(tmp_path / "t"), check=False)
    assert r.returncode == 1 and f"{tmp_path / 't'} does not exist; {tmp_path} is empty" in r.stderr
    (tmp_path / "t").mkdir()
    nothing = "no namespace 'nothing' on these tiers; these tiers hold no namespace"
    r = cli("ls", "-n", "nothing", str(tmp_path / "t"), check=False)
    assert r.returncode == 1 and nothing in r.stderr
    r = cli("verify", "-n", "nothing", str(tmp_path / "t"), check=False)
    assert r.returncode == 1 and nothing in r.stderr
    r = cli("export", "-n", "nothing", str(tmp_path / "t"), "--to", str(tmp_path / "x"), check=False)
    assert r.returncode == 1 and nothing in r.stderr
    r = cli("ls", "-n", "bad/name", str(tmp_path / "t"), check=False)
    assert r.returncode == 2 and "not a safe path component" in r.stderr
    r = cli("ls", "-n", "x", check=False)
    assert r.returncode == 2 and "say which job" in r.stderr
    # az:// needs adlfs, which is not installed (s3fs is, with the test tools)
    for out in (cli("ls", "-n", "nothing", "az://b/c", check=False), cli("--bogus", check=False)):
        assert out.returncode == 2 and "Traceback" not in out.stderr
    r = cli("demo", "--steps", "5", "--kill-at", "9", check=False)  # the command reaches run_demo
    assert r.returncode == 2 and "--kill-at must be between 2 and 4" in r.stderr, r.stderr
    r = cli("--version")
    assert r.stdout.startswith("tiered-dcp 0.")
    assert "exit codes" in cli("--help").stdout and "2  usage" in cli("ls", "--help").stdout


def test_ls_names_the_namespaces_a_tier_holds(tiers3, tmp_path):
    for step in (1, 2):
        save(tiers3, step)
    root = str(tmp_path / "ram/{node}")
    r = cli("ls", root)
    assert "run" in r.stdout and "tiered-dcp ls -n NAMESPACE" in r.stdout, r.stdout
    (row,) = [line.split() for line in r.stdout.splitlines() if line.startswith("run ")]
    assert row[2:4] == ["2", "2"]  # two committed steps there, the newest is 2
    r = cli("ls", "-n", "typo", root, check=False)
    assert r.returncode == 1 and "namespaces there: run" in r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("ls", str(tmp_path / "empty"), check=False)
    assert r.returncode == 1 and "no namespace on" in r.stderr


def test_ls_fits_the_terminal_unless_wide(tiers3, tmp_path):
    """On a terminal (a real pty here) 60 columns wide, ls fits; --wide and a pipe do not."""
    save(tiers3, 1)
    args = [sys.executable, "-m", "tiered_dcp.cli", "ls", *tier_args(tmp_path)]

    def on_a_terminal(*extra: str) -> str:
        main, sub = pty.openpty()
        env = {**os.environ, "COLUMNS": "60"}
        proc = preloaded.run([*args, *extra], stdout=sub, stderr=subprocess.PIPE, env=env, timeout=120)
        os.close(sub)
        out = b""
        with contextlib.suppress(OSError):  # EIO once the pty is drained
            while chunk := os.read(main, 65536):
                out += chunk
        os.close(main)
        assert proc.returncode == 0, proc.stderr
        return out.decode().replace("\r\n", "\n")

    narrow = on_a_terminal()
    assert narrow.startswith("tier 0: ")  # the paths above the table, the columns by index
    table = narrow[narrow.index("step") :].split("host memory")[0].split("writer processes")[0]
    assert max(len(line) for line in table.splitlines()) <= 60, narrow
    wide = on_a_terminal("--wide")
    assert wide.startswith("step") and "logical" in wide
    piped = cli("ls", *tier_args(tmp_path)).stdout
    assert piped.startswith("step") and "logical" in piped


def test_demo_runs(tmp_path, capsys):
    # what `tiered-dcp demo --steps 12 --kill-at 7` runs, its ranks forked from an interpreter
    # that imported torch already (the command starts fresh ones: subprocess.Popen)
    assert run_demo(str(tmp_path / "demo"), steps=12, kill_at=7, start=preloaded.Popen) == 0
    demo_out = capsys.readouterr().out
    assert "rank 1 SIGKILLed while saving step 7" in demo_out
    assert "OK: the job resumed from step" in demo_out
    assert "(namespace 'demo')" in demo_out
    assert os.path.isdir(tmp_path / "demo/bucket/demo/step_000000000010")
    d = tmp_path / "demo"
    for args in (  # every tier of both scenes verifies OK after the demo
        ["-n", "demo", f"{d}/ram/{{node}}", f"{d}/ssd/{{node}}", f"{d}/bucket"],
        ["-n", "demo-nodeloss", f"{d}/ram/nodeloss/{{node}}", f"{d}/nodeloss/bucket"],
    ):
        r = cli("verify", *args)
        assert "DAMAGED" not in r.stdout and ": OK" in r.stdout, r.stdout
    # the demo ends with the commands to look at what it kept: each runs as printed
    shown = [line.strip() for line in demo_out.splitlines() if line.startswith("    tiered-dcp ")]
    assert [c.split()[1] for c in shown] == ["ls", "verify", "export"], shown
    for command in shown:
        out = preloaded.run(
            [sys.executable, "-m", "tiered_dcp.cli", *shlex.split(command)[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, command + out.stdout + out.stderr


def test_export_of_a_damaged_step_is_one_line_and_without_a_step_takes_the_older(tmp_path):
    """Every copy of step 2 damaged: `export --step 2` says so in one line (exit 1, no
    traceback); `export` without a step exports step 1, the newest that loads. No torch
    warning reaches the user."""
    from tiered_dcp import Tier, TieredConfig

    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd"))])
    for step in (1, 2):
        save(cfg, step)
    (part,) = glob.glob(str(tmp_path / "ssd/run/step_000000000002/rank_*.part"))
    flip_byte(part, 0.7)
    args = ["-n", "run", str(tmp_path / "ssd")]
    r = cli("export", *args, "--step", "2", "--to", str(tmp_path / "x2"), check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "tiered-dcp export: step 2: no good copy of item" in r.stderr and part in r.stderr
    r = cli("export", *args, "--to", str(tmp_path / "x1"))
    assert "UserWarning" not in r.stdout + r.stderr and "export loaded step 1" in r.stderr
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "x1")))
    assert_state_equal(got, value_kinds(1))


def test_rm_and_prune_remove_steps_safely(tmp_path):
    """rm never takes the newest committed step without --force, nor one a writer process
    still copies; prune keeps the newest K; dedup blocks only removed steps used go too."""
    import torch
    from tiered_dcp.storage.format import pin_key

    from tiered_dcp import Tier, TieredConfig, TieredWriter, latest_step, status
    from tiered_dcp.steps.leases import owner_record

    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd"))], dedup=True)
    for step in range(1, 6):  # each step has a block of its own (and shares none)
        dcp.save({"w": torch.full((1 << 18,), float(step))}, storage_writer=TieredWriter(cfg, step=step))
    blocks = lambda: len(list((tmp_path / "ssd/run/blocks").glob("??/*")))  # noqa: E731
    assert blocks() == 5
    args = ["-n", "run", str(tmp_path / "ssd")]
    committed = lambda: [r.step for r in status(cfg) if r.state == "committed"]  # noqa: E731
    r = cli("rm", *args, "--step", "5", check=False)
    assert r.returncode == 1 and "kept step 5" in r.stdout and "newest committed" in r.stdout
    r = cli("rm", *args, "--step", "3")
    assert "removed step 3 from tier 0" in r.stdout and committed() == [1, 2, 4, 5] and blocks() == 4
    # a step a writer process still copies (its pin, by a live process: this one) stays
    (tmp_path / "ssd" / pin_key("run", 2, 0, 1)).write_bytes(owner_record())
    r = cli("rm", *args, "--step", "2", check=False)
    assert r.returncode == 1 and "a writer process still copies it" in r.stdout and 2 in committed()
    (tmp_path / "ssd" / pin_key("run", 2, 0, 1)).unlink()
    r = cli("rm", *args, "--step", "9", check=False)
    assert r.returncode == 1 and "[9]" in r.stderr and "on no tier" in r.stderr
    r = cli("prune", *args, "--keep", "2")
    assert "removed step 1" in r.stdout and "removed step 2" in r.stdout and committed() == [4, 5]
    r = cli("rm", *args, "--step", "5", "--force")
    assert "removed step 5" in r.stdout and committed() == [4] and latest_step(cfg) == 4 and blocks() == 1
    r = cli("prune", *args, "--keep", "0", check=False)
    assert r.returncode == 2 and "keep=0 must be an integer >= 1" in r.stderr


def test_a_stock_dcp_checkpoint_is_imported_as_a_step(tmp_path):
    """A stock FileSystemWriter directory becomes step 7 of the tiers: committed, checksummed,
    loaded by TieredReader exactly, and copied down by the writer process like any save. A
    taken step number, a directory that is no checkpoint and one with a file cut short are
    each refused in one line."""
    from tiered_dcp import Tier, TieredConfig, TieredReader, import_dcp, shutdown
    from tiered_dcp.ops.verify import verify_step

    stock = tmp_path / "stock"
    dcp.save(value_kinds(7), storage_writer=dcp.FileSystemWriter(str(stock)))
    cfg = TieredConfig("imp", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    args = ["-n", "imp", str(tmp_path / "ram"), str(tmp_path / "ssd")]
    r = cli("import", *args, "--from", str(stock), "--step", "7")
    assert "imported" in r.stdout and "as step 7" in r.stdout
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=TieredReader(cfg))
    assert_state_equal(got, value_kinds(7))
    wait_for(cfg, 7, timeout=120)  # the slower tier got it from the writer process
    assert all(c.ok for c in verify_step(cfg, 7))
    with pytest.raises(ValueError, match="step 7 of 'imp' exists"):
        import_dcp(cfg, stock, 7)
    r = cli("import", *args, "--from", str(tmp_path / "nothing"), "--step", "8", check=False)
    assert r.returncode == 1 and "is no stock DCP checkpoint" in r.stderr and "Traceback" not in r.stderr
    (data,) = [f for f in stock.iterdir() if f.suffix == ".distcp"]
    os.truncate(data, data.stat().st_size // 2)
    r = cli("import", *args, "--from", str(stock), "--step", "8", check=False)
    assert r.returncode == 1 and "cannot be imported" in r.stderr and "Traceback" not in r.stderr
    assert 8 not in {row.step for row in __import__("tiered_dcp").status(cfg)}
    shutdown()


def test_an_imported_checkpoint_whose_metadata_names_code_is_refused_unrun(tmp_path):
    """torch's reader unpickles a stock .metadata whatever it names; the import reads it
    admitting only DCP's metadata records, so a crafted one is refused and never run."""
    import pickle

    from tiered_dcp import CheckpointCorruptError, Tier, TieredConfig, import_dcp

    stock = tmp_path / "stock"
    dcp.save(value_kinds(3), storage_writer=dcp.FileSystemWriter(str(stock)))
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    (stock / ".metadata").write_bytes(pickle.dumps(Payload()))
    cfg = TieredConfig("imp", [Tier(str(tmp_path / "ram"))])
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: metadata refused: forbidden global"):
        import_dcp(cfg, stock, 3)
    assert not ran.exists()


def test_cli_exports_safetensors_and_refuses_what_it_cannot_do(tmp_path):
    """`export --format safetensors --only model`: files of at most --max-shard-size with the
    index, names without the prefix, the non-tensor values named as left out. A prefix the
    step does not hold, a destination holding an export, or no safetensors package: exit 2
    and the fix in one line. A damaged step: exit 1 and the destination is not made."""
    import json

    import torch
    from safetensors.torch import load_file

    from tiered_dcp import Tier, TieredConfig, TieredWriter

    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd"))])
    model = {f"layers.{i}.w": torch.randn(64, 64) for i in range(4)}
    state = {"model": {**model, "step": 7}, "optim": {"lr": torch.tensor(0.1)}}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=3), no_dist=True)
    args = ["-n", "run", str(tmp_path / "ssd")]
    dest = tmp_path / "hf"
    r = cli("export", *args, "--format", "safetensors", "--only", "model", "--max-shard-size", "20KB",
            "--to", str(dest))  # fmt: skip
    assert "exported step 3 to" in r.stdout and "4 tensor(s), 64.0 KiB" in r.stdout, r.stdout
    assert "  wrote model-00002-of-00004.safetensors (16.0 KiB), 2 of 4" in r.stdout
    assert "left out 1 non-tensor item(s), which safetensors cannot hold: step" in r.stdout
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)
    ]
    got = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(dest / f).items()}
    assert sorted(got) == sorted(model) and all(torch.equal(got[k], v) for k, v in model.items())

    r = cli("export", *args, "--format", "safetensors", "--only", "model", "--to", str(dest), check=False)
    assert r.returncode == 2 and "already holds an export" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "export",
        *args,
        "--format",
        "safetensors",
        "--only",
        "modle",
        "--to",
        str(tmp_path / "x"),
        check=False,
    )
    assert r.returncode == 2 and "no item under 'modle.'" in r.stderr and "model, optim" in r.stderr
    assert not (tmp_path / "x").exists()
    blocked = (
        "import sys; sys.modules['safetensors'] = None\n"
        "from tiered_dcp.cli.main import main; sys.exit(main())"
    )
    r = preloaded.run(
        [sys.executable, "-c", blocked, "export", *args, "--format", "safetensors", "--to", str(dest) + "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "pip install safetensors" in r.stderr, r.stderr

    (part,) = glob.glob(str(tmp_path / "ssd/run/step_000000000003/rank_*.part"))
    flip_byte(part, 0.5)
    r = cli(
        "export", *args, "--step", "3", "--format", "safetensors", "--to", str(tmp_path / "z"), check=False
    )
    assert r.returncode == 1 and "no good copy" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "z").exists()


def test_an_imported_tensor_is_copied_as_it_lies_and_checked_against_its_crc(tmp_path, shm):
    """The stock tensors lying as plain records are copied by the kernel into the part file
    and checked there against the CRC-32 of their zip record; a transposed tensor goes
    through torch's reader. The step loads exactly from a RAM tier (tmpfs) and a disk tier.
    A byte flipped in a tensor's bytes, which torch's own reader does not notice, is refused
    naming the item (by the API, and by the CLI in one line), and nothing of the step is left."""
    import torch
    from tiered_dcp.storage.format import step_dir

    from tiered_dcp import CheckpointCorruptError, Tier, TieredConfig, TieredReader, import_dcp
    from tiered_dcp.ops.import_dcp import _plain_records, _stock_reader

    state = {**value_kinds(5), "t": torch.randn(64, 32).t()}
    stock = tmp_path / "stock"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(stock)))
    md, _ = _stock_reader(str(stock), {})
    plain = {index.fqn for index in _plain_records(str(stock), md)}
    assert {"f32", "nested.big", "nested.bf16", "nested.bool", "list.2"} <= plain and "t" not in plain
    for name, root in (("ram", shm), ("ssd", tmp_path / "ssd")):
        cfg = TieredConfig(name, [Tier(str(root), keep=2)])
        import_dcp(cfg, stock, 1)
        got = zeros_like_state(state)
        dcp.load(got, storage_reader=TieredReader(cfg))
        assert_state_equal(got, state)

    info = next(v for k, v in md.storage_data.items() if k.fqn == "nested.big")
    with open(stock / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    with pytest.raises(CheckpointCorruptError, match=r"item 'nested.big' .* fails its CRC-32"):
        import_dcp(cfg, stock, 2)
    assert not (tmp_path / "ssd" / step_dir("ssd", 2)).exists()
    r = cli("import", "-n", "ram", str(shm), "--from", str(stock), "--step", "2", check=False)
    assert r.returncode == 1 and "fails its CRC-32" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (shm / step_dir("ram", 2)).exists()


def test_cli_storage_options_take_json_for_nested_values():
    """`-o KEY=VALUE`: a VALUE starting with { or [ is JSON (s3fs's config_kwargs is a dict);
    a bad one is refused in one line naming the key, anything else stays a string."""
    from tiered_dcp.cli.main import key_values

    got = key_values(['config_kwargs={"read_timeout": 5, "retries": {"max_attempts": 1}}', "key=a=b"], "-o")
    assert got == {"config_kwargs": {"read_timeout": 5, "retries": {"max_attempts": 1}}, "key": "a=b"}
    r = cli("ls", "-n", "run", "s3://b/x", "-o", "config_kwargs={read_timeout: 5}", check=False)
    assert r.returncode == 2 and "--option config_kwargs: " in r.stderr, r.stderr
    assert "no JSON object" in r.stderr and "Traceback" not in r.stderr


def test_an_imported_step_is_deduplicated_against_by_the_next_save(tmp_path):
    """Under dedup=True an imported step is stored as blocks like any save: a job resuming
    from it and saving its unchanged tensors again writes none of their bytes anew."""
    import torch

    from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, import_dcp, shutdown, status

    state = {"w": torch.randn(1 << 20), "b": torch.randn(3 << 18)}  # 4 MiB and 3 MiB: blocks
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    cfg = TieredConfig("dd", [Tier(str(tmp_path / "ssd"))], dedup=True)
    import_dcp(cfg, tmp_path / "stock", 1)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=TieredReader(cfg))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    got["b"][:10] += 1  # one block changes
    dcp.save(got, storage_writer=TieredWriter(cfg, step=2), no_dist=True)
    rows = {r.step: r for r in status(cfg)}
    assert rows[1].written_bytes >= 7 << 20
    assert rows[2].written_bytes < 2 << 20, rows[2]  # the changed block and the small files
    shutdown()


def test_a_stock_checkpoint_in_a_bucket_is_imported(bucket, tmp_path):
    """A stock checkpoint that torch's FsspecWriter wrote to a bucket (fake GCS, moto's S3)
    is imported from its URL with the bucket's storage options, by the API and by the CLI
    (--from-option), and loads exactly."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from tiered_dcp import Tier, TieredConfig, TieredReader, import_dcp

    url = f"{bucket.url}/stock"
    options = bucket.storage_options
    dcp.save(value_kinds(4), storage_writer=FsspecWriter(url, **options), no_dist=True)
    cfg = TieredConfig("imp", [Tier(str(tmp_path / "ssd"))])
    import_dcp(cfg, url, 4, storage_options=options)
    flags = [f"--from-option={k}={v}" for k, v in options.items()]
    r = cli("import", "-n", "imp", str(tmp_path / "ssd"), "--from", url, *flags, "--step", "5")
    assert "as step 5" in r.stdout
    for step in (4, 5):
        got = zeros_like_state(value_kinds(0))
        dcp.load(got, storage_reader=TieredReader(cfg, step))
        assert_state_equal(got, value_kinds(4))
    r = cli(
        "import", "-n", "imp", str(tmp_path / "ssd"), "--from", url + "x", *flags, "--step", "6", check=False
    )
    assert r.returncode == 1 and "is no stock DCP checkpoint" in r.stderr, r.stderr


class _Payload:
    """A value whose unpickling runs a command: what a crafted checkpoint's byte item holds."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_an_imported_checkpoint_whose_value_names_code_is_refused_unrun(tmp_path):
    """torch's load planner unpickles a stock checkpoint's non-tensor values with
    torch.load(weights_only=False); the import loads each with weights_only=True first, so a
    crafted value is refused in one line and never run."""
    import torch

    ran = tmp_path / "ran"
    stock = tmp_path / "stock"
    state = {"w": torch.arange(4.0), "evil": _Payload(ran)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True)
    assert not ran.exists()
    r = cli("import", "-n", "imp", str(tmp_path / "ram"), "--from", str(stock), "--step", "1", check=False)
    assert r.returncode == 1 and "cannot be imported" in r.stderr, r.stderr
    assert "weights_only=True" in r.stderr and "GLOBAL posix.system" in r.stderr and not ran.exists()
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line, no traceback


def test_a_step_exported_file_by_file_stays_leased_while_a_job_saves_beside(tmp_path):
    """A safetensors export loads one file's tensors at a time; a job saving beside it, with
    keep=1, must not remove the step between those loads: the export holds its lease until
    the last file is written."""
    import torch
    from safetensors.torch import load_file

    from tiered_dcp import Tier, TieredConfig, TieredWriter
    from tiered_dcp.ops.export import format_named, run_export

    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd"), keep=1)])
    model = {f"l{i}": torch.full((64, 64), float(i)) for i in range(3)}  # 16 KiB each

    def save(step):
        state = {"model": {k: v + step for k, v in model.items()}}
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step), no_dist=True)

    save(1)
    saved = []

    def a_job_saves_beside(name, size, done, total):
        saved.append(done + 1)
        save(done + 1)  # retention keeps one step: without the export's lease, step 1 goes

    fmt = format_named("safetensors", 20_000)  # one tensor per file
    done = run_export(cfg, 1, tmp_path / "hf", fmt, "model", a_job_saves_beside)
    assert saved == [2, 3, 4] and len(done.written.files) == 4  # three files and the index
    for name in done.written.files[:3]:
        for k, v in load_file(tmp_path / "hf" / name).items():
            assert torch.equal(v, model[k] + 1), (name, k)
    save(5)  # the export let go: the next retention removes step 1
    assert not (tmp_path / "ssd/run/step_000000000001").exists()
