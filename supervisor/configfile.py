"""The TOML configuration file: every setting of `hermes-sup serve`, checked.

Top-level keys are exactly the fields of `Settings` (see config.py for each
one's meaning and default), plus two tables:

    [agent]             settings for the agent runtime (model, base_url,
                        provider, toolsets, max_iterations, template_home,
                        api_key_env or api_key_file)
    [session_defaults]  options a new session gets when its front end passes
                        none (session_env, env, agent), as in an `open`

For limits that can be off (max_sessions, max_clients, idle_timeout, turn_timeout,
memory_limit_mb, max_procs, max_open_files, cpu_seconds, file_size_limit_mb,
tmp_limit_mb, log_rate_limit), 0 means off.
`pass_env` adds to the built-in allowlist. Every error names the file, the
key and what is wrong.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from hermes_sup.door.remote import RemoteError, parse_tcp
from hermes_sup.protocol import RemoteProtocolError

from .config import DEFAULT_PASS_ENV, Settings
from .environment import parse_options

AGENT_KEYS: dict[str, type] = {
    "model": str,
    "base_url": str,
    "provider": str,
    "toolsets": list,
    "max_iterations": int,
    "template_home": str,
    "api_key_env": str,
    "api_key_file": str,
}
OPTIONAL_FIELDS = {
    "max_sessions",
    "max_clients",
    "idle_timeout",
    "turn_timeout",
    "memory_limit_mb",
    "max_procs",
    "max_open_files",
    "cpu_seconds",
    "file_size_limit_mb",
    "tmp_limit_mb",
    "log_rate_limit",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
SEALED_CHOICES = ("off", "auto", "on")
# Only a restart can change these: sockets, directories, the zygote's imports.
RESTART_FIELDS = (
    "state_dir",
    "data_dir",
    "runtime",
    "preload",
    "max_frame_size",
    "metrics",
    "tcp",
    "max_clients",
    "sealed",
    "client_queue",
    "node",
)
# Bookkeeping, not settings: never reported as changed.
META_FIELDS = ("config_file", "overrides")
_FIELD_TYPES = typing.get_type_hints(Settings)
_FIELDS = [f.name for f in dataclasses.fields(Settings)]
_FILE_KEYS = [f for f in _FIELDS if f not in ("runtime_config", "session_defaults")]


class ConfigError(Exception):
    """A configuration file (or agent config) that cannot be used."""


def check_agent_config(
    raw: object, where: str, environ: typing.Mapping[str, str]
) -> dict[str, Any]:
    """Check agent settings and resolve the api key from the named environment
    variable or file (the key itself never sits in a config file)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table")
    config: dict[str, Any] = {}
    for name, value in raw.items():
        kind = AGENT_KEYS.get(name)
        if kind is None:
            raise ConfigError(f"{where}: unknown key {name!r}; known keys: {', '.join(AGENT_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{where}: {name!r} must be a {kind.__name__}")
        config[name] = value
    env_name = config.pop("api_key_env", None)
    key_file = config.pop("api_key_file", None)
    if env_name:
        if env_name not in environ:
            raise ConfigError(f"{where}: api_key_env names {env_name}, which is not set")
        config["api_key"] = environ[env_name]
    elif key_file:
        try:
            config["api_key"] = Path(key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}: api_key_file: {exc}") from None
    if "template_home" in config:
        template = Path(config["template_home"]).expanduser().absolute()
        if not template.is_dir():
            raise ConfigError(f"{where}: template_home {template} is not a directory")
        config["template_home"] = str(template)
    return config


def load_agent_config(path: Path, environ: typing.Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Read an agent config file (TOML, or JSON by its suffix)."""
    import json

    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return check_agent_config(raw, str(path), environ)


def _check_value(path: Path, key: str, value: Any) -> Any:
    kind = _FIELD_TYPES[key]
    where = f"{path}: {key}"
    if key in OPTIONAL_FIELDS:
        base = int if "int" in str(kind) else float
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (base is int and not isinstance(value, int))
        ):
            raise ConfigError(
                f"{where} must be a {'whole ' if base is int else ''}number (0 = off)"
            )
        if value < 0:
            raise ConfigError(f"{where} must not be negative")
        return None if value == 0 else base(value)
    if kind is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} must be a path")
        # Absolute (from our directory): the zygote and workers run elsewhere.
        return Path(value).expanduser().absolute()
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value
    if kind in (int, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and not isinstance(value, int))
        ):
            raise ConfigError(f"{where} must be a {'whole ' if kind is int else ''}number")
        if value < 0:
            raise ConfigError(f"{where} must not be negative")
        return kind(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string")
        if key == "log_level" and value not in LOG_LEVELS:
            raise ConfigError(f"{where} must be one of {', '.join(LOG_LEVELS)}")
        if key == "sealed" and value not in SEALED_CHOICES:
            raise ConfigError(f"{where} must be one of {', '.join(SEALED_CHOICES)}")
        if key == "tcp" and value:
            try:
                parse_tcp(value)
            except RemoteError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        return value
    if kind == tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings")
        if key == "workspace_roots":
            relative = [v for v in value if not os.path.isabs(v)]
            if relative:
                raise ConfigError(f"{where}: {relative[0]!r} is not an absolute path")
        return tuple(value)
    if kind == dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where} must be a table of strings")
        return dict(value)
    raise ConfigError(f"{where} cannot be set in a file")


def load(path: Path, environ: typing.Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Read and check a configuration file; returns {Settings field: value}."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "agent":
            values["runtime_config"] = check_agent_config(value, f"{path}: [agent]", environ)
        elif key == "session_defaults":
            try:
                values["session_defaults"] = parse_options(value).to_wire()
            except RemoteProtocolError as exc:
                raise ConfigError(f"{path}: [session_defaults]: {exc.message}") from None
        elif key in _FILE_KEYS:
            values[key] = _check_value(path, key, value)
        else:
            close = difflib.get_close_matches(key, [*_FILE_KEYS, "agent", "session_defaults"], 1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
    if "pass_env" in values:
        values["pass_env"] = DEFAULT_PASS_ENV + values["pass_env"]
    return values


def build(
    base: Settings,
    path: Path | None,
    overrides: dict[str, Any],
    environ: typing.Mapping[str, str] = os.environ,
) -> Settings:
    """Settings = defaults, then the file, then what the command line set."""
    values = load(path, environ) if path is not None else {}
    values.update(overrides)
    check_preload(tuple(values.get("preload", ())), values.get("sealed", base.sealed))
    return dataclasses.replace(base, **values)


# Hermes's own modules capture HERMES_HOME and paths under it at import:
# imported in the zygote, every session's logs and state would land in the
# zygote's home. Only its third-party dependencies are safe to preload.
HERMES_DISTRIBUTION = "hermes-agent"


def hermes_agent_version() -> str | None:
    """The hermes-agent installed beside the supervisor, which the workers it
    starts load (None if there is none). Looked up each time: an upgrade is
    what the next worker runs."""
    import importlib.metadata

    try:
        return importlib.metadata.version(HERMES_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_preload(modules: tuple[str, ...], sealed: str = "off") -> None:
    """Refuse preloading a module of hermes-agent itself (ConfigError),
    unless sessions are sealed (auto or on: each worker then finds its own
    session's directories over the paths the zygote imported under; the
    supervisor refuses them again at start if auto turns out unsealed)."""
    if not modules or sealed in ("auto", "on"):
        return  # the usual case: no package metadata to read at start
    import importlib.metadata

    try:
        top = importlib.metadata.distribution(HERMES_DISTRIBUTION).read_text("top_level.txt")
    except importlib.metadata.PackageNotFoundError:
        return  # not installed: nothing of it can be preloaded anyway
    own = set((top or "").split()) | {"run_agent"}
    refused = sorted(m for m in modules if m.partition(".")[0] in own)
    if refused:
        raise ConfigError(
            f"preload: {', '.join(refused)} belong to hermes-agent, which captures "
            "HERMES_HOME and paths under it at import: preloaded in the zygote, every "
            "session's logs and state would land in the zygote's home. Preload only its "
            "dependencies (the hermes runtime preloads the safe ones by itself), or seal "
            "the sessions (sealed = on), which makes preloading hermes safe"
        )


def reload_settings(old: Settings) -> tuple[Settings, list[str], list[str]]:
    """Read the configuration file again for a running supervisor: the new
    settings, the fields that changed, and the fields that changed in the
    file but need a restart (those keep their old values). ConfigError for
    an invalid file; the caller keeps the old settings then."""
    assert old.config_file is not None
    base = Settings(state_dir=old.state_dir, data_dir=old.data_dir)
    new = build(base, old.config_file, old.overrides)
    new.config_file, new.overrides = old.config_file, old.overrides
    if "preload" not in old.overrides and new.preload == ():
        new.preload = old.preload  # computed at start (e.g. for hermes), not from the file
    restart = [f for f in RESTART_FIELDS if getattr(new, f) != getattr(old, f)]
    for name in restart:
        setattr(new, name, getattr(old, name))
    changed = [
        f.name
        for f in dataclasses.fields(Settings)
        if f.name not in META_FIELDS and getattr(new, f.name) != getattr(old, f.name)
    ]
    return new, changed, restart
