import pytest

from tiered_dcp import Tier, TieredConfig, TieredWriter


def ok_tiers():
    return [Tier("/tmp/x/{node}")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": "", "tiers": ok_tiers()}, "namespace must be a non-empty"),
        ({"namespace": "a/b", "tiers": ok_tiers()}, "not a safe path component"),
        ({"namespace": "..", "tiers": ok_tiers()}, "not a safe path component"),
        ({"namespace": "run", "tiers": []}, "tiers must be a non-empty list"),
        ({"namespace": "run", "tiers": ["/tmp/x"]}, "every tier must be a Tier"),
        ({"namespace": "run", "tiers": ok_tiers() + ok_tiers()}, "listed twice"),
        ({"namespace": "run", "tiers": ok_tiers(), "replication_factor": 0}, "replication_factor=0"),
        ({"namespace": "run", "tiers": ok_tiers(), "replication_jump": -1}, "replication_jump=-1"),
        ({"namespace": "run", "tiers": ok_tiers(), "dedup": "yes"}, "dedup='yes'"),
        ({"namespace": "run", "tiers": ok_tiers(), "failure_domain": ""}, "failure_domain='' must be"),
        ({"namespace": "run", "tiers": ok_tiers(), "failure_domain": "MY RACK"}, "name of an environment"),
        ({"namespace": "run", "tiers": ok_tiers(), "failure_domain": 3}, "failure_domain=3 must be"),
    ],
)
def test_bad_config_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TieredConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": ""}, "non-empty path"),
        ({"path": "/x", "every": 0}, "every=0 must be an integer >= 1"),
        ({"path": "/x", "every": 2.5}, "every=2.5"),
        ({"path": "/x", "keep": 0}, "keep=0 must be an integer >= 1"),
        ({"path": "/x", "compression": "lz4"}, "unknown compression 'lz4'"),
        ({"path": "/x/{host}"}, "unknown placeholder"),
        ({"path": "gs://b/{node}"}, "cannot contain {node}"),
        ({"path": "gs://b/x", "shared": False}, "cannot be declared node-local"),
        ({"path": "/nfs/{rank}", "shared": True}, "cannot contain {node}"),
    ],
)
def test_bad_tier_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tier(**kwargs)


def test_tier_kinds_and_placeholders():
    assert not Tier("/dev/shm/t/{node}").is_shared
    assert not Tier("file:///ssd/t").is_shared
    assert Tier("gs://bucket/ckpt").is_shared
    assert Tier("memory://x").is_shared
    assert Tier("/nfs/ckpt", shared=True).is_shared
    assert Tier("/d/{node}/r{rank}").root(node=3, rank=7) == "/d/3/r7"
    assert Tier("/x", compression="none").compression is None


def test_step_no_tier_takes_is_refused_before_writing(tmp_path):
    cfg = TieredConfig("run", [Tier(str(tmp_path / "a"), every=5), Tier(str(tmp_path / "b"), every=10)])
    with pytest.raises(ValueError, match="no tier takes step 7"):
        TieredWriter(cfg, step=7)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="step must be an integer"):
        TieredWriter(cfg, step=-1)
    assert TieredWriter(cfg, step=10).tier_indexes == [0, 1]
    assert TieredWriter(cfg, step=5).tier_indexes == [0]


def test_node_from_environment(monkeypatch):
    from tiered_dcp.config import node_of

    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_of(5) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_of(5) == 2
    monkeypatch.setenv("GROUP_RANK", "7")
    assert node_of(5) == 7


def _rack(rank: int) -> str:
    return f"rack-{rank // 8}"


def test_failure_domain_travels_to_the_writer_process_as_data():
    by_env = TieredConfig("run", ok_tiers(), failure_domain="RACK")
    assert TieredConfig.from_dict(by_env.to_dict()) == by_env
    by_function = TieredConfig("run", ok_tiers(), failure_domain=_rack)
    assert by_function.to_dict()["failure_domain"] is None  # cliques come from each step's marker
