"""DCP's own conventions: StorageMeta with a save id, and what ``checkpoint_id`` means."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal
from dist_utils import run_ranks
from torch.distributed.checkpoint.metadata import StorageMeta

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredReader, TieredWriter, latest_step, status


def sd(step: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def zeros() -> dict:
    return {"w": torch.zeros(64), "step": -1}


def local_cfg(tmp_path, every: int = 1) -> TieredConfig:
    return TieredConfig("conv", [Tier(str(tmp_path / "ram" / "{node}"), every=every)])


def steps_on(cfg: TieredConfig) -> set[int]:
    return {s.step for s in status(cfg) if s.state == "committed"}


@pytest.mark.parametrize("shared", [False, True], ids=["node-local", "shared"])
def test_storage_meta_has_a_save_id_that_the_metadata_keeps(tmp_path, shared):
    cfg = TieredConfig("conv", [Tier(str(tmp_path / "t"), shared=shared)])
    writer = TieredWriter(cfg, step=3)
    meta = writer.storage_meta()
    assert isinstance(meta, StorageMeta)
    assert meta.checkpoint_id == writer.checkpoint_id == "conv/step_000000000003"
    assert isinstance(meta.save_id, str) and len(meta.save_id) == 32
    writer.reset()
    assert writer.storage_meta().save_id != meta.save_id  # one id per save, as FileSystemWriter
    saved = dcp.save(sd(3), storage_writer=writer)
    assert saved.storage_meta.save_id == writer.save_id
    reader = TieredReader(cfg)
    md = reader.read_metadata()  # what the tier stored, with this load's id added (FileSystemReader's way)
    assert md.storage_meta.save_id == writer.save_id
    assert md.storage_meta.checkpoint_id == "conv/step_000000000003"
    assert md.storage_meta.load_id == reader.load_id and len(reader.load_id) == 32
    assert reader.checkpoint_id == "conv/step_000000000003"
    target = zeros()
    dcp.load(target, storage_reader=reader)
    assert_state_equal(target, sd(3))


@pytest.mark.parametrize("cid", [5, "5", "conv/step_000000000005"])
def test_checkpoint_id_names_the_step_to_save(tmp_path, cid):
    cfg = local_cfg(tmp_path)
    writer = TieredWriter(cfg, step=1)
    dcp.save(sd(5), checkpoint_id=cid, storage_writer=writer)
    assert steps_on(cfg) == {5} and writer.step == 5
    target = zeros()
    dcp.load(target, storage_reader=TieredReader(cfg))
    assert_state_equal(target, sd(5))


def test_one_writer_reused_across_saves_by_checkpoint_id(tmp_path):
    """DCP's idiom: one storage writer, a new checkpoint_id per save; the slower tier follows."""
    cfg = TieredConfig("conv", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"), every=2)])
    writer = TieredWriter(cfg, step=1)
    for step in (1, 2, 3):
        dcp.save(sd(step), checkpoint_id=step, storage_writer=writer)
    dcp.async_save(sd(4), checkpoint_id=4, storage_writer=writer).result()
    from tiered_dcp import wait_for

    wait_for(cfg, 4, timeout=60)
    assert steps_on(cfg) == {1, 2, 3, 4}
    for step in (1, 2, 3, 4):
        target = zeros()
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        assert_state_equal(target, sd(step))
    ssd = TieredConfig("conv", [cfg.tiers[1]])
    assert steps_on(ssd) == {2, 4}


@pytest.mark.parametrize("cid", ["/ckpt/step_5", "other/step_000000000005", "step_5", 2.5, -1])
def test_a_checkpoint_id_that_is_not_a_step_is_refused_before_any_write(tmp_path, cid):
    cfg = local_cfg(tmp_path)
    with pytest.raises(ValueError, match="checkpoint_id=.*does not name a step of namespace 'conv'"):
        dcp.save(sd(1), checkpoint_id=cid, storage_writer=TieredWriter(cfg, step=1))
    assert not (tmp_path / "ram").exists() and not os.path.exists("/ckpt/step_5")


def test_a_checkpoint_id_no_tier_takes_is_refused(tmp_path):
    cfg = local_cfg(tmp_path, every=2)
    with pytest.raises(ValueError, match="no tier takes step 3"):
        dcp.save(sd(2), checkpoint_id=3, storage_writer=TieredWriter(cfg, step=2))
    assert latest_step(cfg) is None


def test_checkpoint_id_names_the_step_to_load(tmp_path):
    cfg = local_cfg(tmp_path)
    for step in (1, 2):
        dcp.save(sd(step), storage_writer=TieredWriter(cfg, step=step))
    reader = TieredReader(cfg)
    assert reader.step == 2
    target = zeros()
    dcp.load(target, checkpoint_id="conv/step_000000000001", storage_reader=reader)
    assert reader.step == 1
    assert_state_equal(target, sd(1))
    with pytest.raises(NoCheckpointError, match="step 7 of namespace 'conv' is not complete"):
        dcp.load(zeros(), checkpoint_id=7, storage_reader=reader)
    with pytest.raises(ValueError, match="does not name a step"):
        dcp.load(zeros(), checkpoint_id=str(tmp_path / "ram"), storage_reader=TieredReader(cfg))


def _load_by_checkpoint_id(rank, world, root):
    cfg = TieredConfig("conv", [Tier(f"{root}/ram/{{node}}")])
    for step in (1, 2):
        dcp.save(
            {"w": torch.full((4,), float(step + rank)), "step": step}, storage_writer=TieredWriter(cfg, step)
        )
    reader = TieredReader(cfg)
    target = {"w": torch.zeros(4), "step": -1}
    dcp.load(target, checkpoint_id=1, storage_reader=reader)  # chosen again, agreed by both ranks
    return reader.step, target["step"], target["w"].tolist()


def test_checkpoint_id_at_load_is_agreed_by_every_rank(tmp_path):
    results = run_ranks(_load_by_checkpoint_id, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})
    # "w" is saved as replicated (same fqn, no sharding): rank 0's copy is the one stored
    assert results == [(1, 1, [1.0] * 4), (1, 1, [1.0] * 4)]
