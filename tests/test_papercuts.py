"""A fresh clone's first hour: the command as this python runs it, a closed pipe, an unknown
flag, torch's single-process note, the snippets in the README and the user guide,
replication on a node-local path that names no node, a tier directory that is missing."""

from __future__ import annotations

import ast
import builtins
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter, latest_step
from tiered_dcp.cli.main import EXIT_STDOUT_CLOSED, _print_cliques
from tiered_dcp.config import ReplicaPathWarning

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
GUIDE = (REPO / "docs" / "user-guide.md").read_text()


def tdcp(*args: str, **kw) -> subprocess.CompletedProcess:
    """``python -m tiered_dcp ARGS``: the command as the README's quickstart prints it."""
    return preloaded.run(
        [sys.executable, "-m", "tiered_dcp", *args], capture_output=True, text=True, timeout=60, **kw
    )


def python_block_after(text: str, heading: str) -> str:
    """The first ```python block after ``heading`` in ``text``."""
    return re.search(re.escape(heading) + r".*?```python\n(.*?)```", text, re.S).group(1)


# ------------------------------------------------------------------------ the command line


def test_python_m_tiered_dcp_is_the_command_and_the_quickstart_prints_it():
    r = tdcp("ls", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: tiered-dcp ls"), r.stdout
    quickstart = re.search(r"<!-- runnable[^>]*-->\n```python\n(.*?)```", README, re.S).group(1)
    assert "{sys.executable} -m tiered_dcp ls -n quickstart" in quickstart
    assert "look: tiered-dcp ls" not in quickstart  # not on the PATH without .venv/bin/


def test_ls_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """``tiered-dcp ls TIER | head -1``: more lines than the pipe holds, the reader gone after
    the first: exit 141 (as a command killed by SIGPIPE), nothing on stderr."""
    for n in range(3000):  # ~160 KiB of listing: more than the pipe and our read hold
        os.makedirs(tmp_path / f"namespace-number-{n:04d}" / "step_000000000001")
    p = preloaded.Popen(
        [sys.executable, "-m", "tiered_dcp", "ls", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = p.stdout.readline()
    p.stdout.close()  # head -1 has what it wants
    stderr = p.stderr.read().decode()
    assert p.wait(timeout=60) == EXIT_STDOUT_CLOSED == 141, stderr
    assert first.startswith(b"namespace"), first
    assert stderr == "", stderr  # no BrokenPipeError traceback, no "Exception ignored"


def test_an_unknown_flag_is_reported_with_the_command_s_usage():
    r = tdcp("ls", "--bogus")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: tiered-dcp ls "), r.stderr
    assert "tiered-dcp ls: error: unrecognized arguments: --bogus" in r.stderr, r.stderr
    r = tdcp("--bogus", "ls")  # before the command: the top level's own
    assert r.returncode == 2
    assert r.stderr.startswith("usage: tiered-dcp [-h]"), r.stderr
    assert "tiered-dcp: error: unrecognized arguments: --bogus" in r.stderr, r.stderr


# ------------------------------------------------------------- torch's single-process note

SAVE_AND_LOAD = """
import warnings

import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown

config = TieredConfig("quiet", [Tier("ram", keep=2)])
dcp.save({"w": torch.arange(8.0)}, storage_writer=TieredWriter(config, step=1))
dcp.async_save({"w": torch.arange(8.0)}, storage_writer=TieredWriter(config, step=2)).result()
state = {"w": torch.zeros(8)}
dcp.load(state, storage_reader=TieredReader(config))
assert torch.equal(state["w"], torch.arange(8.0))
shutdown()
warnings.warn("any other warning still shows")
print("ok")
"""


def test_a_single_process_save_and_load_print_no_torch_note(tmp_path):
    (tmp_path / "run.py").write_text(SAVE_AND_LOAD)
    r = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stdout + r.stderr
    assert "assuming the intent is to" not in r.stderr, r.stderr
    assert "UserWarning: any other warning still shows" in r.stderr, r.stderr


# ------------------------------------------------------------------- the docs' snippets

EMERGENCY_PRELUDE = """
import os
import signal

import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig

config = TieredConfig("emergency", [Tier("ram", keep=3)])
state = {"w": torch.zeros(4)}
start, end = 1, 40
trained = 0


class Watched:
    # a future that knows whether it was waited for
    def __init__(self, future):
        self.future, self.waited = future, False

    def result(self):
        self.waited = True
        return self.future.result()


saves = []


def one_at_a_time(save):
    def wrapped(*args, **kwargs):
        assert all(s.waited for s in saves), "a save started before the previous one was waited for"
        out = save(*args, **kwargs)
        if save is ASYNC_SAVE:
            out = Watched(out)
            saves.append(out)
        return out

    return wrapped


ASYNC_SAVE = dcp.async_save
dcp.async_save, dcp.save = one_at_a_time(dcp.async_save), one_at_a_time(dcp.save)


def train_step():
    global trained
    trained += 1
    state["w"] += 1
    if trained == 23:  # after the saves of steps 10 and 20
        os.kill(os.getpid(), signal.SIGTERM)
"""


def test_the_user_guide_s_emergency_save_snippet_runs_as_written(tmp_path):
    """Defined names only, one save at a time, and the preempted step saved."""
    snippet = python_block_after(GUIDE, "### Emergency saves on preemption")
    (tmp_path / "run.py").write_text(
        EMERGENCY_PRELUDE + "\n" + snippet + "\nraise SystemExit('not preempted')\n"
    )
    r = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    config = TieredConfig("emergency", [Tier(str(tmp_path / "ram"))])
    assert latest_step(config) == 23
    steps = sorted(int(d.name.removeprefix("step_")) for d in (tmp_path / "ram" / "emergency").glob("step_*"))
    assert steps == [10, 20, 23], steps


def free_names(code: str) -> set[str]:
    """Names ``code`` reads that it neither imports nor assigns (nor Python's builtins)."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef):
            bound.add(node.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - bound


def test_the_readme_s_cluster_snippet_imports_what_it_uses():
    snippet = python_block_after(README, "On a cluster the tiers are node-local")
    assert free_names(snippet) == {"state"}  # the job's own state dict, as its comment says


def test_the_docs_cite_no_design_file_the_repository_lacks():
    assert not (REPO / "DESIGN.md").exists()
    files = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("tiered_dcp/**/*.py")]
    cited = [str(f.relative_to(REPO)) for f in files if "DESIGN" in f.read_text()]
    assert cited == []


# --------------------------------------------------------- replication without {node}


def test_a_replicated_node_local_tier_without_node_warns(tmp_path):
    ram = str(tmp_path / "ram")
    with pytest.warns(ReplicaPathWarning, match=r"tier 0 .*names no node.*Put \{node\} in the path") as got:
        cfg = TieredConfig("nodeless", [Tier(ram), Tier(str(tmp_path / "ssd/{node}"))], replication_factor=2)
    assert len(got) == 1 and got[0].filename == __file__  # the user's line, and only tier 0
    assert "replication_factor=2" in str(got[0].message) and "shared=True" in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TieredConfig.from_dict(cfg.to_dict())  # the same job again (the writer's copy): said once


@pytest.mark.parametrize(
    "tier, factor",
    [
        ("{root}/ram/{{node}}", 2),
        ("{root}/ram/{{rank}}", 2),
        ("{root}/nfs", 1),
        ("shared", 2),
        ("declared-local", 2),
    ],
)
def test_no_warning_where_every_copy_has_a_place(tmp_path, tier, factor):
    if tier == "shared":
        t = Tier(str(tmp_path / "nfs"), shared=True)
    elif tier == "declared-local":
        t = Tier(str(tmp_path / "ram"), shared=False)  # each node's own directory, declared
    else:
        t = Tier(tier.format(root=tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TieredConfig("placed", [t, Tier("gs://bucket/ckpt")], replication_factor=factor)


def _rows(tier: int) -> list:
    return [
        SimpleNamespace(step=s, tier_index=tier, cliques=[[0, 2], [1, 3]], clique_domains=[]) for s in (1, 2)
    ]


def test_ls_says_when_a_tier_s_cliques_may_be_one_copy(tmp_path, capsys):
    with pytest.warns(ReplicaPathWarning):
        cfg = TieredConfig(
            "c", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd/{node}"))], replication_factor=2
        )
    _print_cliques(cfg, _rows(0) + _rows(1))
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "cliques on tier 0 (steps 1, 2): [0, 2]; [1, 3]",
        "  but tier 0's path names no {node}: if the nodes share that directory, "
        "each part is held there once, not 2 times",
        "cliques on tier 1 (steps 1, 2): [0, 2]; [1, 3]",
    ], out


def test_a_tier_whose_directory_is_missing_is_said_once_naming_its_file_system(tmp_path, caplog):
    """``Tier("/mnt/nvme/...")`` on a host without that disk must not fill the disk below in
    silence: the first save says where the missing directory is made; the next says nothing."""
    cfg = TieredConfig("missing", [Tier(str(tmp_path / "nvme" / "tdcp" / "{node}"), keep=2)])
    with caplog.at_level(logging.WARNING, logger="tiered_dcp"):
        dcp.save({"w": torch.ones(3)}, storage_writer=TieredWriter(cfg, step=1))
        dcp.save({"w": torch.ones(3)}, storage_writer=TieredWriter(cfg, step=2))
    said = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(said) == 1, said
    assert str(tmp_path / "nvme" / "tdcp" / "0") in said[0] and "the first save makes it on /" in said[0]


def test_a_missing_root_per_rank_is_said_by_its_rank_a_node_s_by_its_first(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's first rank
    tiers = [Tier(str(tmp_path / "node" / "{node}")), Tier(str(tmp_path / "own" / "{rank}"), every=2)]
    with caplog.at_level(logging.WARNING, logger="tiered_dcp"):
        dcp.save({"w": torch.ones(3)}, storage_writer=TieredWriter(TieredConfig("per", tiers), step=1))
    said = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "own" / "0") in said[0], said
