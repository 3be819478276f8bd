"""Several real processes on gloo: node-local tiers, resharding, FSDP2, async modes."""

import io
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, settle
from dist_utils import run_ranks
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, export, wait_for
from tiered_dcp.ops.verify import verify_step


def make_config(root: str) -> TieredConfig:
    return TieredConfig(
        "job",
        [
            Tier(f"{root}/ram/{{node}}", every=1, keep=2),
            Tier(f"{root}/bucket", every=2, shared=True, compression="zstd"),
        ],
    )


def full(step: int) -> torch.Tensor:
    return torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) + 1000 * step


def dtensor_state(step: int, mesh, placement):
    return {
        "w": distribute_tensor(full(step), mesh, [placement]),
        "plain": torch.full((5,), float(step)),
        "meta": {"step": step, "name": "x"},
    }


def _save_and_load_two_nodes(rank, world, root):
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    for step in range(4):
        dcp.save(dtensor_state(step, mesh, Shard(0)), storage_writer=TieredWriter(cfg, step=step))
    target = dtensor_state(0, mesh, Shard(0))
    target["w"] = distribute_tensor(torch.zeros(16, 12), mesh, [Shard(0)])
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    assert reader.step == 3 and reader.tiers == [0]
    assert torch.equal(target["w"].full_tensor(), full(3))
    assert target["meta"] == {"step": 3, "name": "x"} and torch.equal(target["plain"], torch.full((5,), 3.0))
    return sorted(os.listdir(f"{root}/ram/{rank}/job/step_000000000003"))


def test_two_ranks_on_two_nodes(tmp_path):
    listings = run_ranks(_save_and_load_two_nodes, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})
    settle(make_config(str(tmp_path)))
    # each node's RAM dir holds its own rank's part and index, plus the metadata and the marker
    assert listings[0] == ["COMMITTED", "metadata", "rank_00000.index", "rank_00000.part"]
    assert listings[1] == ["COMMITTED", "metadata", "rank_00001.index", "rank_00001.part"]
    assert sorted(os.listdir(tmp_path / "ram/0/job")) == ["step_000000000002", "step_000000000003"]
    assert sorted(os.listdir(tmp_path / "bucket/job")) == ["step_000000000000", "step_000000000002"]


def _save_sharded_rows(rank, world, root):
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(dtensor_state(2, mesh, Shard(0)), storage_writer=TieredWriter(cfg, step=2))


def _load_sharded_cols(rank, world, root, tier_root):
    cfg = make_config(root)
    if tier_root == "bucket":  # read the shared copy only
        cfg = TieredConfig("job", [cfg.tiers[1]])
    mesh = init_device_mesh("cpu", (world,))
    target = {
        "w": distribute_tensor(torch.zeros(16, 12), mesh, [Shard(1)]),
        "plain": torch.zeros(5),
        "meta": {"step": -1, "name": ""},
    }
    dcp.load(target, storage_reader=TieredReader(cfg))
    assert target["w"].placements == (Shard(1),)
    expect = full(2).chunk(world, dim=1)[rank]
    assert torch.equal(target["w"].to_local(), expect)
    assert target["meta"] == {"step": 2, "name": "x"}
    return True


def test_reshard_four_ranks_rows_to_two_ranks_columns(tmp_path):
    run_ranks(_save_sharded_rows, 4, str(tmp_path))
    settle(make_config(str(tmp_path)))
    run_ranks(_load_sharded_cols, 2, str(tmp_path), "ram")
    run_ranks(_load_sharded_cols, 2, str(tmp_path), "bucket")
    # the sharded checkpoint exports, in one process, to a stock DCP directory
    dest = export(make_config(str(tmp_path)), 2, tmp_path / "exported")
    got = {"w": torch.zeros(16, 12), "plain": torch.zeros(5), "meta": {"step": -1, "name": ""}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(dest))
    assert torch.equal(got["w"], full(2)) and got["meta"] == {"step": 2, "name": "x"}


def _model_and_opt(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int):
    for s in range(steps):
        torch.manual_seed(100 + s)
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full_state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def _fsdp2_roundtrip(rank, world, root, mode):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg = make_config(root)
    model, opt = _model_and_opt(0)
    _train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 3}
    writer = TieredWriter(cfg, step=4)
    if mode == "sync":
        dcp.save(state, storage_writer=writer)
    else:
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind).result()
    expected = _full_state(model, opt)

    model2, opt2 = _model_and_opt(1)  # different init, no optimizer state yet
    _train(model2, opt2, 1)
    msd2, osd2 = get_state_dict(model2, opt2)
    loaded = {"model": msd2, "optim": osd2, "step": 0}
    dcp.load(loaded, storage_reader=TieredReader(cfg))
    set_state_dict(model2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert loaded["step"] == 3
    assert_state_equal(_full_state(model2, opt2), expected)
    # training continues identically from the restored state
    _train(model, opt, 1)
    _train(model2, opt2, 1)
    assert_state_equal(_full_state(model2, opt2), _full_state(model, opt))
    return True


def test_fsdp2_model_and_optimizer_roundtrip(tmp_path):
    run_ranks(_fsdp2_roundtrip, 2, str(tmp_path), "sync")


def _slower_tier_filled(root: str) -> None:
    """The bucket (every=2) got step 4 from the ranks' writer processes, intact."""
    cfg = make_config(root)
    wait_for(cfg, 4, tier=1, timeout=60)
    (check,) = [c for c in verify_step(cfg, 4) if c.tier_index == 1]
    assert check.problems == [] and check.items > 0


def test_async_save_thread_mode(tmp_path):
    run_ranks(_fsdp2_roundtrip, 2, str(tmp_path), "thread")
    _slower_tier_filled(str(tmp_path))


def test_async_save_process_mode(tmp_path):
    # DCP's upload subprocess hands the step to the rank's writer process
    run_ranks(_fsdp2_roundtrip, 2, str(tmp_path), "process")
    _slower_tier_filled(str(tmp_path))


def _ranks_see_different_steps(rank, world, root):
    cfg = TieredConfig("job", [Tier(f"{root}/ram/{{rank}}")])
    for step in (1, 2):
        dcp.save({"x": torch.ones(3) * step}, storage_writer=TieredWriter(cfg, step=step))
    dist.barrier()
    if rank == 0:  # rank 0 loses its view of step 2; rank 1 still sees it complete
        os.remove(f"{root}/ram/0/job/step_000000000002/COMMITTED")
    dist.barrier()
    from tiered_dcp import latest_step

    alone = latest_step(cfg)
    reader = TieredReader(cfg)
    target = {"x": torch.zeros(3)}
    dcp.load(target, storage_reader=reader)
    return alone, reader.step, target["x"].tolist()


def test_ranks_agree_on_a_step_every_rank_can_load(tmp_path):
    results = run_ranks(_ranks_see_different_steps, 2, str(tmp_path))
    assert [r[0] for r in results] == [1, 2]  # alone, the ranks would disagree
    assert [r[1:] for r in results] == [(1, [1.0] * 3)] * 2


def _stock_sharded_save(rank, world, root):
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(dtensor_state(5, mesh, Shard(0)), storage_writer=dcp.FileSystemWriter(f"{root}/stock"))
    dist.barrier()


def _imported_config(root: str, shared_only: bool = False) -> TieredConfig:
    ram = Tier(f"{root}/ram/{{node}}")
    shared = Tier(f"{root}/shared", shared=True)
    return TieredConfig(
        "imported", [shared] if shared_only else [ram, shared], replication_factor=2, replication_jump=1
    )


def _load_imported(rank, world, root, shared_only):
    mesh = init_device_mesh("cpu", (world,))
    target = dtensor_state(0, mesh, Shard(1))  # another sharding than the stock save's
    reader = TieredReader(_imported_config(root, shared_only))
    dcp.load(target, storage_reader=reader)
    exact = torch.equal(target["w"].full_tensor(), full(5)) and torch.equal(
        target["plain"], torch.full((5,), 5.0)
    )
    return reader.step, reader.tiers, exact, target["meta"]


def test_a_sharded_stock_checkpoint_is_imported_and_resharded_on_load(tmp_path):
    """2 ranks save a stock DCP checkpoint of a row-sharded DTensor; one process imports it
    as step 5 of a replicated config (one process has no clique peers: stored unreplicated,
    on node 0's RAM tier and, through the writer process, the shared tier); 2 ranks on 2
    nodes load it column-sharded, exactly: from node 0's RAM and the shared tier (node 1
    holds nothing of it), and from the shared tier alone."""
    from tiered_dcp import import_dcp, shutdown

    run_ranks(_stock_sharded_save, 2, str(tmp_path))
    import_dcp(_imported_config(str(tmp_path)), tmp_path / "stock", 5)
    shutdown()
    assert not (tmp_path / "ram/1").exists()
    for shared_only, tiers in ((False, [0, 1]), (True, [0])):
        got = run_ranks(_load_imported, 2, str(tmp_path), shared_only, env={"LOCAL_WORLD_SIZE": 1})
        assert got == [(5, tiers, True, {"step": 5, "name": "x"})] * 2, (shared_only, got)


def _save_model_for_export(rank, world, root):
    """An FSDP2 model's sharded state (DTensors), a row-sharded ShardedTensor and a bf16
    DTensor under ``model``, beside an optimizer and a non-tensor value."""
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model_and_opt(seed=3)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_empty(spec, 4 * world, 6)
    st.local_shards()[0].tensor.copy_(torch.arange(24.0).reshape(4, 6) + 100 * rank)
    mesh = init_device_mesh("cpu", (world,))
    half = distribute_tensor(full(1).to(torch.bfloat16), mesh, [Shard(1)])
    state = {"model": {**msd, "table": st, "half": half, "note": {"epoch": 3}}, "optim": osd}
    dcp.save(state, storage_writer=TieredWriter(make_config(root), step=5))
    full_model, _ = _full_state(model, opt)
    buf = io.BytesIO()  # tensors through the result queue would need their memory shared
    torch.save({k: v.clone() for k, v in full_model.items()}, buf)
    return buf.getvalue()


def test_a_sharded_state_exports_to_safetensors_whole_and_exact(tmp_path):
    """Two ranks save FSDP2 DTensors, a ShardedTensor and a bf16 DTensor
    sharded by columns; one process exports the model to safetensors, in several files with
    Hugging Face's index, and `safetensors.torch.load_file` reads every tensor whole and exact,
    named without the `model.` prefix; the non-tensor value is left out and named."""
    import json

    from safetensors.torch import load_file

    from tiered_dcp.ops.export import INDEX_FILE, format_named, run_export

    saved = run_ranks(_save_model_for_export, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})[0]
    expect = torch.load(io.BytesIO(saved))
    settle(make_config(str(tmp_path)))
    expect["table"] = torch.cat([torch.arange(24.0).reshape(4, 6) + 100 * r for r in range(2)])
    expect["half"] = full(1).to(torch.bfloat16)
    done = run_export(
        make_config(str(tmp_path)), None, tmp_path / "hf", format_named("safetensors", 4000), only="model"
    )
    assert done.step == 5 and done.written.left_out == ("note.epoch",) and len(done.written.files) > 2
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(expect)
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(tmp_path / "hf" / name))
    assert sorted(got) == sorted(expect)
    for k, v in expect.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expect.values())
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(done.written.files)  # nothing else left there
    # the public call, one file at the default size: the same tensors
    dest = export(make_config(str(tmp_path)), 5, tmp_path / "hf1", format="safetensors", only="model")
    assert os.listdir(dest) == ["model.safetensors"]
    one = load_file(os.path.join(dest, "model.safetensors"))
    assert sorted(one) == sorted(expect) and all(torch.equal(one[k], v) for k, v in expect.items())


def _gather_blobs(rank, world):
    from tiered_dcp.load.discovery import GATHER_SLOT_BYTES, all_gather_bytes

    small = [b"", b"holdings", b"\x00\xff" * 7]
    fits = all_gather_bytes(small[rank])
    edge = all_gather_bytes(b"e" * (GATHER_SLOT_BYTES - 8) if rank == 1 else b"x")
    large = all_gather_bytes(bytes(range(256)) * 20 if rank == 2 else small[rank])
    return fits, edge, large


def test_all_gather_bytes_gives_every_rank_every_blob_whole():
    """The load's holdings exchange: blobs that fit a slot in one all-gather, one longer than
    a slot (on one rank) through a second round that every rank takes, empty ones too."""
    from tiered_dcp.load.discovery import GATHER_SLOT_BYTES

    small = [b"", b"holdings", b"\x00\xff" * 7]
    for fits, edge, large in run_ranks(_gather_blobs, 3):
        assert fits == small
        assert edge == [b"x", b"e" * (GATHER_SLOT_BYTES - 8), b"x"]
        assert large == [b"", b"holdings", bytes(range(256)) * 20]
