"""TieredSavePlanner: bytes held by several ranks (any fqn) are written once, the writes are
spread over the ranks, and every step loads exactly. Real processes on gloo, real files;
the plan pass itself is checked as the pure function it is."""

import glob
import json
import os
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from tiered_dcp.planners.save import ALIASES, CONTENT, DEDUP, WHERE, Alias, ContentKey, SaveRank, dedup_plans
from tiered_dcp.storage.format import is_block_id
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredSavePlanner, TieredWriter, wait_for
from tiered_dcp.ops.verify import verify_step

MiB = 1 << 20


def vec(seed: int, mib: int = 1) -> torch.Tensor:
    return torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(seed))


def state(rank: int, step: int) -> dict:
    """Per rank: a replicated value (one fqn), 2 MiB both ranks hold under their own fqn, 1 MiB
    of its own that changes every step, and a small value."""
    return {
        "rep": vec(1),
        f"emb{rank}": vec(2, 2),
        f"own{rank}": vec(100 * step + rank),
        f"bias{rank}": torch.full((5,), float(step + rank)),
    }


def loaded_wrong(cfg: TieredConfig, step: int, want: dict, **kw) -> list[str]:
    """Load ``step`` into zeros shaped as ``want``: the keys that differ (asserted by the
    caller after every load, so that no rank leaves the others in a collective)."""
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(target, storage_reader=TieredReader(cfg, step=step, **kw))
    return [f"step {step}: {k}" for k, v in want.items() if not torch.equal(target[k], v)]


def indexes(root, step: int, ns: str = "run") -> dict[int, dict]:
    """Each rank's index file of ``step`` under ``root`` (JSON)."""
    out = {}
    for f in glob.glob(f"{root}/{ns}/step_{step:012d}/rank_*.index"):
        with open(f) as fh:
            doc = json.load(fh)
        out[doc["rank"]] = doc
    return out


def records(doc: dict) -> dict[str, dict]:
    return {item["key"][0]: item for item in doc["items"]}


def refs(root, step: int, rank: int, ns: str = "run") -> set[str]:
    with open(f"{root}/{ns}/step_{step:012d}/rank_{rank:05d}.blocks") as fh:
        return set(json.load(fh))


def block_files(root, ns: str = "run") -> set[str]:
    return {
        os.path.basename(f) for f in glob.glob(f"{root}/{ns}/blocks/*/*") if is_block_id(os.path.basename(f))
    }


def shared(root, dedup=True) -> TieredConfig:
    return TieredConfig("run", [Tier(f"{root}/bucket", shared=True)], dedup=dedup)


def two_tiers(root) -> TieredConfig:
    return TieredConfig(
        "run", [Tier(f"{root}/ram/{{node}}"), Tier(f"{root}/bucket", shared=True)], dedup=True
    )


def _save_twice(rank, root, cfg, planner=TieredSavePlanner, steps=(1, 2)):
    for step in steps:
        if step == 2:  # async_save: the planner hashes the staged copy in the save's background part
            dcp.async_save(
                state(rank, step), storage_writer=TieredWriter(cfg, step), planner=planner()
            ).result()
        else:
            dcp.save(state(rank, step), storage_writer=TieredWriter(cfg, step), planner=planner())
    wrong = [w for step in steps for w in loaded_wrong(cfg, step, state(rank, step))]
    assert not wrong, wrong


def _spread(rank, root):
    cfg = shared(root)
    sd = {f"a{rank}": vec(7, 2), f"b{rank}": vec(8, 2)}  # both ranks hold both contents
    dcp.save(sd, storage_writer=TieredWriter(cfg, 1), planner=TieredSavePlanner())
    assert not loaded_wrong(cfg, 1, sd)


def _node_local(rank, root):
    cfg = two_tiers(root)
    _save_twice(rank, root, cfg)  # each rank's own root, then its peer for what lives on the other node
    wait_for(cfg, 2, timeout=60)
    torch.distributed.barrier()
    bucket = TieredConfig("run", [cfg.tiers[1]], dedup=True)  # the writer process's copy
    wrong = [w for step in (1, 2) for w in loaded_wrong(bucket, step, state(rank, step))]
    assert not wrong, wrong


def _replicated(rank, root):
    cfg = TieredConfig("run", [Tier(f"{root}/ram/{{node}}")], dedup=True, replication_factor=2)
    _save_twice(rank, root, cfg)  # aliases travel to the peer with the part's records


def _cached_state(rank: int, step: int) -> dict:
    """emb0 == emb1 at steps 1, 3 and 4, not at step 2: the items stay, the bytes do not.
    Rank 0's plan is then [emb0] at every step, with emb1 as an alias or without."""
    if rank == 0:
        return {"emb0": vec(2)}
    return {"emb1": vec(3 if step == 2 else 2), "own1": vec(11)}


def _plan_caching(rank, root):
    cfg = shared(root)
    planner, writer = TieredSavePlanner(enable_plan_caching=True), TieredWriter(cfg, 1)
    for step in (1, 2, 3, 4):
        dcp.save(_cached_state(rank, step), storage_writer=writer, planner=planner, checkpoint_id=step)
    wrong = [w for step in (1, 2, 3, 4) for w in loaded_wrong(cfg, step, _cached_state(rank, step))]
    assert not wrong, wrong


SCENARIOS = {
    "tiered": lambda rank, root: _save_twice(rank, root, shared(root)),
    "stock": lambda rank, root: _save_twice(rank, root, shared(root), DefaultSavePlanner, (1,)),
    "nodedup": lambda rank, root: _save_twice(rank, root, shared(root, dedup=False), steps=(1,)),
    "spread": _spread,
    "local": _node_local,
    "replicated": _replicated,
    "cached": _plan_caching,
}


def _job(rank, world, root):
    """Every save of this file's tests, in one pair of processes (two nodes: a rank each);
    what failed, per scenario."""
    failed = {}
    for name, scenario in SCENARIOS.items():
        try:
            scenario(rank, f"{root}/{name}")
        except BaseException:  # DCP's CheckpointException is one
            failed[name] = traceback.format_exc()
        torch.distributed.barrier()
    return failed


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner")
    return root, run_ranks(_job, 2, str(root), env={"LOCAL_WORLD_SIZE": 1})


def ran(run, scenario: str):
    """The root of a scenario that saved and loaded exactly on both ranks."""
    root, failed = run
    for rank, f in enumerate(failed):
        assert scenario not in f, f"rank {rank}:\n{f[scenario]}"
    return root / scenario


def test_bytes_two_ranks_hold_are_written_once_and_both_steps_load(run):
    bucket = ran(run, "tiered") / "bucket"
    # rep (1 MiB), emb (2 MiB: emb0 == emb1), own0 and own1 of two steps (4 x 1 MiB): one block file each
    assert len(block_files(bucket)) == 1 + 2 + 4
    for step in (1, 2):
        idx = indexes(bucket, step)
        holders = [r for r, d in idx.items() if {"emb0", "emb1"} & set(records(d))]
        assert len(holders) == 1, "emb0 and emb1 are recorded by the one rank writing their bytes"
        writer = holders[0]
        recs = records(idx[writer])
        assert recs["emb0"]["blocks"] == recs["emb1"]["blocks"] and recs["emb0"]["rank"] == writer
        assert not refs(bucket, step, 1 - writer) & set(recs["emb0"]["blocks"]), "the other rank put none"
        written = sum(d["written"] for d in idx.values())
        expected = (1 + 2 + 2) * MiB if step == 1 else 2 * MiB  # own0 and own1 change every step
        assert expected <= written < expected + 64 * 1024, (step, written)
    for rank in (0, 1):  # one process alone (another world: resharded routing) loads exactly too
        assert not loaded_wrong(shared(ran(run, "tiered")), 2, state(rank, 2), no_dist=True)
    checks = [c for step in (1, 2) for c in verify_step(shared(ran(run, "tiered")), step)]
    assert checks and all(c.ok for c in checks), [c.problems for c in checks]
    # DCP's own planner: the same blocks, recorded and put by each rank (written twice when both
    # ranks look before either wrote)
    stock = ran(run, "stock") / "bucket"
    idx = indexes(stock, 1)
    emb = records(idx[0])["emb0"]["blocks"]
    assert records(idx[1])["emb1"]["blocks"] == emb
    assert set(emb) <= refs(stock, 1, 0) and set(emb) <= refs(stock, 1, 1)
    assert (1 + 2 + 2) * MiB <= sum(d["written"] for d in idx.values())


def test_the_writes_are_spread_over_the_ranks(run):
    bucket = ran(run, "spread") / "bucket"
    written = {r: d["written"] for r, d in indexes(bucket, 1).items()}
    assert all(2 * MiB <= w < 2 * MiB + 4096 for w in written.values()), written  # each wrote one of two
    assert len(block_files(bucket)) == 4


def test_without_dedup_the_planner_plans_as_dcp_does(run):
    bucket = ran(run, "nodedup") / "bucket"
    assert not block_files(bucket)
    idx = indexes(bucket, 1)
    assert "emb0" in records(idx[0]) and "emb1" in records(idx[1])  # each rank wrote its own
    assert sum(d["size"] for d in idx.values()) >= (1 + 2 * 2 + 2) * MiB


def test_node_local_tier_and_its_writer_process(run):
    ram = ran(run, "local") / "ram"
    idx = {**indexes(ram / "0", 1), **indexes(ram / "1", 1)}
    holders = [r for r, d in idx.items() if {"emb0", "emb1"} & set(records(d))]
    assert len(holders) == 1  # the emb bytes live on one node only, and were loaded from there by both
    emb = set(records(idx[holders[0]])["emb0"]["blocks"])
    assert emb <= block_files(ram / str(holders[0])) and not emb & block_files(ram / str(1 - holders[0]))
    bucket = ran(run, "local") / "bucket"
    assert len(block_files(bucket)) == 1 + 2 + 4
    # the writer processes put each block once, though two records of one part name it
    written = sum(d["written"] for d in indexes(bucket, 1).values())
    assert (1 + 2 + 2) * MiB <= written < (1 + 2 + 2) * MiB + 64 * 1024, written


def test_replicas_carry_the_aliases(run):
    ram = ran(run, "replicated") / "ram"
    for node in (0, 1):  # each node holds both parts: the emb bytes once, named by both records
        idx = indexes(ram / str(node), 1)
        holders = [r for r, d in idx.items() if {"emb0", "emb1"} & set(records(d))]
        assert len(idx) == 2 and len(holders) == 1
        recs = records(idx[holders[0]])
        assert recs["emb0"]["blocks"] == recs["emb1"]["blocks"]
        assert set(recs["emb0"]["blocks"]) <= block_files(ram / str(node))
        assert len(block_files(ram / str(node))) == 1 + 2 + 4


def test_plan_caching_reuses_no_plan_whose_bytes_changed(run):
    bucket = ran(run, "cached") / "bucket"
    emb = [{r: records(d) for r, d in indexes(bucket, step).items()} for step in (1, 2, 3)]
    together = [sum("emb0" in recs and "emb1" in recs for recs in e.values()) for e in emb]
    assert together == [1, 0, 1]  # aliased, then each rank its own, then aliased again (all loaded exactly)


# -- the pass, as a pure function ----------------------------------------------------------


def item(fqn: str, numel: int) -> WriteItem:
    props = TensorProperties(dtype=torch.float32)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))
    data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size([numel]))
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.TENSOR, tensor_data=data)


def plan(rank: int, items: list[WriteItem], content: dict[str, str], dedup: bool = True) -> SavePlan:
    keys = {
        MetadataIndex(i.index.fqn): ContentKey(
            content[i.index.fqn], "torch.float32", 4 * i.tensor_data.size[0]
        )
        for i in items
        if i.index.fqn in content
    }
    data = {WHERE: SaveRank(rank, 0), CONTENT: keys, **({DEDUP: True} if dedup else {})}
    return SavePlan(items, storage_data=data)


def test_the_pass_keeps_one_copy_per_content_and_spreads_them():
    x, y, z = item("x", MiB), item("y", MiB), item("z", MiB // 2)
    x1, y1 = item("x1", MiB), item("y1", MiB)
    plans = [plan(0, [x, y, z], {"x": "X", "y": "Y", "z": "Z"}), plan(1, [x1, y1], {"x1": "X", "y1": "Y"})]
    out = dedup_plans(plans)
    # z only rank 0 holds: planned first; then x on the rank with less planned (1), y on 0
    assert [sorted(i.index.fqn for i in p.items) for p in out] == [["y", "z"], ["x1"]]
    aliases = [[(a.index.fqn, a.source.fqn) for a in p.storage_data[ALIASES]] for p in out]
    assert aliases == [[("y1", "y")], [("x", "x1")]]
    aliases = [a for p in out for a in p.storage_data[ALIASES]]
    assert all(isinstance(a, Alias) and a.shape == (MiB,) for a in aliases)
    assert all(CONTENT not in p.storage_data for p in out)
    # a different dtype or length is other content, even with the same digest
    other = [plan(0, [x], {"x": "X"}), plan(1, [item("w", MiB // 2)], {"w": "X"})]
    assert [len(p.items) for p in dedup_plans(other)] == [1, 1]


def test_the_pass_is_the_identity_unless_every_writer_writes_aliases():
    x, x1 = item("x", MiB), item("x1", MiB)
    plans = [plan(0, [x], {"x": "X"}), plan(1, [x1], {"x1": "X"}, dedup=False)]
    assert dedup_plans(plans) == plans
    assert dedup_plans([SavePlan([x]), SavePlan([x1])]) == [SavePlan([x]), SavePlan([x1])]
