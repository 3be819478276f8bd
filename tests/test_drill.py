"""A short failure drill: real SIGKILLs (one mid-save), a node wiped, flipped bytes, the newest
step's every copy damaged, NaN saved, a bucket outage; and no silent escape."""

import json
import sys

import preloaded

from tiered_dcp.cli.drill import FAULTS, Drill, DrillReport, Event, print_report, run_drill


def test_a_short_drill_loses_nothing_and_lets_nothing_escape(tmp_path, capsys):
    # each fault once; the ranks forked from an interpreter that imported torch already
    report = run_drill(1, str(tmp_path / "drill"), seed=7, pause=(0.2, 0.6), start=preloaded.Popen)
    assert report.ok, json.dumps(report.to_json(), indent=1)
    assert report.silent_escapes == 0 and report.to_json()["silent_escapes"] == 0
    faults = [e for e in report.events if e.fault != "start"]
    assert {e.fault for e in faults} >= set(FAULTS) - {"outage"}  # outage: where fake-gcs-server is
    for e in faults:
        if e.fault == "outage":
            assert e.recovery_s is not None  # a newer step committed on the bucket afterwards
        else:
            assert e.resumed is not None and e.resumed >= e.expected and e.recovery_s > 0
            assert e.match and e.finite and not e.silent
    by_kind = {kind: [e for e in faults if e.fault == kind] for kind in FAULTS}
    assert all("verify saw it: True" in e.detail for e in by_kind["flip"])
    for e in by_kind["damage"]:  # the step the drill destroyed is passed over, said so, quarantined
        (step,) = e.unloadable
        assert e.expected < step and e.resumed < step and "quarantined: True" in e.detail
        assert any(f"passing over step {step}" in w for w in e.warnings)
    for e in by_kind["nan"]:  # the NaN step is saved marked and passed over for the step before it
        (step,) = e.unloadable
        assert e.resumed == e.expected == step - 1 and "marked non-finite" in e.detail
        assert any(f"passing over step {step}: non-finite" in w for w in e.warnings)
    for e in by_kind["kill-save"]:  # the survivor's own error is in the report
        assert "still in flight" in e.detail and e.errors
        assert all(any(w in err for w in ("Error", "Exception", "stopped answering")) for err in e.errors)
    print_report(report)
    assert "silent escapes: 0" in capsys.readouterr().out


def test_a_wrong_state_restored_without_a_word_is_a_silent_escape(tmp_path, capsys):
    drill = Drill(str(tmp_path), str(tmp_path / "ram"), 1, 0, ["kill"])

    def restart(attempt: int, reports: list[dict]) -> Event:
        drill.attempt = attempt
        for rank, r in enumerate(reports):
            (tmp_path / f"resume.{attempt}.rank{rank}.json").write_text(
                json.dumps({"rank": rank, "step": 5, "time": 0.0, "boot_s": 0.0, **r})
            )
        event = Event("kill", 0.0, expected=5)
        drill.wait_resumed(event, 0.0)
        return event

    exact = {"match": True, "finite": True}
    assert not restart(1, [exact, exact]).lost
    wrong = restart(2, [exact, {"match": False, "finite": True}])
    nonfinite = restart(3, [{"match": True, "finite": False}, exact])
    unrelated = restart(4, [{"match": False, "finite": True, "warnings": ["step 6: passed over"]}, exact])
    warned = restart(5, [{"match": False, "finite": True, "warnings": ["step 5: 'w' is damaged"]}, exact])
    assert wrong.silent and nonfinite.silent and unrelated.silent and not warned.silent
    assert wrong.lost and warned.lost  # said or not, a wrong state restored is a failure
    report = DrillReport(1.0, 9, [wrong, nonfinite, unrelated, warned], "bucket")
    assert report.silent_escapes == 3 and not report.ok and report.to_json()["silent_escapes"] == 3
    print_report(report)
    assert "silent escapes: 3" in capsys.readouterr().out


def test_drill_command_refuses_an_unknown_fault():
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "drill", "--seconds", "1", "--faults", "meteor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "meteor" in r.stderr
