"""The chunk codec: byte-grouped zstd for floats, chosen per chunk, recorded, verified."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiered_dcp.storage.codec import (
    ChecksumMismatch,
    Encoder,
    checksum,
    decode_chunk,
    decode_into,
    make_record,
)
from tiered_dcp.storage.format import ItemInfo, Record, read_index

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter


def raw_of(t: torch.Tensor) -> memoryview:
    """A copy of the tensor's bytes (bytearray(untyped_storage()) would copy them one by one)."""
    return memoryview(bytearray(t.contiguous().view(torch.uint8).numpy().tobytes()))


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 0.70), (torch.float32, 0.86)])
def test_byte_grouping_beats_plain_zstd_on_float_weights(dtype, bound):
    torch.manual_seed(0)
    raw = raw_of((torch.randn(1 << 20) * 0.02).to(dtype))
    enc = Encoder("zstd")
    plain = len(enc.encode(raw)) / len(raw)
    codec = enc.choose(raw, str(dtype))
    grouped = enc.encode_as(raw, codec)
    assert codec == f"zstd-bg{dtype.itemsize}"
    assert len(grouped) / len(raw) < bound < plain  # bf16 ~0.68 vs 0.78, fp32 ~0.84 vs 0.92
    out = bytearray(len(raw))
    decode_chunk(codec, grouped, len(raw), memoryview(out), 0, checksum(raw))
    assert out == raw


def test_choice_is_per_chunk_and_recorded():
    torch.manual_seed(0)
    weights = raw_of((torch.randn(1 << 16) * 0.02).to(torch.bfloat16))
    zeros = memoryview(bytearray(len(weights)))  # plain zstd wins on a run of zeros
    enc = Encoder("zstd")
    chunks = [weights, zeros]
    stored, codec, codecs = enc.encode_item(chunks, "torch.bfloat16")
    assert (codec, codecs) == ("zstd-bg2", ("zstd-bg2", "zstd"))
    info = ItemInfo(0, "tensor", tuple((len(c), checksum(c)) for c in chunks), "torch.bfloat16", (2, 1 << 16))
    rec = make_record("f", 0, stored, codec, info, codecs)
    assert Record.from_dict(rec.to_dict()) == rec
    out = bytearray(rec.info.raw_length)
    decode_into(rec, memoryview(b"".join(bytes(s) for s in stored)), memoryview(out))
    assert out == bytes(weights) + bytes(zeros)
    # not a float tensor, or a raw tier: no grouping
    assert Encoder("zstd").choose(weights, "torch.int16") == "zstd"
    assert Encoder(None).choose(weights, "torch.bfloat16") == "raw"


def test_damaged_grouped_chunk_is_detected():
    raw = raw_of((torch.randn(4096) * 0.02).to(torch.float32))
    enc = Encoder("zstd")
    stored = bytearray(enc.encode_as(raw, "zstd-bg4"))
    stored[len(stored) // 2] ^= 0x5A
    with pytest.raises(ChecksumMismatch):
        decode_chunk("zstd-bg4", stored, len(raw), memoryview(bytearray(len(raw))), 0, checksum(raw))


def test_zstd_tier_stores_floats_grouped_and_loads_exactly(tmp_path):
    torch.manual_seed(0)
    cfg = TieredConfig("run", [Tier(str(tmp_path / "b"), compression="zstd", shared=True)])
    sd = {"bf16": (torch.randn(256, 1024) * 0.02).to(torch.bfloat16), "fp32": torch.randn(512, 512) * 0.02}
    sd["ints"] = torch.arange(4096)
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=1))
    from tiered_dcp.storage import open_storage

    index = read_index(open_storage(str(tmp_path / "b")), "run", 1, 0, 1 << 30)
    codecs = {k.fqn: r.codec for k, r in index.records.items()}
    assert codecs["bf16"] == "zstd-bg2" and codecs["fp32"] == "zstd-bg4" and codecs["ints"] == "zstd"
    raw = index.logical_bytes
    assert index.size < 0.8 * raw
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=TieredReader(cfg))
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
