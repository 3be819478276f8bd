"""Save/load in one process (no process group): values, schedule, retention, damage."""

import dataclasses
import glob
import json
import os

import pytest
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, settle, value_kinds, zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import (
    CheckpointCorruptError,
    NoCheckpointError,
    Tier,
    TieredConfig,
    TieredReader,
    TieredWriter,
    latest_step,
    status,
)
from tiered_dcp.steps.status import StepStatus


def save(cfg, step, sd=None):
    dcp.save(sd if sd is not None else value_kinds(step), storage_writer=TieredWriter(cfg, step=step))


def load(cfg, step=None):
    target = zeros_like_state(value_kinds(0))
    reader = TieredReader(cfg, step=step)
    dcp.load(target, storage_reader=reader)
    return reader, target


def flip_byte(path, where=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(int(size * where))
        b = f.read(1)
        f.seek(int(size * where))
        f.write(bytes([b[0] ^ 0x5A]))


def cause(exc: CheckpointException) -> BaseException:
    """The original exception DCP recorded (it keeps (exception, traceback) per rank)."""
    failure = next(iter(exc.failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


@pytest.mark.parametrize("kind", ["ram", "zstd-shared", "fsspec-memory", "fsspec-file"])
def test_roundtrip_every_value_kind(tmp_path, kind):
    tier = {
        "ram": Tier(str(tmp_path / "{node}")),
        "zstd-shared": Tier(str(tmp_path / "b"), compression="zstd", shared=True),
        "fsspec-memory": Tier(f"memory://rt-{os.getpid()}-{tmp_path.name}"),
        "fsspec-file": Tier(f"file://{tmp_path}/f"),
    }[kind]
    cfg = TieredConfig("run", [tier])
    save(cfg, 3)
    reader, got = load(cfg)
    assert reader.step == 3
    assert_state_equal(got, value_kinds(3))


def test_schedule_retention_newest_and_named(tiers3):
    for step in range(10):
        save(tiers3, step)
    settle(tiers3)
    held = {}
    for row in status(tiers3):
        assert row.state == "committed"
        held.setdefault(row.tier_index, []).append(row.step)
    assert held == {0: [8, 9], 1: [4, 6, 8], 2: [0, 4, 8]}
    assert latest_step(tiers3) == 9
    reader, got = load(tiers3)
    assert (reader.step, reader.tiers) == (9, [0])
    assert_state_equal(got, value_kinds(9))
    reader, got = load(tiers3, step=4)
    assert reader.tiers == [1, 2]  # RAM no longer holds it: the SSD copy is read
    assert_state_equal(got, value_kinds(4))
    reader, got = load(tiers3, step=0)
    assert reader.tiers == [2]
    assert_state_equal(got, value_kinds(0))


def test_missing_step_names_every_tier(tiers3, tmp_path):
    with pytest.raises(NoCheckpointError) as e:
        TieredReader(tiers3)
    for sub in ("ram/0/run", "ssd/0/run", "bucket/run"):
        assert str(tmp_path / sub) in str(e.value)
    assert latest_step(tiers3) is None
    save(tiers3, 2)
    with pytest.raises(NoCheckpointError, match="step 3 of namespace 'run' is not complete"):
        TieredReader(tiers3, step=3)


def test_deleted_data_file_falls_back_to_previous_step(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"), keep=3)])
    for step in range(3):
        save(cfg, step)
    (part,) = glob.glob(str(tmp_path / "ram/run/step_000000000002/rank_*.part"))
    os.remove(part)
    assert latest_step(cfg) == 1
    rows = status(cfg)
    assert [r.state for r in rows] == ["committed", "committed", "damaged"]  # a user's strings still match
    assert [r.state for r in rows] == [StepStatus.COMMITTED, StepStatus.COMMITTED, StepStatus.DAMAGED]
    assert all(type(r.state) is StepStatus for r in rows)  # an enum, printed and written as before:
    assert f"{rows[2].state} {rows[2].state!s}" == "damaged damaged"
    assert json.loads(json.dumps(dataclasses.asdict(rows[2])))["state"] == "damaged"
    reader, got = load(cfg)
    assert reader.step == 1
    assert_state_equal(got, value_kinds(1))
    with pytest.raises(NoCheckpointError, match="committed but damaged \\(a file missing\\): \\[2\\]"):
        TieredReader(cfg, step=2)


def test_flipped_bytes_fall_back_to_another_tier(tiers3, tmp_path, caplog):
    save(tiers3, 4)
    settle(tiers3)
    (part,) = glob.glob(str(tmp_path / "ram/0/run/step_000000000004/rank_*.part"))
    flip_byte(part)
    reader, got = load(tiers3)
    assert_state_equal(got, value_kinds(4))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(part in w and "damaged" in w for w in warnings), warnings


def test_flipped_bytes_without_good_copy_raise_corrupt(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    save(cfg, 1)
    (part,) = glob.glob(str(tmp_path / "ram/run/step_000000000001/rank_*.part"))
    flip_byte(part, 0.9)  # inside nested.big, the largest item
    target = zeros_like_state(value_kinds(0))
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=TieredReader(cfg))
    err = cause(e.value)
    assert isinstance(err, CheckpointCorruptError)
    assert part in str(err) and "nested.big" in str(err)


def test_damaged_metadata_uses_another_tier(tiers3, tmp_path, caplog):
    save(tiers3, 4)
    settle(tiers3)
    md = tmp_path / "ram/0/run/step_000000000004/metadata"
    flip_byte(md)
    reader, got = load(tiers3)
    assert_state_equal(got, value_kinds(4))
    assert any(str(md) in r.getMessage() for r in caplog.records)


def test_uncommitted_step_is_never_chosen_and_is_cleaned_up(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"), keep=2)])
    save(cfg, 1)
    save(cfg, 2)
    os.remove(tmp_path / "ram/run/step_000000000002/COMMITTED")  # as if killed before commit
    assert latest_step(cfg) == 1
    assert [(r.step, r.state) for r in status(cfg)] == [(1, "committed"), (2, "clean")]
    save(cfg, 3)
    assert [(r.step, r.state) for r in status(cfg)] == [(1, "committed"), (3, "committed")]


def test_retention_keeps_complete_steps_not_damaged_ones(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"), keep=2)])
    for step in (1, 2, 5):
        save(cfg, step)
    (part,) = glob.glob(str(tmp_path / "ram/run/step_000000000005/rank_*.part"))
    os.remove(part)  # step 5 is committed but can no longer be loaded
    save(cfg, 3)  # e.g. the job resumed from step 2
    complete = [r.step for r in status(cfg) if r.state == "committed"]
    assert complete == [2, 3]  # keep=2 good steps; the damaged one does not take a slot
