"""Python programs started as forks of one preloaded interpreter, not as fresh ones.

A fresh interpreter spends ~5 CPU-seconds importing torch and DCP on a 2-core machine, and
most of the programs the tests start (a rank of a job, the command line, a trainer to kill)
prove nothing more for it. ``Popen`` and ``run`` take ``python``'s argv (``[sys.executable,
SCRIPT | -m MODULE | -c CODE, ...]``) and behave as ``subprocess``'s: real pipes, a real pid
to signal, the exit status as ``subprocess`` reports it. The program runs in a fork of a
server (one per test process) that imported ``PRELOAD`` once and started no thread, as
``python`` would run it: its own environment, working directory, ``sys.argv``,
``sys.path[0]`` and ``__main__``, fresh random seeds, its standard streams made anew; at
its end its threads are joined and its ``atexit`` functions run.

What only a fresh interpreter shows (what an import costs or loads, what is read from the
environment at startup, a launcher's own processes) is tested with ``subprocess`` itself.

``python preloaded.py SOCKET`` is the server: it preloads, listens on ``SOCKET``, forks a
program per connection (its argv, environment and directory as JSON, its three standard
streams as descriptors) and answers with the pid, later with the exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

# torch._dynamo: DTensor and FSDP import it on their first call (~1 CPU-second a process)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "tiered_dcp",
    "tiered_dcp.cli.main",
    "gcsfs",
    "fsspec",
]
_SERVER: tuple[subprocess.Popen, str] | None = None
_LOCK = threading.Lock()


# -- the client: subprocess's interface ----------------------------------------------------


def _server() -> str:
    """The socket of this process's server, started on first use."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="tdcp-preloaded-"), "sock")
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
            )
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(
                    f"the preloaded server did not start (it said {line!r}); its error is above, on "
                    f"stderr: one of {PRELOAD} failed to import in this environment"
                )
            _SERVER = (proc, path)
        return _SERVER[1]


def stop_server() -> None:
    """End this process's server, if it runs (the next program starts another)."""
    global _SERVER
    with _LOCK:
        if _SERVER is not None:
            proc, path = _SERVER
            proc.kill()
            proc.wait()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            _SERVER = None


def _stream(spec: Any, std: int, mode: str, pipes: list, text: bool) -> tuple[int, IO | None]:
    """The descriptor the program gets for one standard stream, and our end of a pipe."""
    if spec is None:
        return std, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        pipes.append(fd)
        return fd, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        ours, theirs = (w, r) if mode == "w" else (r, w)
        pipes.append(theirs)
        kw = {"encoding": "utf-8", "errors": "replace"} if text else {}
        return theirs, open(ours, mode + ("" if text else "b"), **kw)
    return (spec if isinstance(spec, int) else spec.fileno()), None


class Popen:
    """``subprocess.Popen`` for a Python program, forked from the preloaded server."""

    def __init__(
        self,
        args: list[str],
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        text: bool = False,
        universal_newlines: bool = False,
    ) -> None:
        if not args or args[0] != sys.executable:
            raise ValueError(
                f"preloaded runs Python programs only: start args with sys.executable, not {args[:1]!r}"
            )
        text = text or universal_newlines
        self.args = args
        self.returncode: int | None = None
        theirs: list[int] = []
        fd0, self.stdin = _stream(stdin, 0, "w", theirs, text)
        fd1, self.stdout = _stream(stdout, 1, "r", theirs, text)
        fd2, self.stderr = (
            (fd1, None) if stderr == subprocess.STDOUT else _stream(stderr, 2, "r", theirs, text)
        )
        order = {
            "argv": list(args[1:]),
            "env": dict(os.environ if env is None else env),
            "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
        }
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_server())
            socket.send_fds(self._conn, [json.dumps(order).encode() + b"\n"], [fd0, fd1, fd2])
            self.pid = int(self._line())
        finally:
            for fd in theirs:
                os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _line(self) -> bytes:
        """One answer of the server, read unbuffered: a buffer could hide the next from select."""
        line = b""
        while not line.endswith(b"\n"):
            got = self._conn.recv(1)
            if not got:
                break
            line += got
        return line

    def _read_status(self) -> None:
        line = self._line()
        self.returncode = int(line) if line else -signal.SIGKILL  # the server itself was killed
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """What the program wrote to its pipes, until it ends (``input`` written first)."""
        got: dict[str, Any] = {}

        def drain(name: str, f: IO) -> None:
            got[name] = f.read()
            f.close()

        readers = [
            threading.Thread(target=drain, args=(name, f), daemon=True)
            for name, f in (("out", self.stdout), ("err", self.stderr))
            if f is not None
        ]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                with contextlib.suppress(BrokenPipeError):
                    self.stdin.write(input)
            self.stdin.close()
        self.wait(timeout)  # raises TimeoutExpired as subprocess's does; the caller kills
        for t in readers:
            t.join()
        return got.get("out"), got.get("err")

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def run(
    args: list[str],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kw: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a Python program, forked from the preloaded server."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    proc = Popen(args, **kw)
    try:
        out, err = proc.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# -- the server and its programs -----------------------------------------------------------


def _program(argv: list[str], env: dict[str, str], cwd: str, keep: list) -> int:
    """Run ``python ARGV`` in this forked process as the interpreter would; its exit status."""
    import atexit
    import io
    import random
    import runpy
    import traceback
    import types

    os.chdir(cwd)
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(env)
    # fresh standard streams over the descriptors the program got (the old ones kept alive:
    # collected, they would close descriptors 0-2)
    keep.extend([sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    raw = io.FileIO(1, "w", closefd=False)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding="utf-8",
        line_buffering=os.isatty(1),
        write_through=unbuffered,
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    base = [p for p in sys.path[1:] if p not in given]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    random.seed()
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read when torch loaded OpenMP: in the server
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-c":
            sys.argv, sys.path = ["-c", *argv[2:]], ["", *extra, *base]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv, sys.path = [argv[1], *argv[2:]], [os.getcwd(), *extra, *base]
            runpy._run_module_as_main(argv[1])  # what ``python -m`` calls
        else:
            path = os.path.abspath(argv[0])
            sys.argv, sys.path = list(argv), [os.path.dirname(path), *extra, *base]
            main.__file__ = argv[0]
            with open(path, "rb") as f:
                code = compile(f.read(), argv[0], "exec")
            exec(code, main.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        e = e.with_traceback(e.__traceback__.tb_next)  # as python prints it: without this frame
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            f.flush()
    return status


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _fork(conn: socket.socket, keep: list[socket.socket | int], waiting: dict) -> None:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        data += conn.recv(1 << 20)
    order = json.loads(data)
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for held in [*keep, *waiting.values(), conn]:
                held.close() if isinstance(held, socket.socket) else os.close(held)
            for std, fd in enumerate(fds):
                os.dup2(fd, std)
            for fd in set(fds) - {0, 1, 2}:
                os.close(fd)
            status = _program(order["argv"], order["env"], order["cwd"], [])
        finally:
            os._exit(status)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    waiting[pid] = conn


def serve(path: str) -> None:
    import importlib

    parent = os.getppid()  # its test process: the server ends with it (checked every second)
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, threading.enumerate()  # a fork must not lose a thread
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    woken, wake = os.pipe()  # a child's end wakes the select below (a handler alone would not)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # not PR_SET_PDEATHSIG: that fires when the starting thread ends
        ready = select.select([listener, woken], [], [], 1.0)[0]
        if woken in ready:
            os.read(woken, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            _fork(conn, [listener, woken, wake], waiting)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the test process stopped waiting
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
