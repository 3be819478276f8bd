"""A checkpoint cannot carry code: whoever can write a tier cannot make a loading rank run theirs.

The step's metadata is unpickled admitting only DCP's metadata classes; part indexes are
JSON (format 2's pickles are read with an allowlist); a user's non-tensor values must load
with ``weights_only=True``. Anything else is refused, named, and another copy is read.
Each crafted file here would touch a marker file if it ran.
"""

import glob
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, settle, value_kinds, zeros_like_state
from dist_utils import run_ranks
from test_save_load import cause, load, save
from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import ItemInfo, Record
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import (
    CheckpointCorruptError,
    NoCheckpointError,
    Tier,
    TieredConfig,
    TieredReader,
    TieredWriter,
)
from tiered_dcp.load.peer_exchange import PeerRequest
from tiered_dcp.steps.metadata import item_key, records_from_json, records_to_json

HERE = os.path.dirname(__file__)
STEP = "run/step_000000000004"


class Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


FORBIDDEN = f"{os.system.__module__}.system"  # posix.system


def two_tiers(tmp_path) -> TieredConfig:
    return TieredConfig("run", [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "bucket"), shared=True)])


def plant_metadata(step_dir, marker) -> str:
    """Replace the step's metadata with a crafted pickle, and rewrite the marker to match."""
    blob = pickle.dumps(Payload(marker))
    md = os.path.join(step_dir, "metadata")
    with open(md, "wb") as f:
        f.write(blob)
    committed = os.path.join(step_dir, "COMMITTED")
    with open(committed) as f:
        doc = json.load(f)
    doc.update(metadata_size=len(blob), metadata_xxh3=checksum(blob))
    with open(committed, "w") as f:
        json.dump(doc, f)
    return md


def plant_indexes(step_dir, marker) -> list[str]:
    out = []
    for index in glob.glob(os.path.join(step_dir, "rank_*.index")):
        with open(index, "wb") as f:
            f.write(pickle.dumps({"x": Payload(marker)}))
        out.append(index)
    assert out
    return out


def warnings_of(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_crafted_metadata_runs_nothing_is_reported_and_another_tier_is_used(tmp_path, caplog):
    cfg = two_tiers(tmp_path)
    save(cfg, 4)
    settle(cfg)
    marker = tmp_path / "pwned"
    md = plant_metadata(tmp_path / "ram" / STEP, marker)
    reader, got = load(cfg)
    assert_state_equal(got, value_kinds(4))
    assert not marker.exists()
    assert re.search(rf"{re.escape(md)}: metadata refused: forbidden global {FORBIDDEN}", warnings_of(caplog))


def test_crafted_metadata_without_another_copy_raises_corrupt_naming_file_and_global(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    save(cfg, 4)
    marker = tmp_path / "pwned"
    md = plant_metadata(tmp_path / "ram" / STEP, marker)
    with pytest.raises(CheckpointCorruptError) as e:
        TieredReader(cfg)
    assert md in str(e.value) and FORBIDDEN in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("metadata_too", [False, True], ids=["indexes", "indexes-and-metadata"])
def test_crafted_indexes_run_nothing_are_reported_and_another_tier_is_used(tmp_path, caplog, metadata_too):
    cfg = two_tiers(tmp_path)
    save(cfg, 4)
    settle(cfg)
    marker = tmp_path / "pwned"
    if metadata_too:
        plant_metadata(tmp_path / "ram" / STEP, marker)
    indexes = plant_indexes(tmp_path / "ram" / STEP, marker)
    reader, got = load(cfg)
    assert_state_equal(got, value_kinds(4))
    assert reader.tiers == [1]  # the fast tier's copy is not whole any more
    assert not marker.exists()
    for index in indexes:
        assert re.search(rf"{re.escape(index)}: .*forbidden global: {FORBIDDEN}", warnings_of(caplog))


def test_crafted_metadata_and_indexes_on_the_only_tier_run_nothing(tmp_path, caplog):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    save(cfg, 4)
    marker = tmp_path / "pwned"
    plant_metadata(tmp_path / "ram" / STEP, marker)
    indexes = plant_indexes(tmp_path / "ram" / STEP, marker)
    with pytest.raises(NoCheckpointError):
        TieredReader(cfg)
    assert not marker.exists()
    assert indexes[0] in warnings_of(caplog)


def test_a_non_tensor_value_that_would_run_code_is_refused_and_another_copy_used(tmp_path, caplog):
    """A value is data only if torch.load(weights_only=True) takes it; DCP's planner would run it."""
    cfg = two_tiers(tmp_path)
    honest = {"w": torch.arange(5.0), "cfg": "lr=0.1"}
    dcp.save(honest, storage_writer=TieredWriter(cfg, step=4))
    settle(cfg)
    marker = tmp_path / "pwned"
    ram_only = TieredConfig("run", [cfg.tiers[0]])
    crafted = {"w": torch.arange(5.0), "cfg": Payload(marker)}  # what a writer of the tier could store
    dcp.save(crafted, storage_writer=TieredWriter(ram_only, step=4))

    target = {"w": torch.zeros(5), "cfg": None}
    dcp.load(target, storage_reader=TieredReader(cfg, step=4))
    assert target["cfg"] == "lr=0.1" and torch.equal(target["w"], honest["w"])
    assert not marker.exists()
    assert re.search(
        r"ram/run/step_000000000004/rank_00000\.part.*refused.*weights_only=True", warnings_of(caplog)
    )
    assert FORBIDDEN in warnings_of(caplog)

    with pytest.raises(CheckpointException) as e:  # the crafted copy alone: refused, named
        dcp.load({"w": torch.zeros(5), "cfg": None}, storage_reader=TieredReader(ram_only, step=4))
    err = cause(e.value)
    assert isinstance(err, CheckpointCorruptError) and "'cfg'" in str(err) and FORBIDDEN in str(err)
    assert not marker.exists()


@pytest.mark.parametrize("fmt", [1, 2])
def test_the_load_path_never_calls_plain_pickle(tmp_path, monkeypatch, fmt):
    """Old checkpoints (format 1/2: pickled metadata, format 2 pickled indexes) and new ones
    load with pickle.load and pickle.loads unusable: only the restricted unpicklers read them."""
    from legacy_checkpoints import config, full_state

    root = str(tmp_path / f"format{fmt}")
    shutil.copytree(os.path.join(HERE, "data", f"format{fmt}"), root)
    legacy = config(root, fmt)
    cfg = two_tiers(tmp_path)
    save(cfg, 4)
    settle(cfg)

    def refuse(*a, **k):
        raise AssertionError("plain pickle used on the load path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    target = zeros_like_state(full_state(2))
    dcp.load(target, storage_reader=TieredReader(legacy, step=2))
    assert_state_equal(target, full_state(2))
    reader, got = load(cfg)
    assert_state_equal(got, value_kinds(4))


def test_no_module_of_ours_calls_plain_pickle_load():
    sources = glob.glob(os.path.join(HERE, "..", "tiered_dcp", "*.py"))
    sources += glob.glob(os.path.join(HERE, "..", "storage", "*.py"))
    sources += glob.glob(os.path.join(HERE, "..", "planners", "*.py"))
    assert len(sources) > 20
    offenders = [s for s in sources if re.search(r"pickle\.loads?\(", Path(s).read_text())]
    assert offenders == []


def test_what_ranks_exchange_through_the_store_is_plain_data():
    """Records and peer requests travel as JSON: the store is not authenticated."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    idx = MetadataIndex("a.b", torch.Size([4, 0]), 3)
    info = ItemInfo(0, "tensor", ((64, 123),), "torch.float32", (4, 4))
    rec = Record("run/step_000000000001/rank_00000.part", 8, "zstd", (5,), info)
    small = Record("f", 0, "raw", (3,), ItemInfo(0, "bytes", ((3, 9),)))
    raw = records_to_json({idx: rec, MetadataIndex("n"): small})
    assert raw[:1] == b"["
    back = records_from_json(raw)
    assert back == {idx: rec, MetadataIndex("n"): small}
    (k,) = [k for k in back if k.fqn == "a.b"]
    assert k.offset == torch.Size([4, 0]) and item_key(k) == item_key(idx)
    req = PeerRequest(1, 2, idx, 64, (32, 32))
    assert PeerRequest.from_json(json.loads(json.dumps(req.to_json()))) == req


def _cluster_config(root: str) -> TieredConfig:
    return TieredConfig(
        "job",
        [Tier(f"{root}/ram/{{node}}"), Tier(f"{root}/bucket", shared=True)],
        replication_factor=2,
    )


def _save_cluster(rank, world, root):
    dcp.save(
        {"w": torch.arange(8.0), "n": "honest"},
        storage_writer=TieredWriter(_cluster_config(root), step=3),
    )


def _load_cluster(rank, world, root):
    captured = []
    handler = type("H", (logging.Handler,), {"emit": lambda self, r: captured.append(r.getMessage())})()
    logging.getLogger("tiered_dcp").addHandler(handler)
    reader = TieredReader(_cluster_config(root))
    target = {"w": torch.zeros(8), "n": ""}
    dcp.load(target, storage_reader=reader)
    return reader.step, reader.tiers, target["w"].tolist(), target["n"], captured


def test_crafted_metadata_on_every_node_falls_back_to_the_shared_tier(tmp_path):
    """Node-local copies pooled over the ranks: a refused metadata blob (the same on both nodes,
    so the cluster agrees on it) is named, nothing runs, and the shared tier's copy is loaded."""
    root = str(tmp_path)
    run_ranks(_save_cluster, 2, root, env={"LOCAL_WORLD_SIZE": 1})
    settle(_cluster_config(root))
    marker = tmp_path / "pwned"
    for node in (0, 1):
        plant_metadata(tmp_path / f"ram/{node}/job/step_000000000003", marker)
    results = run_ranks(_load_cluster, 2, root, env={"LOCAL_WORLD_SIZE": 1})
    assert not marker.exists()
    for step, tiers, w, n, lines in results:
        assert (step, tiers, w, n) == (3, [1], list(range(8)), "honest")
        assert any(f"forbidden global {FORBIDDEN}" in ln and "ram/0/job" in ln for ln in lines), lines
