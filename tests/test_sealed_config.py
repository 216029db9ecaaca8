"""Sealed mode's settings and the supervisor's side of it, without processes:
the `sealed` key, preloading hermes only when sealed, the per-session uids,
and what a worker is told to seal itself with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hermes_sup.seal.paths import SealedPaths
from hermes_sup.supervisor import configfile, sealing
from hermes_sup.supervisor.config import Settings
from hermes_sup.supervisor.environment import parse_options
from hermes_sup.supervisor.session import Session


def test_the_sealed_key_takes_off_auto_or_on(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    for value in ("off", "auto", "on"):
        config.write_text(f'sealed = "{value}"\n')
        assert configfile.load(config)["sealed"] == value
    config.write_text('sealed = "sometimes"\n')
    with pytest.raises(configfile.ConfigError, match="sealed must be one of off, auto, on"):
        configfile.load(config)
    assert "sealed" in configfile.RESTART_FIELDS


@pytest.mark.skipif(
    importlib.util.find_spec("run_agent") is None, reason="hermes-agent is not installed"
)
def test_hermes_may_be_preloaded_only_into_sealed_sessions() -> None:
    with pytest.raises(configfile.ConfigError, match="seal"):
        configfile.check_preload(("run_agent",), "off")
    for sealed in ("auto", "on"):
        configfile.check_preload(("run_agent",), sealed)  # allowed


def test_a_session_keeps_its_uid_unless_a_live_session_holds_it() -> None:
    uid = sealing.uid_for("alice", set())
    assert sealing.SEALED_UID_BASE <= uid < sealing.SEALED_UID_BASE + sealing.SEALED_UID_COUNT
    assert sealing.uid_for("alice", set()) == uid
    assert sealing.uid_for("alice", {uid}) not in (uid, 0)
    assert sealing.uid_for("bob", set()) != uid


def test_what_a_worker_is_told_to_seal_itself_with(tmp_path: Path) -> None:
    settings = Settings(
        state_dir=tmp_path / "s",
        data_dir=tmp_path / "d",
        workspace_roots=("/srv/ws",),
        repo="/srv/repo",
        repo_roots=("/srv/repos",),
    )
    session = Session("k", tmp_path / "d" / "sessions" / "x", parse_options({}))
    assert sealing.Sealing().plan(settings, session, None) is None  # unsealed
    root = sealing.Sealing(mode="root", asked="on").plan(settings, session, 200_123)
    assert root is not None
    assert root["uid"] == root["gid"] == 200_123
    assert root["socket"] == str(tmp_path / "s" / "workers.sock")
    assert root["user_dir"] == str(session.dir / "user")
    # The repository's own checkout is hidden too: a session sees only its
    # git directory (and its own repository, in its workspace).
    assert root["hide"] == ["/srv/ws", "/srv/repos", "/srv/repo"]
    assert root["repos"] == ["/srv/repo", "/srv/repos"]
    assert root["groups"] == [sealing.SESSIONS_GID] and root["tmp_bytes"] == 256 * 1024 * 1024
    # A session on another repository (from before a restart) keeps it visible.
    session.repo = "/srv/old"
    assert sealing.Sealing(mode="user").plan(settings, session, None)["repos"][0] == "/srv/old"
    spare = sealing.Sealing(mode="user").spare_plan(settings)
    assert spare is not None and spare["mode"] == "user" and "/srv/repos" in spare["hide"]
    assert "uid" not in spare and "session_dir" not in spare  # nothing of any session
    assert sealing.Sealing().spare_plan(settings) is None


def test_the_fixed_paths_are_under_the_data_dir(tmp_path: Path) -> None:
    paths = SealedPaths.for_data_dir(tmp_path)
    assert (paths.home, paths.workspace, paths.user) == (
        tmp_path / "sealed" / "home",
        tmp_path / "sealed" / "workspace",
        tmp_path / "sealed" / "user",
    )
    paths.make()
    assert all(p.is_dir() for p in (paths.home, paths.workspace, paths.user))


def test_relative_directories_are_made_absolute(tmp_path: Path, monkeypatch) -> None:
    # The zygote runs in the data dir (sealed: in the fixed workspace), so a
    # relative path would name another directory there (d/d/sessions/...).
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text('data_dir = "d"\nstate_dir = "s"\n')
    values = configfile.load(config)
    assert values["data_dir"] == tmp_path / "d" and values["state_dir"] == tmp_path / "s"
