"""The load planner as a pure function: routes for intact, node-lost and shared-only loads."""

from tiered_dcp.planners.load import ItemRoute, PooledTier, ReadSource, Sources, plan_routes, route

# 4 ranks on 2 nodes, tier 0 node-local ("/ram/{node}", cliques {0, 2} and {1, 3}), tier 1 shared
ROOTS = {0: "/ram/0", 1: "/ram/0", 2: "/ram/1", 3: "/ram/1"}
BUCKET = {1: "gs://b/ckpt"}


def own(tier, root):
    return ReadSource("own", tier, root=root)


def peer(tier, holder):
    return ReadSource("peer", tier, holder=holder)


def shared(tier, root):
    return ReadSource("shared", tier, root=root)


def test_intact_own_root_first_then_peers_on_other_roots_then_the_bucket():
    every = {p: [0, 1, 2, 3] for p in range(4)}  # each node's root holds all four parts
    src = Sources(1, pooled=(PooledTier(0, every, ROOTS),), own={0: "/ram/0"}, shared=BUCKET)
    r = route(src, "w", 2)
    # "w" starts the holder rotation at 1; ranks 0 and 1 share rank 1's root, so are skipped
    assert r.sources == (own(0, "/ram/0"), peer(0, 2), peer(0, 3), shared(1, "gs://b/ckpt"))
    assert r.split_at_exchange() == ((own(0, "/ram/0"),), (shared(1, "gs://b/ckpt"),))
    assert r.peers == (peer(0, 2), peer(0, 3))


def test_node_lost_every_asker_of_an_item_asks_one_holder_and_items_spread_over_holders():
    survivors = {p: [2, 3] for p in range(4)}  # node 0 was wiped: only node 1's root holds parts
    pooled = (PooledTier(0, survivors, ROOTS),)
    r0 = route(Sources(0, pooled=pooled, shared=BUCKET), "w", 0)
    r1 = route(Sources(1, pooled=pooled, shared=BUCKET), "w", 0)
    assert r0.sources == r1.sources == (peer(0, 3), peer(0, 2), shared(1, "gs://b/ckpt"))  # read once
    a = route(Sources(0, pooled=pooled, shared=BUCKET), "a", 0)
    assert a.sources == (peer(0, 2), peer(0, 3), shared(1, "gs://b/ckpt"))  # another item: the other holder
    assert r0.split_at_exchange() == ((), (shared(1, "gs://b/ckpt"),))
    # a survivor reads its own root and has no peer on another root to fall back on
    r2 = route(Sources(2, pooled=pooled, own={0: "/ram/1"}), "w", 0)
    assert r2.sources == (own(0, "/ram/1"),)


def test_own_root_lacking_the_part_is_not_a_source():
    holders = {0: [2], 1: [1, 3]}
    src = Sources(1, pooled=(PooledTier(0, holders, ROOTS),), own={0: "/ram/0"})
    assert route(src, "a", 0).sources == (peer(0, 2),)
    assert route(src, "b", 1).sources == (own(0, "/ram/0"), peer(0, 3))


def test_fastest_node_local_tier_first_for_own_and_peers():
    ssd = {0: "/ssd/0", 1: "/ssd/0", 2: "/ssd/1", 3: "/ssd/1"}
    every = {p: [0, 1, 2, 3] for p in range(4)}
    pooled = (PooledTier(2, every, ssd), PooledTier(0, every, ROOTS))  # given out of order
    src = Sources(0, pooled=pooled, own={0: "/ram/0", 2: "/ssd/0"})
    assert route(src, "w", 1).sources == (
        own(0, "/ram/0"),
        own(2, "/ssd/0"),
        peer(0, 2),
        peer(0, 3),
        peer(2, 2),
        peer(2, 3),
    )


def test_shared_only_and_items_the_pooled_metadata_does_not_place():
    src = Sources(3, shared={1: "gs://b/ckpt", 2: "gs://cold/ckpt"})
    assert route(src, "w", 0).sources == (shared(1, "gs://b/ckpt"), shared(2, "gs://cold/ckpt"))
    every = {p: [0, 1, 2, 3] for p in range(4)}
    pooled = Sources(3, pooled=(PooledTier(0, every, ROOTS),), own={0: "/ram/1"}, shared=BUCKET)
    assert route(pooled, "unknown", None).sources == (shared(1, "gs://b/ckpt"),)


def test_alone_reads_every_tier_itself_in_tier_order():
    src = Sources(0, alone={1: "own", 0: "shared"})  # a shared tier listed before a node-local one
    r = route(src, "w", None)
    assert r.sources == (ReadSource("shared", 0), ReadSource("own", 1))
    assert r.split_at_exchange() == ((), (ReadSource("shared", 0), ReadSource("own", 1)))


def test_plan_routes_keeps_the_items_order():
    src = Sources(0, shared=BUCKET)
    routes = plan_routes(src, [("b", 1), ("a", 0), ("b", 1)])
    assert [r.index for r in routes] == ["b", "a", "b"]
    assert all(isinstance(r, ItemRoute) and r.sources == (shared(1, "gs://b/ckpt"),) for r in routes)
