"""The worker environment policy: the allowlist, how the layers combine, and a
session's options checked and compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_sup.protocol import ErrorCode, RemoteProtocolError
from hermes_sup.supervisor.environment import (
    SessionOptions,
    allowlisted,
    parse_options,
    worker_env,
)


def test_allowlist_keeps_only_named_variables() -> None:
    env = {"PATH": "/bin", "LC_ALL": "C", "OPENAI_API_KEY": "sk-secret", "AWS_SECRET": "x"}
    assert allowlisted(env, ("PATH", "LC_*")) == {"PATH": "/bin", "LC_ALL": "C"}


def test_worker_env_layers_and_session_values_win() -> None:
    opts = parse_options(
        {"session_env": {"platform": "telegram", "chat_id": "42"}, "env": {"FOO": "from-options"}}
    )
    env = worker_env(
        {"PATH": "/bin", "FOO": "base"},
        {"FOO": "fixed", "BAR": "1"},
        opts,
        "alice",
        Path("/d/home"),
        Path("/d/ws"),
    )
    assert env == {
        "PATH": "/bin",
        "FOO": "from-options",
        "BAR": "1",
        "HERMES_SESSION_PLATFORM": "telegram",
        "HERMES_SESSION_CHAT_ID": "42",
        "HERMES_SESSION_KEY": "alice",
        "HERMES_HOME": "/d/home",
        "TERMINAL_CWD": "/d/ws",
    }


@pytest.mark.parametrize(
    "raw, words",
    [
        ("nope", "'options' must be a map"),
        ({"colour": {}}, "unknown option 'colour'"),
        ({"env": {"HERMES_HOME": "/tmp/x"}}, "set by the supervisor"),
        ({"env": {"1BAD": "x"}}, "invalid variable name"),
        ({"env": {"A": 1}}, "must be a string"),
        ({"env": {"A": "x\0y"}}, "NUL"),
        ({"session_env": {"chat-id": "1"}}, "invalid variable name"),
        ({"session_env": {f"k{i}": "v" for i in range(65)}}, "at most 64"),
    ],
)
def test_bad_options_name_what_is_wrong(raw: object, words: str) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        parse_options(raw)
    assert err.value.code is ErrorCode.BAD_FIELD
    assert words in err.value.message


def test_options_compare_by_value() -> None:
    assert parse_options({"env": {"A": "1"}}) == SessionOptions(env={"A": "1"})
    assert not parse_options(None)
