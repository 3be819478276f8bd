"""Goodput and best intervals: hand-computed Young/Daly cases, the command, --from-job on a real run."""

import json
import math
import statistics
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_cli_export import cli

from tiered_dcp import TieredReader, TieredWriter, shutdown, wait_for
from tiered_dcp.cli.jobconfig import load_job_config
from tiered_dcp.metrics.goodput import (
    TierCosts,
    analyze,
    best_every,
    daly_interval,
    goodput,
    lost_per_failure,
    measure_job,
)


def test_daly_by_hand():
    # Daly: sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C
    x = 0.5 / 7200
    assert daly_interval(0.5, 3600) == pytest.approx(60 * (1 + math.sqrt(x) / 3 + x / 9) - 0.5)
    assert daly_interval(0.5, 3600) == pytest.approx(59.6676, abs=1e-3)
    # where it matters: a 10-minute save against an hour's MTBF
    assert daly_interval(600, 3600) == pytest.approx(1697.71, abs=0.01)
    assert daly_interval(8000, 3600) == 3600  # C >= 2M: save once per MTBF
    assert daly_interval(0, 3600) == 0


def test_goodput_by_hand():
    # tau = 60 s, C = 0.5 s: useful 60/60.5; loss per failure (60.5/2 + 30) s per 3600 s
    g = goodput(60, 1.0, 0.5, 30, 3600)
    assert g == pytest.approx(60 / 60.5 * (1 - (30.25 + 30) / 3600))
    assert g == pytest.approx(0.9751, abs=1e-4)
    assert lost_per_failure(60, 1.0, 0.5) == pytest.approx(30.25)
    # a commit latency of 5 s: the uncommitted tail is lost too
    assert lost_per_failure(60, 1.0, 0.5, latency=5) == pytest.approx(35.25)
    # saving faster than a tier commits makes the loop wait: every 2 s with 5 s latency
    assert goodput(2, 1.0, 0.5, 30, 3600, latency=5) == pytest.approx(
        2 / 5.5 * (1 - (5.5 / 2 + 5 + 30) / 3600)
    )
    assert best_every(1.0, 0.5, 3600) == 60
    assert best_every(1.0, 0.01, 3600, latency=20) == 20  # never shorter than the commit latency
    assert best_every(10.0, 0.5, 3600) == 6


def test_analyze_best_beats_neighbours_and_current():
    report = analyze(1.0, [TierCosts("ram", 0.5, 30, 3600, every=10)])
    (t,) = report.tiers
    assert t.best_every == 60 and t.goodput == pytest.approx(0.9751, abs=1e-4)
    assert t.goodput_current == pytest.approx(10 / 10.5 * (1 - (5.25 + 30) / 3600))
    for n in (30, 45, 80, 120):
        assert goodput(n, 1.0, 0.5, 30, 3600) < t.goodput
    # several tiers: the combined figure counts each tier's stall and failures
    tiers = [
        TierCosts("ram", 0.5, 5, 3600, every=1),
        TierCosts("bucket", 0.0, 60, 86400, latency=30, every=50),
    ]
    two = analyze(1.0, tiers)
    assert [a.best_every for a in two.tiers] == [60, 30]
    per_step = 1 + 0.5 / 1 + 0 / 50
    want = 1 / per_step * (1 - (per_step / 2 + 5) / 3600 - (50 * per_step / 2 + 30 + 60) / 86400)
    assert two.goodput_current == pytest.approx(want)
    with pytest.raises(ValueError, match="mtbf"):
        TierCosts("x", 1, 1, 0)


def test_cli_single_tier_json_and_plot(tmp_path):
    r = cli("goodput", "--step-time", "1", "--stall", "0.5", "--restore", "30", "--mtbf", "3600", "--json")
    doc = json.loads(r.stdout)
    assert doc["best_every"] == 60 and doc["goodput"] == pytest.approx(0.975, abs=1e-3)
    png = tmp_path / "goodput.png"
    r = cli(
        "goodput", "--step-time", "1", "--stall", "0.5", "--restore", "30", "--mtbf", "3600", "--every", "10"
    )
    assert "every 60 steps" in r.stdout and "every 10 steps: goodput 0.9431" in r.stdout
    pytest.importorskip("matplotlib")
    cli(
        "goodput",
        "--step-time",
        "1",
        "--stall",
        "0.5",
        "--restore",
        "30",
        "--mtbf",
        "3600",
        "--plot",
        str(png),
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = cli("goodput", "--step-time", "1", "--stall", "0.5", check=False)
    assert r.returncode == 2 and "--restore" in r.stderr and "--mtbf" in r.stderr


def write_toml(tmp_path) -> str:
    path = tmp_path / "tiers.toml"
    path.write_text(
        f"""namespace = "gp"

[[tiers]]
path = "{tmp_path}/ram/{{node}}"
every = 1
keep = 2

[[tiers]]
path = "{tmp_path}/ssd/{{node}}"
every = 2
keep = 2
"""
    )
    return str(path)


STEP_SLEEP = 0.1


def _train_save_load(rank, world, toml):
    cfg = load_job_config(toml)
    for step in range(1, 9):
        time.sleep(STEP_SLEEP)  # the "training step"
        state = {f"w{rank}": torch.full((256, 1024), float(step + rank))}  # 1 MiB per rank
        fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step))
        fut.result()
    wait_for(cfg, 8, timeout=60)
    state = {f"w{rank}": torch.zeros(256, 1024)}
    dcp.load(state, storage_reader=TieredReader(cfg))
    shutdown(wait=True, timeout=60)
    return float(state[f"w{rank}"][0, 0])


def test_from_job_reads_the_costs_a_real_two_rank_run_measured(tmp_path):
    toml = write_toml(tmp_path)
    assert run_ranks(_train_save_load, 2, toml) == [8.0, 9.0]
    measured = measure_job(load_job_config(toml))
    assert measured.saves == 8 and measured.loads == 2
    # the loop's own time between saves: the sleep, and the wait for each save's commit
    assert STEP_SLEEP * 0.8 < measured.step_time < STEP_SLEEP + 2.0
    assert measured.stall[0] > 0 and measured.restore[0] > 0 and measured.latency[0] > 0
    assert measured.latency[1] > measured.latency[0]  # the copy down comes after the commit
    assert measured.restore[1] is None  # never loaded from the SSD tier
    r = cli("goodput", "--config", toml, "--from-job", "--mtbf", "3600,86400", "--json", check=False)
    assert r.returncode == 2 and "--restore for" in r.stderr and "not in the job's records" in r.stderr
    r = cli("goodput", "--config", toml, "--from-job", "--mtbf", "3600,86400", "--restore", "0.5,2", "--json")
    doc = json.loads(r.stdout)
    assert doc["measured"]["saves"] == 8 and doc["step_time"] == pytest.approx(measured.step_time)
    assert [t["every"] for t in doc["tiers"]] == [1, 2]
    assert doc["tiers"][0]["costs"]["stall_s"] == pytest.approx(measured.stall[0])
    assert doc["tiers"][0]["costs"]["restore_s"] == 0.5  # a flag overrides the records
    want = best_every(measured.step_time, measured.stall[0], 3600, measured.latency[0])
    assert doc["best_every"][0] == want
    r = cli("goodput", "--config", toml, "--from-job", "--mtbf", "3600,86400", "--restore", "0.5,2")
    assert "measured from the job's records: 8 saves, 2 loads" in r.stdout


def test_the_plot_is_readable(tmp_path):
    """Rendered for three tiers whose best intervals lie close together: every curve and
    marker inside the axes, no text over another or over the axes, a title in words and
    units on both axes; `--plot` writes it as a PNG."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tiered_dcp.metrics.goodput import figure

    tiers = [
        TierCosts("/dev/shm/tdcp/{node}", 0.05, 5, 3600, 0.3, every=1),
        TierCosts("/mnt/nvme/tdcp/{node}", 0.4, 30, 36000, 3, every=10),
        TierCosts("gs://bucket/ckpt", 0.5, 300, 360000, 60, every=100),
    ]
    report = analyze(2.0, tiers)
    fig = figure(report, tiers, plt)
    fig.canvas.draw()
    (ax,) = fig.axes
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    for line in ax.get_lines():
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            assert x0 <= x <= x1 and y0 <= y <= y1, (line.get_label(), x, y)
    renderer = fig.canvas.get_renderer()
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label, ax.get_legend(), *ax.texts]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert "=" not in ax.get_title() and "goodput" in ax.get_title().lower()
    assert "[" in ax.get_xlabel() and "[" in ax.get_ylabel()  # units
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("best every" in t and "now every" in t for t in legend)
    plt.close(fig)
    png = tmp_path / "p.png"
    args = ["goodput", "-n", "job", *(t.name for t in tiers), "--step-time", "2", "--stall", "0.05,0.4,0.5"]
    args += ["--restore", "5,30,300", "--mtbf", "3600,36000,360000", "--latency", "0.3,3,60"]
    cli(*args, "--every", "1,10,100", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _quickstart_loop(tmp_path, namespace: str) -> list[float]:
    """The README's loop, 20 async saves to a RAM tier (every step) and an SSD tier (every
    fifth), each ``dcp.async_save`` call timed as the loop sees it."""
    from tiered_dcp import Tier, TieredConfig

    cfg = TieredConfig(
        namespace,
        [
            Tier(str(tmp_path / "ram/{node}"), every=1, keep=2),
            Tier(str(tmp_path / "ssd/{node}"), every=5, keep=3),
        ],
    )
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    calls, saving = [], None
    for step in range(1, 21):
        if saving is not None:
            saving.result()
        state = {"model": model.state_dict()}
        t0 = time.perf_counter()
        saving = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step))
        calls.append(time.perf_counter() - t0)
    saving.result()
    wait_for(cfg, 20, timeout=60)
    return calls


def test_from_job_s_stall_is_the_async_save_call_the_loop_saw(tmp_path):
    """Each save's ``call_s`` lies inside the loop's own timer around ``dcp.async_save`` and
    covers most of it (the copy alone, ``stage_s``, was a tenth of it); the schedule of a
    job given by its tiers' paths alone is the job's (every=5 for the SSD tier), not every=1."""
    from tiered_dcp import Tier, TieredConfig
    from tiered_dcp.writer_process.timings import Kind, read_records

    outside = _quickstart_loop(tmp_path, "timed")
    cfg = TieredConfig("timed", [Tier(str(tmp_path / "ram/{node}")), Tier(str(tmp_path / "ssd/{node}"))])
    recs = sorted(read_records(cfg, Kind.SAVE), key=lambda r: r.step)
    assert [r.step for r in recs] == list(range(1, 21))
    for r, t in zip(recs, outside, strict=True):
        assert r.stage_s <= r.call_s <= t + 1e-4, (r.step, r.stage_s, r.call_s, t)
        assert (r.every, r.keep) == ((1, 5), (2, 3))
    calls = [r.call_s for r in recs]
    assert sorted(calls)[10] >= 0.5 * sorted(outside)[10], (calls, outside)
    measured = measure_job(cfg)
    assert measured.stall[0] == pytest.approx(statistics.median(r.call_s - r.call_wait_s for r in recs))
    args = ["-n", "timed", str(tmp_path / "ram/{node}"), str(tmp_path / "ssd/{node}")]
    r = cli("goodput", *args, "--from-job", "--mtbf", "3600,86400", "--restore", "1,2")
    assert "schedule from the job's records: every 1 keep 2, every 5 keep 3" in r.stdout, r.stdout
    assert "now:  every 5 steps" in r.stdout and "now:  every 1 steps" in r.stdout, r.stdout
    assert "stall per save, the async_save call as the loop saw it" in r.stdout, r.stdout


def test_goodput_says_when_it_cannot_know_the_schedule(tmp_path):
    r = cli(
        "goodput",
        "-n",
        "never-ran",
        str(tmp_path),
        "--step-time",
        "1",
        "--stall",
        "0.1",
        "--mtbf",
        "3600",
        "--restore",
        "1",
    )
    assert r.stderr.count("\n") == 1 and "the tiers' schedule (every=) is not known" in r.stderr, r.stderr
    assert "give --every N[,N...] or --config" in r.stderr and "now:" not in r.stdout, r.stdout
    r = cli("goodput", "-n", "never-ran", str(tmp_path), "--from-job", "--mtbf", "3600", check=False)
    assert r.returncode == 1 and "no records of namespace 'never-ran' with these tiers" in r.stderr, r.stderr
