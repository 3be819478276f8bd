"""Checkpoints written by older versions (format 1, format 2) still load, exactly, and verify.

The data under tests/data/ was written by those versions' own code (see
``legacy_checkpoints``); each test works on a copy in tmp_path.
"""

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state
from dist_utils import run_ranks
from legacy_checkpoints import NAMESPACE, config, full_state, rank_state

from tiered_dcp import TieredConfig, TieredReader, latest_step
from tiered_dcp.cli.main import main as cli_main
from tiered_dcp.ops.verify import verify_step

DATA = os.path.join(os.path.dirname(__file__), "data")
FORMATS = [1, 2]


def copy_of(fmt: int, tmp_path) -> str:
    root = str(tmp_path / f"format{fmt}")
    shutil.copytree(os.path.join(DATA, f"format{fmt}"), root)
    return root


def only(cfg: TieredConfig, index: int) -> TieredConfig:
    return TieredConfig(cfg.namespace, [cfg.tiers[index]])


def load_full(cfg: TieredConfig, step: int) -> dict:
    target = zeros_like_state(full_state(step))
    dcp.load(target, storage_reader=TieredReader(cfg, step=step))
    return target


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_step_loads_exactly_from_every_tier(fmt, tmp_path):
    cfg = config(copy_of(fmt, tmp_path), fmt)
    assert latest_step(cfg) == 2
    for tier, steps in ((0, [2]), (1, [1, 2])):
        for step in steps:
            assert_state_equal(load_full(only(cfg, tier), step), full_state(step))


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_finds_every_item_intact(fmt, tmp_path, capsys):
    root = copy_of(fmt, tmp_path)
    cfg = config(root, fmt)
    for step, tiers in ((1, [1]), (2, [0, 1])):
        checks = verify_step(cfg, step)
        assert [c.tier_index for c in checks] == tiers
        for c in checks:
            assert c.ok, c.problems
            assert c.items == 11 and c.bytes_read > 0
    tiers = [t.path for t in cfg.tiers]
    assert cli_main(["verify", "-n", NAMESPACE, "--step", "2", *tiers]) == 0
    assert "DAMAGED" not in capsys.readouterr().out


@pytest.mark.parametrize("fmt", FORMATS)
def test_damage_in_a_legacy_step_is_found_and_read_around(fmt, tmp_path):
    root = copy_of(fmt, tmp_path)
    cfg = config(root, fmt)
    part = os.path.join(root, "ram", "1", NAMESPACE, "step_000000000002", "rank_00001.part")
    with open(part, "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0xFF]))
    (ram, bucket) = verify_step(cfg, 2)
    assert not ram.ok and bucket.ok
    # the damaged items come from another copy
    assert_state_equal(load_full(cfg, 2), full_state(2))


def _load_on_two_ranks(rank, world, root, fmt):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    cfg = config(root, fmt)
    expected = rank_state(2, rank, mesh)
    target = zeros_like_state(expected)
    target["dt"] = rank_state(0, rank, mesh)["dt"]  # a DTensor of zeros, same sharding
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    assert reader.step == 2 and reader.tiers[0] == 0
    assert torch.equal(target["dt"].to_local(), expected["dt"].to_local())
    target["dt"], expected["dt"] = target["dt"].to_local(), expected["dt"].to_local()
    assert_state_equal(target, expected)
    return True


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_ranks_load_a_legacy_step_into_dtensors(fmt, tmp_path):
    root = copy_of(fmt, tmp_path)
    assert run_ranks(_load_on_two_ranks, 2, root, fmt, env={"LOCAL_WORLD_SIZE": 1}) == [True, True]
