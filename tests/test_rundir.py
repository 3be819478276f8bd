"""The run directory's records: what is on disk stays what earlier versions wrote and read (a
writer of one version serves a trainer of another), and a file that is not a record is never
acted on."""

import json
import uuid

import pytest

from tiered_dcp.config import Tier, TieredConfig
from tiered_dcp.writer_process.run_dir import (
    Job,
    Outcome,
    OutcomeState,
    RunDir,
    TierHealth,
    TierState,
    job_dir,
)
from tiered_dcp.writer_process.timings import Kind, TimingRecord, read_records, record


@pytest.fixture
def rd(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "rank_00003")
    rd.make()
    return rd


def test_the_layout_keeps_its_names(tmp_path):
    rd = RunDir(tmp_path / "rank_00003")
    names = [
        rd.config_path,
        rd.owner_path,
        rd.writer.lock_path,
        rd.writer.pid_path,
        rd.writer.log_path,
        rd.writer.out_path,
        rd.writer.stop_path,
    ]
    assert [p.name for p in names] == [
        "config.json",
        "owner",
        "writer.lock",
        "writer.pid",
        "writer.log",
        "writer.out",
        "stop",
    ]
    assert all(p.parent == rd.path for p in names)
    assert [rd.queue.dir.name, rd.results.dir.name, rd.health.dir.name] == ["queue", "results", "health"]
    job = Job(12, 0, 1, 3, 1, 5.0)
    assert rd.queue.path(job).relative_to(rd.path).as_posix() == "queue/t01_s000000000012.json"
    assert rd.results.path(1, 12).relative_to(rd.path).as_posix() == "results/t01_s000000000012.json"
    assert rd.health.path(2).relative_to(rd.path).as_posix() == "health/t02.json"
    assert rd.rank == 3 and rd == RunDir(str(rd.path)) and len({rd, RunDir(rd.path)}) == 1


def test_the_states_are_the_strings_on_disk():
    assert [s.value for s in TierState] == ["healthy", "stalled", "failing"]
    assert [s.value for s in OutcomeState] == ["committed", "clean", "failed", "skipped"]
    assert [k.value for k in Kind] == ["save", "persist", "load", "replicas"]
    for state in [*TierState, *OutcomeState, *Kind]:
        assert json.dumps(state) == json.dumps(state.value)  # the enum member itself, too
        assert str(state) == f"{state}" == "%s" % (state,) == state.value  # noqa: UP031 - as logging formats
        assert state == state.value  # a plain string from an older file compares equal


def test_records_are_written_as_before_and_read_back(rd):
    job = Job(12, 0, 1, 3, 1, 5.5)
    rd.enqueue(job)
    assert json.loads(rd.queue.path(job).read_text()) == {
        "step": 12,
        "source": 0,
        "target": 1,
        "rank": 3,
        "node": 1,
        "enqueued": 5.5,
    }
    assert rd.queue.jobs() == [job] and rd.queue.jobs(1) == [job] and rd.queue.jobs(2) == []
    done = Outcome(12, 1, OutcomeState.COMMITTED, rank=3, seconds=0.25, write_s=0.1, bytes=64, finished=9.0)
    rd.results.write(done)
    text = rd.results.path(1, 12).read_text()
    assert text == (
        '{"step": 12, "target": 1, "rank": 3, "write_s": 0.1, "bytes": 64, "state": "committed", '
        '"seconds": 0.25, "finished": 9.0}'
    )
    skipped = Outcome(
        11, 1, OutcomeState.SKIPPED, rank=3, error="skipped: tier failing", seconds=0.0, finished=1.0
    )
    rd.results.write(skipped)
    assert json.loads(rd.results.path(1, 11).read_text()) == {
        "step": 11,
        "target": 1,
        "rank": 3,
        "state": "skipped",
        "error": "skipped: tier failing",
        "seconds": 0.0,
        "finished": 1.0,
    }
    assert rd.results.all() == {(11, 1): skipped, (12, 1): done}
    rd.enqueue(Job(12, 0, 1, 3, 1, 6.0))  # a new job for the step forgets its old outcome
    assert list(rd.results.all()) == [(11, 1)]
    verdict = TierHealth(1, TierState.STALLED, 7.0, "no progress")
    rd.health.write(verdict)
    assert json.loads(rd.health.path(1).read_text()) == {
        "tier": 1,
        "state": "stalled",
        "since": 7.0,
        "error": "no progress",
    }
    assert rd.health.of(1) == verdict and rd.health.of(1).state is TierState.STALLED
    assert rd.health.of(2) == TierHealth(2, TierState.HEALTHY, None, None)  # never judged: healthy


def test_a_record_written_by_an_earlier_version_reads_alike(rd):
    """As the writer wrote them before the records had classes (keys in its order, extras)."""
    rd.results.path(1, 4).write_text(
        json.dumps(
            {"step": 4, "target": 1, "rank": 0, "state": "failed", "error": "x", "seconds": 1, "new": 1}
        )
    )
    rd.health.path(1).parent.mkdir()
    rd.health.path(1).write_text(json.dumps({"tier": 1, "state": "failing", "since": 3, "error": None}))
    (o,) = rd.results.all().values()
    assert (o.step, o.target, o.state, o.error, o.seconds) == (4, 1, OutcomeState.FAILED, "x", 1)
    assert rd.health.of(1) == TierHealth(1, TierState.FAILING, 3, None)


MALFORMED = [
    "not json",
    '{"step": 1',  # cut short
    "[1, 2]",
    "null",
    '"text"',
    '{"step": 1, "source": 0, "target": 1, "rank": 0, "node": 0, "enqueued": [1]}',
    '{"step": 1, "target": 1, "tier": 1, "state": ["failed"]}',  # unhashable: refused, no crash
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_files_are_never_acted_on(rd, text):
    (rd.queue.dir / "t01_s000000000001.json").write_text(text)
    (rd.results.dir / "t01_s000000000001.json").write_text(text)
    rd.health.dir.mkdir()
    rd.health.path(1).write_text(text)
    assert rd.queue.jobs() == [] and rd.results.all() == {}
    assert rd.results.read("t01_s000000000001.json") is None
    assert rd.health.of(1) == TierHealth(1)  # no verdict: healthy


def test_records_with_wrong_fields_or_types_are_never_acted_on(rd):
    job = {"step": 4, "source": 0, "target": 1, "rank": 0, "node": 0, "enqueued": 1.5}
    for bad in (
        {**job, "step": "4"},
        {**job, "step": True},
        {**job, "x": 1},
        {k: job[k] for k in list(job)[:-1]},
    ):
        assert Job.from_dict(bad) is None, bad
    assert Job.from_dict(job) == Job(**job)
    outcome = {"step": 4, "target": 1, "rank": 0, "state": "failed", "error": "why"}
    for bad in (
        {**outcome, "state": "done"},
        {**outcome, "target": None},
        {**outcome, "error": 3},
        {"step": 4},
    ):
        assert Outcome.from_dict(bad) is None, bad
    health = {"tier": 1, "state": "failing", "since": 1.0, "error": "why"}
    for bad in (
        {**health, "state": "down"},
        {**health, "tier": "1"},
        {**health, "since": "now"},
        {"state": "failing"},
    ):
        assert TierHealth.from_dict(bad) is None, bad
    rd.health.dir.mkdir()
    rd.health.path(1).write_text(json.dumps({**health, "state": "down"}))
    assert rd.health.of(1).state is TierState.HEALTHY


def test_owner_and_writer_pid(rd):
    assert rd.owner() is None and rd.writer.pid() is None and not rd.writer.running()
    rd.set_owner(1234)
    assert rd.owner_path.read_text() == "1234" and rd.owner() == 1234
    rd.owner_path.write_text("garbage")
    assert rd.owner() is None
    rd.writer.set_pid(99)
    assert rd.writer.pid() == 99
    rd.writer.clear_pid()
    assert rd.writer.pid() is None
    lock = rd.writer.take_lock(attempts=1, poll=0)
    assert lock is not None and rd.writer.running()
    assert rd.writer.take_lock(attempts=2, poll=0) is None  # flock: one writer per rank
    lock.close()
    assert not rd.writer.running()


def test_prune_keeps_the_newest_outcomes_of_a_tier(rd):
    for step in range(10):
        rd.results.write(Outcome(step, 1, OutcomeState.CLEAN))
        rd.results.write(Outcome(step, 2, OutcomeState.CLEAN))
    rd.results.prune(1, keep=3)
    assert sorted(rd.results.all()) == sorted([(s, 1) for s in (7, 8, 9)] + [(s, 2) for s in range(10)])


def test_timing_records_read_back_as_written_and_bad_lines_are_skipped(tmp_path):
    cfg = TieredConfig(f"timing-{uuid.uuid4().hex[:8]}", [Tier(str(tmp_path / "ram"))])
    record(cfg, Kind.SAVE, 0, 1, tier=0, bytes=16, write_s=0.5, commit_s=0.7, handoff_s=0.0, sent=0)
    record(
        cfg, Kind.LOAD, 0, 1, tiers=[1, 0], seconds=2.0, open_s=0.5, read_own=3, read_peer=4, read_shared=5
    )
    path = job_dir(cfg) / "records" / "rank_00000.jsonl"
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["kind", "rank", "node", "step", "time", "tier", "bytes", "write_s", "commit_s"] + [
        "handoff_s",
        "sent",
        "every",
        "keep",
    ]
    assert first["kind"] == "save" and (first["every"], first["keep"]) == ([1], [None])  # the schedule
    with open(path, "a") as f:
        f.write('{"kind": "save", "rank": 0, "node": 0, "step": 2}\n')  # no time: not a record
        f.write('{"kind": "backup", "rank": 0, "node": 0, "step": 2, "time": 1.0}\n')  # unknown kind
        f.write('{"kind": "save", "rank": 0, "node": 0, "step": "2", "time": 1.0}\n')
        f.write('{"kind": ["save"], "rank": 0, "node": 0, "step": 2, "time": 1.0}\n')
        f.write('{"kind": "save", "rank": 0, "no')  # cut by a crash
    save, load = read_records(cfg)
    assert isinstance(save, TimingRecord) and save.kind is Kind.SAVE
    assert (save.tier, save.bytes, save.write_s, save.commit_s, save.stage_s) == (0, 16, 0.5, 0.7, None)
    assert load.kind is Kind.LOAD and load.tiers == (1, 0) and load.seconds == 2.0 and load.open_s == 0.5
    assert (load.read_own, load.read_peer, load.read_shared) == (3, 4, 5)
    assert read_records(cfg, Kind.LOAD) == [load]
