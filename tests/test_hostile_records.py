"""Every record read from a tier is checked before it is trusted.

A small checkpoint (steps 1 and 2 on a raw tier, step 2 also on a zstd tier; dedup on) and
one record of it damaged or crafted per case: every field of the commit marker and of an
index set to a wrong type, zero, negative, huge, null, removed, nested 100000 deep, lists
made a million long, keys added; metadata that is consistent pickle but no checkpoint (a
layout key missing, a 10^6 x 10^6 tensor, a chunk outside its tensor, ``bytes(8 GiB)``);
record files made sparse 6 GB, FIFOs, devices, directories, links to a FIFO outside the
tiers; step directories named out of the format; pins, leases, failure notes, quarantine
marks and blocks lists of garbage (``hostile_records.py`` builds and runs them, each case
in a forked child with a 30 s timer per entry point, a hang's, and its address space limited).

Every entry point (``latest_step``, ``TieredReader`` + ``dcp.load``, ``load_latest``,
``status``, ``verify_step``, ``export``, the CLI's ``ls``, ``verify`` and ``export``) must
then load step 2 exact from the good copy, or at worst fail with a ``TieredCheckpointError``
(the loads must succeed: a good copy is there); no other exception, none over 5 CPU-s (or
20 s of wall time: a back-off or a lease waited for), no more
than 64 MiB beyond what the intact case used, nothing changed outside the tiers; a damage
``verify`` reports names a file of the tiers. Two workers share the cases (the machine's
two cores): ~425 cases, ~3300 entry-point runs, ~1 min; it earns that as the only test
that runs every mutation of every record kind through every entry point (the two exports,
which write the whole step anew through the loads' reader, meet one mutation per field of a
marker or an index, in turn, and every other case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import preloaded
import pytest

HERE = Path(__file__).parent
WORKERS = 2
MEMORY_MIB = 64
CPU_SECONDS = 5.0  # an entry point's CPU time on one case (its wall time depends on the machine's load)
WALL_SECONDS = 20.0  # and its wall time: waiting (a retry's back-off, a lease) counts there only
LOADS = {"load", "load_latest", "export", "cli_export"}  # must load step 2 exact


class Battery:
    """The workers (``hostile_records.py``), every case handed out at once; results by case."""

    def __init__(self, base: Path) -> None:
        clean = base / "clean"
        self.procs = []
        for w in range(WORKERS):  # the first builds the checkpoint, the next reuse it
            work = base / f"worker{w}"
            work.mkdir()
            proc = preloaded.Popen(
                [sys.executable, str(HERE / "hostile_records.py"), str(work), str(clean)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                },
            )
            names = json.loads(proc.stdout.readline())["cases"]
            self.procs.append(proc)
        self.names: list[str] = names
        self.results: dict[str, dict] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(proc, names[w::WORKERS]), daemon=True)
            for w, proc in enumerate(self.procs)
        ]
        for t in self.threads:
            t.start()

    def _run(self, proc: subprocess.Popen, names: list[str]) -> None:
        for name in names:
            proc.stdin.write(name + "\n")
            proc.stdin.flush()
            self.results[name] = json.loads(proc.stdout.readline())
        proc.stdin.close()

    def of(self, prefix: str) -> dict[str, dict]:
        for t in self.threads:
            t.join(timeout=900)
        return {n: r for n, r in self.results.items() if n.split(":")[0] == prefix}

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def battery(tmp_path_factory: pytest.TempPathFactory):
    b = Battery(tmp_path_factory.mktemp("hostile"))
    yield b
    b.close()


def judged(r: dict, baseline: float) -> list[str]:
    """What is wrong with one case's outcome (empty: nothing)."""
    if "crash" in r:
        return [f"the case crashed: {r['crash'][-600:]}"]
    bad = []
    for entry, e in r["entries"].items():
        if e["cpu_seconds"] > CPU_SECONDS or e["seconds"] > WALL_SECONDS:
            bad.append(f"{entry} took {e['cpu_seconds']} CPU-s, {e['seconds']} s")
        if not e["ok"]:
            if e["foreign"] or entry in LOADS or entry == "latest_step":
                bad.append(f"{entry} raised {e['error'][:300]}\n{e.get('trace', '')[-800:]}")
            continue
        got = e["got"]
        if entry in LOADS and got != "exact":
            bad.append(f"{entry}: {got}")
        if entry == "latest_step" and got != "step 2":
            bad.append(f"latest_step gave {got}, not step 2")
        if entry in ("cli_ls", "cli_verify") and got.split(";")[0] not in ("rc 0", "rc 1"):
            bad.append(f"{entry} exited {got}")
        if entry == "verify_step" and got.startswith("damage") and "/t0/" not in got and "/t1/" not in got:
            bad.append(f"verify named no file of the tiers: {got}")
    if r["peak_mib"] > baseline + MEMORY_MIB:
        bad.append(f"peak memory {r['peak_mib']} MiB over the intact case's {baseline}")
    if r["outside_changed"]:
        bad.append("something outside the tiers changed")
    return bad


@pytest.mark.parametrize(
    "kind",
    ["marker", "index", "metadata", "file", "step_dir", "pin", "failed", "lease", "quarantine", "blocks"],
)
def test_every_entry_point_passes_a_damaged_record_over_to_a_good_copy(battery: Battery, kind: str) -> None:
    intact = battery.of("intact")["intact"]
    assert not judged(intact, intact["peak_mib"]), intact
    found = battery.of(kind)
    assert found, f"no {kind} cases"
    problems: dict[str, list[str]] = defaultdict(list)
    for name, r in sorted(found.items()):
        for p in judged(r, intact["peak_mib"]):
            problems[name].append(p)
    assert not problems, f"{len(problems)} of {len(found)} {kind} cases:\n" + "\n".join(
        f"{n}:\n  " + "\n  ".join(ps) for n, ps in list(problems.items())[:15]
    )


def test_a_damaged_marker_or_index_is_reported_by_verify_and_ls_naming_the_file(battery: Battery) -> None:
    """A copy whose marker or index fails its checks is damage to report, naming the record
    and the check: not a step that is not there, nor a part file that is missing."""
    r = battery.of("marker")["marker:world_size:zero"]
    verify = r["entries"]["verify_step"]["got"]
    assert "/t0/run/step_000000000002/COMMITTED" in verify and "world_size" in verify, verify
    assert r["entries"]["cli_verify"]["got"] == "rc 1"
    ls = r["entries"]["cli_ls"]["got"]  # a row "damaged", and a line saying why
    assert "step 2 on tier 0: damaged: " in ls and "step_000000000002/COMMITTED: world_size" in ls, ls
    r = battery.of("index")["index:items.0.chunks.0.1:huge"]  # a chunk's raw length of 10^20
    ls, verify = r["entries"]["cli_ls"]["got"], r["entries"]["verify_step"]["got"]
    assert "step_000000000002/rank_00000.index: a chunk must be" in ls and "100000000000" in ls, ls
    assert "rank_00000.index: a chunk must be" in verify, verify
