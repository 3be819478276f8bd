"""The pieces of the replica comparison, one process: the groups found while planning, the
digests, the naming of what differs, the marker, the choice, ls and verify, the suspects."""

from __future__ import annotations

import dataclasses
import sys
from array import array

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiered_dcp.planners.replicas import GROUPS, KEYS, NO_GROUPS, KnownKeys, find_groups, item_key
from tiered_dcp.storage.format import Marker, PartInfo, marker_key
from tiered_dcp.storage.records import DamagedRecord
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from tiered_dcp import Tier, TieredConfig, TieredWriter, latest_step
from tiered_dcp.metrics.scores import suspects
from tiered_dcp.save.replica_check import device_digest
from tiered_dcp.steps.choice import StepMarks, choose
from tiered_dcp.steps.replicas import Disagreement, Mark, Refuse, mismatched, name
from tiered_dcp.writer_process.timings import Kind, TimingRecord


def keys(*items: tuple[str, int]) -> bytes:
    return array("Q", (item_key(MetadataIndex(fqn, torch.Size([off, 0]))) for fqn, off in items)).tobytes()


def test_ddp_is_one_group_of_every_rank():
    found = find_groups([keys(("w", 0), ("b", 0))] * 3)
    assert all(g.ids == found[0].ids and len(g.ids) == 1 and g.world for g in found)
    assert array("i", found[0].of_item).tolist() == [0, 0]


def test_hsdp_is_a_group_per_shard_and_one_for_what_every_rank_holds():
    even, odd = keys(("w", 0), ("b", 0)), keys(("w", 32), ("b", 0))
    g = find_groups([even, odd, even, odd])  # a (2, 2) mesh, w as [Replicate(), Shard(0)]
    assert g[0] == g[2] and g[1] == g[3] and g[0] != g[1]
    (w0, b0), (w1, b1) = ([g[r].ids[i] for i in array("i", g[r].of_item)] for r in (0, 1))
    assert b0 == b1 and len({w0, w1, b0}) == 3  # b: every rank; w: one group per shard


def test_a_sharded_state_has_no_group_but_a_plain_tensor_every_rank_holds_has_one():
    assert find_groups([keys(("w", 0)), keys(("w", 8))]) == [NO_GROUPS, NO_GROUPS]
    g = find_groups([keys(("w", 0), ("step", 0)), keys(("w", 8), ("step", 0))])
    assert [array("i", x.of_item).tolist() for x in g] == [[-1, 0], [-1, 0]] and g[0].ids == g[1].ids


def test_the_pass_hands_each_plan_its_groups_and_keeps_the_last_keys_of_a_cached_plan():
    known = KnownKeys()
    plans = [SavePlan([], storage_data={KEYS: keys(("w", 0))}) for _ in range(2)]
    first = known.assign_groups(plans)
    assert all(KEYS not in p.storage_data and p.storage_data[GROUPS].world for p in first)
    cached = [SavePlan([], usable=False), dataclasses.replace(plans[1])]  # rank 0: DCP's cached plan
    again = known.assign_groups(cached)
    assert again[0] is cached[0] and again[1].storage_data[GROUPS] == first[1].storage_data[GROUPS]


def _said(values, world=(0, 0, 1, 1)) -> Disagreement:
    return Disagreement(2, "w", (0,), values, {r: world[r] for v in values for r in v})


def test_the_line_names_the_odd_copy_of_three_or_more_and_both_of_two():
    three = _said(((0, 1, 3), (2,)))
    assert three.odd == (2,) and "rank 2 (node 1) differs from ranks 0, 1, 3 (nodes 0, 1)" in three.line()
    two = _said(((0,), (2,)))
    assert two.odd == (0, 2) and "rank 0 (node 0) and rank 2 (node 1) hold different values" in two.line()
    tie = _said(((0, 1), (2, 3)))
    assert tie.majority is None and tie.odd == (0, 1, 2, 3)
    assert all(d.line().startswith("step 2: replicas of 'w' disagree") for d in (three, two, tie))
    assert "DCP saves one copy of a key that several ranks hold" in two.line()
    assert Disagreement.from_json(three.to_json()) == three


def test_only_groups_whose_digests_differ_are_asked_and_only_differing_items_named():
    words = {0: {"g1": "a", "g2": "x"}, 1: {"g1": "a", "g2": "y"}, 2: {"g2": "x"}}
    assert mismatched(words) == {"g2": [0, 1, 2]}
    answers = {r: {"g2": [["b", [0], "x1"], ["w", [4], d]]} for r, d in ((0, "x2"), (1, "xBAD"), (2, "x2"))}
    (d,) = name(7, answers, [0, 0, 1])
    assert (d.item, d.offset, d.odd, d.nodes[1]) == ("w", (4,), (1,), 0)
    mixed = {0: {"g": [["w", [0], "x1"]]}, 1: {"g": [["w", [0], "d1"]]}}  # host vs device: not compared
    assert name(7, mixed, [0, 0]) == []


def test_the_policies_mark_or_refuse():
    found = [_said(((0, 1, 3), (2,)))]
    assert Mark().marker_fields(found) == {
        "replica_mismatch_items": 1,
        "replica_mismatch": ["w"],
        "replica_ranks": [2],
    }
    assert Mark().marker_fields([]) == {} and Refuse().refusal(2, "t", []) is None
    refusal = Refuse().refusal(2, "/tier", found)
    assert refusal["kind"] == "replica mismatch" and refusal["ranks"] == [2] and refusal["items"] == ["w"]


def _marker(**kw) -> Marker:
    return Marker(5, "run", 2, [PartInfo(0, 0, 10), PartInfo(1, 1, 10)], 100, 42, created=1.0, **kw)


def test_a_marker_whose_replicas_agreed_reads_as_before_and_a_marked_one_round_trips():
    plain = _marker()
    assert b"replica_" not in plain.to_bytes() and Marker.from_bytes(plain.to_bytes()).trusted
    marked = _marker(replica_mismatch_items=3, replica_mismatch=["b", "w"], replica_ranks=[1])
    back = Marker.from_bytes(marked.to_bytes())
    assert back == marked and not back.replicas_agree and not back.trusted
    for bad in ({"replica_ranks": [2]}, {"replica_mismatch": ["x"] * 17}, {"replica_mismatch_items": -1}):
        with pytest.raises(DamagedRecord):
            Marker.from_bytes(dataclasses.replace(marked, **bad).to_bytes())


def test_loads_pass_a_step_with_disagreeing_replicas_over_and_say_why():
    marks = StepMarks.of(
        3, _marker(replica_mismatch_items=1, replica_mismatch=["w"], replica_ranks=[1]), None
    )
    assert not marks.good and marks.why() == "replicas disagree (in w; odd copies on rank(s) 1)"
    choice = choose({2: StepMarks(2), 3: marks})
    assert choice.step == 2 and "replicas disagree" in choice.skipped[3]
    assert StepMarks.from_json(marks.to_json()) == marks
    assert StepMarks.from_json([3, None, 0, []]) == StepMarks(3)  # from a peer of an older version


def test_a_rank_odd_at_two_steps_is_a_suspect():
    def rec(step, odd):
        return TimingRecord(
            Kind.REPLICAS, 0, 0, step, 1.0, item="w", odd=odd, odd_nodes=tuple(r // 2 for r in odd)
        )

    recs = [rec(2, (3,)), rec(2, (3,)), rec(5, (1, 3)), rec(9, (3,))]
    (s,) = suspects(recs)
    assert (s.rank, s.node, s.steps, s.items) == (3, 1, [2, 5, 9], ["w"])  # rank 1: one step only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64])
def test_the_device_digest_sees_every_single_flipped_bit(dtype):
    t = (torch.arange(13) * 37 % 251).to(dtype)  # 13 elements: a tail of bytes past the last word
    base = device_digest(t)
    assert device_digest(t.clone()) == base and device_digest(t.flip(0).flip(0)) == base
    raw = t.view(torch.uint8)
    seen = set()
    for byte in range(raw.numel()):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            seen.add(device_digest(t))
            raw[byte] ^= 1 << bit
    assert base not in seen and len(seen) == raw.numel() * 8
    wide = torch.arange(24, dtype=dtype).reshape(4, 6)
    assert device_digest(wide[:, ::2]) == device_digest(wide[:, ::2].contiguous())  # a strided view


def test_ls_and_verify_say_why_a_marked_step_is_passed_over(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ram"))])
    for step in (1, 2):
        dcp.save({"w": torch.arange(8.0) + step}, storage_writer=TieredWriter(cfg, step=step))
    path = tmp_path / "ram" / marker_key("run", 2)
    marker = Marker.from_bytes(path.read_bytes())  # as a save that found w's copies differing marks it
    path.write_bytes(
        dataclasses.replace(
            marker, replica_mismatch_items=1, replica_mismatch=["w"], replica_ranks=[0]
        ).to_bytes()
    )
    assert latest_step(cfg) == 1
    why = "replicas disagree (in w; odd copies on rank(s) 0)"
    cli = [sys.executable, "-m", "tiered_dcp.cli"]
    ls = preloaded.run([*cli, "ls", "-n", "run", str(tmp_path / "ram")], capture_output=True, text=True)
    assert f"step 2 on tier 0: passed over by loads: {why}" in ls.stdout, ls.stdout + ls.stderr
    verify = preloaded.run(
        [*cli, "verify", "-n", "run", str(tmp_path / "ram")], capture_output=True, text=True
    )
    assert verify.returncode == 0 and f"loads pass it over: {why}" in verify.stdout, verify.stdout


def test_a_disagreement_over_ten_thousand_copies_is_one_short_line():
    """Every rank may hold a copy (DDP): a line names a few ranks, nodes and groups and counts
    the rest, so the log, the records and an error DCP gathers from every rank stay small."""
    from tiered_dcp.steps.replicas import Disagreement

    nodes = {r: r // 8 for r in range(10_000)}
    one_odd = Disagreement(3, "w", (), (tuple(range(1, 10_000)), (0,)), nodes)
    assert "ranks 1, 2, 3, 4, 5, 6, 7, 8 and 9991 more (nodes 0, 1, 2, 3, 4, 5, 6, 7 and 1242 more)" in (
        one_odd.line()
    )
    all_differ = Disagreement(3, "w", (), tuple((r,) for r in range(10_000)), nodes)
    assert "and 9996 more groups of ranks hold different values (with 10000 copies" in all_differ.line()
    assert max(len(one_odd.line()), len(all_differ.line())) < 500


def test_a_quarantine_mark_is_shown_as_one_printable_line(tmp_path):
    """Whoever can write the tier writes its quarantine marks: ``ls`` shows the first line
    of one, control characters replaced, never a second line or a terminal escape."""
    from tiered_dcp.steps.catalog import views

    cfg = TieredConfig("q", [Tier(str(tmp_path / "ram"))])
    for step in (1, 2):
        dcp.save({"w": torch.arange(8.0) + step}, storage_writer=TieredWriter(cfg, step=step))
    (view,) = views(cfg, 0, 0)
    copy = view.committed()[2]
    view.quarantine(copy.store, 2, copy.marker.metadata_xxh3, 0, "bad\x1b[2J bytes\nstep 9 on tier 0: fine")
    cli = [sys.executable, "-m", "tiered_dcp.cli"]
    ls = preloaded.run([*cli, "ls", "-n", "q", str(tmp_path / "ram")], capture_output=True, text=True)
    assert "bad?[2J bytes" in ls.stdout and "\x1b" not in ls.stdout, ls.stdout + ls.stderr
    assert "step 9" not in ls.stdout, ls.stdout


def test_a_device_digest_sees_a_flip_past_its_first_slab():
    """The digest's weights start again at each slab of ``SLAB`` words: a flip in the second
    slab is seen as in the first."""
    from tiered_dcp.save.replica_check import SLAB, device_digest

    t = torch.arange(SLAB + 1000, dtype=torch.int32)
    base = device_digest(t)
    for word in (5, SLAB + 5):
        t[word] ^= 1 << 3
        assert device_digest(t) != base, word
        t[word] ^= 1 << 3
    assert device_digest(t) == base
