"""Tier placements as pure layout: roots, holders, replicas written, who commits, scans."""

from tiered_dcp.storage.format import Marker, PartInfo

from tiered_dcp import Tier
from tiered_dcp.ranks.cliques import Layout
from tiered_dcp.steps.placement import (
    NodeLocalPlacement,
    SaveProtocol,
    SharedPlacement,
    nodes_of,
    placement_for,
)

# 4 ranks on 2 nodes (2 per node); cliques of 2 across nodes: {0, 2}, {1, 3}
NODES = {0: 0, 1: 0, 2: 1, 3: 1}
PAIRS = Layout(4, 2, 2)


def test_placement_for_follows_the_config():
    assert isinstance(placement_for(Tier("/dev/shm/t/{node}")), NodeLocalPlacement)
    assert isinstance(placement_for(Tier("file:///ssd/t")), NodeLocalPlacement)
    assert isinstance(placement_for(Tier("gs://bucket/ckpt")), SharedPlacement)
    assert isinstance(placement_for(Tier("/nfs/ckpt", shared=True)), SharedPlacement)


def test_node_local_roots_holders_and_replicas():
    p = placement_for(Tier("/ram/{node}"))
    assert p.root(1, 3) == "/ram/1"
    assert p.holders(0, NODES, PAIRS) == [0, 2]  # own first, then the clique peer on node 1
    assert p.holders(3, NODES, PAIRS) == [3, 1]
    assert p.holders(0, NODES, Layout(4)) == [0]  # no replication
    assert p.parts_written_by(0, NODES, PAIRS) == [0, 2]
    assert p.parts_written_by(1, NODES, PAIRS) == [1, 3]
    assert p.parts_written_by(2, NODES, Layout(4)) == [2]


def test_node_local_clique_on_one_root_is_not_copied_twice():
    # cliques {0, 1}, {2, 3}: both members on the same node, so one root holds both parts
    p = placement_for(Tier("/ram/{node}"))
    assert p.holders(0, NODES, Layout(4, 2, 1)) == [0]
    assert p.parts_written_by(0, NODES, Layout(4, 2, 1)) == [0]
    # with a root per rank, the same clique does need the copy
    per_rank = placement_for(Tier("/ram/{rank}"))
    assert per_rank.holders(0, NODES, Layout(4, 2, 1)) == [0, 1]
    assert per_rank.parts_written_by(1, NODES, Layout(4, 2, 1)) == [1, 0]


def test_node_local_who_commits_each_root():
    p = placement_for(Tier("/ram/{node}"))
    assert [r for r in NODES if p.commits_root(r, NODES)] == [0, 2]  # the lowest rank of each node
    per_rank = placement_for(Tier("/ram/{node}/{rank}"))
    assert [r for r in NODES if per_rank.commits_root(r, NODES)] == [0, 1, 2, 3]
    assert p.save_protocol is SaveProtocol.AGREED and p.pooled
    assert p.copies(3) == 3 and p.starts_block_epoch and p.node_owned and not p.skips_unanswered


def test_node_local_scan_and_parts_in_root():
    p = placement_for(Tier("/ram/{node}"))
    assert p.scan_roots(1, 3) == [(1, 3), (0, 0)]
    marker = Marker(5, "run", 4, [PartInfo(r, n, 10) for r, n in NODES.items()], 1, 2, replication=[2, 2])
    assert nodes_of(marker) == NODES
    assert p.parts_in_root(0, 0, marker) == [0, 1, 2, 3]  # its own two and their peers' replicas
    assert p.parts_in_root(0, 1, marker) == [0, 1, 2, 3]  # the same root, seen from rank 1
    unreplicated = Marker(5, "run", 4, marker.parts, 1, 2, replication=[1, 1])
    assert p.parts_in_root(1, 2, unreplicated) == [2, 3]


def test_node_local_holders_follow_the_cliques_a_marker_records():
    # one rank per node; cliques placed by failure domain: {0, 3}, {1, 2} (not the jump rule's)
    nodes = {r: r for r in range(4)}
    marker = Marker(5, "run", 4, [PartInfo(r, r, 10) for r in range(4)], 1, 2, replication=[2, 1])
    marker.cliques, marker.domains = [[0, 3], [1, 2]], ["a", "a", "b", "b"]
    p = placement_for(Tier("/ram/{node}"))
    layout = Layout.of_marker(marker)
    assert layout.describe() == ["[0, 3] in a, b", "[1, 2] in a, b"]
    assert p.holders(0, nodes, layout) == [0, 3] and p.holders(2, nodes, layout) == [2, 1]
    assert p.parts_written_by(3, nodes, layout) == [3, 0]
    assert p.parts_in_root(1, 1, marker) == [1, 2]


def test_shared_one_root_committed_by_the_coordinator():
    p = placement_for(Tier("gs://bucket/ckpt"))
    assert {p.root(n, r) for r, n in NODES.items()} == {"gs://bucket/ckpt"}
    assert p.holders(2, NODES, PAIRS) == [2]  # replication does not apply: one copy
    assert p.parts_written_by(2, NODES, PAIRS) == [2]
    assert [r for r in NODES if p.commits_root(r, NODES)] == [0]
    assert p.scan_roots(1, 3) == [(1, 3)]
    marker = Marker(5, "run", 4, [PartInfo(r, n, 10) for r, n in NODES.items()], 1, 2, replication=[2, 2])
    assert p.parts_in_root(1, 3, marker) == [0, 1, 2, 3]
    assert p.save_protocol is SaveProtocol.COORDINATOR and not p.pooled
    assert p.copies(3) == 1 and not p.starts_block_epoch and not p.node_owned and p.skips_unanswered
