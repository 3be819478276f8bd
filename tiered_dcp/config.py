"""User-facing configuration: tiers, their schedules, and the job-wide options.

Everything is validated at construction so that a bad value fails before any byte is
written, with a message that says what to change.
"""

from __future__ import annotations

import os
import re
import string
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from tiered_dcp.storage import check_url

COMPRESSIONS = (None, "zstd")
_PLACEHOLDERS = {"node", "rank"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*(?:::[A-Za-z][A-Za-z0-9+.-]*)*)://")  # fsspec chains too


def _to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if f.init}


def _check_keys(cls: type, d: Any) -> dict[str, Any]:
    """``d`` if it is a dict naming only ``cls``'s fields (their values are checked by ``cls``)."""
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__}.from_dict: expected a dict, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(cls) if f.init}
    if unknown:
        raise ValueError(f"{cls.__name__}.from_dict: unknown field(s) {sorted(unknown)}")
    return d


def _scheme(path: str) -> str | None:
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def _placeholders(path: str) -> set[str]:
    """The ``{...}`` names in ``path`` (``{{`` is a brace, no placeholder)."""
    return {n for _, n, _, _ in string.Formatter().parse(path) if n is not None}


class ReplicaPathWarning(UserWarning):
    """A replicated node-local tier whose path names no node: on a directory the nodes
    share, its replicas would be the very files they copy (``TieredConfig``)."""


_WARNED_REPLICA_PATHS: set[tuple[str, str, int]] = set()  # once per process, the config's copies too


def unreplicable_tiers(config: TieredConfig) -> list[int]:
    """Indexes of ``config``'s node-local tiers that replication cannot count on: their path
    has neither ``{node}`` nor ``{rank}``, so on a directory the nodes share every node's
    root is the same one and each part is held once, not ``replication_factor`` times.
    A tier declared ``shared=False`` is not one: that says each node's directory is its own."""
    if config.replication_factor < 2:
        return []
    return [i for i, t in enumerate(config.tiers) if names_no_node(t)]


def names_no_node(tier: Tier) -> bool:
    """Whether ``tier`` is node-local by inference (not declared ``shared=False``) with a
    path that has neither ``{node}`` nor ``{rank}``: every node's root is the same path."""
    return tier.shared is None and not tier.is_shared and not _placeholders(tier.path)


@dataclass(frozen=True)
class Tier:
    """One storage tier: a path (node-local) or an fsspec URL (shared).

    Args:
        path: a directory (``{node}`` and ``{rank}`` filled per process) or a URL
            (``gs://``, ``s3://``, any fsspec protocol). A directory on tmpfs is memory.
        every: the tier receives the steps divisible by it.
        keep: it retains the newest ``keep`` complete steps (``None`` keeps all).
        compression: ``None`` or ``"zstd"``.
        storage_options: passed to the URL's backend (credentials, endpoint, bounds).
        shared: ``None`` infers it (plain paths and ``file://`` are node-local, other URL
            schemes are shared); ``True`` declares a plain path shared (an NFS/Lustre
            mount), ``False`` a node-local one that names no node.

    Raises:
        ValueError: a bad value, at construction, with what to change (an unknown URL
            scheme or one whose package is missing names the package).
    """

    path: str
    every: int = 1
    keep: int | None = None
    compression: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    shared: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike) or not str(self.path).strip():
            raise ValueError(f"Tier path must be a non-empty path or URL, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(
                f"Tier({self.path!r}): every={self.every!r} must be an integer >= 1 "
                "(1 takes every step, 5 every fifth)"
            )
        if self.keep is not None and (
            isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1
        ):
            raise ValueError(
                f"Tier({self.path!r}): keep={self.keep!r} must be an integer >= 1, or None to keep every step"
            )
        if self.compression == "none":
            object.__setattr__(self, "compression", None)
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"Tier({self.path!r}): unknown compression {self.compression!r}; use None or 'zstd'"
            )
        if not isinstance(self.storage_options, dict):
            raise ValueError(f"Tier({self.path!r}): storage_options must be a dict")
        names = _placeholders(self.path)
        unknown = names - _PLACEHOLDERS
        if unknown:
            raise ValueError(
                f"Tier({self.path!r}): unknown placeholder(s) {sorted(unknown)}; "
                "only {node} and {rank} are filled in"
            )
        scheme = _scheme(self.path)
        if scheme not in (None, "file"):
            try:
                check_url(self.path)
            except ValueError as e:
                raise ValueError(f"Tier({self.path!r}): {e}") from None
        if self.shared is False and scheme not in (None, "file"):
            raise ValueError(
                f"Tier({self.path!r}): a {scheme}:// URL is one store for the whole job; "
                "it cannot be declared node-local (drop shared=False)"
            )
        if self.is_shared and names:
            raise ValueError(
                f"Tier({self.path!r}): a shared tier is one copy for the whole job, so it "
                "cannot contain {node} or {rank}; remove the placeholder or make it node-local"
            )

    @property
    def is_shared(self) -> bool:
        """Whether one copy serves the whole job (else every node has its own)."""
        if self.shared is not None:
            return self.shared
        return _scheme(self.path) not in (None, "file")

    @property
    def is_local_fs(self) -> bool:
        """Whether the tier is a directory of this machine's file system."""
        return _scheme(self.path) in (None, "file")

    def takes(self, step: int) -> bool:
        return step % self.every == 0

    def resolved(self) -> Tier:
        """This tier with a local path made absolute against the current directory, as
        ``LocalStorage`` opens it (a ``file://`` URL keeps its scheme; other URLs, and
        ``{node}``/``{rank}``, unchanged): the directory it means here, for a process
        started elsewhere (the writer process) and as part of what the job is (``run_dir``)."""
        if not self.is_local_fs:
            return self
        prefix = "file://" if self.path.startswith("file://") else ""
        rest = self.path.removeprefix(prefix)
        if not os.path.isabs(rest):  # the directory's braces are no placeholders
            rest = os.path.join(os.getcwd().replace("{", "{{").replace("}", "}}"), rest)
        path = prefix + os.path.normpath(rest)
        return self if path == self.path else replace(self, path=path)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as given (plain data: the writer process gets its config as JSON)."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tier:
        """The tier ``to_dict`` described, validated like any other."""
        return cls(**_check_keys(cls, d))

    def root(self, node: int, rank: int) -> str:
        """The tier's base path or URL for a process on ``node`` with ``rank``."""
        return self.path.format(node=node, rank=rank)


NONFINITE_POLICIES = ("mark", "raise", "ignore")  # TieredConfig.on_nonfinite; the first is the default
REPLICA_POLICIES = ("mark", "raise", "warn", "ignore")  # TieredConfig.on_replica_mismatch; likewise
LAGGING_POLICIES = ("wait", "skip")  # TieredConfig.on_lagging_tier; the first is the default


def is_namespace(name: str) -> bool:
    """Whether ``name`` may be a namespace: a safe path component (``TieredConfig``)."""
    return bool(_SAFE_NAME.match(name)) and name not in (".", "..")


@dataclass(frozen=True)
class TieredConfig:
    """The whole checkpointing setup of one training job.

    Args:
        namespace: the job's name in every tier (a safe path component: letters, digits,
            ``.``, ``_``, ``-``); its steps live under ``<tier root>/<namespace>/``.
        tiers: fastest first: a save commits on the fastest tier that takes its step, and a
            load reads from the fastest tier holding the step complete.
        replication_factor: copies of each rank's part on node-local tiers (1: none), held
            by the members of its clique (``ranks.cliques``).
        replication_jump: ranks between two members of a clique; the ranks per node, so
            that each copy lies on another node.
        dedup: store large tensors as content-named blocks, so unchanged data is not
            written again (``steps.dedup``).
        peer_timeout: seconds any wait on another rank may last (a replica transfer, the
            commit agreement, a rank's arrival at a save, a peer read).
        tier_timeout: seconds a tier may go without answering before it counts as down: a
            load or query skips a shared tier silent that long (with a warning), and a
            writer process whose writes make no progress that long marks the tier
            unhealthy, so saves stop waiting for it.
        writer_drain_timeout: seconds a writer process goes on writing after its trainer is
            gone; then it records what it could not persist and exits.
        on_nonfinite: a save of a floating tensor holding NaN/Inf (``NONFINITE_POLICIES``):
            ``"mark"`` saves the step marked, so that ``load_latest`` and
            ``TieredReader(config)`` pass it over; ``"raise"`` fails the save before it
            commits; ``"ignore"`` does not look.
        on_replica_mismatch: a save whose data-parallel replicas disagree
            (``REPLICA_POLICIES``; every copy of an item several ranks hold is checksummed and
            compared at the save's agreement): ``"mark"`` commits the step marked, passed
            over as a non-finite one; ``"raise"`` refuses it (``ReplicaMismatchError`` on
            every rank); ``"warn"`` commits it as any other; ``"ignore"`` compares nothing.
            Each disagreement is logged and recorded at once, whatever the policy.
        failure_domain: where each rank sits among the groups that fail together (a rack, a
            power domain, a node pool): the name of an environment variable each rank reads,
            or a callable ``rank -> str`` (a module-level function, for DCP's PROCESS async
            mode). Given, cliques are laid out across domains (``ranks.cliques.by_domain``)
            instead of by ``replication_jump``.
        on_lagging_tier: when the first tier is in memory, what happens to a step leaving
            its ``keep`` window while a slower tier still copies it (``LAGGING_POLICIES``):
            ``"wait"`` makes the save that would push it out wait, before it stages, until
            the copy is done (every step a tier's ``every`` takes reaches it; training waits
            for the slower tier); ``"skip"`` drops it all the same (no save waits; the slower
            tier's copy is recorded as skipped, and it takes the newest step next). Host
            memory stays at ``keep + 1`` steps either way.

    Raises:
        ValueError: any bad value, at construction, with what to change.
    """

    namespace: str
    tiers: list[Tier]
    replication_factor: int = 1
    replication_jump: int = 1
    dedup: bool = False
    peer_timeout: float = 120.0
    tier_timeout: float = 10.0
    writer_drain_timeout: float = 600.0
    on_nonfinite: str = "mark"
    on_replica_mismatch: str = "mark"
    failure_domain: str | Callable[[int], str] | None = None
    on_lagging_tier: str = "wait"

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError("TieredConfig: namespace must be a non-empty string, e.g. 'run3'")
        if not is_namespace(self.namespace):
            raise ValueError(
                f"TieredConfig: namespace {self.namespace!r} is not a safe path component; "
                "use letters, digits, '.', '_' and '-' only, starting with a letter or digit"
            )
        tiers = list(self.tiers) if isinstance(self.tiers, list | tuple) else None
        if not tiers:
            raise ValueError("TieredConfig: tiers must be a non-empty list of Tier(...)")
        for t in tiers:
            if not isinstance(t, Tier):
                raise ValueError(f"TieredConfig: every tier must be a Tier, got {t!r}")
        paths = [t.path for t in tiers]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"TieredConfig: tier path(s) listed twice: {dupes}")
        object.__setattr__(self, "tiers", tiers)
        for name in ("replication_factor", "replication_jump"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TieredConfig: {name}={value!r} must be an integer >= 1")
        for name in ("peer_timeout", "tier_timeout", "writer_drain_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"TieredConfig: {name}={value!r} must be a number of seconds > 0")
        if not isinstance(self.dedup, bool):
            raise ValueError(f"TieredConfig: dedup={self.dedup!r} must be True or False")
        fd = self.failure_domain
        if not (fd is None or callable(fd) or (isinstance(fd, str) and _ENV_NAME.match(fd))):
            raise ValueError(
                f"TieredConfig: failure_domain={fd!r} must be the name of an environment variable "
                "each rank reads (e.g. 'RACK'), a function rank -> str, or None"
            )
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"TieredConfig: on_nonfinite={self.on_nonfinite!r} must be one of {list(NONFINITE_POLICIES)}"
            )
        if self.on_replica_mismatch not in REPLICA_POLICIES:
            raise ValueError(
                f"TieredConfig: on_replica_mismatch={self.on_replica_mismatch!r} "
                f"must be one of {list(REPLICA_POLICIES)}"
            )
        if self.on_lagging_tier not in LAGGING_POLICIES:
            raise ValueError(
                f"TieredConfig: on_lagging_tier={self.on_lagging_tier!r} "
                f"must be one of {list(LAGGING_POLICIES)}"
            )
        self._warn_unreplicable()

    def _warn_unreplicable(self) -> None:
        """Warn (once per tier and process; not refused: one node, or directories that are
        truly each node's own, hold every copy) where replication's copies may not exist."""
        for i in unreplicable_tiers(self):
            tier = self.tiers[i]
            where = os.path.abspath(tier.path.removeprefix("file://"))  # a relative path as its resolved copy
            key = (self.namespace, where, self.replication_factor)
            if key in _WARNED_REPLICA_PATHS:
                continue
            _WARNED_REPLICA_PATHS.add(key)
            warnings.warn(
                ReplicaPathWarning(
                    f"TieredConfig({self.namespace!r}): tier {i} ({tier.path!r}) is node-local and "
                    f"replication_factor={self.replication_factor}, but its path names no node: where "
                    "the nodes share that directory, each part is held there once, not "
                    f"{self.replication_factor} times. Put {{node}} in the path (e.g. "
                    f"{tier.path.rstrip('/') + '/{node}'!r}), or declare the tier shared=True if it is "
                    "one directory for the whole job (shared=False if each node's is its own: then "
                    "this warning goes)"
                ),
                stacklevel=4,  # _warn_unreplicable, __post_init__, the dataclass's __init__: its caller
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field, the tiers as dicts: plain data, as the writer process receives it.

        Generic over the fields, so a field added later travels without edits here; its
        value must be JSON data (``run_dir.config_json`` says which when it is not). A callable
        ``failure_domain`` travels as None: the writer process takes each step's cliques
        from its marker, and a function is no data.
        """
        d = {**_to_dict(self), "tiers": [t.to_dict() for t in self.tiers]}
        if callable(self.failure_domain):
            d["failure_domain"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TieredConfig:
        """The config ``to_dict`` described, validated like any other (unknown fields refused)."""
        d = _check_keys(cls, d)
        tiers = d.get("tiers")
        if not isinstance(tiers, list):
            raise ValueError(f"TieredConfig.from_dict: tiers must be a list, got {type(tiers).__name__}")
        return cls(**{**d, "tiers": [Tier.from_dict(t) for t in tiers]})

    def resolved(self) -> TieredConfig:
        """This config with its tiers' local paths made absolute against the current
        directory (``Tier.resolved``; itself when they already are): what the job is, as its
        writer processes are keyed (``run_dir.job_dir``) and as they receive it."""
        tiers = [t.resolved() for t in self.tiers]
        if all(a is b for a, b in zip(tiers, self.tiers, strict=True)):
            return self
        return replace(self, tiers=tiers)

    def tiers_for(self, step: int) -> list[int]:
        """Indexes of the tiers that take ``step``, fastest first."""
        return [i for i, t in enumerate(self.tiers) if t.takes(step)]


def here() -> tuple[int, int]:
    """(node, rank) of this process outside a process group: from RANK and the node vars."""
    rank = int(os.environ.get("RANK", "0"))
    return node_of(rank), rank


def node_of(rank: int) -> int:
    """This process's node: GROUP_RANK, else rank // LOCAL_WORLD_SIZE, else 0."""
    if os.environ.get("GROUP_RANK"):
        return int(os.environ["GROUP_RANK"])
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws and int(lws) > 0:
        return rank // int(lws)
    return 0


class StrEnum(str, Enum):
    """A state (a step's, a tier's, a job's) stored as its plain string (the JSON on disk is
    the value), shown as it too:
    ``str()``, ``%s`` and f-strings give ``failing``, not ``TierState.FAILING`` (what
    ``enum.StrEnum`` does from Python 3.11; this package still runs on 3.10)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
