"""Data-parallel replicas compared at the save: a step whose copies disagree is never the
resume point while the step before it is whole; the message names the item, the ranks and
their nodes; nothing is reported when nothing differs. Real processes on gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from said import kept_warnings
from tiered_dcp.storage.format import Marker, marker_key
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tiered_dcp import Tier, TieredConfig, TieredSavePlanner, TieredWriter, latest_step, load_latest, shutdown
from tiered_dcp.metrics.scores import suspects
from tiered_dcp.writer_process.timings import Kind, read_records


def flip_bit(t: torch.Tensor, byte: int = 3, bit: int = 0) -> None:
    """Flip one bit of ``t``'s bytes in place (a replica gone bad)."""
    raw = t.view(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit


def ram_config(root: str, ns: str, **kw) -> TieredConfig:
    return TieredConfig(ns, [Tier(f"{root}/ram/{{node}}", keep=8)], **kw)


def marker(root: str, ns: str, step: int, node: int = 0) -> Marker:
    with open(f"{root}/ram/{node}/{marker_key(ns, step)}", "rb") as f:
        return Marker.from_bytes(f.read())


# -- HSDP-style DTensors on 4 ranks as 2 nodes ---------------------------------------------


def hsdp_state(mesh, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    full = torch.randn(64, 32, generator=g)
    return {
        "w": distribute_tensor(full, mesh, [Replicate(), Shard(0)]),
        "b": torch.randn(40, generator=g),
        "i": torch.arange(24, dtype=torch.int64) * step,
        "h": torch.randn(48, generator=g).to(torch.bfloat16),
    }


def _save(state: dict, cfg: TieredConfig, step: int, mode: str, planner=None) -> None:
    writer = TieredWriter(cfg, step=step)
    if mode == "sync":
        dcp.save(state, storage_writer=writer, planner=planner)
    else:
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        dcp.async_save(state, storage_writer=writer, planner=planner, async_checkpointer_type=kind).result()


def _hsdp_job(rank, world, root, ns, mode, dedup):
    said = kept_warnings()
    cfg = ram_config(root, ns, dedup=dedup)
    planner = TieredSavePlanner() if dedup else None
    mesh = init_device_mesh("cpu", (2, 2))
    for step in (1, 2, 3, 4):
        state = hsdp_state(mesh, step)
        if step == 2 and rank == 3:
            flip_bit(state["w"].to_local(), byte=17, bit=5)  # rank 3's replica of its w shard
        if step == 4 and rank == 2:
            state["b"][7] += 1.0  # rank 2's b differs from the other three copies
        _save(state, cfg, step, mode, planner)
    got = hsdp_state(mesh, 0)
    resumed = load_latest(got, cfg)
    ok = torch.equal(got["w"].to_local(), hsdp_state(mesh, resumed)["w"].to_local())
    dist.barrier()
    shutdown()
    return {"resumed": resumed, "latest": latest_step(cfg), "said": said, "exact": ok}


@pytest.mark.parametrize(("mode", "dedup"), [("async", False), ("sync", True)])
def test_hsdp_replicas_that_disagree_are_named_and_never_resumed(tmp_path, mode, dedup):
    root, ns = str(tmp_path), f"hsdp-{mode}"
    out = run_ranks(_hsdp_job, 4, root, ns, mode, dedup, env={"LOCAL_WORLD_SIZE": 2})
    assert [o["resumed"] for o in out] == [3] * 4, out  # 4 and 2 disagree; 3 is whole
    assert all(o["exact"] for o in out) and out[0]["latest"] == 3
    m2, m4 = marker(root, ns, 2), marker(root, ns, 4)
    assert (m2.replica_mismatch, m2.replica_ranks) == (["w"], [1, 3])  # two copies: both named
    assert (m4.replica_mismatch, m4.replica_ranks) == (["b"], [2])  # four copies: the odd one
    assert marker(root, ns, 1).replicas_agree and marker(root, ns, 3).replicas_agree
    lines = [line for line in out[0]["said"] if "replicas of" in line]
    assert len(lines) == 2, out[0]["said"]
    assert (
        "step 2: replicas of 'w'" in lines[0]
        and "rank 1 (node 0) and rank 3 (node 1) hold different" in lines[0]
    )
    assert "step 4: replicas of 'b'" in lines[1] and "rank 2 (node 1) differs from ranks 0, 1, 3" in lines[1]
    assert "DCP saves one copy" in lines[1]
    assert not any("replicas of" in line for o in out[1:] for line in o["said"])  # the coordinator says it


# -- DDP on 2 ranks: a float, a bf16 and an int tensor, one bit flipped at chosen steps ----


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.register_buffer("scale", torch.ones(8, dtype=torch.bfloat16))
        self.register_buffer("seen", torch.zeros(4, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.lin(x) * self.scale.float()


FLIPS = {2: (1, "lin.weight"), 4: (0, "scale"), 6: (1, "seen")}  # step -> (rank, the tensor flipped)


def _ddp_job(rank, world, root, ns, mode, dedup):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel

    said = kept_warnings()
    cfg = ram_config(root, ns, dedup=dedup)
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 8):
        torch.manual_seed(step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        bad = FLIPS.get(step)
        if bad is not None and bad[0] == rank:  # one bit of this rank's copy goes bad...
            flip_bit(msd[bad[1]], byte=5, bit=6)
        _save(state, cfg, step, mode, TieredSavePlanner() if dedup else None)
        if bad is not None and bad[0] == rank:  # ...and is put right after the save (DDP would not)
            flip_bit(msd[bad[1]], byte=5, bit=6)
    got = {"model": get_state_dict(model, opt)[0]}
    resumed = load_latest(got, cfg)
    dist.barrier()
    shutdown()
    return {"resumed": resumed, "said": said}


@pytest.mark.parametrize(("mode", "dedup"), [("async", True), ("sync", False), ("process", False)])
def test_ddp_one_flipped_bit_marks_its_step_in_every_dtype(tmp_path, mode, dedup):
    root, ns = str(tmp_path), f"ddp-{mode}"
    out = run_ranks(_ddp_job, 2, root, ns, mode, dedup, env={"LOCAL_WORLD_SIZE": 1})
    assert [o["resumed"] for o in out] == [7, 7]  # the newest step is whole
    for step in range(1, 8):
        m = marker(root, ns, step)
        if step in FLIPS:
            assert (m.replica_mismatch, m.replica_ranks) == ([f"model.{FLIPS[step][1]}"], [0, 1]), step
        else:
            assert m.replicas_agree, (step, m.replica_mismatch)  # the control: nothing differs, nothing said
    recs = read_records(ram_config(root, ns), Kind.REPLICAS)  # the job's records: a line each
    assert [(r.step, r.item, r.odd, r.odd_nodes) for r in recs] == [
        (s, f"model.{name}", (0, 1), (0, 1)) for s, (_, name) in FLIPS.items()
    ]
    assert [s.rank for s in suspects(recs)] == [0, 1]  # named at two steps or more
    if mode != "process":  # DCP's process saves: their log is that process's
        lines = [line for line in out[0]["said"] if "replicas of" in line]
        assert [line.split(":")[0] for line in lines] == ["step 2", "step 4", "step 6"], lines
        assert all("rank 0 (node 0) and rank 1 (node 1)" in line for line in lines)


def _ddp_batchnorm_job(rank, world, root):
    from torch.nn.parallel import DistributedDataParallel

    said = kept_warnings()
    cfg = ram_config(root, "bn")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(1, 5):
        torch.manual_seed(100 * step + rank)  # each rank its own batch: its own running statistics
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        _save({"model": model.state_dict()}, cfg, step, "async")
    got = {"model": model.state_dict()}
    resumed = load_latest(got, cfg)
    dist.barrier()
    shutdown()
    return {"resumed": resumed, "said": said}


def test_ddp_batchnorm_statistics_kept_per_rank_do_not_mark_every_step(tmp_path):
    """DDP with BatchNorm: each rank updates the running statistics from its own batch, so
    their copies differ at every save, by design (stock DCP saves one of them). The first save
    that shows it is marked; from the next, the values are known to be per rank and said
    once: the job's newest step resumes (before: every step was marked, none could)."""
    out = run_ranks(_ddp_batchnorm_job, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})
    assert [o["resumed"] for o in out] == [4, 4]
    assert [marker(str(tmp_path), "bn", s).replicas_agree for s in range(2, 5)] == [True, True, True]
    first = tmp_path / "ram/0" / marker_key("bn", 1)  # marked, then dropped once good steps came
    assert not first.exists() or not marker(str(tmp_path), "bn", 1).replicas_agree
    per_rank = [line for line in out[0]["said"] if "differed at two saves in a row" in line]
    assert sorted(line.split("'")[1] for line in per_rank) == [
        "model.module.1.running_mean",
        "model.module.1.running_var",
    ], out[0]["said"]


def _stays_bad_job(rank, world, root):
    cfg = ram_config(root, "stays")
    for step in range(1, 5):
        w = torch.arange(64.0) + step  # a replica on every rank
        if rank == 2 and step >= 2:  # one bit of rank 2's copy goes bad and stays bad
            flip_bit(w, byte=5, bit=6)
        _save({"w": w}, cfg, step, "sync")
    got = {"w": torch.zeros(64)}
    resumed = load_latest(got, cfg)
    dist.barrier()
    shutdown()
    return resumed


def test_one_rank_s_copy_that_stays_bad_is_marked_at_every_save(tmp_path):
    """Unlike a value kept per rank (no majority), a copy one rank keeps apart from two that
    agree is a fault at every save that shows it: it is never taken for a per-rank value."""
    assert run_ranks(_stays_bad_job, 3, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}) == [1, 1, 1]
    for step in (2, 3, 4):
        m = marker(str(tmp_path), "stays", step)
        assert (m.replica_mismatch, m.replica_ranks) == (["w"], [2]), step


def _coordinator_fails_job(rank, world, root):
    import time

    from tiered_dcp.steps import metadata

    cfg = ram_config(root, "fails", peer_timeout=10.0)
    if rank == 0:  # the coordinator fails in its verdict, before it compares the replicas

        def broken(*args, **kwargs):
            raise ValueError("the records could not be read")

        metadata.records_from_json = broken
    started = time.monotonic()
    try:
        _save({"x": torch.arange(8.0)}, cfg, 1, "sync")  # "x": a replica on each rank
        error = ""
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = str(_failure(e))
    took = time.monotonic() - started
    dist.barrier()
    shutdown()
    return {"error": error, "took": took}


def test_a_coordinator_failing_before_the_comparison_leaves_no_rank_waiting(tmp_path):
    """Rank 1 holds a replica, so it waits for the coordinator's question; the coordinator
    fails first. Rank 1 learns it at once, with the coordinator's error (before: it waited
    twice the peer timeout for the question, then blamed rank 0 as lost)."""
    out = run_ranks(_coordinator_fails_job, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})
    assert all("the records could not be read" in o["error"] for o in out), out
    assert out[1]["took"] < 10, out


# -- what a disagreement does (``on_replica_mismatch``), on either commit protocol -----------


def _failure(e: BaseException) -> BaseException:
    """The library's error inside DCP's ``CheckpointException`` (the first rank's)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) else first


def _policies_job(rank, world, root):
    said = kept_warnings()
    out = {}
    tiers = {"ram": [Tier(f"{root}/ram/{{node}}", keep=8)], "shared": [Tier(f"{root}/bucket", shared=True)]}
    for policy in ("mark", "raise", "warn", "ignore"):
        for where in ("ram", "shared"):
            cfg = TieredConfig(f"{policy}-{where}", tiers[where], on_replica_mismatch=policy)
            _save({"x": torch.arange(8.0), "n": torch.tensor(3)}, cfg, 1, "sync")
            # the user's own mistake: a value of each rank's own under one key
            mine = {"x": torch.arange(8.0) + rank, "n": torch.tensor(3)}
            try:
                _save(mine, cfg, 2, "async" if where == "ram" else "sync")
                out[(policy, where)] = ["saved", latest_step(cfg)]
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                inner = _failure(e)
                out[(policy, where)] = [
                    type(inner).__name__,
                    latest_step(cfg),
                    str(inner),
                    inner.items,
                    inner.ranks,
                ]
    dist.barrier()
    shutdown()
    return out, said


def test_each_policy_on_either_commit_protocol_and_the_users_own_mistake(tmp_path):
    (out, said), (other, _) = run_ranks(_policies_job, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1})
    for where in ("ram", "shared"):
        assert out[("mark", where)] == ["saved", 1], where  # committed, marked, passed over
        assert out[("warn", where)] == ["saved", 2] and out[("ignore", where)] == ["saved", 2]
        kind, latest, message, items, ranks = out[("raise", where)]
        assert (kind, latest, items, ranks) == ("ReplicaMismatchError", 1, ("x",), (0, 1)), out[
            ("raise", where)
        ]
        assert "step 2" in message and "'x'" in message and "rank 0 (node 0) and rank 1 (node 1)" in message
        assert "DCP saves one copy of a key that several ranks hold" in message
        assert other[("raise", where)][0] == "ReplicaMismatchError"  # on every rank
    lines = [line for line in said if "replicas of 'x'" in line]
    assert len(lines) == 6  # mark, raise, warn on both tiers; ignore compares nothing
    assert not any("'n'" in line for line in said)  # the copies that agree: nothing said


# -- a healthy job: no false report ----------------------------------------------------------

# 200 here (about 20 s); the thousand saves the target names: TDCP_HEALTHY_SAVES=1000
HEALTHY_SAVES = int(os.environ.get("TDCP_HEALTHY_SAVES", "200"))


def _healthy_job(rank, world, root, saves):
    said = kept_warnings()
    cfg = TieredConfig("healthy", [Tier(f"{root}/ram/{{node}}", keep=2)], dedup=True)
    g = torch.Generator().manual_seed(0)
    shared = {"w": torch.randn(64, 64, generator=g), "h": torch.randn(300, generator=g).to(torch.bfloat16)}
    own = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    for step in range(1, saves + 1):
        shared["w"].mul_(0.999).add_(1e-3)  # every rank steps alike: bitwise equal copies
        state = {**shared, "n": torch.tensor([step]), f"own{rank}": own + step, "meta": {"step": step}}
        _save(
            state, cfg, step, "sync" if step % 3 == 0 else "async", TieredSavePlanner() if step % 2 else None
        )
    dist.barrier()
    shutdown()
    return [line for line in said if "replica" in line]


def test_many_saves_of_a_healthy_job_report_nothing(tmp_path):
    out = run_ranks(_healthy_job, 2, str(tmp_path), HEALTHY_SAVES, env={"LOCAL_WORLD_SIZE": 1}, timeout=900)
    assert out == [[], []]
    cfg = ram_config(str(tmp_path), "healthy")
    assert read_records(cfg, Kind.REPLICAS) == [] and latest_step(cfg) == HEALTHY_SAVES
    assert marker(str(tmp_path), "healthy", HEALTHY_SAVES).replicas_agree


# -- a sync save of device state: digests computed where the copies lie ----------------------


def _device_digest_job(rank, world, root):
    from tiered_dcp.save import replica_check

    replica_check.HOST.clear()  # CPU tensors digested as a GPU's would be, on their "device"
    cfg = ram_config(root, "device")
    for step in (1, 2, 3):
        state = {"w": torch.arange(64.0).to(torch.bfloat16), f"own{rank}": torch.full((8,), float(rank))}
        if step == 2 and rank == 1:
            flip_bit(state["w"], byte=9, bit=2)
        _save(state, cfg, step, "sync")
    dist.barrier()
    shutdown()
    return latest_step(cfg)


def test_a_sync_save_digests_device_copies_where_they_lie(tmp_path):
    assert run_ranks(_device_digest_job, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}) == [3, 3]
    m1, m2, m3 = (marker(str(tmp_path), "device", s) for s in (1, 2, 3))
    assert (
        m1.replicas_agree and m3.replicas_agree and (m2.replica_mismatch, m2.replica_ranks) == (["w"], [0, 1])
    )
