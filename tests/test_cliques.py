"""Clique layout: who holds whose copies, and which layouts are refused or warned about."""

import dataclasses
import json
import logging
import random

import pytest
from dist_utils import run_ranks
from tiered_dcp.storage.format import Marker, PartInfo

from tiered_dcp import Tier, TieredConfig, TieredWriter
from tiered_dcp.ranks.cliques import Layout, by_domain, by_node, check_cliques
from tiered_dcp.ranks.domains import layout_unless_gathered, own_domain


def test_clique_members():
    # F=2, J=2 over 8 ranks (2 ranks per node): each rank's peer is on the next node
    assert [Layout(8, 2, 2).clique(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert Layout(8, 2, 2).clique(5) == [5, 7]
    assert Layout(6, 3, 2).clique(4) == [0, 2, 4]
    assert Layout(4).clique(3) == [3]
    assert Layout(8, 2, 2).cliques() == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize(
    "nodes, factor, groups",
    [
        ([0, 0, 1], 2, [[0, 1, 2]]),  # a 2x2 job that lost rank 3: one clique over both nodes
        ([0, 0, 0, 1, 1, 2], 2, [[0, 3], [1, 4], [2, 5]]),
        ([0, 0, 1, 1, 2], 2, [[0, 2, 4], [1, 3]]),
        ([0, 1], 3, [[0, 1]]),  # fewer ranks than the factor: one clique of all
        ([0], 2, [[0]]),  # one rank: no replica can be placed
    ],
)
def test_a_world_the_jump_rule_does_not_fit_is_laid_out_by_node(nodes, factor, groups):
    layout = by_node(factor, nodes)
    assert layout.cliques() == groups
    marker = Marker(1, "ns", len(nodes), [PartInfo(r, n, 1) for r, n in enumerate(nodes)], 0, 0)
    marker = dataclasses.replace(marker, **layout.marker_fields())
    assert Layout.of_marker(Marker.from_bytes(marker.to_bytes())).cliques() == groups  # the format admits it


def test_a_jump_rule_that_does_not_fit_neither_refuses_nor_warns_at_construction(caplog):
    check_cliques(6, 2, 4)  # laid out by node at the save instead (with its warning there)
    check_cliques(1, 2, 1)
    assert not caplog.records


def test_same_node_clique_warns(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_cliques(4, 2, 2)  # peers on the other node: silent
    assert not caplog.records
    check_cliques(4, 2, 1)  # ranks 0 and 1 share node 0
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "same node" in rec.getMessage() and "replication_jump" in rec.getMessage()


def _three_ranks_on_two_nodes(rank, world, root):
    """A job configured for 2x2 (replication_jump=2) that runs with 3 ranks."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_dcp import TieredReader

    cfg = TieredConfig("uneven", [Tier(f"{root}/{{node}}", keep=2)], replication_factor=2, replication_jump=2)
    state = {f"w{rank}": torch.full((1000,), float(rank))}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    got = {f"w{rank}": torch.zeros(1000)}
    dcp.load(got, storage_reader=TieredReader(cfg, step=1))
    return torch.equal(got[f"w{rank}"], state[f"w{rank}"])


def test_a_world_the_jump_rule_does_not_fit_saves_with_a_copy_of_every_part_on_another_node(tmp_path, caplog):
    """3 ranks on 2 nodes with replication_jump=2 (made for 2x2): the save is not refused; its
    cliques are laid out by node, and each node's root holds every part (its own ranks',
    and the other node's replicas), so losing either node loses none."""
    assert run_ranks(_three_ranks_on_two_nodes, 3, str(tmp_path), env={"LOCAL_WORLD_SIZE": 2}) == [True] * 3
    for node in (0, 1):
        step = tmp_path / str(node) / "uneven" / "step_000000000001"
        assert sorted(p.name for p in step.glob("*.part")) == [f"rank_0000{r}.part" for r in range(3)]
        marker = json.loads((step / "COMMITTED").read_text())
        assert marker["cliques"] == [[0, 1, 2]] and marker["replication"] == [2, 2]


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
        if len(nodes) % factor == 0:  # a whole number of cliques: each member in another domain
            if max(sizes.values()) <= len(nodes) // factor:
                _assert_apart(by_domain(factor, nodes, domains, "'RACK'"), nodes, domains, factor)
            else:
                with pytest.raises(ValueError, match="the domains found are"):
                    by_domain(factor, nodes, domains, "'RACK'")
            continue
        # a shrunk world: never refused; cliques of factor..2*factor-1 (one of all, below
        # factor), each across two domains where the largest domain leaves room for it
        layout = by_domain(factor, nodes, domains, "'RACK'")
        assert sorted(r for g in layout.groups for r in g) == list(range(len(nodes)))
        for g in layout.groups:
            assert len(g) <= 2 * factor - 1 and (len(g) >= factor or len(layout.groups) == 1), g
            if len(sizes) > 1 and max(sizes.values()) <= len(layout.groups):
                assert len({domains[r] for r in g}) >= 2, (g, domains)


def test_a_node_in_two_domains_is_refused():
    with pytest.raises(ValueError, match=r"node 1 has rank 2 in domain 'a' and rank 3 in 'b'"):
        by_domain(2, [0, 0, 1, 1], ["a", "a", "a", "b"], "'RACK'")


def test_without_a_domain_the_layout_is_the_jump_rule_and_the_marker_unchanged():
    cfg = TieredConfig("c", [Tier("/x/{node}")], replication_factor=2, replication_jump=2)
    layout = layout_unless_gathered(cfg, 8)
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


def test_a_world_shrunk_by_a_fault_is_laid_out_across_the_domains_not_refused():
    """4 ranks on 2 racks lose one; the 3 left (2 on rack a, 1 on rack b) do not
    split into cliques of 2, and before every save refused them. One clique of the three now
    spans both racks: every part keeps a copy on the other rack. A world left in one rack, or
    of one rank, saves too, and says what it keeps."""
    from tiered_dcp.ranks.cliques import uneven_domains

    layout = by_domain(2, [0, 0, 1], ["a", "a", "b"], "'RACK'")
    assert layout.groups == ((0, 1, 2),)
    assert "every part keeps a copy in another domain" in (uneven_domains(layout) or "")
    assert uneven_domains(by_domain(2, [0, 1, 2, 3], ["a", "a", "b", "b"], "'RACK'")) is None
    wide = by_domain(2, [0, 1, 2, 3, 4], ["a", "a", "b", "b", "c"], "'RACK'")
    assert sorted(len(g) for g in wide.groups) == [2, 3] and all(
        len({"aabbc"[r] for r in g}) >= 2 for g in wide.groups
    )
    one_rack = uneven_domains(by_domain(2, [0, 0, 1], ["a", "a", "a"], "'RACK'"))
    assert "some cliques lie in one domain" in (one_rack or "")
    alone = uneven_domains(by_domain(2, [0], ["a"], "'RACK'"))  # one rank left: saved without
    assert "no replica can be placed" in (alone or "")
