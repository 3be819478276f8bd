"""Import tiered_dcp from another checkout: ``TIERED_DCP_BENCH_TREE=PATH`` (a benchmark's
``--baseline-tree``), set before the first import of tiered_dcp (import this module first).

The editable install maps ``tiered_dcp``, ``tiered_dcp.storage`` and ``tiered_dcp.planners``
to this worktree's tiered_dcp/, storage/ and planners/ (a finder at the end of
``sys.meta_path``); PYTHONPATH alone would load the other tree's ``tiered_dcp`` but still
this tree's ``storage`` and ``planners``. A finder first on ``sys.meta_path`` maps all three
to PATH; their submodules follow from the packages' ``__path__``. ``loaded_from`` says where
every tiered_dcp module came from, so a benchmark can check it ran the code it names.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from typing import Any

PACKAGES = {"tiered_dcp": "tiered_dcp", "tiered_dcp.storage": "storage", "tiered_dcp.planners": "planners"}


class TreeFinder(importlib.abc.MetaPathFinder):
    """Finds tiered_dcp's three top packages in ``root`` (a checkout of this repository)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        folder = PACKAGES.get(fullname)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        init = os.path.join(where, "__init__.py")
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[where])


def loaded_from() -> dict[str, str]:
    """Every imported tiered_dcp module and its file."""
    return {
        name: str(getattr(m, "__file__", ""))
        for name, m in sorted(sys.modules.items())
        if name == "tiered_dcp" or name.startswith("tiered_dcp.")
    }


TREE = os.environ.get("TIERED_DCP_BENCH_TREE")
if TREE:
    if any(name == "tiered_dcp" or name.startswith("tiered_dcp.") for name in sys.modules):
        raise RuntimeError("bench_tree: tiered_dcp was imported before bench_tree; import bench_tree first")
    sys.meta_path.insert(0, TreeFinder(TREE))
