"""The two pure policies behind `reload` and start-up sizing:
configfile.reload_settings (what a re-read file changes now, and what only a
restart can change) and limits.allowed_sessions (how many sessions the
open-file limit allows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_sup.supervisor import configfile
from hermes_sup.supervisor.config import Settings
from hermes_sup.supervisor.limits import (
    FD_RESERVE,
    FDS_PER_SESSION,
    PROXY_FD_SHARE,
    allowed_sessions,
)


def started_from(tmp_path: Path, text: str, **overrides: object) -> Settings:
    """Settings as `serve --config` makes them at start (file, then flags)."""
    path = tmp_path / "hermes-sup.toml"
    path.write_text(text)
    base = Settings(state_dir=tmp_path / "s", data_dir=tmp_path / "d")
    settings = configfile.build(base, path, dict(overrides))
    settings.config_file, settings.overrides = path, dict(overrides)
    return settings


def rewrite(settings: Settings, text: str) -> None:
    assert settings.config_file is not None
    settings.config_file.write_text(text)


def test_a_reload_applies_what_changed_and_keeps_what_needs_a_restart(tmp_path) -> None:
    old = started_from(tmp_path, 'max_queue = 10\nturn_timeout = 0\nruntime = "probe"\n')
    rewrite(old, 'max_queue = 20\nturn_timeout = 30\nmax_sessions = 5\nruntime = "other"\n')
    new, changed, restart = configfile.reload_settings(old)
    assert (new.max_queue, new.turn_timeout, new.max_sessions) == (20, 30.0, 5)
    assert sorted(changed) == ["max_queue", "max_sessions", "turn_timeout"]
    assert restart == ["runtime"]
    assert new.runtime == "probe"  # kept until a restart
    assert (new.config_file, new.overrides) == (old.config_file, old.overrides)
    assert old.max_queue == 10  # the old settings are not touched


def test_a_reload_of_an_unchanged_file_changes_nothing(tmp_path) -> None:
    old = started_from(tmp_path, 'max_queue = 10\nmetrics = "9100"\n[agent]\nmodel = "m"\n')
    new, changed, restart = configfile.reload_settings(old)
    assert (changed, restart) == ([], [])
    assert new == old


def test_what_the_command_line_set_still_wins_after_a_reload(tmp_path) -> None:
    old = started_from(tmp_path, "max_queue = 10\nmax_sessions = 3\n", max_queue=5)
    assert old.max_queue == 5
    rewrite(old, "max_queue = 20\nmax_sessions = 4\n")
    new, changed, restart = configfile.reload_settings(old)
    assert new.max_queue == 5 and new.max_sessions == 4
    assert (changed, restart) == (["max_sessions"], [])


def test_a_preload_computed_at_start_survives_a_reload(tmp_path) -> None:
    """`serve` picks the preload for hermes itself when none is given; the
    file does not name it, so a reload must not drop it (or call it changed)."""
    old = started_from(tmp_path, 'runtime = "hermes"\n')
    old.preload = ("json", "email")  # as serve computes it after building
    new, changed, restart = configfile.reload_settings(old)
    assert new.preload == ("json", "email")
    assert (changed, restart) == ([], [])


def test_a_preload_changed_in_the_file_needs_a_restart(tmp_path) -> None:
    old = started_from(tmp_path, 'preload = ["json"]\n')
    rewrite(old, 'preload = ["json", "email"]\n')
    new, changed, restart = configfile.reload_settings(old)
    assert new.preload == ("json",) and restart == ["preload"] and changed == []


def test_a_preload_given_on_the_command_line_is_kept(tmp_path) -> None:
    old = started_from(tmp_path, "", preload=("json",))
    rewrite(old, 'preload = ["email"]\n')  # the flag still wins
    new, changed, restart = configfile.reload_settings(old)
    assert new.preload == ("json",) and (changed, restart) == ([], [])


def test_an_invalid_file_is_refused_as_a_whole(tmp_path) -> None:
    old = started_from(tmp_path, "max_queue = 10\n")
    rewrite(old, "max_queue = 20\nmax_sesions = 4\n")
    with pytest.raises(configfile.ConfigError, match="did you mean 'max_sessions'"):
        configfile.reload_settings(old)
    assert old.max_queue == 10


# ------------------------------------------------------------ fd limit

SAFE_AT_1024 = (1024 - FD_RESERVE - 1024 // PROXY_FD_SHARE) // FDS_PER_SESSION  # 64


@pytest.mark.parametrize(
    "fd_limit, spares, wanted, allowed",
    [
        pytest.param(1024, 0, None, SAFE_AT_1024, id="derived"),
        pytest.param(1024, 0, 60, 60, id="wanted-fits"),
        pytest.param(1024, 0, 1000, SAFE_AT_1024, id="wanted-lowered"),
        pytest.param(1024, 3, None, SAFE_AT_1024 - 3, id="spares-hold-fds"),
        pytest.param(1024, 3, SAFE_AT_1024 - 3, SAFE_AT_1024 - 3, id="wanted-just-fits"),
        pytest.param(1024, 3, SAFE_AT_1024 - 2, SAFE_AT_1024 - 3, id="one-too-many"),
        pytest.param(
            340,
            0,
            1000,
            (340 - FD_RESERVE - 340 // PROXY_FD_SHARE) // FDS_PER_SESSION,
            id="as-in-test-faults",
        ),
        pytest.param(100, 0, None, 1, id="tiny-limit-still-one"),
        pytest.param(300, 50, 10, 1, id="spares-eat-everything"),
        pytest.param(
            1 << 20,
            0,
            None,
            ((1 << 20) - FD_RESERVE - (1 << 20) // PROXY_FD_SHARE) // FDS_PER_SESSION,
            id="huge",
        ),
    ],
)
def test_the_sessions_allowed_fit_in_the_open_file_limit(
    fd_limit: int, spares: int, wanted: int | None, allowed: int
) -> None:
    assert allowed_sessions(fd_limit, spares, wanted) == allowed


def test_more_descriptors_never_allow_fewer_sessions() -> None:
    for spares in (0, 4):
        counts = [allowed_sessions(fd, spares, None) for fd in range(0, 4096, 7)]
        assert counts == sorted(counts) and min(counts) == 1
