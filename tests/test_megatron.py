"""Megatron-core's dist_checkpointing.save/load through the tiers, on real gloo processes.

Skipped when megatron-core is not installed (scripts/setup.sh installs it). Each rank
process imports megatron.core (several seconds), so the scenarios share few process
launches.
"""

import importlib.util
import logging
import os
import shutil

import pytest
import torch
from conftest import settle
from dist_utils import run_ranks

from tiered_dcp import NoCheckpointError, Tier, TieredConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (scripts/setup.sh installs it: "
    "pip install --no-deps --ignore-requires-python megatron-core==0.19.2 psutil triton)",
)

ROWS, COLS = 8, 6


def make_config(root: str) -> TieredConfig:
    return TieredConfig(
        "mg",
        [
            Tier(f"{root}/ram/{{node}}", every=1, keep=3),
            Tier(f"{root}/bucket", every=100, shared=True, compression="zstd"),
        ],
    )


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def sharded_sd(rank: int, world: int, step: int, empty: bool = False) -> dict:
    """A small Megatron state: a row-sharded weight, a replicated bias, an object, common state."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    local = full(step).chunk(world)[rank].clone()
    bias = torch.full((4,), float(step))
    if empty:
        local, bias = torch.zeros_like(local), torch.zeros_like(bias)
    return {
        "w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
        "bias": ShardedTensor.from_rank_offsets("bias", bias, replica_id=rank),
        "obj": ShardedObject("obj", {"step": step} if not empty else None, (1,), (0,), replica_id=rank),
        "iteration": step,
    }


def check_loaded(loaded: dict, rank: int, world: int, step: int) -> None:
    assert torch.equal(loaded["w"], full(step).chunk(world)[rank])
    assert torch.equal(loaded["bias"], torch.full((4,), float(step)))
    assert loaded["obj"] == {"step": step}
    assert loaded["iteration"] == step  # the common state, read by Megatron from ckpt_dir


def cuda_free_async_queue() -> None:
    """Megatron's AsyncCallsQueue hard-codes CUDA for its completion all-reduce and a
    device sync before it forks; with no GPU here, point those two calls at the CPU (the
    queue's own logic, the forked worker and the gloo all-reduces all run for real)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None


def _save_sync_async_and_load(rank, world, root):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tiered_dcp.megatron import TieredLoadStrategy, TieredSaveStrategy

    cfg = make_config(root)
    sync_dir, async_dir = f"{root}/ckpt/iter_0000100", f"{root}/ckpt/iter_0000200"
    os.makedirs(sync_dir, exist_ok=True)
    os.makedirs(async_dir, exist_ok=True)

    # sync: the step is taken from the directory name
    dist_checkpointing.save(sharded_sd(rank, world, 100), sync_dir, sharded_strategy=TieredSaveStrategy(cfg))

    # async: Megatron's AsyncRequest, scheduled and finalized by its AsyncCallsQueue
    cuda_free_async_queue()
    state = sharded_sd(rank, world, 200)
    request = dist_checkpointing.save(
        state, async_dir, sharded_strategy=TieredSaveStrategy(cfg), async_sharded_save=True
    )
    assert isinstance(request, AsyncRequest)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    state["w"].data.add_(1e6)  # the loop goes on: the staged copy is what is saved
    state["bias"].data.add_(1e6)
    # a sync save while the async one may still be writing (it waits for it), wrapped as
    # Megatron-LM wraps its save strategy by default: fully parallel (its load wrapper
    # exchanges the loaded shards over CUDA only: not run here)
    parallel_dir = f"{root}/ckpt/iter_0000300"
    os.makedirs(parallel_dir, exist_ok=True)
    wrapped = FullyParallelSaveStrategyWrapper(TieredSaveStrategy(cfg))
    dist_checkpointing.save(sharded_sd(rank, world, 300), parallel_dir, sharded_strategy=wrapped)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert queue.get_num_unfinalized_calls() == 0

    for step, ckpt in ((100, sync_dir), (200, async_dir), (300, parallel_dir)):
        loaded = dist_checkpointing.load(
            sharded_sd(rank, world, step, empty=True), ckpt, sharded_strategy=TieredLoadStrategy(cfg)
        )
        check_loaded(loaded, rank, world, step)

    # an explicit step must be the one saved there: Megatron read that step's common state
    loaded = dist_checkpointing.load(
        sharded_sd(rank, world, 0, empty=True), async_dir, sharded_strategy=TieredLoadStrategy(cfg, step=200)
    )
    check_loaded(loaded, rank, world, 200)
    with pytest.raises(ValueError, match="common state of step 100"):
        strategy = TieredLoadStrategy(cfg, step=200)
        dist_checkpointing.load(sharded_sd(rank, world, 0, empty=True), sync_dir, sharded_strategy=strategy)

    # metadata queries
    strategy = TieredLoadStrategy(cfg)
    tensors = dist_checkpointing.load_tensors_metadata(async_dir, strategy)
    assert sorted(tensors) == ["bias", "w"]
    assert tensors["w"].global_shape == (ROWS, COLS) and tensors["w"].dtype == torch.float32
    assert tensors["bias"].global_shape == (4,)
    sharded = load_sharded_metadata(async_dir, strategy)
    assert sorted(sharded) == ["bias", "common_state/shard_0_1", "obj/shard_0_1", "w"]

    # strict loading (Megatron's terms: "unexpected" is asked for but not in the checkpoint,
    # "missing" is in the checkpoint but not asked for)
    target = sharded_sd(rank, world, 0, empty=True)
    from megatron.core.dist_checkpointing import ShardedTensor

    target["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3), replica_id=rank)
    del target["bias"]
    loaded, missing, unexpected = dist_checkpointing.load(
        target, sync_dir, sharded_strategy=TieredLoadStrategy(cfg), strict=StrictHandling.RETURN_ALL
    )
    assert (missing, unexpected) == ({"bias"}, {"extra"})
    assert torch.equal(loaded["w"], full(100).chunk(world)[rank]) and "extra" not in loaded
    target = sharded_sd(rank, world, 0, empty=True)
    target["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(3), replica_id=rank)
    with pytest.raises(CheckpointingException, match="extra"):
        dist_checkpointing.load(
            target, sync_dir, sharded_strategy=TieredLoadStrategy(cfg), strict=StrictHandling.RAISE_ALL
        )
    return {d: sorted(os.listdir(d)) for d in (sync_dir, async_dir, parallel_dir)}


def _save(rank, world, root, step, ckpt):
    from megatron.core import dist_checkpointing

    from tiered_dcp.megatron import TieredSaveStrategy

    os.makedirs(ckpt, exist_ok=True)
    strategy = TieredSaveStrategy(make_config(root), step=step)  # a name without a step: given
    dist_checkpointing.save(sharded_sd(rank, world, step), ckpt, sharded_strategy=strategy)


def _load(rank, world, root, step, ckpt):
    from megatron.core import dist_checkpointing

    from tiered_dcp.megatron import TieredLoadStrategy

    loaded = dist_checkpointing.load(
        sharded_sd(rank, world, 0, empty=True), ckpt, sharded_strategy=TieredLoadStrategy(make_config(root))
    )
    check_loaded(loaded, rank, world, step)


def _two_ranks(rank, world, root):
    _load(rank, world, root, 7, f"{root}/ckpt/run_a")  # saved by four ranks
    return _save_sync_async_and_load(rank, world, root)


def _one_rank(rank, world, root):
    _load(rank, world, root, 100, f"{root}/ckpt/iter_0000100")  # saved by two ranks
    _argument_errors(root)


def _argument_errors(root):
    from tiered_dcp.megatron import TieredLoadStrategy, TieredSaveStrategy, load_latest, step_from_dir

    assert step_from_dir("/ckpts/iter_0000100") == 100
    assert step_from_dir("global_step42") == 42
    with pytest.raises(ValueError, match="step=N"):
        step_from_dir("/ckpts/release")
    cfg = make_config(root)
    with pytest.raises(ValueError, match="nonsense"):
        TieredSaveStrategy(cfg, nonsense=1)
    with pytest.raises(ValueError, match="TieredConfig"):
        TieredLoadStrategy("not a config")
    os.makedirs(f"{root}/ckpt/by_hand")
    with pytest.raises(NoCheckpointError, match="tiered_dcp.json"):
        TieredLoadStrategy(cfg)._step(f"{root}/ckpt/by_hand")
    sd = sharded_sd(0, 1, 0, empty=True)
    with pytest.raises(ValueError, match="checkpoint directory itself"):  # save_dir is its parent
        load_latest(sd, f"{root}/ckpt/iter_0000100", cfg)
    with pytest.raises(ValueError, match="TieredLoadStrategy"):
        load_latest(sd, f"{root}/ckpt", cfg, sharded_strategy=TieredLoadStrategy(cfg))


def test_save_load_sync_async_metadata_strict_reshard(tmp_path):
    """One scenario over three launches (each rank process spends seconds importing
    megatron.core): four ranks save; two ranks load that (4 -> 2), save sync and async
    and query; one rank loads the two ranks' step (2 -> 1)."""
    root = str(tmp_path)
    run_ranks(_save, 4, root, 7, f"{root}/ckpt/run_a")
    listings = run_ranks(_two_ranks, 2, root)
    small = [".metadata", "__0_0.distcp", "metadata.json", "tiered_dcp.json"]
    assert listings[0] == {d: small for d in listings[0]}  # ckpt_dir: only what Megatron reads
    settle(make_config(root))
    for step in (100, 200):  # on the RAM tier at once, on the bucket through the writer process
        assert (tmp_path / f"ram/0/mg/step_{step:012d}/COMMITTED").exists()
        assert (tmp_path / f"bucket/mg/step_{step:012d}/COMMITTED").exists()
    run_ranks(_one_rank, 1, root)


# -- the resume: the newest good step, through the directory that names it ----------------


def flip_item(root: str, step: int, fqn: str) -> None:
    """Flip a byte inside item ``fqn``'s data in rank 0's part of ``step``, on the RAM tier."""
    from tiered_dcp.storage import open_storage
    from tiered_dcp.storage.format import read_index

    store = open_storage(f"{root}/ram/0")
    (record,) = [r for k, r in read_index(store, "mg", step, 0, 1 << 30).records.items() if k.fqn == fqn]
    with open(f"{root}/ram/0/{record.file}", "r+b") as f:
        f.seek(record.offset + 5)
        byte = f.read(1)
        f.seek(record.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def _resume(rank, world, root):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from tiered_dcp.megatron import TieredSaveStrategy, load_latest

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tiered_dcp").addHandler(handler)

    def resume(target=None):
        warnings.clear()
        loaded, step = load_latest(target or sharded_sd(rank, world, 0, empty=True), save_dir, cfg)
        said = [w for w in warnings if "megatron.load_latest loaded step" in w]
        return loaded, step, said

    cfg, save_dir = make_config(root), f"{root}/ckpt"
    with pytest.raises(NoCheckpointError):  # nothing at all (not even save_dir)
        load_latest(sharded_sd(rank, world, 0, empty=True), save_dir, cfg)

    def save(step, nan=False):
        sd = sharded_sd(rank, world, step)
        if nan and rank == 1:
            sd["w"].data[0, 0] = float("nan")
        ckpt = f"{save_dir}/iter_{step:07d}"
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save(sd, ckpt, sharded_strategy=TieredSaveStrategy(cfg))
        if rank == 0:  # Megatron-LM's tracker names the newest save; load_latest does not read it
            with open(f"{save_dir}/latest_checkpointed_iteration.txt", "w") as f:
                f.write(str(step))

    save(1)
    save(2)
    dist.barrier()
    if rank == 0:  # step 2 is on the RAM tier only: its only copy of w's first rows
        flip_item(root, 2, "w")
    dist.barrier()
    loaded, step, said = resume()
    assert step == 1
    check_loaded(loaded, rank, world, 1)  # exact values of the older step
    out = {"damaged": said}

    save(3, nan=True)  # non-finite on one rank: marked for all, passed over
    loaded, step, said = resume()
    assert step == 1
    check_loaded(loaded, rank, world, 1)
    out["nonfinite"] = said

    save(4)
    dist.barrier()
    if rank == 0:  # its directory gone (Megatron-LM's cleanup, a crash before the small files)
        shutil.rmtree(f"{save_dir}/iter_0000004")
    dist.barrier()
    dirs = []  # the sharded state dict made from the directory about to be loaded
    loaded, step, said = resume(lambda d: dirs.append(d) or sharded_sd(rank, world, 0, empty=True))
    assert step == 1 and dirs == [f"{save_dir}/iter_0000001"]
    check_loaded(loaded, rank, world, 1)
    out["gone"] = said

    save(5)  # a good newer step loads, with no warning
    loaded, step, said = resume()
    assert step == 5 and said == []
    check_loaded(loaded, rank, world, 5)

    dist.barrier()
    if rank == 0:  # Megatron had not written metadata.json yet: not a checkpoint it loads
        os.remove(f"{save_dir}/iter_0000005/metadata.json")
    dist.barrier()
    loaded, step, said = resume()
    assert step == 1
    out["unfinished"] = said

    dist.barrier()
    if rank == 0:  # no directory names any step
        for name in os.listdir(save_dir):
            if name.startswith("iter_"):
                shutil.rmtree(f"{save_dir}/{name}")
    dist.barrier()
    with pytest.raises(NoCheckpointError) as info:
        load_latest(sharded_sd(rank, world, 0, empty=True), save_dir, cfg)
    out["none"] = str(info.value)
    return out


def test_load_latest_resumes_from_the_newest_step_that_loads_through_its_directory(tmp_path):
    """Two ranks: the newest step damaged (its only copy), then non-finite, then its
    directory gone or unfinished: every rank resumes from the older step, exactly, and rank 0
    (only) says why; with no step at all, or none named by a directory, NoCheckpointError."""
    results = run_ranks(_resume, 2, str(tmp_path))
    r0, r1 = results
    assert r1 == {"damaged": [], "nonfinite": [], "gone": [], "unfinished": [], "none": r1["none"]}
    (damaged,) = r0["damaged"]
    assert "loaded step 1" in damaged and "step 2: " in damaged and "damaged" in damaged
    (nonfinite,) = r0["nonfinite"]
    assert "step 3: non-finite (NaN/Inf in w" in nonfinite and "step 2: quarantined" in nonfinite
    (gone,) = r0["gone"]
    assert "step 4: no checkpoint directory under" in gone and "step 3: non-finite" in gone
    (unfinished,) = r0["unfinished"]
    assert "step 5: " in unfinished and "iter_0000005 is not a complete Megatron checkpoint" in unfinished
    for r in results:
        assert "step 5: no checkpoint directory" in r["none"] and "step 1: no checkpoint" in r["none"]
