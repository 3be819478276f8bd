"""The commit protocol's pure decisions: which protocol a tier's save uses, and what a
refused commit raises on every rank (the kinds cross the job's store as JSON)."""

import json

import pytest

from tiered_dcp import NonFiniteStateError, PeerLostError, Tier, TieredCheckpointError, TieredConfig
from tiered_dcp.steps.catalog import TierView
from tiered_dcp.steps.commit import AgreedCommit, CoordinatorCommit, _outcome, _refusal, _refused, for_save


def test_the_save_protocol_is_the_one_the_placement_names(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd")), Tier(str(tmp_path / "nfs"), shared=True)])
    node_local, shared = (TierView(cfg, i, 0, 0) for i in range(2))
    assert type(for_save(node_local, 1, 0, True, lambda world: None)) is AgreedCommit
    assert type(for_save(shared, 1, 0, True, lambda world: None)) is CoordinatorCommit


@pytest.mark.parametrize(
    ("errors", "raised"),
    [
        ([NonFiniteStateError("nan")], NonFiniteStateError),  # all the user asked for
        ([NonFiniteStateError("nan"), OSError("disk")], TieredCheckpointError),
        ([OSError("disk"), PeerLostError("gone", 3, "the replica exchange", (2,))], PeerLostError),
    ],
)
def test_a_refused_commit_raises_the_same_kind_on_every_rank(tmp_path, errors, raised):
    view = TierView(TieredConfig("run", [Tier(str(tmp_path))]), 0, 0, 0)
    failed = [json.loads(json.dumps(_outcome(e, r))) for r, e in enumerate(errors)]  # as the store has them
    err = _refused(json.loads(json.dumps(_refusal(3, view, failed))), 3)
    assert type(err) is raised
    assert all(f"rank {r}" in str(err) for r in range(len(errors)))
    if raised is PeerLostError:
        assert err.ranks == (2,) and err.step == 3 and err.phase == "the commit agreement"
