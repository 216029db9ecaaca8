"""What the Hermes runtime carries for Hermes's own front ends (the HTTP
endpoint): an agent built from the session's config.yaml as Hermes's API
server builds it, a turn's context (instructions, history, conversation),
and every field of Hermes's tool progress, interim messages and clarify
questions as events. The real agent, against the fake model server."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest

from hermes_sup.client.errors import TurnFailed

from .conftest import needs_hermes
from .fake_model import FakeModel
from .test_hermes import session_dir

pytestmark = [needs_hermes, pytest.mark.e2e]

HISTORY = [
    {"role": "system", "content": "left out, as Hermes's API server leaves it"},
    {"role": "user", "content": "what is the colour of the sky?"},
    {"role": "assistant", "content": [{"type": "text", "text": "the sky is teal here"}]},
]


def texts(request: dict, role: str) -> list[str]:
    """The text of each message of `role` the model was sent."""
    out = []
    for m in request["messages"]:
        if m.get("role") == role:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            out.append(str(content or ""))
    return out


def start(supervisor_factory, workdir, agent_toml: str, config_yaml: str):
    """A supervisor running the hermes runtime against a new fake model
    (`sup.model`), with `agent_toml` as its agent config (the api key always
    from FAKE_MODEL_KEY) and a template HERMES_HOME holding `config_yaml`;
    both may name the fake model's base URL as {url}."""
    fake = FakeModel()
    template = workdir / "template"
    template.mkdir()
    (template / "config.yaml").write_text(config_yaml.format(url=fake.url))
    config = workdir / "agent.toml"
    config.write_text(
        agent_toml.format(url=fake.url)
        + f'api_key_env = "FAKE_MODEL_KEY"\ntemplate_home = "{template}"\n'
    )
    home = workdir / "user-home"
    home.mkdir()
    env = dict(os.environ, FAKE_MODEL_KEY="sk-fake-secret", HOME=str(home))
    try:
        sup = supervisor_factory("--agent", "hermes", "--agent-config", str(config), env=env)
    except BaseException:
        fake.close()
        raise
    sup.model = fake
    return sup


@pytest.fixture
def hermes(supervisor_factory, workdir):
    """Model settings in the agent config, as tests/test_hermes.py has them."""
    sup = start(
        supervisor_factory,
        workdir,
        'model = "fake-model"\nbase_url = "{url}"\nprovider = "custom"\ntoolsets = ["terminal"]\n',
        "approvals:\n  timeout: 3\n",
    )
    yield sup
    sup.model.close()


@pytest.fixture
def hermes_yaml(supervisor_factory, workdir):
    """An agent config that names no model and no endpoint, only the api
    key: the template HERMES_HOME's config.yaml names them, as an operator's
    existing Hermes config does."""
    sup = start(
        supervisor_factory,
        workdir,
        "",
        "model:\n"
        "  default: fake-model\n"
        "  provider: custom\n"
        "  base_url: {url}\n"
        "  api_key: sk-from-config-yaml\n"
        "platform_toolsets:\n"
        "  api_server: [terminal]\n",
    )
    yield sup
    sup.model.close()


def test_config_yaml_alone_names_the_model_and_its_toolsets(hermes_yaml) -> None:
    fake = hermes_yaml.model
    with hermes_yaml.client(timeout=120) as client:
        reply = client.run("yaml", "run: echo from-yaml; env")
    assert reply.text.startswith("done: ") and "from-yaml" in reply.text
    assert "HERMES_HOME=" in reply.text  # the shell's whole environment
    assert {r["model"] for r in fake.requests} == {"fake-model"}
    # config.yaml's platform_toolsets.api_server: the terminal and nothing else.
    tools = {t["function"]["name"] for t in fake.requests[0]["tools"]}
    assert "terminal" in tools and "read_file" not in tools
    # The agent config's key wins over config.yaml's, and stays out of the
    # worker's environment, and so of its shell, and of its log.
    assert set(fake.auth) == {"Bearer sk-fake-secret"}
    assert "sk-fake-secret" not in reply.text
    assert b"sk-fake-secret" not in (session_dir(hermes_yaml, "yaml") / "worker.log").read_bytes()


def test_a_turns_instructions_history_and_conversation_reach_hermes(hermes) -> None:
    model = hermes.model
    context = {"instructions": "Answer as INSTR-42.", "history": HISTORY, "conversation": "conv-1"}
    with hermes.client(timeout=120) as client:
        first = client.run("webui", "hello", context=context)
        # The front end resends its whole history, as a webui does each turn.
        again = HISTORY + [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.text},
        ]
        second = client.run("webui", "again", context={"history": again, "conversation": "conv-1"})
        second_sent = model.requests[-1]
        # A context this runtime cannot use fails its turn, naming what is
        # wrong; the session goes on.
        for bad, named in (
            ({"history": "hello"}, "context history must be a list"),
            ({"conversation": "../other"}, "context conversation may not hold"),
        ):
            with pytest.raises(TurnFailed, match=named):
                client.run("webui", "bad", context=bad)
        assert client.run("webui", "still", context={"conversation": "conv-1"}).ok
    # The history's one user message, then this one.
    assert first.text == "echo: hello (turn 2)"
    sent = model.requests[0]
    assert "INSTR-42" in texts(sent, "system")[0]
    assert texts(sent, "user")[0] == "what is the colour of the sky?"
    assert "the sky is teal here" in texts(sent, "assistant")
    assert not any("left out" in t for t in texts(sent, "system") + texts(sent, "user"))
    # The next turn: the history once (from state.db), not again from the
    # context; instructions were that turn's only.
    assert second.text == "echo: again (turn 3)"
    sent = second_sent
    assert texts(sent, "user") == ["what is the colour of the sky?", "hello", "again"]
    assert texts(sent, "assistant").count("the sky is teal here") == 1
    assert "INSTR-42" not in texts(sent, "system")[0]
    assert first.data["session_id"] == "conv-1"
    # Hermes recorded the conversation under its id, with the history first.
    db = sqlite3.connect(session_dir(hermes, "webui") / "home" / "state.db")
    rows = db.execute(
        "SELECT role, content FROM messages WHERE session_id = 'conv-1' ORDER BY id"
    ).fetchall()
    db.close()
    assert [r[1] for r in rows if r[0] == "user"] == [
        "what is the colour of the sky?",
        "hello",
        "again",
        "still",
    ]


def test_tool_progress_interim_messages_and_clarify_reach_the_front_end(hermes) -> None:
    with hermes.client(timeout=120) as client:
        client.open("tools", options={"agent": {"toolsets": ["terminal", "clarify"]}})
        ran = client.run("tools", "narrate: echo progress-ok")
        asked = client.run("tools", "ask: Which colour? ;; red | blue")
    events = {e.type: [] for e in ran.events}
    for e in ran.events:
        events[e.type].append(e.data)
    progress = {e["event"]: e for e in events["tool_progress"]}
    started, completed = progress["tool.started"], progress["tool.completed"]
    assert started["event"] == "tool.started" and started["tool"] == "terminal"
    assert "echo progress-ok" in started["preview"] and started["emoji"]
    assert started["label"] == started["preview"]
    assert started["args"] == {"command": "echo progress-ok"}
    # Hermes's keyword arguments, by name.
    assert completed["event"] == "tool.completed" and completed["tool"] == "terminal"
    assert isinstance(completed["duration"], float) and completed["is_error"] is False
    assert "progress-ok" in completed["result"]
    start, done = events["tool_start"][0], events["tool_complete"][0]
    assert start["emoji"] == started["emoji"] and start["label"] == started["label"]
    assert done["id"] == start["id"] and done["duration"] == completed["duration"]
    assert done["is_error"] is False
    # The sentence said beside the tool call, as a message of its own.
    assert events["assistant_message"] == [
        {"text": "Running echo progress-ok for you.", "already_streamed": True}
    ]

    clarify = [e.data for e in asked.events if e.type == "clarify"]
    assert clarify == [{"id": "clarify-1", "question": "Which colour?", "choices": ["red", "blue"]}]
    # The agent was told at once that the user answers in the next message.
    answered = json.loads(asked.text.removeprefix("done: "))
    assert "next message" in answered["user_response"]


def test_the_models_reasoning_reaches_the_front_end_apart_from_the_reply(hermes) -> None:
    with hermes.client(timeout=120) as client:
        thought = client.run("thinker", "think: first I weigh it, then I answer ;; yes")
    reasoning = [e.data for e in thought.events if e.type == "reasoning"]
    assert "".join(reasoning) == "first I weigh it, then I answer"
    assert len(reasoning) > 1  # streamed as it came, in pieces
    tokens = "".join(e.data for e in thought.events if e.type == "token")
    assert thought.text == "said: yes" and "weigh" not in tokens + thought.text
    kinds = [e.type for e in thought.events]
    assert kinds.index("reasoning") < kinds.index("token")  # in the order the model said them


def test_a_context_is_checked_before_the_turn() -> None:
    from hermes_sup.worker.hermes import HermesTurnError, TurnContext

    assert TurnContext.parse(None) == TurnContext()
    parsed = TurnContext.parse(
        {"instructions": "", "history": HISTORY, "conversation": "webui:1", "other": 1}
    )
    assert parsed.instructions is None and parsed.conversation == "webui:1"
    assert parsed.history == (
        {"role": "user", "content": "what is the colour of the sky?"},
        {"role": "assistant", "content": "the sky is teal here"},
    )
    for bad, named in (
        ({"instructions": 3}, "instructions must be a string"),
        ({"history": [{"content": "x"}]}, r"history\[0\] must be a map with a role"),
        ({"history": [{"role": "user", "content": 3}]}, r"history\[0\].content"),
        ({"conversation": ""}, "non-empty"),
        ({"conversation": "x" * 257}, "257 characters, over 256"),
        ({"conversation": "a\nb"}, "control characters"),
    ):
        with pytest.raises(HermesTurnError, match=named):
            TurnContext.parse(bad)
