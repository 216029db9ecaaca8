"""Session keys: which keys the protocol accepts, and the directory name a key gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_sup.protocol import ErrorCode, RemoteProtocolError, check_session_key, session_dir_name


@pytest.mark.parametrize(
    "key",
    [
        "alice",
        "telegram:-100123456",
        "slack:T01:C02",
        "550e8400-e29b-41d4-a716-446655440000",
        "user@example.com",
        "a" * 128,
        "7",
    ],
)
def test_valid_keys(key: str) -> None:
    assert check_session_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "../../etc",
        "..",
        ".hidden",
        "-rf",
        "a/b",
        "a\0b",
        "a b",
        "a\nb",
        "é",
        "a" * 129,
        "/etc/passwd",
        "a\\b",
        42,
        None,
        b"bytes",
    ],
)
def test_invalid_keys_are_refused_with_the_rule(key: object) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        check_session_key(key)
    assert err.value.code is ErrorCode.BAD_SESSION_KEY
    assert "session key" in err.value.message


def test_session_dir_is_a_digest_not_the_key() -> None:
    name = session_dir_name("alice")
    assert "alice" not in name and len(name) == 32
    assert name != session_dir_name("alice2")
    assert Path(name).name == name
