"""A short failure drill: real SIGKILLs, a node wiped, flipped bytes, a bucket outage."""

import json
import subprocess
import sys

from tiered_dcp.drill import run_drill


def test_a_short_drill_loses_nothing(tmp_path):
    report = run_drill(25, str(tmp_path / "drill"), seed=7, faults=["kill", "flip", "wipe", "outage"])
    assert report.ok, json.dumps(report.to_json(), indent=1)
    faults = [e for e in report.events if e.fault != "start"]
    assert faults, report
    for e in faults:
        if e.fault == "outage":
            assert e.recovery_s is not None  # a newer step committed on the bucket afterwards
        else:
            assert e.resumed is not None and e.resumed >= e.expected and e.match and e.recovery_s > 0
    flips = [e for e in faults if e.fault == "flip"]
    assert all("verify saw it: True" in e.detail for e in flips)


def test_drill_command_refuses_an_unknown_fault():
    r = subprocess.run(
        [sys.executable, "-m", "tiered_dcp.cli", "drill", "--seconds", "1", "--faults", "meteor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "meteor" in r.stderr
