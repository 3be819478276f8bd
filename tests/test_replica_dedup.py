"""Dedup with clique replication: a peer is sent only the blocks its root lacks.

2 real ranks on gloo as 2 nodes (LOCAL_WORLD_SIZE=1), replication_factor=2: each node's
root holds both parts, their large tensors as blocks in its own block store. Real files,
real processes; the bytes sent are what the writers count and record.
"""

import glob
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from said import kept_warnings
from test_dedup import files, new_bytes
from tiered_dcp.storage.format import is_block_id, read_index
from tiered_dcp.storage.local import LocalStorage
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter
from tiered_dcp.ops.verify import verify_step

NODES = {"LOCAL_WORLD_SIZE": 1}
WORLD = 2
MiB = 1 << 20
ROWS = Shard(0)
PART = 5 * MiB  # each rank's share: 4.5 MiB of backbone (6 blocks), 0.5 MiB of adapter (1 block)


def make_config(root: str, keep: int | None = None) -> TieredConfig:
    return TieredConfig(
        "job",
        [Tier(f"{root}/ram/{{node}}", keep=keep)],
        dedup=True,
        replication_factor=2,
        replication_jump=1,
    )


def full(step: int, frozen_seed: int = 0) -> dict:
    """Whole tensors: 9 MiB of frozen backbone, a 1 MiB adapter that changes every step."""
    g = torch.Generator().manual_seed(frozen_seed)
    a = torch.Generator().manual_seed(1000 + step)
    return {
        "backbone": {f"layer{i}": torch.randn(768, 1024, generator=g) for i in range(3)},
        "adapter": torch.randn(256, 1024, generator=a),
        "bias": torch.full((7,), float(step)),
    }


def state(step: int, mesh, frozen_seed: int = 0, placement=ROWS, zeros: bool = False) -> dict:
    sd = full(step, frozen_seed)
    if zeros:
        sd = {
            k: torch.zeros_like(v) if torch.is_tensor(v) else {n: torch.zeros_like(t) for n, t in v.items()}
            for k, v in sd.items()
        }
    return {
        "backbone": {k: distribute_tensor(v, mesh, [placement]) for k, v in sd["backbone"].items()},
        "adapter": distribute_tensor(sd["adapter"], mesh, [placement]),
        "bias": sd["bias"],
        "step": -1 if zeros else step,
    }


def check(loaded: dict, step: int, frozen_seed: int = 0) -> None:
    want = full(step, frozen_seed)
    for k, v in want["backbone"].items():
        assert torch.equal(loaded["backbone"][k].full_tensor(), v), k
    assert torch.equal(loaded["adapter"].full_tensor(), want["adapter"])
    assert torch.equal(loaded["bias"], want["bias"])
    assert loaded["step"] == step


def block_files(root) -> list[str]:
    return [f for f in glob.glob(f"{root}/job/blocks/*/*") if is_block_id(os.path.basename(f))]


def _save(rank, world, root, steps, changing=False, keep=None):
    """Save ``steps`` (``changing``: a new backbone every step); per step, the bytes this rank
    sent its peer (the writer's count and its record) and (rank 0) both roots' files after
    the save. With ``keep``, the last step is loaded at the end."""
    import torch.distributed as dist

    from tiered_dcp.writer_process.timings import Kind, read_records

    cfg = make_config(root, keep)
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for step in steps:
        writer = TieredWriter(cfg, step=step)
        dcp.save(state(step, mesh, step if changing else 0), storage_writer=writer)
        dist.barrier()
        recorded = [r.sent for r in read_records(cfg, Kind.SAVE) if r.rank == rank and r.step == step]
        listings = [files(f"{root}/ram/{n}") for n in range(world)] if rank == 0 else None
        out.append((writer.sent_bytes, recorded, listings))
        dist.barrier()
    if keep is not None:
        _load(cfg, steps[-1], mesh, frozen_seed=steps[-1] if changing else 0)
    return out


def _load(cfg, step, mesh, placement=ROWS, frozen_seed=0):
    captured = kept_warnings()
    target = state(step, mesh, placement=placement, zeros=True)
    reader = TieredReader(cfg, step=step)
    dcp.load(target, storage_reader=reader)
    check(target, step, frozen_seed)
    return reader.tiers, captured


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 (same backbone, new adapter) saved by 2 ranks as 2 nodes."""
    root = tmp_path_factory.mktemp("replica-dedup")
    results = run_ranks(_save, WORLD, str(root), [1, 2], env=NODES)
    return root, results


@pytest.fixture
def root(saved, tmp_path):
    dest = tmp_path / "tiers"
    shutil.copytree(saved[0], dest)
    return dest


def test_second_save_sends_and_writes_only_the_changed_blocks(saved):
    root, results = saved
    for rank, ((sent1, rec1, _), (sent2, rec2, _)) in enumerate(results):
        assert rec1 == [sent1] and rec2 == [sent2], (rank, rec1, rec2)  # the writer's records say it too
        assert PART <= sent1 < 1.05 * PART, (rank, sent1)  # the whole part: the peer held nothing
        assert sent2 <= 0.15 * sent1, (rank, sent1, sent2)  # the adapter's block and the small items
    (_, _, after1), (_, _, after2) = results[0]
    for node in (0, 1):  # each root holds both parts: its own and its peer's replica
        first, second = new_bytes({}, after1[node]), new_bytes(after1[node], after2[node])
        assert 2 * PART <= first < 2.1 * PART, (node, first)
        assert second <= 0.15 * first, (node, first, second)
        assert len(block_files(root / f"ram/{node}")) == 2 * (6 + 1) + 2, node  # + step 2's adapters
        store = LocalStorage(str(root / f"ram/{node}"))
        for step in (1, 2):
            for rank in (0, 1):  # the replica's records point into this root's own block store
                index = read_index(store, "job", step, rank, 1 << 30)
                assert index.size < 64 << 10  # the part file keeps the small items only
                assert sum(len(r.blocks or ()) for r in index.records.values()) == 7, (node, step, rank)
    for step in (1, 2):  # every block of every copy, replicas included, reads back right
        checks = verify_step(make_config(str(root)), step)
        assert [c.ok for c in checks] == [True] and len(checks[0].roots) == 2, [c.problems for c in checks]


def _lose_node_then_save_again(rank, world, root):
    """Node 1 lost: both steps load from node 0's replicas; step 3 then rebuilds node 1
    (rank 0 sends the blocks it holds), and after node 0 is lost too, step 3 loads from node 1."""
    import torch.distributed as dist

    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:
        shutil.rmtree(f"{root}/ram/1")
    dist.barrier()
    loads = [_load(cfg, step, mesh) for step in (1, 2)]
    writer = TieredWriter(cfg, step=3)
    dcp.save(state(3, mesh), storage_writer=writer)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/ram/0")
    dist.barrier()
    loads.append(_load(cfg, 3, mesh))
    return writer.sent_bytes, loads


def test_node_loss_loads_every_step_exactly_from_the_replica(root):
    results = run_ranks(_lose_node_then_save_again, WORLD, str(root), env=NODES)
    for _, loads in results:
        assert [tiers for tiers, _ in loads] == [[0]] * 3
    sent0, sent1 = results[0][0], results[1][0]
    assert sent0 >= PART  # node 1 held nothing: rank 0 sent every block, read back from its root
    assert sent1 <= 0.15 * PART  # node 0 held rank 1's frozen blocks already
    assert len(block_files(root / "ram/1")) == 2 * (6 + 1)  # step 3's blocks, both parts


def _load_whole(rank, world, root, steps):
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    return [_load(cfg, step, mesh, placement=Replicate()) for step in steps]


def test_flipped_byte_in_a_replica_block_is_caught_and_read_from_the_peer(root):
    # a backbone block of rank 1's part, in node 0's root (the replica): both steps use it
    store = LocalStorage(str(root / "ram/0"))
    index = read_index(store, "job", 2, 1, 1 << 30)
    block = next(b for k, r in index.records.items() if "backbone" in k.fqn for b in r.blocks)
    victim = root / f"ram/0/job/blocks/{block[:2]}/{block}"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(data)
    for step in (1, 2):  # verify reads the replica's blocks: both steps report the damage there
        problems = [p for c in verify_step(make_config(str(root)), step) for p in c.problems]
        assert problems and all("ram/0" in p for p in problems), (step, problems)
    # every rank loads whole tensors: rank 0 reads rank 1's items from its own root first
    results = run_ranks(_load_whole, WORLD, str(root), [1, 2], env=NODES)
    for step, (tiers, lines) in zip((1, 2), results[0], strict=True):
        assert tiers == [0]
        assert any("is damaged" in line and "ram/0/job/blocks" in line for line in lines), (step, lines)
    assert not any("is damaged" in line for _, lines in results[1] for line in lines)


def test_keep_one_leaves_about_one_step_of_blocks_on_every_root(tmp_path):
    # the backbone changes every step: each step is all new blocks, the older ones go
    run_ranks(_save, WORLD, str(tmp_path), [1, 2, 3], True, 1, env=NODES)  # step 3 loads too
    for node in (0, 1):
        ram = tmp_path / f"ram/{node}"
        assert sorted(os.listdir(ram / "job")) == ["blocks", "step_000000000003"], node
        assert len(block_files(ram)) == 2 * (6 + 1), node
        held = sum(size for _, size in files(ram).values())
        assert 2 * PART <= held < 2.1 * PART, (node, held)


def _save_catching(rank, world, root, step):
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    try:
        dcp.save(state(step, mesh), storage_writer=TieredWriter(cfg, step=step))
    except CheckpointException as e:  # what each rank was told
        return str(e)
    return None


def test_a_damaged_block_sent_to_a_peer_is_caught_on_arrival(root):
    # node 1 replaced (empty): rank 0 sends it the frozen blocks it holds, read from its root,
    # where one of them is damaged: the peer's check on arrival fails the save
    shutil.rmtree(root / "ram/1")
    index = read_index(LocalStorage(str(root / "ram/0")), "job", 2, 0, 1 << 30)
    block = next(b for k, r in index.records.items() if "backbone" in k.fqn for b in r.blocks)
    victim = root / f"ram/0/job/blocks/{block[:2]}/{block}"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(data)
    errors = run_ranks(_save_catching, WORLD, str(root), 3, env=NODES)
    assert all(e is not None and "rank 0's part arrived damaged" in e and block in e for e in errors), errors
    assert not (root / "ram/1/job/blocks" / block[:2] / block).exists()
    assert not (root / "ram/0/job/step_000000000003/COMMITTED").exists()
