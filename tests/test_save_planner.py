"""The save plan passes: rank/node tagging, the world, DCP's cached plans, the dedup hook."""

import pytest
from tiered_dcp.planners.save import WHERE, SaveRank, dedup_plans, plan_global, tag_local_plan
from torch.distributed.checkpoint.planner import SavePlan


def test_global_pass_gives_every_plan_the_world():
    plans = [tag_local_plan(SavePlan([]), r, n) for r, n in enumerate([0, 0, 1, 1])]
    out, world = plan_global(plans)
    assert world == [0, 0, 1, 1]
    assert [p.storage_data for p in out] == [{WHERE: SaveRank(r, r // 2, (0, 0, 1, 1))} for r in range(4)]
    assert dedup_plans(out) == out  # no content keys (no TieredSavePlanner): the identity


def test_cached_plans_pass_through_and_a_wrong_order_is_refused():
    cached = [SavePlan([]), SavePlan([])]
    assert plan_global(cached) == (cached, None)
    swapped = [tag_local_plan(SavePlan([]), 1, 0), tag_local_plan(SavePlan([]), 0, 0)]
    with pytest.raises(ValueError, match=r"unexpected rank order \[1, 0\]"):
        plan_global(swapped)
