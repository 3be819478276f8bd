"""A step written under torch 2.15 (whose metadata pickles TensorProperties.strides) loads,
exports and verifies under the torch running the tests (CI: 2.13, which cannot unpickle
that field on its own)."""

import dataclasses
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
from torch215_checkpoint import STEP, config, state

from tiered_dcp import TieredConfig, TieredReader, export
from tiered_dcp.ops.verify import verify_step

DATA = os.path.join(os.path.dirname(__file__), "data", "torch215")
KNOWS_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


@pytest.fixture
def root(tmp_path) -> str:
    root = str(tmp_path / "torch215")
    shutil.copytree(DATA, root)
    return root


def only(cfg: TieredConfig, index: int) -> TieredConfig:
    return TieredConfig(cfg.namespace, [cfg.tiers[index]])


def test_the_data_holds_strides_that_older_torch_refuses(root):
    with open(f"{root}/ram/0/t215/step_{STEP:012d}/metadata", "rb") as f:
        blob = f.read()
    if KNOWS_STRIDES:
        md = pickle.loads(blob)
        assert md.state_dict_metadata["transposed"].properties.strides == (1, 4)
    else:
        with pytest.raises(ValueError, match="too many values to unpack"):
            pickle.loads(blob)


@pytest.mark.parametrize("tier", [0, 1], ids=["ram", "bucket-zstd"])
def test_a_step_written_by_torch_215_loads_exactly(root, tier):
    target = zeros_like_state(state())
    target["transposed"] = torch.zeros(4, 3, dtype=torch.float64)
    reader = TieredReader(only(config(root), tier), step=STEP)
    md = reader.read_metadata()
    props = md.state_dict_metadata["transposed"]
    assert isinstance(props, TensorStorageMetadata) and type(props.properties) is TensorProperties
    dcp.load(target, storage_reader=reader)
    assert_state_equal(target, state() | {"transposed": state()["transposed"].contiguous()})


def test_a_step_written_by_torch_215_exports_and_verifies(root, tmp_path):
    cfg = config(root)
    assert all(check.ok for check in verify_step(cfg, STEP))
    dest = export(cfg, STEP, tmp_path / "stock")
    target = zeros_like_state(state())
    target["transposed"] = torch.zeros(4, 3, dtype=torch.float64)
    dcp.load(target, storage_reader=dcp.FileSystemReader(dest))  # torch's own reader, this torch
    assert torch.equal(target["transposed"], state()["transposed"])
    assert target["nested"]["ids"] == [3, "three"]
