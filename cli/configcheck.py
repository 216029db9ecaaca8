"""`hermes-sup config check FILE`: every error in a configuration file at
once, and what can be tried without starting anything.

Each key is checked as `serve --config` checks it (supervisor/configfile.py),
but one bad key does not hide the next. Then what the settings name is
tried: the runtime (and every runtime front ends may choose) is imported as
a worker would import it, hermes-agent is looked for when the runtime is
hermes, preload modules are looked up, workspace and repository roots must
be directories, the repository a git repository, and the metrics address
must parse, and the HTTP endpoint's extra must be installed when `http`
is set. The other services' tables (`[http_api]`, `[route]`, `[ray]`) are
checked with their own settings, each key on its own too.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hermes_sup.local.settings import Setting, read_table
from hermes_sup.local.version import install_hint
from hermes_sup.supervisor import configfile
from hermes_sup.supervisor.worktrees import repository_problem

# What the hermes runtime imports in its worker (worker/hermes.py): present
# only with hermes-agent installed.
HERMES_MODULES = ("run_agent", "gateway", "hermes_state", "tools")


def section_tables() -> dict[str, Mapping[str, Setting]]:
    """The settings of each service's table of the file (local/settings.py's
    SECTIONS), by the table's name."""
    from hermes_sup.httpapi.settings import API_SETTINGS

    from .ray import RAY_SETTINGS
    from .route import ROUTER_SETTINGS

    return {"http_api": API_SETTINGS, "route": ROUTER_SETTINGS, "ray": RAY_SETTINGS}


def check_keys(
    path: Path, raw: dict[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], list[str]]:
    """Each key of the file checked on its own, serve's and those of each
    service's table: the values that are good (a service's under its
    table's name) and one error line per bad one."""
    values: dict[str, Any] = {}
    errors: list[str] = []
    tables = section_tables()
    for key, value in raw.items():
        if key in tables:
            values[key], bad = read_table(tables[key], value, f"{path}: [{key}]")
            errors += bad
            continue
        try:
            name, checked = configfile.read_key(path, key, value, environ)
        except configfile.ConfigError as exc:
            errors.append(str(exc))
        else:
            values[name] = checked
    return values, errors


def check_runtime(spec: str) -> str | None:
    """Why the runtime `spec` could not start in a worker, or None."""
    from hermes_sup.worker.runtime import RuntimeLoadError, resolve

    try:
        resolve(spec)
    except RuntimeLoadError as exc:
        return str(exc)
    if spec == "hermes":
        missing = [m for m in HERMES_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            return (
                f"hermes-agent is not installed (no {', '.join(missing)}); add the hermes "
                f"extra: {install_hint('hermes')}"
            )
    return None


def check_http(path: Path, values: Mapping[str, Any]) -> list[str]:
    """What `serve` with `http` set would refuse: no http extra, a page
    directory without its index.html."""
    if not values.get("http"):
        return []
    errors = []
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        errors.append(
            f"{path}: http needs {' and '.join(missing)} (the http extra): " + install_hint("http")
        )
    web = values.get("http_web")
    if web and not (Path(web) / "index.html").is_file():
        errors.append(f"{path}: http_web: {web} is not a directory with an index.html")
    return errors


def check_file(
    path: Path,
    environ: Mapping[str, str] = os.environ,
    progress: Callable[[str], None] = lambda text: None,
) -> tuple[dict[str, Any], list[str]]:
    """Every error of the file (an empty list: it is good) and its values."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        return {}, [f"{path}: cannot read: {exc.strerror or exc}"]
    except tomllib.TOMLDecodeError as exc:
        return {}, [f"{path}: not valid TOML: {exc}"]
    values, errors = check_keys(path, raw, environ)
    if "runtime" in raw and "runtime" not in values:
        return values, errors  # a bad value: nothing to try
    for spec in dict.fromkeys([values.get("runtime", "probe"), *values.get("runtimes", ())]):
        progress(f"importing runtime {spec}...")
        why = check_runtime(spec)
        if why is not None:
            errors.append(f"{path}: runtime {spec!r} cannot start: {why}")
    for module in values.get("preload", ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            errors.append(f"{path}: preload: no module named {module!r}")
    for root in values.get("workspace_roots", ()):
        if not Path(root).is_dir():
            errors.append(f"{path}: workspace_roots: {root} is not a directory")
    if values.get("repo"):
        problem = repository_problem(os.path.abspath(values["repo"]))
        if problem is not None:
            errors.append(f"{path}: repo: {problem}")
    for root in values.get("repo_roots", ()):
        if not Path(root).is_dir():
            errors.append(f"{path}: repo_roots: {root} is not a directory")
    errors += check_http(path, values)
    if values.get("metrics"):
        from hermes_sup.supervisor.metrics import parse_address

        try:
            parse_address(values["metrics"])
        except ValueError as exc:
            errors.append(f"{path}: metrics: {exc}")
        if importlib.util.find_spec("prometheus_client") is None:
            errors.append(
                f"{path}: metrics needs prometheus-client (the metrics extra): "
                + install_hint("metrics")
            )
    return values, errors
