"""Content-hash dedup: unchanged blocks are written once per tier, on the save path and by
the writer process; GC by reference survives a SIGKILL; damage in a shared block is caught
by every step using it. Real files, real processes."""

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import preloaded
import torch
import torch.distributed.checkpoint as dcp
from conftest import settle
from dist_utils import run_ranks
from tiered_dcp.storage.blocks import BLOCK_BYTES, block_id, fingerprints
from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import is_block_id

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, status, wait_for
from tiered_dcp.ops.verify import verify_step

MiB = 1 << 20
HERE = os.path.dirname(__file__)


def lora_state(step: int, frozen_seed: int = 0) -> dict:
    """9 MiB of frozen backbone, 1 MiB of adapter that changes every step, a few small values."""
    g = torch.Generator().manual_seed(frozen_seed)
    a = torch.Generator().manual_seed(1000 + step)
    return {
        "backbone": {f"layer{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(3)},
        "adapter": torch.randn(MiB // 4, generator=a),
        "bias": torch.full((7,), float(step)),
        "step": step,
    }


def zeros_like(sd):
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if torch.is_tensor(sd) else -1


def assert_equal(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


def load(cfg, step, like):
    target = zeros_like(like)
    dcp.load(target, storage_reader=TieredReader(cfg, step=step))
    return target


def files(root) -> dict[str, tuple[int, int]]:
    """Every file under root: (inode, size), so a rewrite (a new inode) is seen."""
    out = {}
    for f in glob.glob(f"{root}/**", recursive=True):
        if os.path.isfile(f):
            st = os.stat(f)
            out[os.path.relpath(f, root)] = (st.st_ino, st.st_size)
    return out


def new_bytes(before, after) -> int:
    """Bytes of files that are new or rewritten between two listings."""
    return sum(size for name, (ino, size) in after.items() if before.get(name, (None,))[0] != ino)


def block_files(root, ns="run") -> set[str]:
    return {
        os.path.basename(f) for f in glob.glob(f"{root}/{ns}/blocks/*/*") if is_block_id(os.path.basename(f))
    }


def two_tiers(tmp_path, dedup=True, keep=None):
    return TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram" / "{node}"), keep=keep),
            Tier(str(tmp_path / "bucket"), compression="zstd", shared=True, keep=keep),
        ],
        dedup=dedup,
    )


def test_frozen_backbone_written_once_per_tier_and_both_steps_load(tmp_path):
    cfg = two_tiers(tmp_path)
    ram, bucket = tmp_path / "ram" / "0", tmp_path / "bucket"
    dcp.save(lora_state(1), storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, timeout=60)
    ram1, bucket1 = files(ram), files(bucket)
    dcp.save(lora_state(2), storage_writer=TieredWriter(cfg, step=2))
    wait_for(cfg, 2, timeout=60)
    ram2, bucket2 = files(ram), files(bucket)
    first_ram, second_ram = new_bytes({}, ram1), new_bytes(ram1, ram2)
    first_bucket, second_bucket = new_bytes({}, bucket1), new_bytes(bucket1, bucket2)
    assert second_ram <= 0.15 * first_ram, (second_ram, first_ram)
    # the writer process neither rewrote nor re-uploaded a block the bucket held
    assert second_bucket <= 0.15 * first_bucket, (second_bucket, first_bucket)
    for name in bucket1:
        if "/blocks/" in name:
            assert bucket2[name] == bucket1[name], name  # same inode: not written again
    assert len(block_files(ram)) == 9 + 2 and len(block_files(bucket)) == 9 + 2
    for step in (1, 2):
        assert_equal(load(cfg, step, lora_state(step)), lora_state(step))
        assert_equal(load(TieredConfig("run", [cfg.tiers[1]]), step, lora_state(step)), lora_state(step))
        assert all(c.ok for c in verify_step(cfg, step)), [c.problems for c in verify_step(cfg, step)]
    # status: logical, stored and written bytes per step and tier, and their ratios
    rows = {(r.tier_index, r.step): r for r in status(cfg)}
    for tier in (0, 1):
        first, second = rows[(tier, 1)], rows[(tier, 2)]
        assert 10 * MiB <= first.logical_bytes == second.logical_bytes < 10.1 * MiB
        assert first.dedup_ratio > 0.99 and second.dedup_ratio <= 0.15, (tier, second)
    assert rows[(0, 2)].compression_ratio == 1.0 and rows[(1, 2)].compression_ratio < 0.95


def test_without_dedup_everything_is_written(tmp_path):
    cfg = two_tiers(tmp_path, dedup=False)
    ram = tmp_path / "ram" / "0"
    dcp.save(lora_state(1), storage_writer=TieredWriter(cfg, step=1))
    first = files(ram)
    dcp.save(lora_state(2), storage_writer=TieredWriter(cfg, step=2))
    settle(cfg)
    assert new_bytes(first, files(ram)) >= 10 * MiB
    assert not block_files(ram) and not block_files(tmp_path / "bucket")
    assert_equal(load(cfg, 2, lora_state(2)), lora_state(2))


def test_keep_one_over_four_steps_keeps_about_one_step(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram" / "{node}"), keep=1)], dedup=True)
    for step in range(1, 5):  # the backbone changes too: every step is new bytes
        dcp.save(lora_state(step, frozen_seed=step), storage_writer=TieredWriter(cfg, step=step))
    held = sum(size for _, size in files(tmp_path / "ram" / "0").values())
    assert 10 * MiB <= held <= 11 * MiB, held
    assert sorted(os.listdir(tmp_path / "ram" / "0" / "run")) == ["blocks", "step_000000000004"]
    assert_equal(load(cfg, 4, lora_state(4, 4)), lora_state(4, 4))


def test_writer_process_skips_blocks_the_slower_tier_holds(tmp_path):
    """The bucket already holds step 1's blocks: step 2's copy writes only the adapter's."""
    cfg = two_tiers(tmp_path)
    bucket = tmp_path / "bucket"
    dcp.save(lora_state(1), storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, timeout=60)
    before = files(bucket)
    # step 2 on the bucket only through the writer process (the RAM tier is the save path)
    dcp.save(lora_state(2), storage_writer=TieredWriter(cfg, step=2))
    wait_for(cfg, 2, timeout=60)
    after = files(bucket)
    written = {n for n in after if before.get(n, (None,))[0] != after[n][0] and "/blocks/" in n}
    assert len(written) == 1, written  # the 1 MiB adapter's one block
    assert_equal(load(TieredConfig("run", [cfg.tiers[1]]), 2, lora_state(2)), lora_state(2))


GC_CHILD = """
import sys, time
from tiered_dcp import Tier, TieredConfig
from tiered_dcp.steps.catalog import TierView
from tiered_dcp.steps.retention import apply_retention
from tiered_dcp.storage.local import LocalStorage
real = LocalStorage.delete
def slow_delete(self, key):
    real(self, key)
    if "/blocks/" in key and "GC.lease" not in key:
        print("deleted", key, flush=True)
        time.sleep(600)  # held here until the test kills it: one block deleted, whatever the pace
LocalStorage.delete = slow_delete
cfg = TieredConfig("run", [Tier(sys.argv[1], keep=1)], dedup=True)
apply_retention(TierView(cfg, 0, 0, 0), int(sys.argv[2]))
print("done", flush=True)
"""


def test_sigkill_in_the_middle_of_gc_loses_nothing_committed(tmp_path):
    root = tmp_path / "ram"
    keep_all = TieredConfig("run", [Tier(str(root))], dedup=True)
    for step in range(1, 4):  # the backbone changes at step 3: steps 1, 2 hold blocks only they use
        dcp.save(lora_state(step, frozen_seed=step // 3), storage_writer=TieredWriter(keep_all, step=step))
    child = preloaded.Popen(
        [sys.executable, "-c", GC_CHILD, str(root), "3"], stdout=subprocess.PIPE, text=True, cwd=HERE
    )
    line = child.stdout.readline()
    assert line.startswith("deleted"), line
    os.kill(child.pid, signal.SIGKILL)  # one block deleted, the others not yet
    child.wait()
    leases = glob.glob(f"{root}/run/blocks/GC.lease*")
    assert leases, "the killed GC's lease is left behind"
    assert sorted(os.listdir(root / "run")) == ["blocks", "step_000000000003"]
    cfg = TieredConfig("run", [Tier(str(root), keep=1)], dedup=True)
    assert_equal(load(cfg, 3, lora_state(3, 1)), lora_state(3, 1))
    assert all(c.ok for c in verify_step(cfg, 3))
    # the next save is not held up by the dead GC's lease, and its GC reclaims the leak
    started = time.monotonic()
    dcp.save(lora_state(4, frozen_seed=1), storage_writer=TieredWriter(cfg, step=4))
    assert time.monotonic() - started < 30
    assert not glob.glob(f"{root}/run/blocks/GC.lease*")
    assert len(block_files(root)) == 9 + 1  # step 4's: the backbone and its adapter
    assert_equal(load(cfg, 4, lora_state(4, 1)), lora_state(4, 1))


def test_flipped_byte_in_a_shared_block_is_caught_by_every_step_and_read_elsewhere(tmp_path):
    cfg = two_tiers(tmp_path)
    for step in (1, 2):
        dcp.save(lora_state(step), storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, 2, timeout=60)
    ram = tmp_path / "ram" / "0"
    shared = sorted(glob.glob(f"{ram}/run/blocks/*/*"))
    # a backbone block: used by both steps (the adapters' blocks differ)
    from tiered_dcp.storage.format import read_index
    from tiered_dcp.storage.local import LocalStorage

    store = LocalStorage(str(ram))
    used = [
        {b for r in read_index(store, "run", s, 0, 1 << 30).records.values() for b in r.blocks or ()}
        for s in (1, 2)
    ]
    common = sorted(used[0] & used[1])
    victim = next(f for f in shared if os.path.basename(f) == common[0])
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    for step in (1, 2):
        checks = {c.tier_index: c for c in verify_step(cfg, step)}
        assert not checks[0].ok and checks[1].ok, (step, checks[0].problems)
        assert_equal(load(cfg, step, lora_state(step)), lora_state(step))  # from the bucket


def _save_rows_twice(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = TieredConfig("job", [Tier(f"{root}/ram/{{node}}"), Tier(f"{root}/bucket", shared=True)], dedup=True)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256)
    for step in (1, 2):
        sd = {"w": distribute_tensor(full + (step == 2) * 0, mesh, [Shard(0)]), "step": step}
        dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, 2, timeout=60)


def _load_cols(rank, world, root, only_bucket):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = TieredConfig("job", [Tier(f"{root}/ram/{{node}}"), Tier(f"{root}/bucket", shared=True)], dedup=True)
    if only_bucket:
        cfg = TieredConfig("job", [cfg.tiers[1]], dedup=True)
    mesh = init_device_mesh("cpu", (world,))
    target = {"w": distribute_tensor(torch.zeros(512, 256), mesh, [Shard(1)]), "step": -1}
    dcp.load(target, storage_reader=TieredReader(cfg, step=2))
    full = torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256)
    assert torch.equal(target["w"].to_local(), full.chunk(world, dim=1)[rank]) and target["step"] == 2
    return True


def test_resharding_deduped_steps(tmp_path):
    run_ranks(_save_rows_twice, 4, str(tmp_path))
    assert len(block_files(tmp_path / "bucket", "job")) == 4 * 1  # four 128 KiB row shards, stored once
    run_ranks(_load_cols, 2, str(tmp_path), False, env={"LOCAL_WORLD_SIZE": 4})
    run_ranks(_load_cols, 2, str(tmp_path), True)


def test_an_unchanged_block_keeps_its_checksum_and_a_changed_one_gets_its_own():
    """The second save takes a known block's checksum from the first (hashing it once);
    whatever moved or changed, every checksum is its chunk's."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (memoryview(torch.randn(BLOCK_BYTES // 4, generator=g).numpy()).cast("B") for _ in range(3))
    small = memoryview(b"x" * 100)
    for chunks, blocked in (
        ([a, b, small], [True, True, False]),
        ([b, c, a, small], [True, True, True, False]),
    ):
        got = fingerprints(chunks, blocked, [None] * len(chunks))
        assert [p.checksum for p in got] == [checksum(x) for x in chunks]
        assert [p.block for p in got] == [
            block_id(x) if cut else None for x, cut in zip(chunks, blocked, strict=True)
        ]
    named = fingerprints([c], [True], [block_id(c)])  # the planner's id: same answer
    assert named == [(checksum(c), block_id(c), True)]


def test_a_block_the_gc_deleted_or_a_wiped_root_lost_is_written_again(tmp_path):
    """A save remembers which blocks its root holds (skipping their checks next time) only
    while no GC has deleted any and the root was not wiped."""
    cfg = TieredConfig("job", [Tier(f"{tmp_path}/ram/{{node}}", keep=2)], dedup=True)
    a, b = torch.randn(1 << 18), torch.randn(1 << 18)  # one 1 MiB block each

    def save_and_load(step: int, value: torch.Tensor) -> None:
        dcp.save({"w": value}, storage_writer=TieredWriter(cfg, step=step))
        out = {"w": torch.empty_like(value)}
        dcp.load(out, storage_reader=TieredReader(cfg, step=step))
        assert torch.equal(out["w"], value)

    save_and_load(1, a)
    shutil.rmtree(tmp_path / "ram")
    save_and_load(2, a)
    for step, value in ((3, b), (4, b), (5, a)):  # step 4's commit drops step 2 and a's block
        save_and_load(step, value)


def test_savers_leave_a_shared_roots_gc_epoch_to_its_gc(tmp_path):
    """Every rank writing the shared root's epoch at once would contend for one object."""
    cfg = TieredConfig("job", [Tier(f"{tmp_path}/bucket", shared=True, keep=1)], dedup=True)
    a, b = torch.randn(1 << 18), torch.randn(1 << 18)
    epoch = tmp_path / "bucket" / "job" / "blocks" / "GC.epoch"
    dcp.save({"w": a}, storage_writer=TieredWriter(cfg, step=1))
    assert not epoch.exists()
    dcp.save({"w": b}, storage_writer=TieredWriter(cfg, step=2))  # its GC deletes a's block
    assert epoch.exists()
    dcp.save({"w": a}, storage_writer=TieredWriter(cfg, step=3))
    out = {"w": torch.empty_like(a)}
    dcp.load(out, storage_reader=TieredReader(cfg, step=3))
    assert torch.equal(out["w"], a)
