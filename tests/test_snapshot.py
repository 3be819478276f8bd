"""async_save saves the state as it was when it returned (or when staging_completion fired).

Two real ranks on gloo hold one value of every kind: a ShardedTensor, a DTensor, a plain
tensor, a tensor subclass, a checkpointable-protocol object (a DTensor over a LocalShardsWrapper) and
nested Python values. Right after staging, every one of them is changed in place; the
loaded step must equal the state before the change, exactly, in THREAD and PROCESS modes,
with and without background staging.
"""

from __future__ import annotations

import copy
import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal
from dist_utils import run_ranks
from torch.distributed._shard.sharded_tensor import empty as sharded_empty
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from tiered_dcp import SnapshotError, Tier, TieredConfig, TieredReader, TieredWriter, latest_step
from tiered_dcp.save.staging import POOL, StagingPool

MODES = ["thread", "process", "background-thread", "background-process"]


class Scaled(torch.Tensor):
    """A tensor subclass over ordinary storage, with an attribute of its own."""


@dataclass
class Schedule:
    lr: float
    betas: list[float] = field(default_factory=list)


# A value of a class of one's own loads once allowed, as torch.load(weights_only=True) asks: the
# reader refuses any other non-tensor value (docs/user-guide.md, trust model). The rank
# processes import this module, so each of them allows it.
torch.serialization.add_safe_globals([Schedule])


def _config(root: str) -> TieredConfig:
    return TieredConfig("snap", [Tier(f"{root}/ram/{{node}}", keep=None)])


def _state(rank: int, world: int, mesh, seed: int) -> dict:
    """One value of every kind, its values set by ``seed`` (0: a load target of the same layout)."""
    k = float(seed)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_empty(spec, 4 * world, 6)
    st.local_shards()[0].tensor.copy_(torch.arange(24.0).reshape(4, 6) * k + 100 * rank * k)
    full = torch.arange(8 * world * 3, dtype=torch.float32).reshape(8 * world, 3) * k
    sub = torch.full((5, 2), 3.0 * k).as_subclass(Scaled)
    sub.scale = 2.0 * k
    shards = [torch.arange(4.0) * k + rank, torch.arange(4.0) * -k - rank]
    lsw = DTensor.from_local(  # as torchrec shards tables: a DTensor over a checkpointable local
        LocalShardsWrapper(shards, [(rank * 8,), (rank * 8 + 4,)]),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size([8 * world]),
        stride=(1,),
    )
    return {
        "st": st,
        "dt": distribute_tensor(full, mesh, [Shard(0)]),
        "plain": torch.linspace(0, 1, 7) * k,
        "sub": sub,
        "lsw": lsw,
        "meta": {
            "list": [int(k), [2, 3], {"a": f"x{k}"}],
            "schedule": Schedule(0.1 * k, [0.9, k]),
            "counts": {"seen": int(k)},
            "tup": (int(k), torch.full((2,), k)),
        },
    }


def _change_everything(state: dict) -> None:
    """What the next optimizer step (and the loop's bookkeeping) does: in place, everywhere."""
    with torch.no_grad():
        state["st"].local_shards()[0].tensor.add_(1000)
        state["dt"]._local_tensor.add_(1000)
        state["plain"].add_(1000)
        state["sub"].add_(1000)
        state["sub"].scale = -1.0
        for s in state["lsw"]._local_tensor.local_shards():
            s.add_(1000)
        state["meta"]["tup"][1].add_(1000)
    state["meta"]["list"][1].append(4)
    state["meta"]["list"][2]["a"] = "changed"
    state["meta"]["list"].append("more")
    state["meta"]["schedule"].lr = -1.0
    state["meta"]["schedule"].betas.append(0.5)
    state["meta"]["counts"]["seen"] += 1


def _comparable(state: dict) -> dict:
    """The state as plain values: local shards, local tensors and Python data."""
    return {
        "st": state["st"].local_shards()[0].tensor.clone(),
        "dt": state["dt"]._local_tensor.clone(),
        "plain": state["plain"].clone(),
        "sub": torch.Tensor(state["sub"]).clone(),
        "lsw": [s.clone() for s in state["lsw"]._local_tensor.local_shards()],
        "meta": copy.deepcopy(
            {k: v for k, v in state["meta"].items() if k != "tup"} | {"tup0": state["meta"]["tup"][0]}
        ),
        "tup1": state["meta"]["tup"][1].clone(),
    }


def _save_change_load(rank: int, world: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    cfg = _config(root)
    group = dist.new_group(backend="gloo")
    out = {}
    arenas: set[int] = set()
    for step, mode in enumerate(MODES * 2, start=1):  # each mode twice: the second reuses the slot
        state = _state(rank, world, mesh, seed=step)
        before = _comparable(state)
        kind = AsyncCheckpointerType.PROCESS if mode.endswith("process") else AsyncCheckpointerType.THREAD
        background = mode.startswith("background")
        writer = TieredWriter(cfg, step=step, background_staging=background)
        resp = dcp.async_save(state, storage_writer=writer, process_group=group, async_checkpointer_type=kind)
        if background:
            resp.staging_completion.result()
        _change_everything(state)
        (resp.upload_completion if background else resp).result()
        arenas_now = {s.arena.data_ptr() for s in POOL._slots}
        reused = step > len(MODES) and bool(arenas_now & arenas)
        arenas |= arenas_now
        target = _state(rank, world, mesh, seed=0)
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        try:
            assert_state_equal(_comparable(target), before)
            verdict = "exact"
        except AssertionError as e:
            verdict = f"differs: {e!r}"[:300]
        out[f"{mode} step {step}"] = (verdict, reused, POOL.info()["slots"])
    out["shipped"] = _ship(_state(rank, world, mesh, seed=7))
    return out


def _staged_values(staged: dict) -> dict:
    """A staged copy as plain values (its sharded leaves are ``SnapshotTensor``s)."""
    return {
        "st": list(staged["st"]._shards.values()),
        "dt": staged["dt"]._local_tensor,
        "plain": staged["plain"],
        "sub": (type(staged["sub"]).__name__, torch.Tensor(staged["sub"]), staged["sub"].__dict__),
        "lsw": list(staged["lsw"]._shards.values()),
        "meta": staged["meta"],
    }


def _ship(state: dict) -> tuple[str, bool, int]:
    """A staged copy pickled as DCP's PROCESS mode sends it: every leaf arrives equal, and
    over the same shared memory, the staging arena (torch's own pickling would move each
    piece into a new segment, the staged copy with it, and leave the arena unused)."""
    pool = StagingPool()  # a slot no save has shipped yet
    staged = pool.stage(state)
    pieces = [staged["plain"], staged["dt"]._local_tensor]
    where = [t.data_ptr() for t in pieces]
    received = pickle.loads(ForkingPickler.dumps(staged))
    try:
        assert_state_equal(_staged_values(received), _staged_values(staged))
        verdict = "exact"
    except AssertionError as e:
        verdict = f"differs: {e!r}"[:300]
    for t in pieces:
        t.add_(1)
    shared = [t.data_ptr() for t in pieces] == where and torch.equal(received["plain"], staged["plain"])
    shared = shared and torch.equal(received["dt"]._local_tensor, staged["dt"]._local_tensor)
    return verdict, shared, pool.info()["slots"]


def test_async_save_is_a_snapshot_of_every_value_kind(tmp_path):
    for rank_result in run_ranks(_save_change_load, 2, str(tmp_path), timeout=300):
        verdict, shared, _ = rank_result.pop("shipped")
        assert verdict == "exact" and shared, "the staged copy DCP's PROCESS mode receives"
        for what, (verdict, reused, slots) in rank_result.items():
            assert verdict == "exact", what
            assert slots <= 2, what
            step = int(what.rsplit(" ", 1)[1])
            if step > len(MODES):  # the same layout again: the staging arena is reused
                assert reused, f"{what}: a new staging arena was allocated"


def _one_process_config(tmp_path) -> TieredConfig:
    return TieredConfig("snap1", [Tier(str(tmp_path / "ram"))])


@pytest.mark.parametrize("background", [False, True])
def test_a_value_that_cannot_be_snapshotted_is_refused_naming_its_key(tmp_path, background):
    cfg = _one_process_config(tmp_path)
    state = {"w": torch.ones(3), "opt": {"extras": [1, {"lock": threading.Lock()}]}}
    writer = TieredWriter(cfg, step=1, background_staging=background)
    with pytest.raises(SnapshotError) as err:
        resp = dcp.async_save(state, storage_writer=writer)  # without background: raises right here
        # DCP reports a staging future that failed before it looked as done, so the refusal
        # is certain to surface on the upload (which never writes a byte without a snapshot)
        resp.upload_completion.result(timeout=60)
    msg = str(err.value)
    assert "opt.extras.1.lock" in msg and "_thread.lock" in msg and "dcp.save" in msg
    assert latest_step(cfg) is None
    assert POOL.info()["busy"] == 0  # the refused save holds no staging slot


def test_a_tensor_that_cannot_be_copied_is_refused_naming_its_key(tmp_path):
    state = {"model": {"w": torch.ones(3), "ghost": torch.empty(4, device="meta")}}
    with pytest.raises(SnapshotError, match=r"model\.ghost"):
        dcp.async_save(state, storage_writer=TieredWriter(_one_process_config(tmp_path), step=1))
    assert POOL.info()["busy"] == 0


def test_snapshot_tensor_answers_dcp_like_the_sharded_value(tmp_path):
    """Unit check of the stand-in: same write items (with the real fqn), same shard bytes."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.checkpoint.utils import find_tensor_shard

    lsw = LocalShardsWrapper([torch.arange(3.0), torch.arange(3.0) + 10], [(0,), (3,)])
    staged = POOL.stage({"x": lsw})
    snap = staged["x"]
    assert type(snap).__name__ == "SnapshotTensor"
    assert _create_write_items("model.x", snap) == _create_write_items("model.x", lsw)
    for item in _create_write_items("model.x", lsw):
        assert torch.equal(find_tensor_shard(snap, item.index), find_tensor_shard(lsw, item.index))
    lsw.local_shards()[0].add_(7)
    item = _create_write_items("model.x", lsw)[0]
    assert not torch.equal(find_tensor_shard(snap, item.index), find_tensor_shard(lsw, item.index))
    del staged, snap
