"""The README's examples marked runnable run as a new user would run them: copied into a
file in an empty directory and run with the installed package, twice (the second run
resumes where the first stopped)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
RUNNABLE = re.compile(r"<!-- runnable[^>]*-->\n```python\n(.*?)```", re.S)


def runnable_blocks() -> list[str]:
    return RUNNABLE.findall(README.read_text())


def test_the_readme_has_a_runnable_example():
    assert runnable_blocks(), "the README's first example must be marked runnable"


def test_every_runnable_readme_example_runs_and_resumes(tmp_path):
    for n, code in enumerate(runnable_blocks()):
        work = tmp_path / f"example{n}"
        work.mkdir()
        (work / "example.py").write_text(code)
        runs = [
            subprocess.run(
                [sys.executable, "example.py"], cwd=work, capture_output=True, text=True, timeout=300
            )
            for _ in range(2)
        ]
        for r in runs:
            assert r.returncode == 0, r.stdout + r.stderr
            assert "Traceback" not in r.stderr, r.stderr
        if "load_latest" in code:  # the quickstart: the second run goes on from the first
            assert "trained to step 20" in runs[0].stdout, runs[0].stdout
            assert "resumed after step 20" in runs[1].stdout and "trained to step 40" in runs[1].stdout
