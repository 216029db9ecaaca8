"""What a worker's environment is made of, and checking a front end's options.

A worker's os.environ is built from scratch, in this order (later wins):
  1. the allowlisted part of the supervisor's own environment (--pass-env);
  2. variables configured for every worker (--env NAME=VALUE);
  3. per-session `env` from the front end's open options;
  4. per-session `session_env` as HERMES_SESSION_<NAME> (platform, chat_id, ...);
  5. the session's own HERMES_SESSION_KEY, HERMES_HOME, TERMINAL_CWD, HOME
     and temporary directory.
Nothing else of the supervisor's environment reaches a worker.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_sup.protocol import ErrorCode, RemoteProtocolError

from .worktrees import repository_problem

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
SESSION_ENV_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
MAX_VALUE_LENGTH = 4096
MAX_ENTRIES = 64
# `env` and `session_env` together, as NAME=VALUE strings in UTF-8: what
# every program the session runs gets, and exec(2) refuses (E2BIG) an
# environment and arguments over a quarter of the stack limit (2 MiB with
# the usual 8 MiB). The largest ASCII values fit (64 x 4,096 in each, about
# 530 KiB); the same in 4-byte characters would not.
MAX_ENVIRONMENT_BYTES = 1024 * 1024
# Set by the supervisor for each session; a front end may not override them.
SESSION_PREFIX = "HERMES_SESSION_"
RESERVED = frozenset({"HERMES_HOME", "TERMINAL_CWD", "HERMES_SESSION_KEY"})
# Variables with which a session's env could switch Hermes's approvals off
# (HERMES_EXEC_ASK=0 with HERMES_GATEWAY_SESSION=0, or HERMES_YOLO_MODE=1):
# refused from front ends unless the operator allows them (allow_env).
APPROVAL_ENV = frozenset({"HERMES_EXEC_ASK", "HERMES_GATEWAY_SESSION", "HERMES_YOLO_MODE"})
OPTION_NAMES = ("session_env", "env", "agent", "workspace", "runtime", "label", "repo")
# A label is for people (`list`, `inspect`): e.g. the conversation id a front
# end hashed into a session key. Printable text only, so that it cannot
# rewrite an operator's terminal.
MAX_LABEL_LENGTH = 200
# What a front end may choose per session for the agent runtime. Secrets
# (api keys) are not among them: they come from the supervisor's config.
AGENT_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "base_url": (str,),
    "provider": (str,),
    "toolsets": (list,),
    "max_iterations": (int,),
}


@dataclass(frozen=True)
class SessionOptions:
    """Per-session settings a front end passes when it opens a session."""

    session_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    # An absolute directory under one of the supervisor's workspace_roots
    # (None: the session's own), and a runtime among its allowed ones.
    workspace: str | None = None
    runtime: str | None = None
    # A free text shown with the session (see MAX_LABEL_LENGTH).
    label: str | None = None
    # A git repository under one of the supervisor's repo_roots: the
    # session works in its own worktree of it (supervisor/worktrees.py).
    repo: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The options as a plain map (for the worker and session.json)."""
        wire: dict[str, Any] = {
            "session_env": dict(self.session_env),
            "env": dict(self.env),
            "agent": dict(self.agent),
        }
        if self.workspace is not None:
            wire["workspace"] = self.workspace
        if self.runtime is not None:
            wire["runtime"] = self.runtime
        if self.label is not None:
            wire["label"] = self.label
        if self.repo is not None:
            wire["repo"] = self.repo
        return wire

    def __bool__(self) -> bool:
        return bool(
            self.session_env
            or self.env
            or self.agent
            or self.workspace
            or self.runtime
            or self.label is not None
            or self.repo
        )


def _bad(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_FIELD, message)


def _check_map(where: str, value: object, name_re: re.Pattern[str], upper: bool) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad(f"option {where!r} must be a map of names to strings")
    if len(value) > MAX_ENTRIES:
        raise _bad(f"option {where!r} has {len(value)} entries; at most {MAX_ENTRIES}")
    out: dict[str, str] = {}
    for name, val in value.items():
        if not isinstance(name, str) or not name_re.fullmatch(name):
            raise _bad(f"option {where!r} has an invalid variable name {str(name)[:40]!r}")
        if not isinstance(val, str):
            raise _bad(f"option {where}.{name} must be a string, got {type(val).__name__}")
        if "\0" in val or len(val) > MAX_VALUE_LENGTH:
            raise _bad(f"option {where}.{name} holds a NUL or is over {MAX_VALUE_LENGTH} chars")
        out[name.upper() if upper else name] = val
    return out


def parse_options(raw: object) -> SessionOptions:
    """Check the `options` map of an open/send request; RemoteProtocolError names
    what is wrong."""
    if raw is None:
        return SessionOptions()
    if not isinstance(raw, dict):
        raise _bad("'options' must be a map")
    unknown = sorted(str(k) for k in raw if k not in OPTION_NAMES)
    if unknown:
        raise _bad(f"unknown option {unknown[0]!r}; known options: {', '.join(OPTION_NAMES)}")
    session_env = _check_map("session_env", raw.get("session_env", {}), SESSION_ENV_NAME_RE, True)
    env = _check_map("env", raw.get("env", {}), ENV_NAME_RE, False)
    clash = sorted(RESERVED & env.keys())
    if clash:
        raise _bad(f"option env.{clash[0]} is set by the supervisor for each session")
    size = _environment_bytes(env, "") + _environment_bytes(session_env, SESSION_PREFIX)
    if size > MAX_ENVIRONMENT_BYTES:
        raise _bad(
            f"options env and session_env make {size} bytes of environment (NAME=VALUE, "
            f"UTF-8); at most {MAX_ENVIRONMENT_BYTES}, so that the session's programs can start"
        )
    return SessionOptions(
        session_env=session_env,
        env=env,
        agent=_check_agent(raw.get("agent", {})),
        workspace=_check_string(raw, "workspace"),
        runtime=_check_string(raw, "runtime"),
        label=_check_label(raw.get("label")),
        repo=_check_string(raw, "repo"),
    )


def _environment_bytes(variables: dict[str, str], prefix: str) -> int:
    """Bytes the variables take in a process's environment block."""
    return sum(
        len(prefix) + len(name) + len(value.encode()) + 2 for name, value in variables.items()
    )


def _check_string(raw: dict[Any, Any], name: str) -> str | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\0" in value or len(value) > MAX_VALUE_LENGTH:
        raise _bad(f"option {name!r} must be a non-empty string without NUL")
    return value


def _check_label(value: object) -> str | None:
    """A label: printable text (no control characters, no line breaks) of
    1 to MAX_LABEL_LENGTH characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"option 'label' must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_LABEL_LENGTH:
        raise _bad(f"option 'label' must be 1 to {MAX_LABEL_LENGTH} characters, got {len(value)}")
    if not value.isprintable():
        bad = next(ch for ch in value if not ch.isprintable())
        raise _bad(
            f"option 'label' holds a control or non-printable character ({ord(bad):#x}); "
            "a label is printable text"
        )
    return value


def check_policy(
    options: SessionOptions,
    workspace_roots: tuple[str, ...],
    runtimes: tuple[str, ...],
    allow_env: tuple[str, ...] = (),
    repo_roots: tuple[str, ...] = (),
) -> None:
    """Refuse a workspace outside the configured roots (symlinks resolved),
    a repository outside repo_roots or that is no git repository, a runtime
    the operator did not allow, and variables that switch the agent's
    approvals (APPROVAL_ENV) unless the operator allows them."""
    if options.repo is not None and options.workspace is not None:
        raise _bad(
            "options 'workspace' and 'repo' exclude each other: with a repository, "
            "the session's workspace is its own worktree of it"
        )
    switches = sorted((APPROVAL_ENV & options.env.keys()) - set(allow_env))
    if switches:
        raise _bad(
            f"option 'env': {', '.join(switches)} decide whether the agent asks before "
            "running a dangerous command, which is the operator's policy; this supervisor "
            "does not let front ends set them (allow_env)"
        )
    if options.workspace is not None:
        if not workspace_roots:
            raise _bad(
                "option 'workspace': this supervisor allows no chosen workspaces "
                "(set workspace_roots)"
            )
        path = Path(options.workspace)
        if not path.is_absolute():
            raise _bad(f"option 'workspace' must be an absolute path, got {options.workspace!r}")
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(os.path.realpath(root)) for root in workspace_roots):
            raise _bad(
                f"option 'workspace': {options.workspace} is not under a workspace root "
                f"({', '.join(workspace_roots)})"
            )
    if options.repo is not None:
        _check_repo(options, repo_roots)
    if options.runtime is not None and options.runtime not in runtimes:
        allowed = ", ".join(runtimes) or "none besides the default"
        raise _bad(
            f"option 'runtime': {options.runtime!r} is not allowed here (allowed: {allowed})"
        )


def _check_repo(options: SessionOptions, repo_roots: tuple[str, ...]) -> None:
    """The `repo` option: an absolute git repository under a repo root."""
    assert options.repo is not None
    if not repo_roots:
        raise _bad("option 'repo': this supervisor allows no chosen repositories (set repo_roots)")
    if not Path(options.repo).is_absolute():
        raise _bad(f"option 'repo' must be an absolute path, got {options.repo!r}")
    real = Path(os.path.realpath(options.repo))
    if not any(real.is_relative_to(os.path.realpath(root)) for root in repo_roots):
        raise _bad(
            f"option 'repo': {options.repo} is not under a repository root "
            f"({', '.join(repo_roots)})"
        )
    problem = repository_problem(str(real))
    if problem is not None:
        raise _bad(f"option 'repo': {problem}")


def _check_agent(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad("option 'agent' must be a map")
    out: dict[str, Any] = {}
    for name, val in value.items():
        types = AGENT_OPTION_TYPES.get(name)
        if types is None:
            raise _bad(
                f"unknown agent option {str(name)[:40]!r}; known: {', '.join(AGENT_OPTION_TYPES)}"
            )
        if isinstance(val, bool) or not isinstance(val, types):
            raise _bad(f"agent option {name!r} must be {types[0].__name__}")
        if isinstance(val, str) and ("\0" in val or len(val) > MAX_VALUE_LENGTH):
            raise _bad(f"agent option {name!r} holds a NUL or is too long")
        if isinstance(val, list):
            if not all(isinstance(v, str) for v in val):
                raise _bad(f"agent option {name!r} must be a list of strings")
            # As for env: every value is carried to the worker twice.
            if len(val) > MAX_ENTRIES or any("\0" in v or len(v) > MAX_VALUE_LENGTH for v in val):
                raise _bad(
                    f"agent option {name!r}: at most {MAX_ENTRIES} strings of at most "
                    f"{MAX_VALUE_LENGTH} characters without NUL"
                )
        out[name] = val
    return out


def allowlisted(environ: Mapping[str, str], patterns: tuple[str, ...]) -> dict[str, str]:
    """The part of `environ` whose names match the allowlist (globs allowed)."""
    return {
        name: value
        for name, value in environ.items()
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
    }


TMP_VARIABLES = ("TMPDIR", "TMP", "TEMP")


def worker_env(
    base: Mapping[str, str],
    fixed: Mapping[str, str],
    options: SessionOptions,
    key: str,
    home: Path,
    workspace: Path,
    tmp: Path | None = None,
    user: Path | None = None,
) -> dict[str, str]:
    """The complete os.environ of one session's worker. `user`: its HOME
    (the supervisor's own never reaches a session)."""
    env = dict(base)
    env.update(fixed)
    env.update(options.env)
    for name, value in options.session_env.items():
        env[f"{SESSION_PREFIX}{name}"] = value
    env["HERMES_SESSION_KEY"] = key
    env["HERMES_HOME"] = str(home)
    env["TERMINAL_CWD"] = str(workspace)
    if user is not None:
        env["HOME"] = str(user)
    if tmp is not None:
        # Every name a program may read its temporary directory from.
        for name in TMP_VARIABLES:
            env[name] = str(tmp)
    return env
