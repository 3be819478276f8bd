"""The format module: names, records, markers and per-part indexes, on real files."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiered_dcp.storage.format import (
    FORMAT_VERSION,
    BadIndex,
    IndexCache,
    ItemInfo,
    ItemKey,
    Marker,
    PartIndex,
    PartInfo,
    Record,
    index_key,
    is_pin,
    marker_key,
    metadata_key,
    parse_step_dir,
    part_key,
    pin_key,
    read_index,
    step_dir,
    write_index,
)
from tiered_dcp.storage.local import LocalStorage

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter
from tiered_dcp.verify import verify_step

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_every_name_of_the_layout():
    assert step_dir("run", 12) == "run/step_000000000012"
    assert part_key("run", 12, 3) == "run/step_000000000012/rank_00003.part"
    assert index_key("run", 12, 3) == "run/step_000000000012/rank_00003.index"
    assert pin_key("run", 12, 3, 2) == "run/step_000000000012/pin.rank_00003.t02"
    assert metadata_key("run", 12) == "run/step_000000000012/metadata"
    assert marker_key("run", 12) == "run/step_000000000012/COMMITTED"
    assert parse_step_dir("step_000000000012") == 12
    assert [parse_step_dir(n) for n in ("step_", "step_12a", "rank_00001.part", "x")] == [None] * 4
    assert is_pin("pin.rank_00003.t02") and not is_pin("rank_00003.part")


def _record(**kw) -> Record:
    base = {
        "file": "run/step_000000000001/rank_00001.part",
        "offset": 64,
        "codec": "zstd",
        "chunks": ((10, 100, 2**64 - 1), (5, 20, 7)),
        "rank": 1,
        "kind": "tensor",
        "dtype": "torch.float32",
        "shape": (5, 6),
    }
    return Record(**{**base, **kw})


def test_record_round_trips_through_json():
    rec = _record()
    assert (rec.length, rec.raw_length, rec.raw_chunks) == (15, 120, ((100, 2**64 - 1), (20, 7)))
    assert Record.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    as_bytes = _record(kind="bytes", dtype=None, shape=None)
    assert "dtype" not in as_bytes.to_dict()
    assert Record.from_dict(json.loads(json.dumps(as_bytes.to_dict()))) == as_bytes
    info = rec.info()
    assert info == ItemInfo(1, "tensor", ((100, 2**64 - 1), (20, 7)), "torch.float32", (5, 6))
    assert ItemInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert info.raw_length == rec.raw_length


# An index as this version writes it (blocks, codecs, a non-finite item, a bytes item): the
# layout on storage, key order included, must not change with the classes that read it.
TODAYS_INDEX = (
    b'{"format":3,"rank":1,"size":67,"items":[{"key":["model.w",[0,0],0],"file":"run/blocks",'
    b'"offset":0,"codec":"zstd-bg2","chunks":[[10,100,18446744073709551615],[5,20,7]],"rank":1,'
    b'"kind":"tensor","dtype":"torch.bfloat16","shape":[5,6],"blocks":["00000000000000000000000000000000",'
    b'"ffffffffffffffffffffffffffffffff"],"codecs":["zstd-bg2","zstd"],"nonfinite":true},'
    b'{"key":["extra",null,null],"file":"run/step_000000000001/rank_00001.part","offset":64,'
    b'"codec":"raw","chunks":[[3,3,9]],"rank":1,"kind":"bytes"}],"written":90}'
)


def test_todays_index_reads_into_records_and_back_byte_for_byte():
    index = PartIndex.from_bytes(TODAYS_INDEX, "run", 1, 1)
    assert index.to_bytes() == TODAYS_INDEX
    assert (index.size, index.written, index.stored_bytes, index.logical_bytes) == (67, 90, 18, 123)


def test_legacy_record_dicts_name_their_file_relative_to_the_step():
    old = {
        "file": "rank_00001.part",
        "offset": 64,
        "length": 15,
        "codec": "zstd",
        "rank": 1,
        "kind": "tensor",
    }
    old.update(chunks=[[10, 100, 2**64 - 1], [5, 20, 7]], dtype="torch.float32", shape=[5, 6])
    assert Record.from_dict(old, "run/step_000000000001") == _record()
    assert ItemInfo.from_dict(old) == _record().info()  # format 1/2 metadata held full records


def test_item_key_compares_like_metadata_index():
    a, b = ItemKey("w", (0, 4), 0), ItemKey("w", (0, 4), 3)
    assert a == b and hash(a) == hash(b)  # ``index`` is a lookup hint, as in DCP
    assert ItemKey("w", (0, 4)) != ItemKey("w", (4, 0)) != ItemKey("w")
    assert ItemKey.from_json(json.loads(json.dumps(a.to_json()))) == a
    assert ItemKey.from_json(ItemKey("x").to_json()) == ItemKey("x", None, None)


def test_marker_round_trip_and_formats():
    m = Marker(5, "run", 2, [PartInfo(0, 0, 10), PartInfo(1, 1, 20)], 300, 2**63, replication=[2, 1])
    assert Marker.from_bytes(m.to_bytes()) == m
    assert m.format == FORMAT_VERSION == 3 and m.has_indexes and m.part(1) == PartInfo(1, 1, 20)
    old = json.loads(m.to_bytes())
    del old["replication"]
    old["format"] = 1
    legacy = Marker.from_bytes(json.dumps(old).encode())
    assert legacy.replication == [1, 1] and not legacy.has_indexes
    old["format"] = 4
    with pytest.raises(ValueError, match="unsupported marker format 4"):
        Marker.from_bytes(json.dumps(old).encode())


def test_index_written_read_and_cached_once(tmp_path):
    store = LocalStorage(str(tmp_path))
    recs = [
        (ItemKey("a", (0,), 0), _record(offset=0)),
        (ItemKey("b"), _record(offset=15, kind="bytes", dtype=None, shape=None)),
    ]
    index = PartIndex.of(1, recs)
    assert index.size == 30
    write_index(store, "run", 1, index)
    raw = store.read(index_key("run", 1, 1))
    assert json.loads(raw)["format"] == 3  # JSON, not a pickle
    assert read_index(store, "run", 1, 1) == index
    cache = IndexCache()
    assert cache.get(store, "run", 1, 1) == index
    os.remove(tmp_path / index_key("run", 1, 1))
    assert cache.get(store, "run", 1, 1) == index  # read once per operation
    assert IndexCache().get(store, "run", 1, 1) is None  # a fresh one sees it is gone
    with pytest.raises(FileNotFoundError):
        read_index(store, "run", 1, 1)
    store.write(index_key("run", 1, 1), [raw[: len(raw) // 2]])  # cut short
    damaged = IndexCache()
    with pytest.raises(BadIndex):
        damaged.get(store, "run", 1, 1)
    store.write(index_key("run", 1, 1), [raw])
    with pytest.raises(BadIndex):
        damaged.get(store, "run", 1, 1)  # remembered for the rest of the operation
    assert IndexCache().get(store, "run", 1, 1) == index


def test_format2_pickled_index_is_read_without_torch_classes():
    store = LocalStorage(os.path.join(DATA, "format2", "ram", "0"))
    marker = Marker.from_bytes(store.read(marker_key("legacy", 2)))
    index = read_index(store, "legacy", 2, 1)
    assert marker.format == 2 and index.size == marker.part(1).size
    rec = index.records[ItemKey("nested.half", (0,))]
    assert rec.file == "legacy/step_000000000002/rank_00001.part"  # the base name, completed
    assert (rec.kind, rec.dtype, rec.shape, rec.rank) == ("tensor", "torch.bfloat16", (4,), 1)
    assert store.size(rec.file) == index.size


class _Evil:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-tiered-dcp-test",))


def test_an_index_that_would_run_code_is_refused(tmp_path):
    store = LocalStorage(str(tmp_path))
    store.write(index_key("run", 1, 0), [pickle.dumps({"x": _Evil()}, protocol=5)])
    with pytest.raises(BadIndex, match="shutil.rmtree has no place in an index file"):
        read_index(store, "run", 1, 0)


def test_a_record_pointing_into_another_steps_file_is_honoured(tmp_path):
    """Step 2's record of ``frozen`` names step 1's part: the reader and verify go there."""
    cfg = TieredConfig("ptr", [Tier(str(tmp_path / "ram"))])
    frozen = torch.arange(1000, dtype=torch.float32)
    for step in (1, 2):
        state = {"frozen": frozen, "moving": torch.full((500,), float(step))}
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
    store = LocalStorage(str(tmp_path / "ram"))
    old, new = read_index(store, "ptr", 1, 0), read_index(store, "ptr", 2, 0)
    key = ItemKey("frozen", (0,))
    moved = PartIndex(0, new.size, {**new.records, key: old.records[key]})
    write_index(store, "ptr", 2, moved)
    with open(tmp_path / "ram" / part_key("ptr", 2, 0), "r+b") as f:  # step 2's own copy: wrecked
        f.seek(new.records[key].offset)
        f.write(b"\xff" * new.records[key].length)
    target = {"frozen": torch.zeros(1000), "moving": torch.zeros(500)}
    dcp.load(target, storage_reader=TieredReader(cfg, step=2))
    assert torch.equal(target["frozen"], frozen) and torch.equal(target["moving"], torch.full((500,), 2.0))
    (check,) = verify_step(cfg, 2)
    assert check.ok, check.problems
