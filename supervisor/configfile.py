"""The TOML configuration file: every setting of `hermes-sup serve`, checked.

Top-level keys are the settings of config.py's table (`SETTINGS`: each
one's type, bounds and meaning), plus two tables of serve's own:

    [agent]             settings for the agent runtime (model, base_url,
                        provider, toolsets, max_iterations, template_home,
                        api_key_env or api_key_file)
    [session_defaults]  options a new session gets when its front end passes
                        none (session_env, env, agent), as in an `open`

A setting that may be off or derived (its type admits None: max_sessions,
turn_timeout, memory_limit_mb, ...) reads 0 as None. `pass_env` adds to the
built-in allowlist. Every error names the file, the key and what is wrong.

The file's other tables (`[http_api]`, `[route]`, `[ray]`: local/settings.py's
`SECTIONS`) are the other services' settings; the supervisor skips them, the
commands that run those services read them (cli/), and `config check` checks
them all.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from hermes_sup.local.settings import SECTIONS, SettingError, did_you_mean, from_file
from hermes_sup.protocol import RemoteProtocolError

from .config import AGENT_KEYS, SETTINGS, Setting, Settings
from .environment import parse_options

__all__ = [
    "AGENT_KEYS",
    "FILE_SETTINGS",
    "META_FIELDS",
    "OPTIONAL_FIELDS",
    "RESTART_FIELDS",
    "ConfigError",
    "build",
    "check_agent_config",
    "check_preload",
    "check_value",
    "load",
    "load_agent_config",
    "read_key",
    "reload_settings",
]

# Settings by their key in the file ("agent" is runtime_config's table).
FILE_SETTINGS: dict[str, Setting] = {s.file_key: s for s in SETTINGS.values()}
# Settings whose 0 in the file is None in Settings (off, or derived).
OPTIONAL_FIELDS = frozenset(s.name for s in SETTINGS.values() if s.optional)
# Only a restart can change these: sockets, directories, the zygote's imports.
RESTART_FIELDS = tuple(s.name for s in SETTINGS.values() if not s.reload)
# Bookkeeping, not settings: never reported as changed.
META_FIELDS = ("config_file", "overrides")


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
        if "base_url" not in config:
            # The model an operator's existing Hermes config names: the
            # supervisor must know it to forward a sealed session's calls
            # (model_gate.py), or the session could not reach it at all.
            named = template_base_url(template)
            if named is not None:
                config["base_url"] = named
    return config


def template_base_url(template: Path) -> str | None:
    """`model.base_url` of a template home's config.yaml, if it names one
    (read only where PyYAML is installed, as with the Hermes runtime)."""
    try:
        import yaml
    except ImportError:
        return None
    try:
        loaded = yaml.safe_load((template / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    model = loaded.get("model") if isinstance(loaded, dict) else None
    url = model.get("base_url") if isinstance(model, dict) else None
    return url if isinstance(url, str) and url else None


def load_agent_config(path: Path, environ: typing.Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Read an agent config file (TOML, or JSON by its suffix)."""
    import json

    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return check_agent_config(raw, str(path), environ)


def check_value(path: Path, setting: Setting, value: Any) -> Any:
    """A top-level value of the file as Settings holds it; ConfigError
    naming the file, the key and what is wrong."""
    try:
        return from_file(setting, value)
    except SettingError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def read_key(
    path: Path, key: str, value: Any, environ: typing.Mapping[str, str] = os.environ
) -> tuple[str, Any]:
    """One top-level key of the file checked: its Settings field and value.
    ConfigError for an unknown key (with the nearest known one) or a bad value."""
    setting = FILE_SETTINGS.get(key)
    if setting is None:
        hint = did_you_mean(key, [*FILE_SETTINGS, *SECTIONS])
        raise ConfigError(f"{path}: unknown key {key!r}{hint}")
    if setting.name == "runtime_config":
        return setting.name, check_agent_config(value, f"{path}: [agent]", environ)
    if setting.name == "session_defaults":
        try:
            return setting.name, parse_options(value).to_wire()
        except RemoteProtocolError as exc:
            raise ConfigError(f"{path}: [session_defaults]: {exc.message}") from None
    return setting.name, check_value(path, setting, value)


def load(path: Path, environ: typing.Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Read and check a configuration file; returns {Settings field: value}."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    # The other services' tables are theirs to read (cli/): serve skips them.
    return dict(
        read_key(path, key, value, environ) for key, value in raw.items() if key not in SECTIONS
    )


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
