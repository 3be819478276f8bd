"""Recovery as a contract: a damaged or non-finite newest step never stops a resume.

Real files damaged in place, real NaN saved, several real processes on gloo: the newest
step that loads is found on every rank, quarantined and non-finite steps are passed over,
and retention never deletes the last good step.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from tiered_dcp.storage.blocks import BLOCK_BYTES, SCREEN_PIECE, block_id, fingerprints
from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import (
    Marker,
    marker_key,
    metadata_key,
    parse_quarantine,
    part_key,
    read_index,
    step_dir,
)
from tiered_dcp.storage.local import LocalStorage
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import (
    CheckpointCorruptError,
    NoCheckpointError,
    NonFiniteStateError,
    Tier,
    TieredConfig,
    TieredReader,
    TieredWriter,
    latest_step,
    load_latest,
    shutdown,
    wait_for,
    writer_status,
)
from tiered_dcp.api import prune, remove_steps


def config(root: Path | str, **kw) -> TieredConfig:
    """The issue's setup: RAM every=1 keep=2, SSD every=2 keep=2, node-local."""
    return TieredConfig(
        "run",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=2), Tier(f"{root}/ssd/{{node}}", every=2, keep=2)],
        **kw,
    )


def state(step: int, rank: int = 0) -> dict:
    return {"w": torch.full((4096,), float(step * 10 + rank)), "b": torch.arange(64.0) + step}


def flip(path: Path | str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def failure(e: CheckpointException) -> BaseException:
    """The first rank's recorded exception (torch >= 2.7 records (exception, traceback))."""
    f = next(iter(e.failures.values()))
    return f[0] if isinstance(f, tuple) else f


def save_steps(cfg: TieredConfig, steps, make=state) -> None:
    for s in steps:
        dcp.save(make(s), storage_writer=TieredWriter(cfg, step=s))
    shutdown()


def test_a_damaged_newest_step_is_quarantined_and_every_later_load_skips_it(tmp_path, caplog):
    cfg = config(tmp_path)
    save_steps(cfg, [1, 2, 3])  # step 3 is on the RAM tier only
    flip(tmp_path / "ram/0" / part_key("run", 3, 0))

    got = state(0)
    with pytest.raises(CheckpointException) as info:  # plain dcp.load: this load fails once
        dcp.load(got, storage_reader=TieredReader(cfg))
    err = failure(info.value)
    assert isinstance(err, CheckpointCorruptError) and err.step == 3
    assert "quarantined in" in str(err) and "loads step 2" in str(err)
    assert [parse_quarantine(n)[0] for n in os.listdir(tmp_path / "ram/0/run") if parse_quarantine(n)] == [3]

    reader = TieredReader(cfg)  # every later reader (and process) passes it over
    assert reader.step == 2 and "quarantined" in reader.skipped[3]
    assert latest_step(cfg) == 2
    got = state(0)
    dcp.load(got, storage_reader=reader)
    assert torch.equal(got["w"], state(2)["w"]) and torch.equal(got["b"], state(2)["b"])

    with pytest.raises(CheckpointException) as info:  # asked for by number, it still fails
        dcp.load(state(0), storage_reader=TieredReader(cfg, step=3))
    assert isinstance(failure(info.value), CheckpointCorruptError)


def test_load_latest_resumes_from_the_newest_step_that_loads_and_says_what_it_skipped(tmp_path, caplog):
    cfg = config(tmp_path)
    save_steps(cfg, [1, 2, 3])
    flip(tmp_path / "ram/0" / part_key("run", 3, 0))
    got = state(0)
    with caplog.at_level(logging.WARNING, logger="tiered_dcp"):
        assert load_latest(got, cfg) == 2  # no earlier load quarantined it: this one does
    assert torch.equal(got["w"], state(2)["w"])
    warnings = [r.getMessage() for r in caplog.records if "load_latest loaded step 2" in r.getMessage()]
    assert len(warnings) == 1 and "step 3" in warnings[0] and "damaged" in warnings[0]
    assert load_latest(state(0), cfg) == 2  # and again, from the mark


def test_damaged_metadata_on_every_tier_is_quarantined_too(tmp_path):
    cfg = config(tmp_path)
    save_steps(cfg, [1, 2, 4])  # step 4 is on both tiers
    for tier in ("ram", "ssd"):
        flip(tmp_path / tier / "0" / step_dir("run", 4) / "metadata", at=20)
    got = state(0)
    assert load_latest(got, cfg) == 2
    assert torch.equal(got["w"], state(2)["w"])
    assert latest_step(cfg) == 2


def test_without_any_good_step_load_latest_says_so(tmp_path):
    cfg = config(tmp_path)
    with pytest.raises(NoCheckpointError):
        load_latest(state(0), cfg)
    save_steps(cfg, [1])
    flip(tmp_path / "ram/0" / part_key("run", 1, 0))
    with pytest.raises(NoCheckpointError, match="step 1"):
        load_latest(state(0), cfg)


def test_nonfinite_state_is_marked_and_passed_over(tmp_path, caplog):
    cfg = config(tmp_path)
    save_steps(cfg, [1])
    bad = state(2)
    bad["w"][7] = float("nan")
    with caplog.at_level(logging.WARNING, logger="tiered_dcp"):
        dcp.save(bad, storage_writer=TieredWriter(cfg, step=2))
    shutdown()
    assert any("NaN/Inf in 1 item(s) ['w']" in r.getMessage() for r in caplog.records)
    for tier in ("ram", "ssd"):  # the writer process copies the mark down with the marker
        marker = Marker.from_bytes((tmp_path / tier / "0" / marker_key("run", 2)).read_bytes())
        assert marker.nonfinite_items == 1 and marker.nonfinite == ["w"]
    assert latest_step(cfg) == 1
    got = state(0)
    assert load_latest(got, cfg) == 1 and torch.equal(got["w"], state(1)["w"])
    got = state(0)
    dcp.load(got, storage_reader=TieredReader(cfg, step=2))  # by number it loads anyway
    assert torch.isnan(got["w"][7]) and got["w"][0] == 20.0


def test_pruning_by_hand_never_removes_the_last_good_step(tmp_path):
    """A non-finite newer step takes no place: prune(keep=1) keeps the good step 10, and
    remove_steps refuses it without force, as retention after a commit does."""
    cfg = TieredConfig("run", [Tier(f"{tmp_path}/ram/{{node}}")])  # keep all: only prune removes
    bad = state(20)
    bad["w"][3] = float("inf")
    save_steps(cfg, [5, 10])
    dcp.save(bad, storage_writer=TieredWriter(cfg, step=20))
    shutdown()
    removed = prune(cfg, keep=1)
    assert [(r.step, r.removed) for r in removed] == [(5, True)]
    assert latest_step(cfg) == 10
    refused = remove_steps(cfg, [10])
    assert [(r.step, r.removed) for r in refused] == [(10, False)] and "newest good step" in refused[0].why
    assert latest_step(cfg) == 10
    got = state(0)
    assert load_latest(got, cfg) == 10 and torch.equal(got["w"], state(10)["w"])


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_nonfinite_value_is_caught_in_every_float_dtype(tmp_path, value):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    sd = {
        str(dt): torch.zeros(3000, dtype=dt)
        for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    }
    sd["ints"] = torch.arange(10)
    for i, key in enumerate(sd):
        if key != "ints":
            one = {k: v.clone() for k, v in sd.items()}
            one[key][2999 - i] = value  # the last row of the screen, and the tail beyond it
            dcp.save(one, storage_writer=TieredWriter(cfg, step=i))
            marker = Marker.from_bytes((tmp_path / "ram" / marker_key("run", i)).read_bytes())
            assert marker.nonfinite == [key], key
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=9))
    assert Marker.from_bytes((tmp_path / "ram" / marker_key("run", 9)).read_bytes()).finite
    shutdown()


def test_the_largest_finite_values_are_not_taken_for_nonfinite(tmp_path):
    """The screen reads each value's exponent bits: values whose sum would overflow (every
    element at its dtype's largest finite magnitude) are finite, in every float dtype."""
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    sd = {}
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        big = torch.full((3000,), torch.finfo(dt).max, dtype=dt)
        big[1::2] = torch.finfo(dt).min
        sd[str(dt)], sd[f"{dt}-tiny"] = big, torch.full((3000,), torch.finfo(dt).tiny / 2, dtype=dt)
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=1))
    assert Marker.from_bytes((tmp_path / "ram" / marker_key("run", 1)).read_bytes()).finite
    shutdown()


def test_every_tiers_index_says_an_item_was_nonfinite_blocks_included(tmp_path):
    """The writer process copies a record with its item's facts, ``nonfinite`` among them,
    whether the item is stored in the part or as blocks (dedup)."""
    cfg = config(tmp_path, dedup=True)
    sd = {"big": torch.zeros(BLOCK_BYTES), "small": torch.zeros(16)}  # 4 MiB of float32: blocks
    sd["big"][5] = sd["small"][3] = float("nan")
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=2))
    shutdown()
    for tier in ("ram", "ssd"):
        index = read_index(LocalStorage(str(tmp_path / tier / "0")), "run", 2, 0, 1 << 30)
        recs = {k.fqn: r for k, r in index.records.items()}
        assert recs["big"].blocks is not None and recs["small"].blocks is None, tier
        assert recs["big"].info.nonfinite and recs["small"].info.nonfinite, tier


@pytest.mark.parametrize("dedup", [False, True])
def test_a_nonfinite_value_deep_in_a_large_tensor_is_caught_and_an_unchanged_block_keeps_its_answer(
    tmp_path, dedup
):
    """The check runs piece by piece beside the hash: a NaN in the last piece of a later
    chunk (or 1 MiB block) is found in float32 and bfloat16; with dedup an unchanged block
    keeps its answer in the next save, and its fix is seen; float16 values whose row sums
    overflow are still finite (the element-wise fallback)."""
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"), keep=5)], dedup=dedup)
    n = (9 << 20) // 4  # 9 MiB of float32: two 8 MiB chunks, or nine 1 MiB blocks
    sd = {
        "f32": torch.zeros(n),
        "bf16": torch.zeros(2 * n, dtype=torch.bfloat16),
        "f16": torch.full((1 << 19,), 60000.0, dtype=torch.float16),  # finite; row sums overflow
    }
    marks = lambda step: Marker.from_bytes((tmp_path / "ram" / marker_key("run", step)).read_bytes())  # noqa: E731
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=1))
    assert marks(1).finite
    sd["f32"][n - 5] = float("nan")
    sd["bf16"][(9 << 20) // 2 - 700_000] = float("-inf")  # the 9th MiB, two pieces before the end
    for step in (2, 3):  # step 3: the same bytes again (dedup: the blocks' remembered answers)
        dcp.save(sd, storage_writer=TieredWriter(cfg, step=step))
        assert marks(step).nonfinite == ["bf16", "f32"], step
    sd["f32"][n - 5] = 0.0
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=4))
    assert marks(4).nonfinite == ["bf16"]
    shutdown()


def test_a_screen_runs_once_per_block_and_only_where_asked():
    """``fingerprints``: a screen sees every byte of a chunk (piece by piece) on the first
    call, and a block's answer is remembered for the next call (also when the planner
    named the block); a block first hashed without the screen is screened when asked."""
    seen: list[int] = []

    def screen(piece: memoryview) -> bool:
        seen.append(len(piece))
        return bytes(piece[:1]) != b"\xff"

    good, bad = (memoryview(bytes([v]) * (SCREEN_PIECE + 10)) for v in (0, 0xFF))
    got = fingerprints([good, bad], [True, True], [None, None], [screen, screen])
    assert [p.passed for p in got] == [True, False] and sum(seen) == len(good) + SCREEN_PIECE
    seen.clear()
    again = fingerprints([good, bad], [True, True], [p.block for p in got], [screen, screen])
    assert again == got and seen == []
    other = memoryview(bytes([1]) * 100)
    fingerprints([other], [True], [None])  # no screen
    (p,) = fingerprints([other], [True], [block_id(other)], [screen])
    assert p.passed and seen == [100] and p.checksum == checksum(other)


def test_on_nonfinite_raise_fails_the_save_before_it_is_committed(tmp_path):
    cfg = config(tmp_path, on_nonfinite="raise")
    save_steps(cfg, [1])
    bad = state(2)
    bad["b"][0] = float("inf")
    with pytest.raises(CheckpointException) as info:
        dcp.save(bad, storage_writer=TieredWriter(cfg, step=2))
    shutdown()
    err = failure(info.value)
    assert isinstance(err, NonFiniteStateError) and "'b'" in str(err) and "step 2" in str(err)
    assert not (tmp_path / "ram/0" / marker_key("run", 2)).exists()
    assert latest_step(cfg) == 1


def test_on_nonfinite_ignore_saves_and_loads_as_any_step(tmp_path):
    cfg = config(tmp_path, on_nonfinite="ignore")
    bad = state(1)
    bad["w"][0] = float("nan")
    dcp.save(bad, storage_writer=TieredWriter(cfg, step=1))
    shutdown()
    assert latest_step(cfg) == 1
    with pytest.raises(ValueError, match="on_nonfinite"):
        config(tmp_path, on_nonfinite="skip")


def test_retention_never_deletes_the_last_good_step(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"), every=1, keep=2)])
    steps = lambda: sorted(int(n[5:]) for n in os.listdir(tmp_path / "ram/run") if n[5:].isdigit())  # noqa: E731
    save_steps(cfg, [1, 2])
    for s in (3, 4, 5):  # K+1 non-finite steps in a row
        bad = state(s)
        bad["w"][1] = float("nan")
        dcp.save(bad, storage_writer=TieredWriter(cfg, step=s))
    assert steps() == [1, 2, 3, 4, 5]  # the kept good steps stay; bad ones take no place
    assert load_latest(state(0), cfg) == 2
    save_steps(cfg, [6])
    assert steps() == [2, 3, 4, 5, 6]  # bad steps go once older than every kept good step
    save_steps(cfg, [7])
    assert steps() == [6, 7]

    flip(tmp_path / "ram" / part_key("run", 7, 0))  # a quarantined step takes no place either
    assert load_latest(state(0), cfg) == 6
    save_steps(cfg, [8])
    assert steps() == [6, 7, 8]
    save_steps(cfg, [9])
    assert steps() == [8, 9]
    assert not [n for n in os.listdir(tmp_path / "ram/run") if parse_quarantine(n)]  # its mark went with it


# -- several ranks -------------------------------------------------------------------------


def _four_ranks_two_nodes(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    def mine(step: int) -> dict:  # each rank's own items (DCP writes a replicated value once)
        return {f"{k}.{rank}": v for k, v in state(step, rank).items()}

    cfg = config(root)
    save_steps(cfg, [1, 2, 3], mine)
    dist.barrier()
    if rank == 2:  # step 3 is on the RAM tier only; its only copy of rank 2's part is on node 1
        flip(Path(root) / "ram/1" / part_key("run", 3, 2))
    dist.barrier()
    got = mine(0)
    planned = []  # DCP's plan collectives (``_DistWrapper``: gathered to rank 0, scattered back)
    for name in ("gather_object", "scatter_object_list", "all_gather_object", "broadcast_object_list"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: planned.append(_name) or _real(*a, **k))
    step = load_latest(got, cfg)
    by_load = list(planned)  # the load's own (the saves below plan through rank 0, as DCP's do)
    exact = all(torch.equal(got[k], v) for k, v in mine(2).items())
    after = TieredReader(cfg).step  # a plain reader afterwards: the mark is seen by every rank
    bad = mine(4)  # NaN on one rank only: the step is non-finite for all
    if rank == 3:
        bad["b.3"][5] = float("nan")
    dcp.save(bad, storage_writer=TieredWriter(cfg, step=4))
    shutdown()
    dist.barrier()
    got = mine(0)
    nonfinite = load_latest(got, cfg)
    exact_nf = all(torch.equal(got[k], v) for k, v in mine(2).items())
    return {
        "step": step,
        "exact": exact,
        "after": after,
        "nonfinite": nonfinite,
        "exact_nf": exact_nf,
        "planned": by_load,
    }


def test_four_ranks_two_nodes_resume_from_the_older_step_on_every_rank(tmp_path):
    """Rank 2's only copy of its part of step 3 is damaged: its load fails there alone, every
    rank learns it (the outcome agreed after each rank planned its reads alone, no plan
    gathered through rank 0) and passes step 3 over, loading step 2 exactly."""
    results = run_ranks(_four_ranks_two_nodes, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": 2})
    for r in results:
        want = {"step": 2, "exact": True, "after": 2, "nonfinite": 2, "exact_nf": True, "planned": []}
        assert r == want, results


def test_a_step_saved_again_is_judged_by_its_new_save_not_an_older_copy_on_a_slower_tier(tmp_path):
    """NaN at step 3, a resume from 2, step 3 saved again (finite) while the SSD still holds
    the old save of step 3: the step is judged by its new save, and loaded from it."""
    cfg = TieredConfig("run", [Tier(f"{tmp_path}/ram", every=1, keep=2), Tier(f"{tmp_path}/ssd", every=3)])
    save_steps(cfg, [1, 2])
    bad = state(3)
    bad["w"][0] = float("nan")
    dcp.save(bad, storage_writer=TieredWriter(cfg, step=3))
    wait_for(cfg, 3, timeout=60)  # the NaN save of step 3 is on the SSD too
    assert load_latest(state(0), cfg) == 2
    (writer,) = writer_status(cfg)
    os.kill(writer.pid, signal.SIGSTOP)  # the slower tier lags (a bucket, an outage)
    try:
        again = state(3)
        again["w"][1] = 123.0  # not the old bytes anywhere
        dcp.save(again, storage_writer=TieredWriter(cfg, step=3))
        assert latest_step(cfg) == 3
        got = state(0)
        assert load_latest(got, cfg) == 3
        assert torch.equal(got["w"], again["w"]) and torch.equal(got["b"], again["b"])
    finally:
        os.kill(writer.pid, signal.SIGCONT)
        shutdown()


def _raise_on_one_rank(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    cfg = TieredConfig("run", [Tier(f"{root}/ram/{{node}}")], replication_factor=2, on_nonfinite="raise")
    sd = {f"w.{rank}": torch.full((4096,), float(rank))}
    dcp.save(sd, storage_writer=TieredWriter(cfg, step=1))
    if rank == 1:
        sd["w.1"][9] = float("-inf")
    try:
        dcp.save(sd, storage_writer=TieredWriter(cfg, step=2))
        raised = None
    except CheckpointException as e:
        raised = [type(failure(e)).__name__, str(failure(e))]
    shutdown()
    dist.barrier()
    return {"raised": raised, "latest": TieredReader(cfg).step}


def test_on_nonfinite_raise_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """Two ranks on two nodes, replicas swapped: the rank holding Inf refuses, the other is
    told through the commit agreement (not left waiting), and no root commits the step."""
    results = run_ranks(_raise_on_one_rank, 2, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}, timeout=60)
    for r in results:
        assert r["raised"][0] == "NonFiniteStateError" and "w.1" in r["raised"][1], results
        assert r["latest"] == 1
    assert not list(tmp_path.glob("ram/*/" + marker_key("run", 2)))


def test_an_excluded_step_is_passed_over_with_the_reason_its_caller_gives():
    from tiered_dcp.steps.choice import Choice, StepMarks, choose

    steps = {s: StepMarks(s) for s in (1, 2, 3)}
    assert choose(steps, exclude={3}).skipped == {3: "it failed to load just now"}
    got = choose(steps, exclude={3: "no iteration directory names it", 2: ""})
    assert got.step == 1
    assert got.skipped == {3: "no iteration directory names it", 2: "it failed to load just now"}
    got = choose(steps, exclude={4: "gone"})  # not among the candidates (a shared tier left it out)
    assert got.step == 3 and got.skipped == {4: "gone"}
    assert choose({}, exclude={4: "gone"}) == Choice(None, {4: "gone"})


def _damaged_shared_metadata(rank: int, world: int, root: str) -> tuple[int, bool]:
    import torch.distributed as dist

    cfg = TieredConfig("run", [Tier(f"{root}/bucket", shared=True)])
    own = lambda step: {f"w{rank}": state(step, rank)["w"]}  # noqa: E731 - each rank's own item
    for step in (1, 2):
        dcp.save(own(step), storage_writer=TieredWriter(cfg, step=step))
    shutdown()
    dist.barrier()
    if rank == 0:  # the newest step's metadata damaged in place: same size, one byte flipped
        flip(Path(root) / "bucket" / metadata_key("run", 2))
    dist.barrier()
    got = own(0)
    step = load_latest(got, cfg)
    return step, torch.equal(got[f"w{rank}"], own(step)[f"w{rank}"])


def test_metadata_damaged_on_a_shared_tier_lets_every_rank_resume_from_the_step_before(tmp_path):
    """With a process group the damaged metadata is found as the step is opened, on every
    rank alike, so load_latest chooses again (it came out of DCP's read_metadata as a bare
    AssertionError, and the resume stopped), and rank 0 alone marks the bucket."""
    results = run_ranks(_damaged_shared_metadata, 3, str(tmp_path), env={"LOCAL_WORLD_SIZE": 1}, timeout=120)
    assert results == [(1, True)] * 3, results
    # every rank found it alike: the bucket holds one quarantine mark (rank 0's), not one per rank
    marks = [n for n in os.listdir(tmp_path / "bucket" / "run") if parse_quarantine(n) is not None]
    assert [parse_quarantine(n)[0] for n in marks] == [2], marks


def test_a_load_planner_with_a_global_plan_of_its_own_keeps_dcp_s_planning():
    """``load_latest`` plans each rank's reads alone only where DCP's global plan would change
    nothing: its default planner's (and a subclass's that keeps it); a planner of the user's
    that works across the ranks' plans gets DCP's gather and scatter."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from tiered_dcp.load.resume import _plans_globally

    class Across(DefaultLoadPlanner):
        def create_global_plan(self, global_plan):
            return global_plan[::-1][::-1]

    assert not _plans_globally(None) and not _plans_globally(DefaultLoadPlanner())
    assert not _plans_globally(type("Keeps", (DefaultLoadPlanner,), {})())
    assert _plans_globally(Across())
