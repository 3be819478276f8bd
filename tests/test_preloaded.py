"""The tests' programs forked from a preloaded interpreter behave as ``python`` run afresh
(``preloaded.py``): what they see, how they end, what the caller gets back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import preloaded
import pytest

SEES = """import json, os, random, sys, torch
print(json.dumps({
    'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(), 'env': os.environ.get('X'),
    'main': __name__, 'threads': torch.get_num_threads(), 'rand': random.random(),
}))"""


def test_a_program_sees_its_own_argv_environment_directory_and_seeds(tmp_path):
    env = {**os.environ, "X": "given", "OMP_NUM_THREADS": "1"}
    runs = [
        preloaded.run(
            [sys.executable, "-c", SEES, "a", "b"], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        for _ in range(2)
    ]
    seen = [json.loads(r.stdout) for r in runs]
    assert seen[0]["argv"] == ["-c", "a", "b"] and seen[0]["path0"] == "" and seen[0]["cwd"] == str(tmp_path)
    assert seen[0]["env"] == "given" and seen[0]["main"] == "__main__" and seen[0]["threads"] == 1
    assert seen[0]["rand"] != seen[1]["rand"]  # each program its own seed, as a fresh interpreter
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(sys.argv, sys.path[0], __file__)")
    out = preloaded.run([sys.executable, str(script), "x"], capture_output=True, text=True, check=True).stdout
    assert out == f"{[str(script), 'x']} {tmp_path} {script}\n"


def test_it_ends_as_python_does_and_the_caller_gets_the_status(tmp_path):
    def status(code: str) -> subprocess.CompletedProcess:
        return preloaded.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    with pytest.raises(ValueError, match="start args with sys.executable"):
        preloaded.Popen(["bash", "-c", "true"])  # only this interpreter's programs can be forked
    assert status("import sys; sys.exit(3)").returncode == 3
    raised = status("raise ValueError('boom')")
    assert raised.returncode == 1 and raised.stderr.endswith("ValueError: boom\n")
    assert "preloaded.py" not in raised.stderr  # the traceback is the program's own
    ended = status(
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread', flush=True))).start()"
    )
    assert ended.returncode == 0 and ended.stdout == "thread\natexit\n"  # threads joined, then atexit
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    proc = preloaded.Popen(
        [sys.executable, "-c", "print('up', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "up\n" and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)  # a real process: signals reach it
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_the_server_outlives_the_thread_that_started_it():
    """A parent-death signal would end it with that thread (PR_SET_PDEATHSIG is per thread)."""
    preloaded.stop_server()
    first = threading.Thread(
        target=preloaded.run, args=([sys.executable, "-c", "pass"],), kwargs={"check": True}
    )
    first.start()
    first.join()
    server = preloaded._SERVER[0]
    with pytest.raises(subprocess.TimeoutExpired):  # a signalled server would be gone at once
        server.wait(timeout=2)
    assert (
        preloaded.run([sys.executable, "-c", "print('still here')"], capture_output=True).stdout
        == b"still here\n"
    )
    assert preloaded._SERVER[0] is server
