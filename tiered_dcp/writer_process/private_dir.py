"""A directory only this user can change, and files in it only this user can read.

The writer processes' runtime directory has a predictable name in a world-writable place
(``/dev/shm/tiered-dcp-<uid>``). Used as found, another user could create it first, or
swap a job's subdirectory in it, and feed the writer process what it reads there. So on
every use the directory must be this user's and not writable by group or others, and no
directory above it may let another user rename it away (each is owned by root or this
user, and sticky where others may write, as ``/tmp`` and ``/dev/shm`` are): the rule ssh
applies to ``~/.ssh`` and XDG to ``$XDG_RUNTIME_DIR``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import TieredCheckpointError


class UnsafeDirectoryError(TieredCheckpointError, PermissionError):
    """The runtime directory (or one above it) could be changed by another user."""


_FIX = (
    "Remove it (it holds nothing worth keeping once no writer process runs), or set "
    "TIERED_DCP_RUNTIME_DIR to a directory of your own: mkdir -m 700 DIR."
)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: Path, st: os.stat_result, why: str, fix: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(
        f"refusing the runtime directory {path}: {why} (owner {_owner(st.st_uid)}, mode "
        f"{stat.filemode(st.st_mode)} {stat.S_IMODE(st.st_mode):04o}; this process runs as "
        f"{_owner(os.geteuid())}). Another user could replace what the writer process reads "
        f"there. {fix}"
    )


def check_private(path: Path) -> None:
    """Raise UnsafeDirectoryError unless ``path`` (resolved, no symlinks) is private to this user."""
    me, fix = os.geteuid(), _FIX
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, st, "it is not a directory", fix)
    if st.st_uid != me:
        raise _refuse(path, st, "it belongs to another user", fix)
    if st.st_mode & 0o022:
        raise _refuse(path, st, "group or others may write it", f"Run: chmod 700 {path}")
    for parent in path.parents:
        pst = os.lstat(parent)
        if pst.st_uid not in (0, me):
            raise _refuse(parent, pst, f"it holds {path} and belongs to another user", fix)
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            raise _refuse(
                parent,
                pst,
                f"it holds {path}, others may write it and it is not sticky (so they may rename "
                "what it holds)",
                fix,
            )


def ensure_private(path: str | os.PathLike) -> Path:
    """``path`` resolved, created mode 0700 where missing, checked by ``check_private``.

    Callers use the returned path: it has no symbolic link left that someone could
    repoint between this check and the use.
    """
    given = Path(os.path.abspath(path))
    for part in [*reversed(given.parents), given]:  # a link another user owns, they can repoint
        st = os.lstat(part) if os.path.lexists(part) else None
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            raise _refuse(part, st, f"it is a symbolic link to {given} that another user owns", _FIX)
    mkdir_private(Path(os.path.realpath(path)))
    real = Path(os.path.realpath(path))  # another process may have made a part of it a link
    check_private(real)
    return real


def mkdir_private(path: Path) -> None:
    """Make ``path`` and every missing directory above it with mode 0700."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another rank meanwhile
            os.mkdir(d, 0o700)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees all of it or none), mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def open_private(path: Path) -> BinaryIO:
    """Open ``path`` for appending, created with mode 0600 if missing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "ab")
