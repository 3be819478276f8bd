"""`tiered-dcp verify` / verify_step check every copy as a load reads it: no false alarms on
compressed tiers, exactly the damaged tier (and root, and replica) named on real damage."""

import glob
import os
import shutil
import sys

import preloaded
from conftest import settle
from dist_utils import run_ranks
from test_cli_export import cli
from test_replication import NODES, WORLD, _save
from test_replication import make_config as replicated_config
from test_save_load import flip_byte, save
from tiered_dcp.storage.format import pin_key

from tiered_dcp import Tier, TieredConfig, wait_for
from tiered_dcp.ops.verify import verify_step


def three_tiers(tmp_path) -> tuple[TieredConfig, list[str]]:
    paths = [str(tmp_path / "ram/{node}"), str(tmp_path / "ssd/{node}"), f"file://{tmp_path}/bucket"]
    cfg = TieredConfig(
        "run",
        [Tier(paths[0], keep=2), Tier(paths[1], compression="zstd"), Tier(paths[2], compression="zstd")],
    )
    return cfg, ["-n", "run", *paths]


def test_compressed_tiers_verify_ok_and_damage_names_exactly_that_tier(tmp_path):
    cfg, args = three_tiers(tmp_path)
    for step in (1, 2):
        save(cfg, step)
    wait_for(cfg, 2, timeout=60)
    settle(cfg)
    r = cli("verify", *args)
    assert r.stdout.count(": OK") >= 3 and "DAMAGED" not in r.stdout, r.stdout
    checks = verify_step(cfg, 2)
    assert [c.tier_index for c in checks] == [0, 1, 2] and all(c.ok and c.items > 0 for c in checks)

    (part,) = glob.glob(str(tmp_path / "ssd/0/run/step_000000000002/rank_*.part"))
    flip_byte(part, 0.6)
    r = cli("verify", *args, check=False)
    assert r.returncode == 1, r.stdout
    verdicts = [line for line in r.stdout.splitlines() if line.startswith("step 2 tier")]
    assert [("DAMAGED" in v) for v in verdicts] == [False, True, False], r.stdout
    assert part in r.stdout and "nested.big" in r.stdout
    ram, ssd, bucket = verify_step(cfg, 2)
    assert ram.ok and bucket.ok and not ssd.ok
    assert all(part in p for p in ssd.problems)


def _save_two_steps(rank, world, root):
    _save(rank, world, root, [1, 2])


def test_a_damaged_replica_is_named_as_such_and_a_wiped_root_is_no_damage(tmp_path):
    root = str(tmp_path)
    run_ranks(_save_two_steps, WORLD, root, env=NODES)
    cfg = replicated_config(root)
    wait_for(cfg, 2, timeout=60)  # on this process's node (0): node 1's SSD copy may come later
    settle(cfg)  # every writer done: node 1's copy of rank 2 is the good one left below
    checks = verify_step(cfg, 2)
    assert [c.tier_index for c in checks] == [0, 1]
    assert all(c.ok for c in checks), [c.problems for c in checks]
    ssd = checks[1]
    by_url = {r.url: r for r in ssd.roots}
    node0 = by_url[f"{root}/ssd/0"]
    assert sorted(node0.parts) == [0, 1, 2, 3] and sorted(node0.replicas) == [2, 3]  # cliques {0,2}, {1,3}

    replica = f"{root}/ssd/0/job/step_000000000002/rank_00002.part"  # rank 2 lives on node 1
    flip_byte(replica, 0.5)
    (ram, ssd) = verify_step(cfg, 2)
    assert ram.ok and not ssd.ok
    by_url = {r.url: r for r in ssd.roots}
    assert by_url[f"{root}/ssd/1"].ok  # rank 2's own copy is intact
    (problem,) = {p for p in by_url[f"{root}/ssd/0"].problems if "rank 2" in p} or {None}
    assert problem is not None and "rank 2's part (replica)" in problem and replica in problem
    assert ssd.tier_problems == []  # the step still loads: a good copy is left
    args = ["-n", "job", f"{root}/ram/{{node}}", f"{root}/ssd/{{node}}", f"{root}/bucket"]
    r = cli("verify", *args, "--step", "2", check=False)
    assert r.returncode == 1 and "(replica)" in r.stdout and replica in r.stdout, r.stdout

    shutil.rmtree(f"{root}/ram/1")  # a wiped node: reported, not damage (its replicas are on node 0)
    (ram, _) = verify_step(cfg, 2)
    assert ram.ok, ram.problems
    assert [r.present for r in ram.roots if r.url.endswith("/ram/1")] == [False]
    r = cli("verify", "-n", "job", f"{root}/ram/{{node}}", "--step", "2")
    assert "holds nothing of step 2" in r.stdout, r.stdout


def _dead_owner() -> bytes:
    """An owner record (pin) of a process that has ended: what a SIGKILLed save leaves."""
    code = (
        "import sys\nfrom tiered_dcp.steps.leases import owner_record\n"
        "sys.stdout.buffer.write(owner_record())"
    )
    return preloaded.run([sys.executable, "-c", code], capture_output=True, check=True).stdout


def test_a_root_the_commit_never_reached_is_incomplete_not_damage(tmp_path):
    root = str(tmp_path)
    run_ranks(_save_two_steps, WORLD, root, env=NODES)
    cfg = replicated_config(root)
    wait_for(cfg, 2, timeout=60)
    # node 1's RAM root: its parts of step 2 but no marker, and the pin of a save that is gone
    # (its root writer SIGKILLed between the coordinator's verdict and writing the marker)
    sdir = f"{root}/ram/1/job/step_000000000002"
    os.remove(f"{sdir}/COMMITTED")
    with open(f"{root}/ram/1/{pin_key('job', 2, 2, 1)}", "wb") as f:
        f.write(_dead_owner())
    (ram, _) = verify_step(cfg, 2)
    assert ram.ok, ram.problems  # node 0's root holds every part (its own and its replicas)
    (node1,) = [r for r in ram.roots if r.url.endswith("/ram/1")]
    assert node1.incomplete and "safe to remove" in node1.incomplete and sdir in node1.incomplete
    r = cli("verify", "-n", "job", f"{root}/ram/{{node}}", "--step", "2")
    assert "incomplete: never committed" in r.stdout and "DAMAGED" not in r.stdout, r.stdout


def test_a_truncated_part_is_a_few_lines_not_one_per_item(tmp_path):
    """A part cut short makes every item after the cut unreadable: verify names the size,
    the first few items, counts the rest in one line, and ends with what it means."""
    cfg = TieredConfig("run", [Tier(str(tmp_path / "ssd"))])
    save(cfg, 1)
    (part,) = (tmp_path / "ssd/run/step_000000000001").glob("rank_*.part")
    os.truncate(part, 100)
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "verify", "-n", "run", str(tmp_path / "ssd")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 10, r.stdout
    assert any("is 100 bytes, its index says" in line for line in lines)
    assert any("more item(s) of rank 0's part unreadable" in line for line in lines), r.stdout
    assert "[Errno" not in r.stdout and lines[-1].startswith("step 1: DAMAGED on tier 0")
