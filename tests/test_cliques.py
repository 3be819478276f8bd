"""Clique layout: who holds whose copies, and which layouts are refused or warned about."""

import logging
import random

import pytest
from dist_utils import run_ranks

from tiered_dcp import Tier, TieredConfig, TieredWriter
from tiered_dcp.ranks.cliques import Layout, by_domain, check_cliques
from tiered_dcp.ranks.domains import layout_for, own_domain


def test_clique_members():
    # F=2, J=2 over 8 ranks (2 ranks per node): each rank's peer is on the next node
    assert [Layout(8, 2, 2).clique(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert Layout(8, 2, 2).clique(5) == [5, 7]
    assert Layout(6, 3, 2).clique(4) == [0, 2, 4]
    assert Layout(4).clique(3) == [3]
    assert Layout(8, 2, 2).cliques() == [[0, 2], [1, 3], [4, 6], [5, 7]]


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


def _assert_apart(layout, nodes, domains, factor):
    groups = layout.cliques()
    assert sorted(r for g in groups for r in g) == list(range(len(nodes)))  # every rank, once
    for g in groups:
        assert len(g) == factor
        assert len({domains[r] for r in g}) == factor and len({nodes[r] for r in g}) == factor, g
        assert all(layout.clique(r) == g for r in g)


@pytest.mark.parametrize(
    "nodes, domains, factor",
    [
        ([0, 1, 2, 3], ["a", "a", "b", "b"], 2),  # the racks: the jump rule would pair 0 and 1
        ([0, 0, 1, 1, 2, 2, 3, 3], ["a"] * 4 + ["b"] * 4, 2),  # 2 ranks per node
        ([0, 1, 2, 3, 4, 5, 6, 7], ["a"] * 4 + ["b", "b", "c", "c"], 2),  # uneven domains
        ([0, 1, 2, 3, 4, 5], ["z", "y", "x", "z", "y", "x"], 3),  # interleaved, factor 3
        ([5, 5, 2, 2, 9, 9, 7, 7], ["r1", "r1", "r1", "r1", "r2", "r2", "r3", "r3"], 2),
    ],
)
def test_domain_cliques_are_on_distinct_nodes_and_domains(nodes, domains, factor):
    layout = by_domain(factor, nodes, domains, "'RACK'")
    _assert_apart(layout, nodes, domains, factor)
    assert list(layout.domains) == domains


def test_domain_cliques_spread_over_the_domains():
    # three racks of two nodes: each rack's two nodes pair with the two other racks, not one
    nodes, domains = list(range(6)), ["a", "a", "b", "b", "c", "c"]
    layout = by_domain(2, nodes, domains, "'RACK'")
    partners = {d: {domains[m] for r in range(6) if domains[r] == d for m in layout.clique(r)} for d in "abc"}
    assert partners == {"a": {"a", "b", "c"}, "b": {"a", "b", "c"}, "c": {"a", "b", "c"}}


def test_random_topologies_either_fit_apart_or_are_refused():
    rng = random.Random(28)
    for _ in range(300):
        factor = rng.choice([2, 3])
        per_node = rng.choice([1, 2])
        n_nodes = rng.randint(1, 8)
        node_domain = [f"d{rng.randint(0, 3)}" for _ in range(n_nodes)]
        nodes = [n for n in range(n_nodes) for _ in range(per_node)]
        domains = [node_domain[n] for n in nodes]
        sizes = {d: domains.count(d) for d in set(domains)}
        fits = len(nodes) % factor == 0 and max(sizes.values()) <= len(nodes) // factor
        if fits:
            _assert_apart(by_domain(factor, nodes, domains, "'RACK'"), nodes, domains, factor)
        else:
            with pytest.raises(ValueError, match="the domains found are"):
                by_domain(factor, nodes, domains, "'RACK'")


def test_a_node_in_two_domains_is_refused():
    with pytest.raises(ValueError, match=r"node 1 has rank 2 in domain 'a' and rank 3 in 'b'"):
        by_domain(2, [0, 0, 1, 1], ["a", "a", "a", "b"], "'RACK'")


def test_without_a_domain_the_layout_is_the_jump_rule_and_the_marker_unchanged():
    cfg = TieredConfig("c", [Tier("/x/{node}")], replication_factor=2, replication_jump=2)
    layout = layout_for(cfg, 8, 0)
    assert layout == Layout(8, 2, 2) and layout.cliques() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.marker_fields() == {"replication": [2, 2]}  # no new marker key


def test_a_domain_from_a_function_or_the_environment(monkeypatch):
    def rack(rank: int) -> str:
        return f"rack-{rank // 2}"

    assert own_domain(TieredConfig("c", [Tier("/x")], failure_domain=rack), 3) == ("rack-1", None)
    cfg = TieredConfig("c", [Tier("/x")], failure_domain="MY_RACK")
    monkeypatch.delenv("MY_RACK", raising=False)
    domain, why = own_domain(cfg, 1)
    assert domain is None and "rank 1: the environment variable MY_RACK is not set" in why
    monkeypatch.setenv("MY_RACK", "r7")
    assert own_domain(cfg, 1) == ("r7", None)
    bad = TieredConfig("c", [Tier("/x")], failure_domain=lambda r: None)
    assert "gave None, not a non-empty string" in own_domain(bad, 0)[1]
