"""The import structure, read from the source (nothing imported): no module
circles in the Python code, function-level imports counted, and no module
that takes another's private name. The folders map to `kvmux.*` as
pyproject.toml says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11

ROOT = Path(__file__).resolve().parent.parent
SKIP = ("native", "examples")  # the C++ extension's package, and programs that are no modules


def modules() -> dict[str, Path]:
    """Every module of the import namespace, by name."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if any(part in SKIP for part in parts) or (package == "kvmux" and parts[0] in folders):
                continue
            out[".".join([package, *parts[: -1 if parts[-1] == "__init__" else None]])] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The modules of `known` that `name` imports, anywhere in it, and the
    private names it takes from another module (as `file:line name`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, private = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join([*up[: len(up) - node.level + 1], *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" for a in node.names]
            private += [
                f"{path.relative_to(ROOT)}:{node.lineno} {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        else:
            continue
        for target in targets:
            module = target
            while module and module not in known:  # a name the module defines: the module
                module = module.rpartition(".")[0]
            if module and module != name:
                found.add(module)
    return found, private


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_module_circles_and_no_private_names_taken():
    known = modules()
    read = {name: imports(name, path, known) for name, path in known.items()}
    assert len(known) > 80 and "kvmux.http.binding" in known and "kvmux.worker.group" in known
    assert circles({name: found for name, (found, _) in read.items()}) == []
    assert [taken for _, private in read.values() for taken in private] == []
