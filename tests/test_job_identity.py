"""A job's writers are keyed by what the job is: its namespace and its tier paths resolved
(a relative path made absolute against the trainer's directory), and each writer receives
those absolute paths, so two jobs with the same relative tiers in two directories never
share one."""

import os
import subprocess
import sys
import time

import preloaded
import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, status
from tiered_dcp.writer_process.run_dir import RunDir, job_dir

STEPS = 10


def quickstart_config() -> TieredConfig:
    """The README's quickstart tiers, relative to the working directory."""
    return TieredConfig(
        "quickstart", [Tier("ckpt/ram/{node}", every=1, keep=2), Tier("ckpt/ssd/{node}", every=5, keep=3)]
    )


def job_state(job: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * job + step)  # each job's bytes its own
    return {"w": torch.randn(64 << 10, generator=g), "step": step}


def run_job(job: int, meeting: str) -> None:
    """One quickstart-like job: meet the other one, then ``STEPS`` async saves back to back."""
    config = quickstart_config()
    open(os.path.join(meeting, f"ready.{job}"), "w").close()
    while not all(os.path.exists(os.path.join(meeting, f"ready.{j}")) for j in (0, 1)):
        time.sleep(0.01)
    saving = None
    for step in range(1, STEPS + 1):
        state = job_state(job, step)
        if saving is not None:
            saving.result()
        saving = dcp.async_save(state, storage_writer=TieredWriter(config, step=step))
        time.sleep(0.05)  # the two jobs' saves interleave
    saving.result()
    assert shutdown(timeout=60), "the writers did not finish"


def test_relative_and_absolute_configs_name_one_job_and_two_directories_two(tmp_path, monkeypatch):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    rel = quickstart_config()
    monkeypatch.chdir(one)
    absolute = TieredConfig(
        "quickstart",
        [
            Tier(f"{one}/ckpt/ram/{{node}}", every=1, keep=2),
            Tier(f"{one}/ckpt/ssd/{{node}}", every=5, keep=3),
        ],
    )
    assert rel.resolved() == absolute and absolute.resolved() is absolute
    assert rel.resolved().tiers[0].root(3, 7) == f"{one}/ckpt/ram/3"
    assert job_dir(rel) == job_dir(absolute)
    file_rel = TieredConfig("quickstart", [Tier("./ckpt/ram/{node}"), Tier("file://ckpt/ssd/../ssd/{node}")])
    file_abs = TieredConfig(
        "quickstart", [Tier(f"{one}/ckpt/ram/{{node}}"), Tier(f"file://{one}/ckpt/ssd/{{node}}")]
    )
    assert file_rel.resolved() == file_abs and job_dir(file_rel) == job_dir(file_abs)
    url = TieredConfig("quickstart", [Tier("ckpt/ram"), Tier("memory://bucket/ckpt", shared=True)])
    assert url.resolved().tiers[1] == url.tiers[1]

    # the writer receives the absolute config, and finds its own directory from it
    rd = RunDir.of(rel, 0)
    rd.make()
    rd.write_config(rel)
    got = rd.read_config()
    assert all(os.path.isabs(t.path) for t in got.tiers) and got == rel.resolved()
    assert RunDir.of(got, 0) == rd
    rd.remove()

    monkeypatch.chdir(two)
    assert job_dir(rel) != job_dir(absolute)

    braces = tmp_path / "a{b}"  # a directory's braces are no placeholders
    braces.mkdir()
    monkeypatch.chdir(braces)
    assert rel.resolved().tiers[0].root(0, 0) == f"{braces}/ckpt/ram/0"


def test_two_quickstarts_in_two_directories_at_once_each_fill_their_own_tiers(tmp_path, monkeypatch):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TIERED_DCP_RUNTIME_DIR": str(runtime), "PYTHONPATH": path}
    code = "import sys, test_job_identity as t; t.run_job(int(sys.argv[1]), sys.argv[2])"
    dirs = [tmp_path / f"job{j}" for j in (0, 1)]
    procs = []
    for j, d in enumerate(dirs):
        d.mkdir()
        cmd = [sys.executable, "-c", code, str(j), str(tmp_path)]
        procs.append(preloaded.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
    # a writer's log and outcomes stay in the runtime dir only if a failure is recorded there
    leftovers = [*runtime.glob("*/rank_*/writer.log"), *runtime.glob("*/rank_*/results/*.json")]
    for text in [*outputs, *(f.read_text() for f in leftovers)]:
        assert "abandoned" not in text and "NOT written" not in text, text

    for j, d in enumerate(dirs):
        monkeypatch.chdir(d)  # each job's relative tiers, read from its own directory
        config = quickstart_config()
        held: dict[int, list[int]] = {}
        for row in status(config):
            assert row.state == "committed", (j, row)
            held.setdefault(row.tier_index, []).append(row.step)
        assert held == {0: [STEPS - 1, STEPS], 1: [5, 10]}, (j, held)
        ssd = TieredConfig(config.namespace, [config.tiers[1]])
        for step in (5, 10):  # its own bytes, not the other job's
            expected = job_state(j, step)
            target = {"w": torch.zeros_like(expected["w"]), "step": -1}
            dcp.load(target, storage_reader=TieredReader(ssd, step=step))
            assert torch.equal(target["w"], expected["w"]) and target["step"] == step, (j, step)
