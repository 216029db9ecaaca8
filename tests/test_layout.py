"""Which packages import which: the boundaries the folders promise.

An embedding front end imports the client and must not load the supervisor,
the worker or the CLI with it (their imports, their globals, their start-up
cost). Each check runs in a fresh interpreter: this test process has long
since imported everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER_SIDE = {"hermes_sup.supervisor", "hermes_sup.worker", "hermes_sup.cli"}
# Imports the modules named in argv and prints sys.modules, one name a line.
PROBE = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "print('\\n'.join(sorted(sys.modules)))\n"
)


def modules_loaded_by(*modules: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


def package(module: str) -> str:
    """hermes_sup.supervisor.table -> hermes_sup.supervisor. By package, not
    by prefix: "hermes_sup.cli" is a prefix of "hermes_sup.client"."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize(
    "modules",
    [
        ("hermes_sup.client",),
        ("hermes_sup.local.statedir", "hermes_sup.local.frames", "hermes_sup.local.prctl"),
    ],
)
def test_the_client_and_local_do_not_import_the_server_side(modules: tuple[str, ...]) -> None:
    loaded = modules_loaded_by(*modules)
    assert set(modules) <= set(loaded)  # the probe did import them
    assert [m for m in loaded if package(m) in SERVER_SIDE] == []


def test_only_the_frames_of_local_import_zmq() -> None:
    # statedir and prctl are standard library only: reading a state
    # directory or calling prctl must not pay for zmq.
    loaded = modules_loaded_by(
        "hermes_sup.local", "hermes_sup.local.statedir", "hermes_sup.local.prctl"
    )
    assert "zmq" not in loaded
    assert "zmq" in modules_loaded_by("hermes_sup.local.frames")  # the probe sees zmq at all


def modules_of(folder: str) -> list[str]:
    """Every module of one of the repository's folders, as installed."""
    root = Path(__file__).resolve().parent.parent / folder
    return [f"hermes_sup.{folder}.{path.stem}" for path in sorted(root.glob("*.py"))]


def test_the_front_door_imports_neither_the_supervisor_nor_the_router() -> None:
    # door/ is how any service listens for front ends: the supervisor and
    # the router both build on it, so it stands on neither.
    modules = modules_of("door")
    loaded = modules_loaded_by(*modules)
    assert set(modules) <= set(loaded)
    assert [
        m for m in loaded if package(m) in {"hermes_sup.supervisor", "hermes_sup.cluster"}
    ] == []


def test_the_router_does_not_import_the_supervisor() -> None:
    # Ray's agents start a supervisor as a child process; they never load it.
    modules = modules_of("cluster")
    loaded = modules_loaded_by(*modules)
    assert set(modules) <= set(loaded)
    assert [m for m in loaded if package(m) == "hermes_sup.supervisor"] == []


def test_the_routing_decisions_import_no_zmq() -> None:
    # cluster/routing.py is sans-IO: requests in, messages out, tested
    # without sockets (test_routing.py); the router does the I/O.
    loaded = modules_loaded_by("hermes_sup.cluster.routing")
    assert "hermes_sup.cluster.routing" in loaded
    assert [m for m in loaded if m == "zmq" or m.startswith("zmq.")] == []


def test_the_supervisor_imports_no_worker_module() -> None:
    # The supervisor and the worker are different processes: what both
    # need of sealing is seal/, so no line of the worker's is loaded (or
    # run at import) in the supervisor.
    modules = modules_of("supervisor")
    loaded = modules_loaded_by(*modules)
    assert set(modules) <= set(loaded)
    assert [m for m in loaded if package(m) == "hermes_sup.worker"] == []


def test_sealing_imports_neither_the_supervisor_nor_the_worker() -> None:
    # Both sides import seal/; it stands on local/ and the standard library.
    modules = modules_of("seal")
    loaded = modules_loaded_by(*modules)
    assert set(modules) <= set(loaded)
    assert [m for m in loaded if package(m) in SERVER_SIDE] == []
    assert [m for m in loaded if m == "zmq" or m.startswith("zmq.")] == []


FOLDERS = (
    "protocol",
    "local",
    "seal",
    "client",
    "door",
    "supervisor",
    "worker",
    "cli",
    "httpapi",
    "cluster",
    "gateway_plugin",
)


def imported_when_run(statements: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements among `statements` that run when they do:
    inside blocks (try, with, if, a class body), not inside a function nor
    under `if TYPE_CHECKING`."""
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from imported_when_run(node.orelse)
        else:
            for block in ("body", "orelse", "finalbody"):
                yield from imported_when_run(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from imported_when_run(handler.body)


def import_graph() -> dict[str, set[str]]:
    """Each module of the tree and the modules of the tree it imports when
    it is imported (its top-level statements: not inside a function, nor
    under `if TYPE_CHECKING`), read from the source, not run."""
    root = Path(__file__).resolve().parent.parent
    files = {
        f"hermes_sup.{folder}" + ("" if path.stem == "__init__" else f".{path.stem}"): path
        for folder in FOLDERS
        for path in sorted((root / folder).glob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in imported_when_run(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            else:
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                named.add(module)
                named.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in named if m in files and m != name}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules in order), or []."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for imported in sorted(graph[module]):
            found = walk(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        found = walk(module, [])
        if found:
            return found
    return []


def test_no_module_imports_itself_back_when_it_is_imported() -> None:
    # A cycle at import time makes the order of imports matter (a name not
    # defined yet, half a module) and ties two places into one: a move like
    # seal/'s must not leave one behind.
    graph = import_graph()
    assert "hermes_sup.seal.paths" in graph["hermes_sup.supervisor.pool"]  # it sees imports
    assert cycle_in(graph) == []
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
