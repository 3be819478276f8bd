"""Save-time scores: by hand, on records written as a job writes them (timing noise and small
differences are no straggler, a rank slow over its recent saves is), and one rank's tier
slowed for real (its writer capped)."""

import json
import logging
import os
import random
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from said import kept_warnings
from test_goodput import cli

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown, wait_for
from tiered_dcp.metrics.scores import (
    FLOOR_SECONDS,
    MIN_SAVES,
    THRESHOLD,
    WINDOW,
    job_scores,
    score_ranks,
    slow_ranks,
    watch,
)
from tiered_dcp.writer_process.timings import Kind, TimingRecord, record


def rec(rank, step, seconds, tier=1, nbytes=1000, kind=Kind.PERSIST):
    return TimingRecord(kind, rank, rank // 2, step, 0.0, tier=tier, write_s=seconds, bytes=nbytes)


def test_scores_by_hand():
    recs = [rec(r, s, 0.1) for s in range(1, 6) for r in range(4)]
    recs = [x if x.rank != 2 else rec(2, x.step, 0.25) for x in recs]  # rank 2: 0.4 of its peers
    recs += [rec(1, 6, 0.2)] + [rec(r, 6, 0.1) for r in (0, 2, 3)]  # rank 1 slow once; rank 2 recovers
    recs += [rec(0, 7, 0.001), rec(1, 7, 0.01)]  # too quick to tell: not scored
    recs += [rec(0, 8, 0.1), rec(1, 8, 0.1, nbytes=0)]  # rank 1 wrote nothing: not scored
    by_rank = {s.rank: s for s in score_ranks(recs)}
    two = by_rank[2]  # the last WINDOW saves: 4 of 5 at 0.4 of its peers' median, 0.15 s behind
    assert (two.relative, two.excess_s, two.saves, two.window, two.step, two.node) == (
        0.4,
        0.15,
        6,
        WINDOW,
        6,
        1,
    )
    assert two.slow and two.individual == 1.0
    one = by_rank[1]  # one save at half its peers' speed: its median is the typical rank's
    assert one.relative == 1.0 and one.excess_s == 0.0 and not one.slow and one.saves == 6
    assert by_rank[0].relative == 1.0 and not by_rank[0].slow
    # throughput, not time: a rank with twice the bytes in twice the time is as fast
    pair = [rec(0, s, 0.1) for s in range(3)] + [rec(1, s, 0.2, nbytes=2000) for s in range(3)]
    assert [(x.relative, x.excess_s, x.slow) for x in score_ranks(pair)] == [(1.0, 0.0, False)] * 2
    # judged on MIN_SAVES saves at least, and on the newest WINDOW only
    slow = [rec(0, s, 0.1) for s in range(20)] + [rec(1, s, 0.5) for s in range(MIN_SAVES - 1)]
    assert not score_ranks(slow)[1].slow
    slow += [rec(1, MIN_SAVES - 1, 0.5)]
    assert score_ranks(slow)[1].slow
    slow += [rec(1, s, 0.1) for s in range(MIN_SAVES, 20)]  # it recovered
    (_, recovered) = score_ranks(slow)
    assert not recovered.slow and recovered.relative == 1.0 and recovered.individual == 1.0


MIB = 1 << 20
SAVES = 8


def make_config(root: str) -> TieredConfig:
    return TieredConfig(
        "scores",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=2), Tier(f"{root}/ssd/{{node}}", every=1, keep=2)],
    )


def _saves_with_one_slow_writer(rank, world, root):
    if rank == 1:
        os.environ["TIERED_DCP_WRITER_MBPS"] = "8"  # this rank's writer process: 8 MB/s to the SSD tier
    seen = kept_warnings()
    cfg = make_config(root)
    for step in range(1, SAVES + 1):
        state = {f"w{rank}": torch.full((MIB,), float(step))}  # 4 MiB per rank
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, SAVES, timeout=120)
    shutdown(wait=True, timeout=60)
    return [m for m in seen if "check its disk or network" in m]


def test_a_rank_whose_tier_is_slow_is_flagged_and_the_other_is_not(tmp_path):
    warnings = run_ranks(_saves_with_one_slow_writer, 2, str(tmp_path), timeout=300)
    cfg = make_config(str(tmp_path))
    flagged = slow_ranks(cfg)
    assert [(s.rank, s.tier) for s in flagged if s.tier == 1] == [(1, 1)], flagged
    assert not [s for s in flagged if s.rank == 0]
    (slow,) = [s for s in flagged if s.tier == 1]
    assert slow.relative < THRESHOLD and slow.excess_s >= FLOOR_SECONDS and slow.slow
    # the lowest rank of the node said so while training (rank 1 itself does not check)
    assert any("rank 1 on node 0 writes to tier 1" in m and "check its disk" in m for m in warnings[0]), (
        warnings
    )
    assert warnings[1] == []
    out = cli("ls", "-n", "scores", f"{tmp_path}/ram/{{node}}", f"{tmp_path}/ssd/{{node}}").stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("rank 1 (node 0) tier 1"))
    assert "SLOW" in line
    assert not any("SLOW" in x for x in out.splitlines() if x.strip().startswith("rank 0"))
    doc = json.loads(
        cli("ls", "-n", "scores", f"{tmp_path}/ram/{{node}}", f"{tmp_path}/ssd/{{node}}", "--json").stdout
    )
    score = next(s for s in doc["scores"] if s["rank"] == 1 and s["tier"] == 1)
    assert score["relative"] == pytest.approx(slow.relative) and score["slow"] is True


# Real records, written as the writer processes write them (``timings.record``), then read
# back by the check a save runs (``watch``) and by ``slow_ranks``.


def job(tmp_path) -> TieredConfig:
    return TieredConfig(
        f"scores-{uuid.uuid4().hex[:8]}", [Tier(f"{tmp_path}/ram/{{node}}"), Tier(f"{tmp_path}/ssd/{{node}}")]
    )


def write_saves(cfg: TieredConfig, saves: list[dict[int, float]], nbytes: int = 4 * MIB) -> None:
    """One ``persist`` record per rank and save to tier 1: ``saves[i][rank]`` is its write time."""
    for step, times in enumerate(saves, 1):
        for rank, seconds in times.items():
            record(
                cfg,
                Kind.PERSIST,
                rank,
                step,
                tier=1,
                bytes=nbytes,
                write_s=seconds,
                latency_s=seconds,
                state="done",
            )


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_timing_noise_on_a_shared_host_is_no_straggler(tmp_path, caplog):
    """The false alarm: 4 ranks at 25-31 ms, each save one of them served by the page cache in
    3 ms. Against that one best rank every other rank was at 0.1 of the best, every save."""
    rng = random.Random(0)
    saves = [
        {r: 0.003 if r == step % 4 else rng.uniform(0.025, 0.031) for r in range(4)} for step in range(8)
    ]
    cfg = job(tmp_path)
    write_saves(cfg, saves)
    assert watch(cfg, 0) == [] and slow_ranks(cfg) == []
    assert warnings_of(caplog) == []
    assert all(0.8 < s.relative < 1.25 for s in job_scores(cfg)), job_scores(cfg)


def test_a_rank_slower_by_less_than_the_floor_is_no_straggler(tmp_path, caplog):
    """8x slower every save, but 35 ms behind: a difference nobody's training time notices."""
    saves = [{0: 0.005, 1: 0.006, 2: 0.004, 3: 0.040} for _ in range(8)]
    cfg = job(tmp_path)
    write_saves(cfg, saves)
    assert watch(cfg, 0) == [] and slow_ranks(cfg) == []
    assert warnings_of(caplog) == []
    (three,) = [s for s in job_scores(cfg) if s.rank == 3]
    assert three.relative < 0.2 and three.excess_s < FLOOR_SECONDS and not three.slow  # shown, not flagged


def test_a_rank_slow_over_its_recent_saves_is_flagged_once(tmp_path, caplog):
    """Rank 2 writes 3x slower than its peers (0.2 s behind) every save but one, its
    newest but one; rank 1 has one bad save. One good save does not clear rank 2, one bad
    save does not flag rank 1."""
    rng = random.Random(1)
    saves = [{r: rng.uniform(0.09, 0.11) for r in range(4)} for _ in range(8)]
    for step, times in enumerate(saves, 1):
        times[2] = 0.1 if step == 7 else rng.uniform(0.28, 0.32)
    saves[4][1] = 0.5
    cfg = job(tmp_path)
    write_saves(cfg, saves)
    (slow,) = watch(cfg, 0)
    assert (slow.rank, slow.tier, slow.step) == (2, 1, 8) and slow.slow
    assert 0.3 < slow.relative < 0.4 and slow.excess_s > 0.15 and slow.saves == 8
    assert [s.rank for s in slow_ranks(cfg)] == [2]
    (msg,) = warnings_of(caplog)
    assert msg.startswith("rank 2 on node 0 writes to tier 1") and "check its disk or network" in msg, msg
    assert watch(cfg, 0) == [slow] and len(warnings_of(caplog)) == 1  # once, until it recovers
    (tmp_path / "ram" / "0" / cfg.namespace).mkdir(parents=True)  # the job's tier, no step in it yet
    doc = json.loads(cli("ls", "-n", cfg.namespace, *(t.path for t in cfg.tiers), "--json").stdout)
    assert [(x["rank"], x["tier"]) for x in doc["scores"] if x["slow"]] == [(2, 1)], doc["scores"]
