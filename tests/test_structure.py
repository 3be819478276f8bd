"""The shape of the library: few top-level modules, small classes and functions, packages
that import only downwards, no import hook."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / "tiered_dcp", ROOT / "storage", ROOT / "planners"]
MAX_TOP_LEVEL, MAX_METHODS, MAX_LINES = 16, 20, 80


def _sources():
    for root in LIBRARY:
        for path in sorted(root.rglob("*.py")):
            if not path.is_symlink():
                yield path, ast.parse(path.read_text())


def test_the_package_has_few_top_level_modules():
    top = [
        p.name
        for p in (ROOT / "tiered_dcp").iterdir()
        if not p.is_symlink() and (p.suffix == ".py" or (p / "__init__.py").exists())
    ]
    assert len(top) <= MAX_TOP_LEVEL, sorted(top)


def test_no_class_has_too_many_methods_and_no_function_is_too_long():
    big = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    big.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: {len(methods)} methods"
                    )
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not big, "\n".join(big)


def _package_of(path: Path) -> str:
    """The sub-package (or top-level module) of tiered_dcp a file belongs to."""
    parts = path.relative_to(ROOT).parts
    if parts[0] != "tiered_dcp":
        return parts[0]  # storage, planners
    return parts[1].removesuffix(".py")


def _imported_packages(path: Path, tree: ast.AST) -> set[str]:
    here = _package_of(path)
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "tiered_dcp":
        parts = ["tiered_dcp", *parts]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [] if node.module else [a.name for a in node.names]
            else:
                target = (node.module or "").split(".")
                names = []
            if target[0] != "tiered_dcp":
                continue
            modules = [
                n
                for n in names
                if (ROOT / "tiered_dcp" / n).exists() or (ROOT / "tiered_dcp" / f"{n}.py").exists()
            ]
            for t in [target, *([*target, n] for n in modules)] if len(target) == 1 else [target]:
                if len(t) > 1 and t[1] != here:
                    found.add(t[1])
    return found


def test_packages_import_without_circles():
    graph: dict[str, set[str]] = {}
    for path, tree in _sources():
        graph.setdefault(_package_of(path), set()).update(_imported_packages(path, tree))
    graph.pop("__init__", None)  # the public names: it imports from everything, lazily
    for deps in graph.values():
        deps.discard("__init__")

    def reach(start: str, seen: set[str]) -> set[str]:
        for nxt in graph.get(start, ()):
            if nxt not in seen:
                seen.add(nxt)
                reach(nxt, seen)
        return seen

    circles = sorted(p for p in graph if p in reach(p, set()))
    assert not circles, {p: sorted(graph[p]) for p in circles}


def test_importing_the_package_adds_no_import_hook():
    """``import tiered_dcp`` leaves every process's import machinery as it found it."""
    code = "import sys; before = list(sys.meta_path); import tiered_dcp; assert sys.meta_path == before"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
