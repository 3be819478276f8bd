"""The README's first command on a fresh checkout: `bash scripts/setup.sh` makes .venv,
installs what the demo needs and prints one line; pip's chatter stays in its log.

A copy of the tracked files in a temporary directory, so the running tests' venv is not
touched. torch is taken from this venv (a .pth file in the new one's site-packages): a
fresh install would fetch it, which the README's first run does once and a test need not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in files.split("\n"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def test_setup_prints_one_line_and_the_demo_command_is_there(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    repo = tmp_path / "repo"
    _checkout(repo)
    subprocess.run([sys.executable, "-m", "venv", str(repo / ".venv")], check=True)
    purelib = sysconfig.get_paths(vars={"base": str(repo / ".venv"), "platbase": str(repo / ".venv")})[
        "purelib"
    ]
    Path(purelib, "_borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch & co.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    r = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [r.stdout.strip()] and r.stdout.startswith(
        "setup: .venv ready (tiered-dcp "
    )
    assert r.stderr == "", r.stderr  # no resolver ERROR lines, no banners
    assert "torch 2." in r.stdout and "test tools" not in r.stdout
    v = subprocess.run(
        [str(repo / ".venv/bin/tiered-dcp"), "--version"], capture_output=True, text=True, env=env
    )
    assert v.returncode == 0 and v.stdout.startswith("tiered-dcp "), v.stdout + v.stderr
    bad = subprocess.run(["bash", "scripts/setup.sh", "--bogus"], cwd=repo, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: bash scripts/setup.sh [--test]" in bad.stderr
