"""How httpapi/'s modules stand on each other: no import circle, nothing
imports the composition root (app.py) but the package and its server, and
the writers and what they fold do no I/O (read from the source, as the
imports are written)."""

from __future__ import annotations

import ast
from pathlib import Path

HTTPAPI = Path(__file__).resolve().parent.parent / "httpapi"
# The package itself re-exports create_app; serve.py runs it.
ROOT_USERS = {"__init__", "serve"}
SANS_IO = ("said", "writers")
IO_MODULES = {"asyncio", "socket", "starlette", "zmq", "time", "uvicorn", "httpx"}


def _trees() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(HTTPAPI.glob("*.py"))}


def _local_imports(tree: ast.Module) -> set[str]:
    """The httpapi modules a module imports (`from .x import`, `from . import x`)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, if there is any."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            found = visit(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def test_httpapi_has_no_import_circle_and_no_part_imports_the_root() -> None:
    graph = {name: _local_imports(tree) for name, tree in _trees().items()}
    assert _circle(graph) is None
    assert sorted(name for name, imported in graph.items() if "app" in imported) == sorted(
        ROOT_USERS
    )
    # The shared state imports no route: they are handed it.
    assert not graph["api"] & {"chat", "responses", "runs", "notices", "info"}


def test_the_writers_do_no_io() -> None:
    trees = _trees()
    for name in SANS_IO:
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.Import):
                modules = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = {node.module.split(".")[0]}
            else:
                modules = set()
            assert not modules & IO_MODULES, f"{name}.py imports {modules & IO_MODULES}"
            assert not isinstance(node, (ast.AsyncFunctionDef, ast.Await)), f"{name}.py awaits"
