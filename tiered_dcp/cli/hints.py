"""What the command line says when it is given a name that is not there: a tier path, a
namespace, a flag. One owner for each check, so that every command says the same.

Torch-free, and cheap: it lists directories, never reads a checkpoint.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from tiered_dcp.storage import open_storage
from tiered_dcp.storage.format import parse_step_dir

from ..config import Tier, _placeholders, here, is_namespace

SHOWN_ENTRIES = 8  # a directory's entries named in one line; the rest are counted


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelled ``name`` (difflib's ratio >= 0.6), if any."""
    close = difflib.get_close_matches(name, sorted(set(known)), n=1)
    return close[0] if close else None


def named(entries: list[str]) -> str:
    """``a, b, c`` for a line, at most ``SHOWN_ENTRIES`` of them and the count of the rest."""
    shown = ", ".join(entries[:SHOWN_ENTRIES])
    more = len(entries) - SHOWN_ENTRIES
    return shown + (f" and {more} more" if more > 0 else "")


# -- namespaces -------------------------------------------------------------------------------


def namespace_hint(namespace: str, there: list[str], where: str = "these tiers") -> str:
    """The end of a "no such namespace" line: the close match, if any, and what is there."""
    if not there:
        return f"{where} hold no namespace"
    close = did_you_mean(namespace, there)
    listed = f"namespaces there: {named(sorted(set(there)))}"
    return f"did you mean {close!r}? ({listed})" if close else listed


# -- tier paths -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathProblem:
    """What is wrong with one tier's path, in one line. ``fatal``: it cannot be the tier
    (a directory of node directories, or a namespace's own); otherwise it does not exist
    (yet: a slower tier before its first step), and the command goes on without it."""

    line: str
    fatal: bool


def tier_path_problems(tiers: list[Tier], must_exist: bool = True) -> list[PathProblem]:
    """One line per local tier whose root (its path for this node) is not a tier root:
    absent (when ``must_exist``), a directory holding node directories but no namespace,
    or a namespace's own directory. URL tiers are not looked at (no network here)."""
    node, rank = here()
    out = []
    for i, tier in enumerate(tiers):
        if not tier.is_local_fs:
            continue
        root = tier.root(node, rank).removeprefix("file://")
        why = _root_problem(tier, root, must_exist)
        if why is not None:
            out.append(PathProblem(f"tier {i} ({tier.path}): {why[0]}", why[1]))
    return out


def _root_problem(tier: Tier, root: str, must_exist: bool) -> tuple[str, bool] | None:
    if not os.path.isdir(root):
        if not must_exist or (os.path.lexists(root) and not os.path.exists(root)):
            return None  # to be made (import), or a dangling link the storage layer reports
        return _missing(tier, root), False
    entries = _entries(root)
    if _holds_namespace(root, entries):
        return None
    if _holds_steps(root):
        parent = os.path.dirname(root.rstrip("/")) or "."
        name = os.path.basename(root.rstrip("/"))
        return (
            f"{root} holds steps: it is the directory of namespace {name!r}; give its parent "
            f"{parent!r} as the tier, with -n {name}"
        ), True
    nodes = sorted((e for e in entries if e.isdigit()), key=int)
    if not _placeholders(tier.path) and any(_holds_namespace(os.path.join(root, n)) for n in nodes):
        return (
            f"{root} holds node directories {named(nodes)}: did you mean "
            f"{tier.path.rstrip('/') + '/{node}'!r}?"
        ), True
    return None


def _missing(tier: Tier, root: str) -> str:
    """``ckpt/sdd does not exist; ckpt holds: ram, ssd (did you mean 'ckpt/ssd/{node}'?)``."""
    gone = os.path.normpath(root)
    while not os.path.isdir(os.path.dirname(gone) or "."):
        gone = os.path.dirname(gone)
    if os.path.exists(gone):
        return f"{gone} is not a directory"
    parent = os.path.dirname(gone) or "."
    if os.path.dirname(parent) == parent:  # the file system's root: its listing helps nobody
        return f"{gone} does not exist"
    entries = _entries(parent)
    line = f"{gone} does not exist; " + (
        f"{parent} holds: {named(entries)}" if entries else f"{parent} is empty"
    )
    close = did_you_mean(os.path.basename(gone), entries)
    if close is None:
        return line
    fixed = _replaced(tier.path, gone, close)
    return line + (f" (did you mean {fixed!r}?)" if fixed else f" (did you mean {close!r}?)")


def _replaced(template: str, gone: str, close: str) -> str | None:
    """``template`` (the tier's path as given) with its component that is ``gone``'s last
    replaced by ``close``, where the template's components line up with ``gone``'s."""
    prefix = "file://" if template.startswith("file://") else ""
    parts = template.removeprefix(prefix).split("/")
    node, rank = here()
    filled = [p.format(node=node, rank=rank) for p in parts]
    target = gone.split("/")
    at = len(target) - 1
    if filled[: len(target)] != target or _placeholders(parts[at]):
        return None
    parts[at] = close
    return prefix + "/".join(parts)


def _entries(directory: str) -> list[str]:
    """The names in ``directory`` a user would look for (not hidden ones), sorted."""
    try:
        return sorted(e for e in os.listdir(directory) if not e.startswith("."))
    except OSError:
        return []


def _holds_namespace(directory: str, entries: list[str] | None = None) -> bool:
    """Whether ``directory`` is a tier root: a directory of it holds steps (a namespace)."""
    names = _entries(directory) if entries is None else entries
    return any(_holds_steps(os.path.join(directory, e)) for e in names if is_namespace(e))


def _holds_steps(directory: str) -> bool:
    return any(parse_step_dir(e) is not None for e in _entries(directory))


def missing_namespace(namespace: str, tiers: list[Tier]) -> str | None:
    """The "no such namespace" line when no tier's root (this node's) holds a directory of
    ``namespace``; None when one does, or it cannot tell at once: a URL tier (listed by the
    command itself, within ``tier_timeout``) or a root it cannot list (the command says why)."""
    if not all(t.is_local_fs for t in tiers):
        return None
    node, rank = here()
    try:
        for tier in tiers:
            if namespace in open_storage(tier.root(node, rank), tier.storage_options).list(""):
                return None
        there = namespace_names(tiers)
    except (OSError, ValueError):
        return None
    return f"no namespace {namespace!r} on these tiers; {namespace_hint(namespace, there)}"


def namespace_names(tiers: list[Tier]) -> list[str]:
    """The namespaces the tiers' roots (this node's) hold: directories holding steps."""
    node, rank = here()
    found = set()
    for tier in tiers:
        store = open_storage(tier.root(node, rank), tier.storage_options)
        for name in store.list(""):
            if is_namespace(name) and any(parse_step_dir(d) is not None for d in store.list(name)):
                found.add(name)
    return sorted(found)


# -- flags ------------------------------------------------------------------------------------


def flag_hint(unknown: list[str], flags: Iterable[str]) -> str:
    """`` (did you mean --step?)`` for the first unknown flag with a close known one."""
    for arg in unknown:
        if arg.startswith("-"):
            close = did_you_mean(arg.split("=", 1)[0], [f for f in flags if f.startswith("--")])
            if close:
                return f" (did you mean {close}?)"
    return ""
