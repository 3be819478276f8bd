"""Clique replication and recovery after node loss: 4 real ranks on gloo as 2 nodes.

Nodes are simulated by ``{node}`` paths (LOCAL_WORLD_SIZE=2: ranks 0-1 on node 0, ranks 2-3
on node 1). With replication_factor=2, replication_jump=2 the cliques are {0, 2} and
{1, 3}, so every node holds every part: its own ranks' and their peers' replicas. One
test runs 6 ranks as 3 nodes (replication_factor=3), for a holder on a third node.
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import fd_table, settle
from dist_utils import run_ranks
from said import kept_warnings
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, status
from tiered_dcp.load.device_reads import HostCopier, Ring

NODES = {"LOCAL_WORLD_SIZE": 2}
WORLD = 4


def make_config(root: str, peer_timeout: float = 60.0) -> TieredConfig:
    return TieredConfig(
        "job",
        [
            Tier(f"{root}/ram/{{node}}", every=1, keep=2),
            Tier(f"{root}/ssd/{{node}}", every=2, keep=2, compression="zstd"),
            Tier(f"{root}/bucket", every=4, shared=True),
        ],
        replication_factor=2,
        replication_jump=2,
        peer_timeout=peer_timeout,
    )


def full(step: int) -> torch.Tensor:
    return torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6) + 1000 * step


def state(step: int, mesh) -> dict:
    return {
        "w": distribute_tensor(full(step), mesh, [Shard(0)]),
        "cols": distribute_tensor(full(step).t().contiguous(), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.full((7,), float(step)), mesh, [Replicate()]),
        "plain": torch.full((5,), float(step)),
        "meta": {"step": step, "name": "x"},
    }


def empty_state(mesh) -> dict:
    s = state(0, mesh)
    s["w"] = distribute_tensor(torch.zeros(32, 6), mesh, [Shard(0)])
    s["cols"] = distribute_tensor(torch.zeros(6, 32), mesh, [Shard(1)])
    s["rep"] = distribute_tensor(torch.zeros(7), mesh, [Replicate()])
    s["plain"] = torch.zeros(5)
    s["meta"] = {"step": -1, "name": ""}
    return s


def check(loaded: dict, step: int) -> None:
    assert torch.equal(loaded["w"].full_tensor(), full(step))
    assert torch.equal(loaded["cols"].full_tensor(), full(step).t())
    assert torch.equal(loaded["rep"].full_tensor(), torch.full((7,), float(step)))
    assert torch.equal(loaded["plain"], torch.full((5,), float(step)))
    assert loaded["meta"] == {"step": step, "name": "x"}


def _save(rank, world, root, steps):
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    for step in steps:
        dcp.save(state(step, mesh), storage_writer=TieredWriter(cfg, step=step))


class Counting(HostCopier):
    """A ring's host copy (the device flow without a GPU), counting the bytes it moved."""

    copied = 0

    def copy(self, dst, src) -> None:
        self.copied += src.numel()
        dst.copy_(src)


def _load(rank, world, root, peer_timeout=60.0, stop_for=0.0, ring=False):
    cfg = make_config(root, peer_timeout)
    mesh = init_device_mesh("cpu", (world,))
    captured = kept_warnings()
    reader = TieredReader(cfg)
    through = Ring(Counting(), slots=2)
    if ring:  # every tensor as onto a GPU: through a ring of 2 slots
        reader._reads.ring_for = lambda device: through
    target = empty_state(mesh)
    planner = PausingPlanner(stop_for) if stop_for and rank == 1 else None
    started = time.monotonic()
    dcp.load(target, storage_reader=reader, planner=planner)
    check(target, reader.step)
    took = time.monotonic() - started
    crossed = (through.copier.copied, through.held) if ring else None
    return (
        reader.step,
        reader.tiers,
        captured,
        took,
        reader._reads.peer_reads,
        reader._reads.read_from,
        crossed,
    )


class PausingPlanner(DefaultLoadPlanner):
    """Stops this very process (SIGSTOP) for a while at its first item: a peer gone silent."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def resolve_tensor(self, read_item):
        if self.seconds:
            subprocess.Popen(["sh", "-c", f"sleep {self.seconds}; kill -CONT {os.getpid()}"])
            seconds, self.seconds = self.seconds, 0
            os.kill(os.getpid(), signal.SIGSTOP)
            del seconds
        return super().resolve_tensor(read_item)


def _resave_and_list(rank, world, root, step):
    _load(rank, world, root)
    _save(rank, world, root, [step])
    names = os.listdir(f"{root}/ram/{rank // 2}/job/step_{step:012d}")
    return sorted(n for n in names if not n.startswith("pin."))  # pins: the SSD copy is under way


def wipe(root, node: int) -> None:
    for tier in ("ram", "ssd"):
        shutil.rmtree(f"{root}/{tier}/{node}", ignore_errors=True)


PARTS = [f"rank_{r:05d}.{ext}" for r in range(WORLD) for ext in ("index", "part")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1..5 saved by 4 ranks as 2 nodes; a pristine copy to restore before each test."""
    root = tmp_path_factory.mktemp("replicated")
    run_ranks(_save, WORLD, str(root), list(range(1, 6)), env=NODES)
    settle(make_config(str(root)))
    return root


@pytest.fixture
def root(saved, tmp_path):
    dest = tmp_path / "tiers"
    shutil.copytree(saved, dest)
    return dest


def test_every_node_holds_every_part_metadata_and_marker(root):
    for node in (0, 1):
        for tier, steps in (("ram", (4, 5)), ("ssd", (2, 4))):
            for step in steps:
                names = sorted(os.listdir(root / f"{tier}/{node}/job/step_{step:012d}"))
                assert names == ["COMMITTED", "metadata", *PARTS], (tier, node, step, names)
        metadata = {(root / f"ram/{n}/job/step_000000000005/metadata").read_bytes() for n in (0, 1)}
        assert len(metadata) == 1  # the same bytes on every node
    assert sorted(os.listdir(root / "bucket/job")) == ["step_000000000004"]
    rows = {(r.tier_index, r.step): r.state for r in status(make_config(str(root)))}
    assert rows == {
        (0, 4): "committed",
        (0, 5): "committed",
        (1, 2): "committed",
        (1, 4): "committed",
        (2, 4): "committed",
    }


def test_node_loss_loads_everything_from_the_survivors(root):
    """Node 1 wiped: its ranks take every item from node 0's; every tensor goes through a
    ring as onto a GPU (own reads and items from peers alike: each byte crosses it once)."""
    wipe(root, 1)
    results = run_ranks(_load, WORLD, str(root), 60.0, 0.0, True, env=NODES)
    assert [r[0] for r in results] == [5] * WORLD  # the RAM step, newer than the bucket's 4
    assert all(0 in r[1] for r in results)
    # node 0's ranks read their own roots; node 1's (no tier left) all from peers, as much
    assert [sorted(r[5]) for r in results] == [["own"], ["own"], ["peer"], ["peer"]], results
    assert results[0][5]["own"] == results[2][5]["peer"] > 0  # the same DTensor shards' sizes
    crossed = [r[6] for r in results]
    assert crossed[0] == crossed[2] and crossed[0][0] > 0 and crossed[0][1] == 0, crossed  # peers' too


def test_replacement_node_holds_its_parts_again_after_the_next_save(root):
    wipe(root, 1)
    listings = run_ranks(_resave_and_list, WORLD, str(root), 6, env=NODES)
    assert listings[2] == listings[3] == ["COMMITTED", "metadata", *PARTS]


def test_both_nodes_lost_falls_back_to_the_shared_tier(root):
    wipe(root, 0)
    wipe(root, 1)
    results = run_ranks(_load, WORLD, str(root), env=NODES)
    assert [(r[0], r[1]) for r in results] == [(4, [2])] * WORLD
    assert not any("own" in r[5] for r in results) and sum(r[5]["shared"] for r in results) > 0  # spread


def test_whole_clique_lost_falls_back_to_the_shared_tier_and_says_why(root):
    # ranks 1 and 3 form a clique: remove their parts everywhere, on the node-local tiers
    for tier in ("ram", "ssd"):
        for node in (0, 1):
            for path in (root / f"{tier}/{node}/job").glob("step_*/rank_0000[13].*"):
                path.unlink()
    results = run_ranks(_load, WORLD, str(root), env=NODES)
    assert [r[0] for r in results] == [4] * WORLD
    assert any("no node holds the part of rank(s) [1, 3]" in line for line in results[0][2])


def test_flipped_byte_in_own_part_is_read_from_the_replica(root):
    bad = root / "ram/0/job/step_000000000005/rank_00001.part"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(data)
    results = run_ranks(_load, WORLD, str(root), env=NODES)
    assert [r[0] for r in results] == [5] * WORLD  # odd step: RAM only, so the peer's replica served
    assert any(str(bad) in line for line in results[1][2]), results[1][2]


def test_silent_peer_falls_back_to_the_shared_tier_instead_of_hanging(root):
    # Make step 4 the newest (on RAM, SSD and bucket), lose node 1, and stop rank 1 (a holder
    # of node 1's parts) for 8 s in the middle of the load: with peer_timeout=2 the others
    # give up on it and read from the bucket. (Not rank 0: it hosts the job's rendezvous
    # store here, and a frozen store freezes every rank's waits, ours included.)
    for node in (0, 1):
        for tier in ("ram",):
            shutil.rmtree(root / f"{tier}/{node}/job/step_000000000005", ignore_errors=True)
    wipe(root, 1)
    results = run_ranks(_load, WORLD, str(root), 2.0, 8.0, env=NODES)
    assert [r[0] for r in results] == [4] * WORLD
    for rank in (2, 3):
        assert any("did not answer within 2 s" in line for line in results[rank][2]), results[rank][2]


def _async_save_then_lose_a_node(rank, world, root):
    import torch.distributed as dist

    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")  # the saves' own group, as a training job would use
    for step in (1, 2, 3):
        fut = dcp.async_save(
            state(step, mesh), storage_writer=TieredWriter(cfg, step=step), process_group=group
        )
        fut.result()
    dist.barrier()
    if rank == 0:
        wipe(root, 1)
    dist.barrier()
    return _load(rank, world, root)[0]


def test_async_saves_replicate_too(tmp_path):
    """DCP's THREAD mode; its PROCESS mode, where a pickled copy of the writer replicates from
    DCP's background process, is test_failure_domains.py's (no shared tier to fall back on)."""
    assert run_ranks(_async_save_then_lose_a_node, WORLD, str(tmp_path), env=NODES) == [3] * WORLD


def _load_counting_broadcasts(rank, world, root):
    """A load: its step, and how often its opening broadcast the metadata (the real
    ``broadcast_bytes``, counted)."""
    from tiered_dcp.load import open_step

    real, calls = open_step.broadcast_bytes, []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    open_step.broadcast_bytes = counted
    return _load(rank, world, root)[0], len(calls)


def test_each_rank_reads_the_metadata_on_its_own_node_and_a_damaged_copy_is_broadcast_around(root):
    """Intact, every rank loads the step's metadata from its own node's copy: nothing is
    broadcast (at 10,000 ranks the metadata's broadcast costs far more than each node's
    read). One node's copy damaged: the ranks learn it in the leases' collective, the metadata
    is broadcast from a node holding it whole, and every rank loads the step exactly."""
    assert run_ranks(_load_counting_broadcasts, WORLD, str(root), env=NODES) == [(5, 0)] * WORLD
    bad = root / "ram/1/job/step_000000000005/metadata"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(data)
    damaged = run_ranks(_load_counting_broadcasts, WORLD, str(root), env=NODES)
    assert [step for step, _ in damaged] == [5] * WORLD  # check() compared every value
    assert all(n >= 1 for _, n in damaged), damaged


def _plain(rank: int, seed: float) -> dict:
    """Per-rank tensors: two a peer's bytes can land in as they are, one (transposed) not."""
    base = torch.arange(48.0).reshape(6, 8) + 100 * rank + seed
    return {f"r{rank}.flat": base.flatten(), f"r{rank}.grid": base.clone(), f"r{rank}.t": base.t()}


def _save_plain_then_load_from_peers(rank, world, root):
    """Save, lose node 1, load: the items received from peers, and the fresh buffers used."""
    import torch.distributed as dist

    from tiered_dcp.load import step_reads

    cfg = make_config(root)
    dcp.save(_plain(rank, 0.5), storage_writer=TieredWriter(cfg, step=1))
    dist.barrier()
    if rank == 0:
        wipe(root, 1)
    dist.barrier()
    real, fresh = step_reads.scratch, []
    step_reads.scratch = lambda req: fresh.append(req) or real(req)
    target = {k: torch.zeros_like(v) for k, v in _plain(rank, 0.0).items()}
    target[f"r{rank}.t"] = torch.zeros(6, 8).t()  # non-contiguous: received into a buffer
    dcp.load(target, storage_reader=TieredReader(cfg))
    assert all(torch.equal(target[k], v) for k, v in _plain(rank, 0.5).items())
    return len(fresh)


def test_items_from_peers_land_in_their_targets(tmp_path):
    """A rank whose node was lost receives each item whose target is its stored bytes as they
    lie straight into the target (checked there, then committed); only the transposed
    target takes a buffer and a copy. Every value exact."""
    fresh = run_ranks(_save_plain_then_load_from_peers, WORLD, str(tmp_path), env=NODES)
    assert fresh == [0, 0, 1, 1]


def _load_counting(rank, world, root, loads):
    """``loads`` loads; after each, the step, the groups this rank opened, the store's key count."""
    import torch.distributed as dist

    from tiered_dcp.ranks import transport, worlds

    out = []
    for _ in range(loads):
        transport.OPENED.clear()
        loaded = _load(rank, world, root)
        step, reads = loaded[0], loaded[4]
        dist.barrier()  # every rank is done: nobody writes or deletes keys while we count
        out.append((step, list(transport.OPENED), worlds.store().num_keys(), reads))
        dist.barrier()
    return out


def test_intact_load_opens_no_peer_group_and_leaves_no_keys_growing(root):
    results = run_ranks(_load_counting, WORLD, str(root), 3, env=NODES)
    for loads in results:
        assert [(step, groups) for step, groups, _, _ in loads] == [(5, [])] * 3
    counts = {keys for loads in results for _, _, keys, _ in loads}
    assert len(counts) == 1, counts  # the same key count after every load: nothing left per load


def _save_counting(rank, world, root, steps):
    """Save ``steps``; after each, the store's key count (every rank done saving)."""
    import torch.distributed as dist

    from tiered_dcp.ranks import worlds

    out = []
    for step in steps:
        _save(rank, world, root, [step])
        dist.barrier()
        out.append(worlds.store().num_keys())
        dist.barrier()
    return out


def test_saves_leave_no_keys_growing_in_the_store(tmp_path):
    # each save deletes the previous one's agreement keys and its clique group's rendezvous keys
    results = run_ranks(_save_counting, WORLD, str(tmp_path), [1, 2, 3, 4], env=NODES)
    counts = {keys for saves in results for keys in saves[1:]}
    assert len(counts) == 1, results


def test_after_node_loss_only_exchanging_ranks_open_groups_of_two_and_each_item_is_read_once(root):
    # node 1 (ranks 2, 3) lost: they ask node 0's ranks, each item of one holder (items
    # spread over the holders), so an item both need is read once; nobody else opens anything
    wipe(root, 1)
    results = run_ranks(_load_counting, WORLD, str(root), 3, env=NODES)
    for rank, loads in enumerate(results):
        for step, groups, _, _ in loads:
            assert step == 5 and all(len(g) == 2 and g[0] in (0, 1) and g[1] in (2, 3) for g in groups)
            assert groups or rank in (0, 1), (rank, loads)
    # ranks 2 and 3 each need 6 items (their shards of "w" and "cols"; "rep", "plain" and
    # "meta"'s two values, the same for both): 8 distinct, each read once (12 reads before)
    for load in range(3):
        assert sum(results[rank][load][3] for rank in range(WORLD)) == 8, results
    counts = {keys for loads in results for _, _, keys, _ in loads}
    assert len(counts) == 1, counts  # each load deletes the previous one's keys, gloo's included


def _save_load_three_nodes(rank, world, root):
    """Save step 1 with cliques {0, 2, 4} and {1, 3, 5}; lose node 2 and damage node 0's
    copy of rank 4's part; load, and say which groups this rank opened."""
    import torch.distributed as dist

    from tiered_dcp.ranks import transport

    cfg = TieredConfig(
        "job", [Tier(f"{root}/ram/{{node}}", keep=1)], replication_factor=3, replication_jump=2
    )
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(state(1, mesh), storage_writer=TieredWriter(cfg, step=1))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/ram/2")
        bad = Path(root) / "ram/0/job/step_000000000001/rank_00004.part"
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(data)
    dist.barrier()
    captured = kept_warnings()
    transport.OPENED.clear()
    reader = TieredReader(cfg)
    target = empty_state(mesh)
    dcp.load(target, storage_reader=reader)
    check(target, 1)
    return reader.step, list(transport.OPENED), captured


def test_damaged_answer_moves_to_the_next_holder_over_groups_of_two(tmp_path):
    # rank 4 (node 2, lost) asks holder 0 first; node 0's copy is damaged, so ranks 0 and 1
    # (one root) answer zeros in rounds 0 and 1, and rank 2 (node 1) serves it in round 2
    results = run_ranks(_save_load_three_nodes, 6, str(tmp_path), env=NODES)
    assert [r[0] for r in results] == [1] * 6
    step, groups, lines = results[4]
    assert groups[:3] == [[0, 4], [1, 4], [2, 4]], groups
    assert any("from rank 0 arrived damaged" in line for line in lines), lines
    assert any("from rank 1 arrived damaged" in line for line in lines), lines
    for _, groups, _ in results:
        assert all(len(g) == 2 for g in groups), groups


def _save_with_a_replica_that_cannot_commit(rank, world, root):
    """Save step 1 on a disk tier (replicas land in the store's own reservations), then
    step 2 with a directory where rank 0's root puts rank 2's replica: its second replica's
    commit fails after the first committed. What the save raised, and the fd table around it."""
    cfg = TieredConfig(
        "job", [Tier(f"{root}/disk/{{node}}", keep=2)], replication_factor=3, replication_jump=1
    )
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(state(1, mesh), storage_writer=TieredWriter(cfg, step=1))  # threads, pools: warm
    if rank == 0:
        Path(root, "disk/0/job/step_000000000002/rank_00002.part").mkdir(parents=True)
    before = fd_table()
    try:
        dcp.save(state(2, mesh), storage_writer=TieredWriter(cfg, step=2))
        failure = ""
    except BaseException as e:  # noqa: BLE001 - judged by the test
        failure = repr(e)
    return failure, before, fd_table()


def test_a_swap_failing_after_a_replica_committed_closes_no_descriptor_twice(tmp_path):
    # rank 0 commits rank 1's replica, then rank 2's fails: the committed one is not
    # discarded again (its directory's descriptor closed a second time would raise EBADF,
    # or close whatever file took its number meanwhile), and nothing is left open
    nodes = {"LOCAL_WORLD_SIZE": 1}
    results = run_ranks(_save_with_a_replica_that_cannot_commit, 3, str(tmp_path), env=nodes)
    failure, before, after = results[0]
    assert "Is a directory" in failure and "Bad file descriptor" not in failure, failure
    assert after == before
    assert Path(tmp_path, "disk/0/job/step_000000000002/rank_00001.part").is_file()
