"""Restore at scale: a step on a bucket read once and spread over the job (``spread.py``).

A job saves to a bucket tier on the GCS emulator; a restarted job (new processes, no
node-local tier: as after a preemption onto new nodes) loads it through a FaultProxy that
counts the bytes the bucket served. Real ranks on gloo, 2 per simulated node.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from conftest import GCSBucket
from dist_utils import launch
from tiered_dcp.storage import open_storage
from tiered_dcp.storage.format import step_dir
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tiered_dcp.load.spread import RankFacts, partners, plan_spread

HERE = Path(__file__).parent


def job(world: int, args: dict, timeout: float = 120) -> list[dict | None]:
    """tests/spread_worker.py on ``world`` ranks, 2 per node: each rank's report with its
    stderr (None for a rank that died)."""
    ranks = launch(str(HERE / "spread_worker.py"), world, [json.dumps(args)], local_world=2, timeout=timeout)
    out: list[dict | None] = []
    for rank, (_, stdout, stderr) in enumerate(ranks):
        lines = stdout.strip().splitlines()
        assert lines or args.get("die") == rank, f"rank {rank} reported nothing: {stderr[-3000:]}"
        out.append({**json.loads(lines[-1]), "stderr": stderr} if lines else None)
    return out


def stored_bytes(bucket) -> int:
    with open_storage(bucket.url, bucket.storage_options) as store:
        return sum(store.list_sizes(step_dir("spread", 1)).values())


def saved(bucket, layout: str, world: int = 4, **extra) -> dict:
    args = {"mode": "save", "layout": layout, "url": bucket.url, "options": bucket.storage_options, **extra}
    assert all(r is not None and r["saved"] for r in job(world, args))
    return {**args, "mode": "load"}


def load(bucket, proxy, args: dict, world: int = 4, **extra) -> tuple[list, float]:
    """Each rank's report, and the bytes the bucket served as a ratio of the step's size."""
    proxy.served = 0
    reports = job(world, {**args, "options": bucket.via(proxy.url), **extra})
    return reports, proxy.served / stored_bytes(bucket)


@pytest.fixture(scope="module")
def ddp_step(gcs_emulator, tmp_path_factory):
    """One DDP-style step saved by 4 ranks on 2 nodes to a bucket, and to a shared directory
    beside it (a second copy to fall back to), for this module's loads."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    gcs_emulator.create_bucket(name)
    bucket = GCSBucket(f"gs://{name}", gcs_emulator.storage_options(), gcs_emulator)
    args = saved(bucket, "ddp", second=str(tmp_path_factory.mktemp("nfs")))
    return bucket, args


def test_a_restart_reads_each_stored_byte_once_and_every_rank_loads_exactly(ddp_step):
    bucket, args = ddp_step
    with bucket.proxy() as proxy:
        spread, spread_ratio = load(bucket, proxy, args, ring=True)  # as onto GPUs: through rings
        each, each_ratio = load(bucket, proxy, args, spread=False)
    for r in spread + each:
        assert r["error"] is None and r["exact"], r
    for r in spread:  # each tensor byte crossed the ring once, those another rank read for it too
        assert r["ring"]["copied"] == r["ring"]["tensor_bytes"] and r["ring"]["held"] == 0, r["ring"]
    assert spread_ratio <= 1.15, spread_ratio  # the bucket served the step about once
    assert each_ratio >= 2.5, each_ratio  # every replica read it (today's way): the test can fail
    # the loads' own count (``read_from``): a rank's state is "w" and "lr", the same on every
    # rank, and its own "r<rank>" (64 KiB); each rank read all of it from the bucket, or,
    # spread, the bucket served each stored item once and peers the rest
    whole = each[0]["read"]["shared"]
    assert all(r["read"] == {"shared": whole} for r in each), each
    assert sum(r["read"].get("shared", 0) for r in spread) == whole + 3 * (1 << 16), spread
    assert all(r["read"].get("shared", 0) + r["read"]["peer"] == whole for r in spread), spread
    # groups only where bytes cross: readers 0 ("w") and 2 ("lr", node 1 before a second read
    # on node 0) send to the others; ranks 1 and 3 only receive, and open nothing between them
    # (a group nobody used could close on one side while the other still connected)
    assert sorted({tuple(g) for r in spread for g in r["groups"]}) == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]


def test_hsdp_shards_are_read_once_at_the_same_and_another_world_size_and_as_fsdp_shards(gcs_bucket):
    args = saved(gcs_bucket, "hsdp")  # a (2 replicas, 2 shards) mesh: each shard stored once
    with gcs_bucket.proxy() as proxy:
        same, same_ratio = load(gcs_bucket, proxy, args)
        # resharded: 2 ranks on a (2 replicas, 1 shard) mesh, each the whole tensor
        other, other_ratio = load(gcs_bucket, proxy, args, world=2)
        # FSDP2-style: 4 shards over the 4 ranks, each a half of a stored shard
        fsdp, fsdp_ratio = load(gcs_bucket, proxy, {**args, "load_layout": "fsdp"})
    for r in same + other + fsdp:
        assert r["error"] is None and r["exact"], r
    assert max(same_ratio, other_ratio, fsdp_ratio) <= 1.15, (same_ratio, other_ratio, fsdp_ratio)


def test_a_damaged_item_is_read_from_the_next_tier_by_its_reader_before_it_is_sent(ddp_step):
    bucket, args = ddp_step
    key = f"{step_dir('spread', 1)}/rank_00000.part"  # rank 0's part holds the replicated tensor
    with open_storage(bucket.url, bucket.storage_options) as store:
        good = store.read(key)
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        store.write(key, [bytes(data)])
        try:
            with bucket.proxy() as proxy:
                reports, _ = load(bucket, proxy, args)
        finally:
            store.write(key, [good])
    for r in reports:
        assert r["error"] is None and r["exact"], r
    readers = [r for r in reports if r["failures"]]
    assert len(readers) == 1 and readers[0]["failures"] == ["DAMAGED"]  # one read, one fall-back


def test_a_rank_dying_mid_load_fails_it_on_every_rank_naming_it(ddp_step):
    bucket, args = ddp_step
    with bucket.proxy() as proxy:
        reports, _ = load(bucket, proxy, {**args, "peer_timeout": 5}, die=3)
    assert reports[3] is None
    for r in reports[:3]:  # within the peer timeout, not DCP's 30 minutes
        assert r is not None and r["error"] is not None, r
    # the ranks that waited on rank 3 say so; DCP's collective after the reads then raises
    # torch's own error on every survivor (as for a rank lost mid-save)
    assert any("rank(s) [3] stopped answering" in r["stderr"] for r in reports[:3])


def _plan(*keys: tuple[str, int]) -> LoadPlan:
    return LoadPlan(
        [
            ReadItem(LoadItemType.TENSOR, MetadataIndex(k, [0]), [0], MetadataIndex(k, [0]), [0], [n])
            for k, n in keys
        ]
    )


def test_readers_go_one_per_node_before_two_on_a_node_and_balance_bytes():
    sizes = {"a": 800, "b": 400, "c": 400, "d": 100, "own": 50}
    plans = [_plan(*[(k, n) for k, n in sizes.items() if k != "own"], ("own", 50)) for _ in range(4)]
    spreads = plan_spread(plans, lambda key: sizes[key.fqn], [RankFacts(r // 2, r) for r in range(4)])
    readers = {t.key.fqn: t.reader for t in spreads[0].transfers}
    assert readers["a"] == 0 and readers["b"] == 2  # node 1 before a second read on node 0
    assert readers["c"] == 3  # node 1 has less (400 < 800): its rank with nothing yet
    assert readers["d"] == 1  # the nodes even (800 each): the least loaded rank, rank 1
    assert "own" in readers  # every rank asked for "own" here: it is spread too
    for rank, s in enumerate(spreads):  # each rank's plan holds exactly the transfers it is in
        assert all(rank == t.reader or rank in t.receivers for t in s.transfers)
        assert [t.key.fqn for t in s.transfers] == [t.key.fqn for t in spreads[0].transfers]
    many = plan_spread([_plan(("w", 10))] * 20, lambda k: 10, [RankFacts(r // 2, r) for r in range(20)])
    transfers = {t for s in many for t in s.transfers}  # 20 ranks ask: read 3 times, 8 + 8 + 4
    assert sorted(len(t.receivers) + 1 for t in transfers) == [4, 8, 8]
    assert sorted(r for t in transfers for r in (t.reader, *t.receivers)) == list(range(20))
    for t in transfers:  # a receiver's one partner is its reader, not the 3 to 6 others receiving
        assert [partners(r, many[r].transfers) for r in t.receivers] == [[t.reader]] * len(t.receivers)
        assert partners(t.reader, many[t.reader].transfers) == sorted(t.receivers)
    alone = [_plan(("x", 10)), _plan(("y", 10))]
    assert [s.transfers for s in plan_spread(alone, lambda k: 10, [RankFacts(0, 0), RankFacts(1, 1)])] == [
        (),
        (),
    ]
    # each rank's partners: the ranks it sends to or receives from, never a fellow receiver
    everyone = [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]  # each rank reads an item for the others
    assert [partners(r, spreads[r].transfers) for r in range(4)] == everyone
    empty = plan_spread([_plan(("e", 0))] * 3, lambda k: 0, [RankFacts(r, r) for r in range(3)])
    assert [len(s.transfers) for s in empty] == [1, 1, 1]  # spread, but nothing crosses:
    assert [partners(r, s.transfers) for r, s in enumerate(empty)] == [[], [], []]
    # DCP's group a subgroup of global ranks 4 and 6: the transfers name the global ranks
    sub = plan_spread([_plan(("w", 10))] * 2, lambda k: 10, [RankFacts(2, 4), RankFacts(3, 6)])
    assert [(t.reader, t.receivers) for s in sub for t in s.transfers] == [(4, (6,))] * 2
