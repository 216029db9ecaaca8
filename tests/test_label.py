"""The `label` session option: a printable text for people, stored with the
session's data and shown by `list` (a LABEL column only when a session has
one) and `inspect`; anything else is a clear bad_field error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hermes_sup.cli.show import inspect_lines, session_table
from hermes_sup.client import SupervisorError
from hermes_sup.protocol import ErrorCode, RemoteProtocolError
from hermes_sup.supervisor.environment import MAX_LABEL_LENGTH, parse_options


@pytest.mark.parametrize(
    ("label", "says"),
    [
        ("line\nbreak", "control or non-printable character (0xa)"),
        ("\x1b[2Jwipe", "control or non-printable character (0x1b)"),
        ("tab\there", "(0x9)"),
        ("x" * (MAX_LABEL_LENGTH + 1), f"1 to {MAX_LABEL_LENGTH} characters, got 201"),
        ("", "1 to 200 characters, got 0"),
        (42, "must be a string, got int"),
    ],
)
def test_a_bad_label_is_a_clear_bad_field_error(label: object, says: str) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        parse_options({"label": label})
    assert err.value.code is ErrorCode.BAD_FIELD
    assert "option 'label'" in err.value.message and says in err.value.message


def test_a_printable_label_is_kept_as_given() -> None:
    head = "conversation 8c1e/Ünïcode · "
    text = head + "x" * (MAX_LABEL_LENGTH - len(head))
    assert len(text) == MAX_LABEL_LENGTH
    options = parse_options({"label": text})
    assert options.label == text
    assert options.to_wire()["label"] == text
    assert parse_options(options.to_wire()) == options


def _row(key: str, label: str | None) -> dict[str, object]:
    return {
        "key": key,
        "state": "idle",
        "pid": 10,
        "started": 0.0,
        "last_activity": 0.0,
        "turns": 0,
        "runtime": "probe",
        "label": label,
    }


def test_list_has_a_label_column_only_when_a_session_has_a_label() -> None:
    plain = session_table([_row("a", None), _row("b", None)], False, 1.0)
    assert "LABEL" not in plain[0]
    labelled = session_table([_row("a", "the original id"), _row("b", None)], False, 1.0)
    assert labelled[0].split()[-1] == "LABEL"
    assert labelled[1].endswith(" the original id")
    assert labelled[2].endswith(" -")
    long = session_table([_row("a", "y" * 200)], False, 1.0)
    assert len(long[1]) < 120 and long[1].endswith("…" + "y" * 15)


def test_inspect_shows_the_label() -> None:
    info = {
        "key": "k",
        "label": "from the web",
        "state": "idle",
        "pid": None,
        "last_activity": 0.0,
        "exits": 0,
        "turns": 0,
        "queued": 0,
        "dir": "/d",
        "workspace": "/w",
        "home": "/h",
        "tmp": "/t",
        "log": "/l",
        "approvals_waiting": ["a1"],
    }
    lines = inspect_lines(info, 1.0)
    assert lines[1] == "label:      from the web"
    assert lines[lines.index(next(x for x in lines if x.startswith("turns:"))) + 1].startswith(
        "approvals:"
    )


def test_a_label_is_stored_listed_inspected_and_survives_a_restart(supervisor_factory) -> None:
    sup = supervisor_factory()
    with sup.client() as client:
        client.open("h:3f9a", options={"label": "telegram thread 1234567890/abc"})
        client.run("plain", "pid")
        rows = {r["key"]: r for r in client.sessions()}
        assert rows["h:3f9a"]["label"] == "telegram thread 1234567890/abc"
        assert rows["plain"]["label"] is None
        info = client.inspect("h:3f9a")
        assert info["label"] == info["options"]["label"] == "telegram thread 1234567890/abc"
        # A new label is no conflict for a running session: it is for people.
        client.open("h:3f9a", options={"label": "renamed"})
        assert client.inspect("h:3f9a")["label"] == "renamed"
        with pytest.raises(SupervisorError) as err:
            client.open("bad", options={"label": "two\nlines"})
        assert err.value.code == "bad_field" and "option 'label'" in str(err.value)
        assert "bad" not in {r["key"] for r in client.sessions()}
    sup.stop()
    again = supervisor_factory()
    cli = [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(again.state_dir), "list"]
    listed = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert {r["key"]: r["label"] for r in json.loads(listed.stdout)} == {
        "h:3f9a": "renamed",
        "plain": None,
    }
    table = subprocess.run(cli, capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[-1] == "LABEL"
    assert any(row.startswith("h:3f9a") and row.endswith(" renamed") for row in rows)
    with again.client() as client:
        assert client.inspect("h:3f9a")["label"] == "renamed"  # loaded from disk


def test_a_label_alone_names_a_session_without_replacing_its_options(
    supervisor_factory, workdir
) -> None:
    """The HTTP endpoint labels a session whose id it hashed, with nothing
    else: the operator's session_defaults, or what the session was opened
    with, still apply."""
    config = workdir / "hs.toml"
    config.write_text('[session_defaults]\nsession_env = { PLATFORM = "api" }\n')
    sup = supervisor_factory("--config", str(config))
    with sup.client(timeout=60) as client:
        client.open("fresh", options={"label": "conversation 1"})
        seen = client.inspect("fresh")
        assert seen["options"]["label"] == "conversation 1"
        assert seen["options"]["session_env"] == {"PLATFORM": "api"}
        assert client.run("fresh", "env HERMES_SESSION_PLATFORM").text == "api"

        client.open("opened", options={"env": {"OWN": "yes"}})
        client.run("opened", "env OWN")  # running, with its own options
        client.open("opened", options={"label": "renamed"})  # no conflict
        seen = client.inspect("opened")
        assert seen["options"]["label"] == "renamed" and seen["options"]["env"] == ["OWN"]
        assert client.run("opened", "env OWN").text == "yes"
