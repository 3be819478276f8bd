"""Save-time scores: by hand on records, and one rank's tier slowed for real (its writer capped)."""

import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_goodput import cli

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown, wait_for
from tiered_dcp.scores import PATIENCE, score_ranks, slow_ranks


def rec(rank, step, seconds, tier=1, nbytes=1000, kind="persist"):
    return {
        "kind": kind,
        "rank": rank,
        "node": rank // 2,
        "step": step,
        "tier": tier,
        "write_s": seconds,
        "bytes": nbytes,
    }


def test_relative_and_individual_scores_by_hand():
    recs = [rec(0, 1, 0.1), rec(1, 1, 0.1), rec(2, 1, 0.25)]  # rank 2 writes at 0.4 of the best
    recs += [rec(0, 2, 0.1), rec(1, 2, 0.2), rec(2, 2, 0.25)]  # rank 1 at half its own best
    recs += [rec(0, 3, 0.001), rec(1, 3, 0.01)]  # too quick to tell: not scored
    recs += [rec(0, 4, 0.1), rec(1, 4, 0.1, nbytes=0)]  # rank 1 wrote nothing: not scored
    by_rank = {s.rank: s for s in score_ranks(recs)}
    assert by_rank[2].relative == 0.4 and by_rank[2].individual == 1.0 and by_rank[2].slow_streak == 2
    assert by_rank[1].relative == 0.5 and by_rank[1].individual == 0.5 and by_rank[1].step == 2
    assert by_rank[0].relative == 1.0 and by_rank[0].saves == 2 and by_rank[0].worst == 1.0
    assert by_rank[2].node == 1 and by_rank[2].worst == 0.4
    # throughput, not time: a rank with twice the bytes in twice the time is as fast
    (a, b) = score_ranks([rec(0, 1, 0.1), rec(1, 1, 0.2, nbytes=2000)])
    assert a.relative == b.relative == 1.0
    # a slow save breaks the streak when the rank recovers
    streak = [rec(0, s, 0.1) for s in range(5)] + [rec(1, s, 0.5 if s != 3 else 0.1) for s in range(5)]
    (_, one) = score_ranks(streak)
    assert one.slow_streak == 1 and one.saves == 5


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
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("tiered_dcp").addHandler(Keep(level=logging.WARNING))
    cfg = make_config(root)
    for step in range(1, SAVES + 1):
        state = {f"w{rank}": torch.full((MIB,), float(step))}  # 4 MiB per rank
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, SAVES, timeout=120)
    shutdown(wait=True, timeout=60)
    return [m for m in seen if "of the best rank" in m]


def test_a_rank_whose_tier_is_slow_is_flagged_and_the_other_is_not(tmp_path):
    warnings = run_ranks(_saves_with_one_slow_writer, 2, str(tmp_path), timeout=300)
    cfg = make_config(str(tmp_path))
    flagged = slow_ranks(cfg)
    assert [(s.rank, s.tier) for s in flagged if s.tier == 1] == [(1, 1)], flagged
    assert not [s for s in flagged if s.rank == 0]
    (slow,) = [s for s in flagged if s.tier == 1]
    assert slow.relative < 0.5 and slow.slow_streak >= PATIENCE
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
    assert score["relative"] == pytest.approx(slow.relative) and score["slow_streak"] >= PATIENCE
