"""Clique layout: who holds whose copies, and which layouts are refused or warned about."""

import logging

import pytest
from dist_utils import run_ranks

from tiered_dcp import Tier, TieredConfig, TieredWriter
from tiered_dcp.cliques import check_cliques, clique


def test_clique_members():
    # F=2, J=2 over 8 ranks (2 ranks per node): each rank's peer is on the next node
    assert [clique(r, 8, 2, 2) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert clique(5, 8, 2, 2) == [5, 7]
    assert clique(4, 6, 3, 2) == [0, 2, 4]
    assert clique(3, 4, 1, 1) == [3]


def test_impossible_layout_is_refused_with_what_would_work():
    with pytest.raises(ValueError, match=r"replication_factor=2 with replication_jump=4 .* 6 rank") as e:
        check_cliques(6, 2, 4)
    assert "replication_jump=1 or 3 would work" in str(e.value)
    with pytest.raises(ValueError, match="needs at least replication_factor=2 ranks"):
        check_cliques(1, 2, 1)


def test_same_node_clique_warns(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_cliques(4, 2, 2)  # peers on the other node: silent
    assert not caplog.records
    check_cliques(4, 2, 1)  # ranks 0 and 1 share node 0
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "same node" in rec.getMessage() and "replication_jump" in rec.getMessage()


def _construct_writer(rank, world, root):
    cfg = TieredConfig("c", [Tier(f"{root}/{{node}}")], replication_factor=2, replication_jump=1)
    try:
        TieredWriter(cfg, step=1)
    except ValueError as e:
        return str(e)
    return None


def test_every_rank_refuses_an_impossible_clique(tmp_path):
    errors = run_ranks(_construct_writer, 3, str(tmp_path))
    assert all(e and "divisible by 2*1=2" in e and "3 rank(s)" in e for e in errors), errors
