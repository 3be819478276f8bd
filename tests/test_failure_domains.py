"""Replicas across failure domains: 4 real ranks on gloo as 4 nodes in two racks.

Nodes are simulated by ``{node}`` paths (LOCAL_WORLD_SIZE=1: rank r on node r); each rank
states its rack in the ``RACK`` environment variable: nodes 0 and 1 in rack-a, 2 and 3 in
rack-b. The jump rule (replication_jump=1) pairs nodes 0 and 1, so losing rack-a loses
their parts; ``failure_domain="RACK"`` pairs each node with one in the other rack.
"""

import json
import os
import shutil
import sys

import preloaded
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredReader, TieredWriter, status

ONE_PER_NODE = {"LOCAL_WORLD_SIZE": 1}
RACKS = ["rack-a", "rack-a", "rack-b", "rack-b"]


def make_config(root: str, failure_domain: str | None = "RACK") -> TieredConfig:
    return TieredConfig(
        "racks",
        [Tier(f"{root}/ram/{{node}}", keep=2)],
        replication_factor=2,
        replication_jump=1,
        failure_domain=failure_domain,
        peer_timeout=30,
    )


def full(step: int) -> torch.Tensor:
    return torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3) + 1000 * step


def state(step: int, mesh) -> dict:
    return {"w": distribute_tensor(full(step), mesh, [Shard(0)]), "meta": {"step": step}}


def _lose_rack_a(rank: int, root: str, mesh) -> dict:
    """Wipe every node of rack-a (nodes 0 and 1) once all ranks saved; an empty load target."""
    dist.barrier()
    if rank == 0:
        for node in (0, 1):
            shutil.rmtree(f"{root}/ram/{node}")
    dist.barrier()
    return {"w": distribute_tensor(torch.zeros(16, 3), mesh, [Shard(0)]), "meta": {"step": -1}}


def _save_lose_rack_a_load(rank, world, root, failure_domain):
    """Save steps 1 and 2, wipe every node of rack-a, then load the newest step on every rank."""
    os.environ["RACK"] = RACKS[rank]
    cfg = make_config(root, failure_domain)
    mesh = init_device_mesh("cpu", (world,))
    for step in (1, 2):
        dcp.save(state(step, mesh), storage_writer=TieredWriter(cfg, step=step))
    target = _lose_rack_a(rank, root, mesh)
    try:
        reader = TieredReader(cfg).open()  # with a group, the step is chosen here (a collective)
    except NoCheckpointError as e:
        return {"error": str(e)}
    dcp.load(target, storage_reader=reader)
    exact = torch.equal(target["w"].full_tensor(), full(reader.step)) and target["meta"] == {"step": 2}
    committed = [r for r in status(cfg) if r.state == "committed"]
    return {"step": reader.step, "exact": exact, "rows": [(r.step, r.cliques, r.domains) for r in committed]}


def test_a_lost_rack_loses_no_step(tmp_path):
    results = run_ranks(_save_lose_rack_a_load, 4, str(tmp_path), "RACK", env=ONE_PER_NODE)
    assert [(r["step"], r["exact"]) for r in results] == [(2, True)] * 4, results
    cliques, domains = [[0, 2], [1, 3]], RACKS
    for r in results[2:]:  # status() on a surviving node shows each clique's domains
        assert r["rows"] == [(1, cliques, domains), (2, cliques, domains)]
    marker = json.loads((tmp_path / "ram/3/racks/step_000000000002/COMMITTED").read_text())
    assert marker["cliques"] == cliques and marker["domains"] == domains
    env = {**os.environ, "RANK": "3", "LOCAL_WORLD_SIZE": "1"}  # ls on node 3, which survived
    out = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "ls", "-n", "racks", f"{tmp_path}/ram/{{node}}"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "cliques on tier 0 (steps 1, 2): [0, 2] in rack-a, rack-b; [1, 3] in rack-a, rack-b" in out, out


def test_without_a_domain_the_cliques_are_the_jump_rule_s_and_the_rack_takes_them(tmp_path):
    """No failure_domain: replication_jump=1 pairs nodes 0 and 1, as before; the marker says
    nothing new; losing rack-a loses every copy of their parts."""
    results = run_ranks(_save_lose_rack_a_load, 4, str(tmp_path), None, env=ONE_PER_NODE)
    assert all("error" in r for r in results), results
    marker = json.loads((tmp_path / "ram/3/racks/step_000000000002/COMMITTED").read_text())
    assert marker["replication"] == [2, 1] and "cliques" not in marker and "domains" not in marker


def _save_in(rank, world, root, racks):
    """One save with RACK=racks[rank] (None: unset); the error it raised, else None. The
    writer is constructed alone (no collective there); the save's set-up refuses, every rank
    the same ValueError, which DCP wraps in its CheckpointException."""
    from tiered_dcp.load.resume import failures_of

    if racks[rank] is not None:
        os.environ["RACK"] = racks[rank]
    mesh = init_device_mesh("cpu", (world,))
    writer = TieredWriter(make_config(root), step=1)
    try:
        dcp.save(state(1, mesh), storage_writer=writer)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
        errors = failures_of(e)
        assert all(isinstance(f, ValueError) for f in errors), errors
        return str(errors[0])
    return None


@pytest.mark.parametrize(
    "racks, message",
    [
        (
            ["rack-a"] * 4,
            "replication_factor=2 with failure_domain='RACK' needs 2 distinct domains per clique, so no "
            "domain may hold more than 4/2=2 of the 4 ranks; the domains found are 'rack-a': 4 rank(s) "
            "on 4 node(s)",
        ),
        (
            ["rack-a", "rack-a", "rack-a", "rack-b"],
            "the domains found are 'rack-a': 3 rank(s) on 3 node(s), 'rack-b': 1 rank(s) on 1 node(s)",
        ),
        (["rack-a", None, "rack-b", "rack-b"], "rank 1: the environment variable RACK is not set"),
    ],
)
def test_domains_that_cannot_hold_the_copies_apart_are_refused_before_any_byte(tmp_path, racks, message):
    errors = run_ranks(_save_in, 4, str(tmp_path), racks, env=ONE_PER_NODE)
    assert all(e is not None and message in e for e in errors), errors
    assert not (tmp_path / "ram").exists()  # nothing written, on any node


def _async_save_in_a_process_then_lose_rack_a(rank, world, root):
    """DCP's PROCESS async mode saves with a pickled copy of the writer: the layout travels,
    and the replicas are made from DCP's background process, once more at the next save."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ["RACK"] = RACKS[rank]
    cfg = make_config(root)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    kind = AsyncCheckpointerType.PROCESS
    for step in (1, 2):
        writer = TieredWriter(cfg, step=step)
        dcp.async_save(
            state(step, mesh), storage_writer=writer, process_group=group, async_checkpointer_type=kind
        ).result()
    target = _lose_rack_a(rank, root, mesh)
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    return reader.step, torch.equal(target["w"].full_tensor(), full(2))


def test_async_saves_in_dcp_s_process_mode_place_replicas_by_domain_too(tmp_path):
    results = run_ranks(_async_save_in_a_process_then_lose_rack_a, 4, str(tmp_path), env=ONE_PER_NODE)
    assert results == [(2, True)] * 4
