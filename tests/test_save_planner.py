"""The save plan passes: rank/node tagging, the world, DCP's cached plans, the dedup hook."""

import pickle

import pytest
from tiered_dcp.planners.save import (
    WHERE,
    EvenNodes,
    SaveRank,
    compact,
    dedup_plans,
    plan_global,
    tag_local_plan,
)
from torch.distributed.checkpoint.planner import SavePlan


def test_global_pass_gives_every_plan_the_world():
    plans = [tag_local_plan(SavePlan([]), r, n) for r, n in enumerate([0, 0, 1, 1])]
    out, world = plan_global(plans)
    assert world == [0, 0, 1, 1]
    assert [p.storage_data for p in out] == [{WHERE: SaveRank(r, r // 2, EvenNodes(4, 2))} for r in range(4)]
    assert [p.storage_data[WHERE].nodes() for p in out] == [[0, 0, 1, 1]] * 4
    assert dedup_plans(out) == out  # no content keys (no TieredSavePlanner): the identity
    odd = [tag_local_plan(SavePlan([]), r, n) for r, n in enumerate([0, 1, 0, 1])]  # ranks dealt round
    out, world = plan_global(odd)
    assert world == [0, 1, 0, 1] and out[3].storage_data[WHERE] == SaveRank(3, 1, (0, 1, 0, 1))


def test_the_world_goes_in_each_plan_in_a_few_bytes_when_nodes_are_filled_in_rank_order():
    """Every rank's global plan carries the world; the coordinator pickles each plan on its
    own, so one int per rank in each plan grows with the square of the job."""
    assert compact([0, 0, 0, 1, 1, 1, 2]) == EvenNodes(7, 3)  # the last node may have fewer
    assert compact([0, 0, 0, 0]) == EvenNodes(4, 4) and compact([3]) == (3,) and compact([]) == ()
    assert compact([0, 0, 1, 1, 1]) == (0, 0, 1, 1, 1)  # nodes of two sizes: as it is
    assert compact([1, 1, 0, 0]) == (1, 1, 0, 0)
    for world in ([0, 0, 0, 1, 1, 1, 2], [0, 1, 0, 1], [5, 5, 2]):
        assert SaveRank(0, world[0], compact(world)).nodes() == world
    world = [r // 8 for r in range(10_000)]
    assert len(pickle.dumps(SaveRank(9_999, world[-1], compact(world)))) < 200  # was 28 KB a plan


def test_cached_plans_pass_through_and_a_wrong_order_is_refused():
    cached = [SavePlan([]), SavePlan([])]
    assert plan_global(cached) == (cached, None)
    swapped = [tag_local_plan(SavePlan([]), 1, 0), tag_local_plan(SavePlan([]), 0, 0)]
    with pytest.raises(ValueError, match=r"unexpected rank order \[1, 0\]"):
        plan_global(swapped)
