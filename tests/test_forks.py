"""A child forked from a process that saved and loaded with tiered-dcp saves and loads on its
own: the parent's thread pools, locks and saves in flight are not the child's
(``storage/forks.py``). Before, the child waited forever on its first save or load."""

import ast
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.mark.parametrize("staging", ["default", "background"])
def test_a_child_forked_during_a_save_saves_and_loads_on_its_own(shm, staging):
    out = preloaded.run(
        [sys.executable, str(HERE / "fork_worker.py"), str(shm), staging],
        capture_output=True,
        text=True,
        timeout=120,  # the child gives up after 30 s of waiting for its writer; never forever
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "child: loaded (2, True) and (1, True)" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "parent: child exited 0; loaded (3, True)" in out.stdout, out.stdout + out.stderr[-3000:]


def test_what_a_fork_must_not_inherit_is_renewed_in_one_place():
    """Only ``storage/forks.py`` registers at-fork handlers, and nothing makes a pool of
    threads of its own outside ``forks.ThreadPool`` (a pool a child inherits never runs)."""
    found = []
    for base in (ROOT / "tiered_dcp", ROOT / "storage", ROOT / "planners"):
        for path in base.rglob("*.py"):
            if path.name == "forks.py" or "cli" in path.parts or "ops" in path.parts:
                continue  # commands and one-shot operations make short-lived pools in a with block
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "register_at_fork":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} register_at_fork")
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ThreadPoolExecutor":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} ThreadPoolExecutor")
    assert not found, found


def test_a_child_forked_while_a_backend_is_imported_on_demand_opens_it_itself():
    """The registry imports the GCS backend the first time a gs:// URL needs it, under a
    lock; a child forked while another thread held it (a DataLoader worker) gets a lock of
    its own: its first gs:// URL does not wait forever. In a fresh interpreter, where the
    backend is still to be imported."""
    code = (
        "import os, time\n"
        "from tiered_dcp.storage import registry\n"
        "with registry._IMPORTING:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0 if registry.backend_for('gs://b/x').__name__ == 'GCSStorage' else 1)\n"
        "deadline = time.monotonic() + 20\n"
        "while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "if done[0] == 0:\n"
        "    os.kill(pid, 9)\n"
        "    raise SystemExit('the child waited on the lock its parent held')\n"
        "raise SystemExit(os.waitstatus_to_exitcode(done[1]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
