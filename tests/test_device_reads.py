"""The device load flow (``device_reads``) on a machine without a GPU.

A CUDA target is read chunk by chunk through a bounded ring of pinned host slots, checked,
then copied to the device. Here the same ring, reads, checks and commits run with a
``HostCopier`` (the device copy is a host copy), put in place of CUDA's by the reader's
``ring_for``: exactness for every kind of record and tier, the pieces of a resharded read,
the ring's bound, the plan's commit order, and the fall-back past a flipped byte. The copy
to the device itself is checked in ``tests/gpu/``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiered_dcp.storage.codec import CHUNK_BYTES
from tiered_dcp.storage.format import part_key, read_index
from tiered_dcp.storage.local import LocalStorage
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tiered_dcp import CheckpointCorruptError, Tier, TieredConfig, TieredReader, TieredWriter, shutdown
from tiered_dcp.load.device_reads import HostCopier, Ring

MiB = 1 << 20


class OrderedCopier(HostCopier):
    """A host copy that keeps where each copy went (to check what crossed to the 'device')."""

    def __init__(self) -> None:
        self.copied = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copied += src.numel()
        dst.copy_(src)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(5 * CHUNK_BYTES // 4 // 2, generator=g),  # 2.5 chunks
        "rows": torch.randn(3000, 1024, generator=g),  # 12 MiB: 2 chunks
        "bf16": torch.randn(1000, 513, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 40, (4097,), generator=g),
        "scalar": torch.tensor(3.5 + step),
        "empty": torch.empty(0, 5),
        "value": {"lr": 0.1 * step, "name": "run"},
    }


def zeros_like(s: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
    out["value"] = {"lr": -1.0, "name": ""}
    return out


def load_through_ring(cfg: TieredConfig, target: dict, ring: Ring, step: int | None = None) -> TieredReader:
    reader = TieredReader(cfg, step)
    reader._reads.ring_for = lambda device: ring
    dcp.load(target, storage_reader=reader)
    return reader


def assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_item_loads_exactly_through_a_bounded_ring(tmp_path, compression):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"), compression=compression)])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    ring = Ring(OrderedCopier(), slots=2)
    got = zeros_like(want)
    load_through_ring(cfg, got, ring)
    assert_same(got, want)
    assert ring.peak <= 2 and ring.held == 0  # never more than the ring, every slot given back
    tensor_bytes = sum(v.numel() * v.element_size() for v in want.values() if isinstance(v, torch.Tensor))
    assert ring.copier.copied == tensor_bytes  # each byte crossed once
    shutdown()


def test_dedup_blocks_and_a_slower_tier_load_exactly_through_the_ring(tmp_path):
    cfg = TieredConfig(
        "run",
        [Tier(str(tmp_path / "ram/{node}"), every=1, keep=1), Tier(str(tmp_path / "ssd/{node}"))],
        dedup=True,
    )
    for step in (1, 2):
        dcp.save(state(step), storage_writer=TieredWriter(cfg, step=step))
    shutdown()
    ring = Ring(HostCopier(), slots=3)
    got = zeros_like(state(0))
    reader = load_through_ring(cfg, got, ring, step=1)  # step 1 left the RAM tier: the dedup tier's
    assert reader.tiers == [1]
    assert_same(got, state(1))


def test_a_target_of_another_dtype_or_layout_is_converted_after_the_ring(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"))])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    got = {
        "rows": torch.zeros(1024, 3000).t(),  # not contiguous
        "bf16": torch.zeros(1000, 513),  # float32 target of a bf16 item
        "scalar": torch.tensor(0.0, dtype=torch.float64),  # a scalar, converted
    }
    load_through_ring(cfg, got, Ring(HostCopier(), slots=2))
    assert torch.equal(got["rows"], want["rows"])
    assert torch.equal(got["bf16"], want["bf16"].float())
    assert got["scalar"].dtype == torch.float64 and got["scalar"].item() == want["scalar"].item()
    shutdown()


def test_a_converted_target_on_the_host_path_is_exact(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"))])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    got = {"rows": torch.zeros(1024, 3000).t(), "scalar": torch.tensor(0.0, dtype=torch.float64)}
    dcp.load(got, storage_reader=TieredReader(cfg))
    assert torch.equal(got["rows"], want["rows"])
    assert got["scalar"].item() == want["scalar"].item()
    shutdown()


class PiecePlanner(DefaultLoadPlanner):
    """A load plan of pieces of one stored item, as a resharded target asks (FSDP's rows,
    a tensor-parallel split's columns); commits are kept in order."""

    def __init__(self, fqn: str, pieces: list[tuple[list[int], list[int]]], dtype: torch.dtype) -> None:
        super().__init__()
        self.fqn, self.pieces = fqn, pieces
        self.targets = [torch.zeros(lengths, dtype=dtype) for _, lengths in pieces]
        self.committed: list[int] = []

    def plan(self) -> LoadPlan:
        items = []
        for i, (offsets, lengths) in enumerate(self.pieces):
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(f"piece{i}", [0] * len(offsets), i),
                    dest_offsets=torch.Size([0] * len(offsets)),
                    storage_index=MetadataIndex(self.fqn, [0] * len(offsets)),
                    storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths),
                )
            )
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.targets[read_item.dest_index.index]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.index)


def test_a_piece_of_an_item_reads_only_its_rows_and_copies_only_its_bytes(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"))])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    pieces = [
        ([2900, 0], [100, 1024]),  # rows in the last chunk only
        ([1000, 0], [1500, 1024]),  # rows across the chunk boundary
        ([0, 512], [3000, 256]),  # columns: every row read, a quarter of them kept
    ]
    copier = OrderedCopier()
    reader = TieredReader(cfg)
    reader._reads.ring_for = lambda device: Ring(copier, slots=2)
    planner = PiecePlanner("rows", pieces, torch.float32)
    reader.read_metadata()
    reader.read_data(planner.plan(), planner).wait()
    for target, (offsets, lengths) in zip(planner.targets, pieces, strict=True):
        assert torch.equal(target, want["rows"][offsets[0] :][: lengths[0], offsets[1] :][:, : lengths[1]])
    assert planner.committed == [0, 1, 2]  # in plan order, whatever finished first
    assert copier.copied == (100 + 1500 + 3000) * 1024 * 4  # rows asked for, no more
    shutdown()


def test_a_piece_read_on_the_host_path_is_exact(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"), compression="zstd")])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    pieces = [([2900, 0], [100, 1024]), ([1000, 512], [1500, 512])]
    planner = PiecePlanner("rows", pieces, torch.float32)
    reader = TieredReader(cfg)
    reader.read_metadata()
    reader.read_data(planner.plan(), planner).wait()
    for target, (offsets, lengths) in zip(planner.targets, pieces, strict=True):
        assert torch.equal(target, want["rows"][offsets[0] :][: lengths[0], offsets[1] :][:, : lengths[1]])
    shutdown()


def flip_in(root: Path, step: int, fqn: str, at: int) -> str:
    """Flip a byte ``at`` bytes into item ``fqn`` of rank 0's part file under ``root``."""
    index = read_index(LocalStorage(str(root)), "run", step, 0, 1 << 30)
    rec = next(r for k, r in index.records.items() if k.fqn == fqn)
    path = root / part_key("run", step, 0)
    with open(path, "r+b") as f:
        f.seek(rec.offset + at)
        byte = f.read(1)
        f.seek(rec.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return str(path)


def test_a_flipped_byte_falls_back_to_the_next_tier_and_commits_nothing_damaged(tmp_path, caplog):
    cfg = TieredConfig(
        "run", [Tier(str(tmp_path / "ram/{node}"), every=1), Tier(str(tmp_path / "ssd/{node}"), every=1)]
    )
    want = state(2)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=2))
    shutdown()
    bad = flip_in(tmp_path / "ram/0", 2, "big", CHUNK_BYTES + 7)  # the second of three chunks
    got = zeros_like(want)
    ring = Ring(HostCopier(), slots=2)
    with caplog.at_level(logging.WARNING, logger="tiered_dcp"):
        reader = load_through_ring(cfg, got, ring)
    assert_same(got, want)
    assert bad in caplog.text and "trying another copy" in caplog.text
    assert [f.kind.name for fs in reader._reads.failures.values() for f in fs] == ["DAMAGED"]
    assert ring.held == 0


def test_a_flipped_byte_with_no_other_copy_fails_the_load(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram/{node}"))])
    dcp.save(state(1), storage_writer=TieredWriter(cfg, step=1))
    shutdown()
    flip_in(tmp_path / "ram/0", 1, "rows", 5)
    ring = Ring(HostCopier(), slots=2)
    with pytest.raises(CheckpointException) as info:
        load_through_ring(cfg, zeros_like(state(1)), ring)
    err = next(iter(info.value.failures.values()))
    err = err[0] if isinstance(err, tuple) else err  # torch >= 2.7: (exception, traceback)
    assert isinstance(err, CheckpointCorruptError) and "no good copy of item 'rows'" in str(err)
    assert ring.held == 0  # every chunk settled before the error


def test_a_bucket_tier_streams_through_the_ring(bucket):
    """A shared tier on a real server (gs:// and s3://), compressed: each chunk a ranged read."""
    tier = Tier(bucket.url, compression="zstd", shared=True, storage_options=bucket.storage_options)
    cfg = TieredConfig("run", [tier])
    want = state(1)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    ring = Ring(HostCopier(), slots=2)
    got = zeros_like(want)
    load_through_ring(cfg, got, ring)
    assert_same(got, want)
    assert ring.held == 0
    shutdown()
