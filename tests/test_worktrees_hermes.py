"""Hermes sessions on one repository: the agent's terminal tool runs in the
session's own worktree, `git status` there shows only the session's own
changes, and the peers file in its workspace names the other session.
Against the fake model server on 127.0.0.1; needs hermes-agent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hermes_sup.protocol import Kind
from hermes_sup.supervisor.worktrees import branch_for

from .conftest import needs_hermes
from .fake_model import FakeModel
from .test_hermes import collect
from .test_worktrees import make_repo

pytestmark = [needs_hermes, pytest.mark.e2e]


@pytest.fixture
def model():
    fake = FakeModel()
    yield fake
    fake.close()


def tool_result(events: list) -> str:  # noqa: ANN001
    done = [e.body["data"] for e in events if e.body["type"] == "tool_complete"]
    assert done, [e.body["type"] for e in events]
    return str(done[-1]["result"])


def test_each_hermes_agent_sees_only_its_own_changes_in_git_status(
    supervisor_factory, model, workdir: Path
) -> None:
    repo = make_repo(workdir / "repo")
    config = workdir / "agent.toml"
    config.write_text(
        f'model = "fake-model"\nbase_url = "{model.url}"\nprovider = "custom"\n'
        'toolsets = ["terminal"]\napi_key_env = "FAKE_MODEL_KEY"\n'
    )
    home = workdir / "user-home"
    home.mkdir()
    env = dict(os.environ, FAKE_MODEL_KEY="sk-fake", HOME=str(home))
    sup = supervisor_factory(
        "--agent", "hermes", "--agent-config", str(config), "--repo", str(repo), env=env
    )
    keys = ["alice", "bob"]
    with sup.client(timeout=120) as client:
        for key in keys:
            client.open(key)
        writes = {
            client.submit(Kind.SEND, {"text": f"run: echo {k} > {k}.txt && pwd"}, session=k): k
            for k in keys
        }
        for key, (final, events) in collect(client, writes).items():
            assert final.kind is Kind.REPLY, final.body
            # In its own worktree (sealed, seen at the fixed workspace path).
            workspace = Path(client.inspect(key)["workspace"])
            assert (workspace / f"{key}.txt").read_text() == f"{key}\n"
            assert tool_result(events).count("/workspace") == 1  # its pwd
        status = {
            client.submit(
                Kind.SEND,
                {"text": "run: git status --porcelain; git branch --show-current"},
                session=k,
            ): k
            for k in keys
        }
        seen = {key: tool_result(events) for key, (_, events) in collect(client, status).items()}
        peers = {
            client.submit(Kind.SEND, {"text": "run: cat .hermes-sup/peers"}, session=k): k
            for k in keys
        }
        listed = {key: tool_result(events) for key, (_, events) in collect(client, peers).items()}
    for key in keys:
        other = next(k for k in keys if k != key)
        assert f"?? {key}.txt" in seen[key] and f"{other}.txt" not in seen[key], seen[key]
        assert branch_for(key) in seen[key]
        assert f"You are session {key}" in listed[key]
        assert branch_for(other) in listed[key], listed[key]  # the live peer, by its branch
    # The agent is told too, in the system prompt of every turn: each model
    # request of a session names the other live session, never itself as a peer.
    for key in keys:
        other = next(k for k in keys if k != key)
        asked = [r for r in model.requests if f"echo {key} > {key}.txt" in json.dumps(r)]
        assert asked, f"no model request of {key}"
        system = " ".join(m["content"] for m in asked[0]["messages"] if m["role"] == "system")
        assert "Other sessions are working on this same git repository" in system
        assert branch_for(other) in system and f"{other}\t" in system, system[-600:]
    assert not (repo / "alice.txt").exists() and not (repo / "bob.txt").exists()
