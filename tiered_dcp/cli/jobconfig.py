"""Loading a job's ``TieredConfig`` from where an operator keeps it, so tools need no retyping.

Two sources, both given to the CLI as ``--config SOURCE``:

- a TOML file with the fields of ``TieredConfig`` and one ``[[tiers]]`` table per tier with
  the fields of ``Tier`` (``storage_options`` as a ``[tiers.storage_options]`` table): every
  field the dataclasses have, and nothing else;
- ``python:module:attr``: the attribute ``attr`` (dotted names allowed) of an importable
  module, either a ``TieredConfig`` or a function of no arguments returning one: the very
  object the training script uses.

Torch-free: ``tiered-dcp ls --config`` stays fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any

from ..config import Tier, TieredConfig

_REQUIRED = {  # the fields without a default, per dataclass
    cls: [f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING]
    for cls in (TieredConfig, Tier)
}


def _toml_loads(text: str, where: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.10 only
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ValueError(
                "reading a TOML config on Python 3.10 needs the 'tomli' package (pip install tomli), "
                "or give the config as python:module:attr"
            ) from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML: {e}") from None


def config_from_dict(data: dict[str, Any], where: str = "config") -> TieredConfig:
    """A ``TieredConfig`` from plain data (a parsed TOML file). Unknown and missing keys are
    refused, and every error names ``where`` (the file) and the table it is about."""
    tiers_data = data.get("tiers")
    if not isinstance(tiers_data, list) or not tiers_data:
        raise ValueError(f"{where}: needs at least one [[tiers]] table with a path")
    tiers = []
    for i, t in enumerate(tiers_data):
        if not isinstance(t, dict):
            raise ValueError(f"{where}: tiers[{i}] must be a table, got {t!r}")
        tiers.append(_build(Tier, t, f"{where}: [[tiers]] #{i + 1}"))
    return _build(TieredConfig, {**data, "tiers": tiers}, where)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    """``cls(**data)``, its keys checked first; its own ValueError prefixed with ``where``."""
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {sorted(unknown)}; {cls.__name__} has "
            f"{sorted(f.name for f in dataclasses.fields(cls))}"
        )
    missing = [name for name in _REQUIRED[cls] if name not in data]
    if missing:
        raise ValueError(f"{where}: {cls.__name__} needs {', '.join(missing)}")
    try:
        return cls(**data)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_job_config(source: str) -> TieredConfig:
    """The config named by ``source``: a TOML file path, or ``python:module:attr``."""
    if source.startswith("python:"):
        return _from_python(source)
    path = Path(source)
    if path.suffix == ".py":
        raise ValueError(
            f"{source}: a Python file is given as python:MODULE:ATTR (e.g. python:{path.stem}:CONFIG, "
            "run from its directory), a TOML file by its path"
        )
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {source}: {e.strerror or e}") from e
    return config_from_dict(_toml_loads(text, str(path)), where=str(path))


def _from_python(source: str) -> TieredConfig:
    module_name, sep, attr = source.removeprefix("python:").partition(":")
    if not module_name or not sep or not attr:
        raise ValueError(f"--config {source!r}: write python:MODULE:ATTR, e.g. python:train_cfg:CONFIG")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # a module next to where the operator runs the command
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--config {source!r}: cannot import {module_name}: {e}") from e
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as e:
            raise ValueError(f"--config {source!r}: {module_name} has no attribute {attr}") from e
    if callable(obj) and not isinstance(obj, TieredConfig):
        obj = obj()
    if not isinstance(obj, TieredConfig):
        raise ValueError(f"--config {source!r} is a {type(obj).__name__}, not a TieredConfig")
    return obj
