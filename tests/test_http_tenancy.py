"""Each HTTP key is a tenant: a session, run or response made through one
key is that key's, another key finds nothing of it (404, never 403), and
the ids clients send live in their key's namespace. Keys made with the CLI
(`keys http generate`, `grant`, `rotate`, `revoke`), a real supervisor
(probe runtime) and endpoint over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from hermes_sup.httpapi.keys import KeyStore
from tests import test_http
from tests.test_http import hs

endpoint = test_http.endpoint
endpoint_factory = test_http.endpoint_factory


@dataclass
class Key:
    """A front end's key, as a client uses it."""

    url: str
    key: str

    def headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", **extra}

    def say(self, text: str, **headers: str) -> str:
        """A chat turn's reply (200 expected)."""
        body = {"messages": [{"role": "user", "content": text}]}
        answer = httpx.post(
            self.url + "/v1/chat/completions",
            json=body,
            headers=self.headers(**headers),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]

    def chat(self, messages: list[dict[str, str]]) -> str:
        """A turn of a chat that names no session (its whole history sent)."""
        answer = self.post("/v1/chat/completions", {"messages": messages})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=30)

    def post(self, path: str, body: dict | None = None, **headers: str) -> httpx.Response:
        return httpx.post(self.url + path, json=body or {}, headers=self.headers(**headers),
                          timeout=30)  # fmt: skip

    def run_events(self, run_id: str, until: str) -> list[dict]:
        seen = []
        with httpx.stream("GET", f"{self.url}/v1/runs/{run_id}/events", headers=self.headers(),
                          timeout=30) as response:  # fmt: skip
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["event"] == until:
                        break
        return seen


def generate(endpoint, name: str, *options: str) -> Key:
    made = hs("keys", "http", "generate", name, *options, data_dir=endpoint.sup.data_dir)
    assert made.returncode == 0, made.stderr
    return Key(endpoint.url, made.stdout.strip())


def not_found(response: httpx.Response, code: str) -> bool:
    return response.status_code == 404 and response.json()["error"]["code"] == code


def test_no_key_reaches_anything_of_another(endpoint) -> None:
    alice, bob = generate(endpoint, "alice"), generate(endpoint, "bob")
    # Alice: a secret in a session's environment and in a file, a run waiting
    # on an approval, a stored response with the secret in it.
    webui = {"X-Hermes-Session-Key": "webui:a1", "X-Hermes-Session-Id": "a1"}
    assert alice.say("setenv SECRET alice-secret", **webui) == "SECRET=alice-secret"
    assert alice.say("write notes.txt alice-secret", **webui).startswith("wrote")
    alice_pid = alice.say("pid", **webui)
    stored = alice.post("/v1/responses", {"input": "env SECRET"}, **webui)
    assert stored.json()["output"][-1]["content"][0]["text"] == "alice-secret"
    response_id = stored.json()["id"]
    run = alice.post("/v1/runs", {"input": "ask touch approved.txt", "session_id": "a1"}, **webui)
    run_id = run.json()["run_id"]
    alice.run_events(run_id, "approval.request")
    # A chat that names no session, resent whole each turn: it keeps its worker.
    transcript = [{"role": "user", "content": "pid"}]
    for text in ("setenv SECRET alice-secret", "pid", "env SECRET"):
        transcript.append({"role": "assistant", "content": alice.chat(transcript)})
        transcript.append({"role": "user", "content": text})
    said = [m["content"] for m in transcript if m["role"] == "assistant"]
    assert said[0] == said[2] and said[1] == "SECRET=alice-secret"
    alice_pids = {alice_pid, said[0]}
    # A session the local CLI opened, with a secret of its own.
    with endpoint.sup.client() as local:
        assert local.run("cli-own", "setenv SECRET cli-secret").text == "SECRET=cli-secret"
    alice_key = KeyStore(endpoint.sup.data_dir).tenant("alice").prefix + "webui:a1"

    # Bob tries everything a client can name.
    refused = {
        "run status": not_found(bob.get(f"/v1/runs/{run_id}"), "run_not_found"),
        "run events": not_found(bob.get(f"/v1/runs/{run_id}/events"), "run_not_found"),
        "run approval": not_found(
            bob.post(f"/v1/runs/{run_id}/approval", {"choice": "once"}), "run_not_found"
        ),
        "run stop": not_found(bob.post(f"/v1/runs/{run_id}/stop"), "run_not_found"),
        "response": not_found(bob.get(f"/v1/responses/{response_id}"), "response_not_found"),
        "response delete": not_found(
            httpx.delete(f"{bob.url}/v1/responses/{response_id}", headers=bob.headers()),
            "response_not_found",
        ),
        "previous response": not_found(
            bob.post("/v1/responses", {"input": "env SECRET", "previous_response_id": response_id}),
            "response_not_found",
        ),
    }
    assert all(refused.values()), refused

    def bob_reaches(how: str, reply: str) -> bool:
        """Whether what bob got came from alice's (or the CLI's) session."""
        return any(secret in reply for secret in ("alice-secret", "cli-secret")) or (
            reply in alice_pids
        )

    tries = {
        "session key header": bob.say("env SECRET", **webui),
        "session id header": bob.say("env SECRET", **{"X-Hermes-Session-Id": "a1"}),
        "pid by header": bob.say("pid", **webui),
        "file by header": bob.say("sh cat notes.txt", **webui),
        "alice's whole session key": bob.say("env SECRET", **{"X-Hermes-Session-Key": alice_key}),
        "the CLI's session": bob.say("env SECRET", **{"X-Hermes-Session-Id": "cli-own"}),
        "header-less, alice's first message": bob.say("pid"),
    }
    # A run's session_id, a response's conversation, a run's previous_response_id.
    bob_run = bob.post("/v1/runs", {"input": "env SECRET", "session_id": "a1"}).json()["run_id"]
    tries["run session_id"] = bob.run_events(bob_run, "run.completed")[-1]["output"]
    chained = bob.post("/v1/runs", {"input": "env SECRET", "previous_response_id": response_id})
    tries["run previous_response_id"] = bob.run_events(chained.json()["run_id"], "run.completed")[
        -1
    ]["output"]
    for name in ("a1", "webui:a1"):
        named = bob.post("/v1/responses", {"input": "env SECRET", "conversation": name})
        tries[f"response conversation {name}"] = named.json()["output"][-1]["content"][0]["text"]
    # Alice's header-less chat, as she holds it, to take up where it was left.
    tries["header-less transcript"] = bob.chat(transcript)
    reached = [how for how, reply in tries.items() if bob_reaches(how, reply)]
    assert reached == [], tries
    assert len(refused) + len(tries) == 19

    # Alice's own things are untouched: her approval is still hers to give.
    assert alice.get(f"/v1/runs/{run_id}").json()["status"] == "waiting_for_approval"
    approved = alice.post(f"/v1/runs/{run_id}/approval", {"choice": "once"})
    assert approved.json()["resolved"] == 1
    assert alice.run_events(run_id, "run.completed")[-1]["output"] == "exit 0"
    assert alice.get(f"/v1/responses/{response_id}").status_code == 200
    assert alice.say("env SECRET", **webui) == "alice-secret"
    assert alice.chat(transcript) == "alice-secret"  # her chat goes on where she left it
    with endpoint.sup.client() as local:
        assert local.run("cli-own", "env SECRET").text == "cli-secret"


def test_grants_reach_sessions_outside_namespaces_and_admin_everything(endpoint) -> None:
    gateway = generate(endpoint, "gateway", "--prefix", "telegram:*")
    alice = generate(endpoint, "alice")
    with endpoint.sup.client() as local:
        local.run("telegram:-100", "setenv SEEN cli")
        local.run("discord:7", "setenv SEEN cli")
    # The grant: the CLI's telegram sessions by their own key.
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "telegram:-100"}) == "cli"
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "discord:7"}) == ""
    alice.say("setenv SEEN alice", **{"X-Hermes-Session-Id": "telegram:-100"})  # her own
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "telegram:-100"}) == "cli"
    # A grant never reaches into another key's namespace, even one that names it.
    alice_ns = KeyStore(endpoint.sup.data_dir).tenant("alice").prefix
    wide = hs("keys", "http", "grant", "gateway", "--prefix", "alice*",
              data_dir=endpoint.sup.data_dir)  # fmt: skip
    assert wide.returncode == 0, wide.stderr
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": alice_ns + "telegram:-100"}) == ""
    # Later grants take effect at the next request, and can be taken back.
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "discord:7"}) == ""
    more = hs("keys", "http", "grant", "gateway", "--prefix", "discord:*",
              data_dir=endpoint.sup.data_dir)  # fmt: skip
    assert more.returncode == 0 and "discord:*" in more.stdout
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "discord:7"}) == "cli"
    reset = hs("keys", "http", "grant", "gateway", "--reset", data_dir=endpoint.sup.data_dir)
    assert reset.returncode == 0 and "reaches its own sessions" in reset.stdout
    assert gateway.say("env SEEN", **{"X-Hermes-Session-Id": "discord:7"}) == ""

    # An admin key reaches every session by its key, and every key's runs.
    admin = generate(endpoint, "ops", "--admin")
    run_id = alice.post("/v1/runs", {"input": "pid"}).json()["run_id"]
    assert admin.get(f"/v1/runs/{run_id}").status_code == 200
    assert admin.say("env SEEN", **{"X-Hermes-Session-Id": alice_ns + "telegram:-100"}) == "alice"
    assert admin.say("env SEEN", **{"X-Hermes-Session-Id": "discord:7"}) == "cli"
    listed = hs("keys", "http", "list", data_dir=endpoint.sup.data_dir).stdout.splitlines()
    scopes = {line.split()[0]: line for line in listed}
    assert scopes["ops"].endswith("reaches everything (admin)")
    assert scopes["alice"].endswith("reaches its own sessions")
    assert f"sessions {alice_ns}*" in scopes["alice"]


def test_a_rotated_key_keeps_its_sessions_a_remade_one_gets_none(endpoint) -> None:
    data = endpoint.sup.data_dir
    alice = generate(endpoint, "alice")
    header = {"X-Hermes-Session-Id": "mine"}
    pid = alice.say("pid", **header)
    run_id = alice.post("/v1/runs", {"input": "pid"}).json()["run_id"]
    rotated = hs("keys", "http", "rotate", "alice", data_dir=data)
    assert rotated.returncode == 0, rotated.stderr
    new = Key(endpoint.url, rotated.stdout.strip())
    assert alice.get("/v1/models").status_code == 401  # the old key is refused at once
    assert new.say("pid", **header) == pid and new.get(f"/v1/runs/{run_id}").status_code == 200
    # Revoked and made again under the same name: a new namespace, nothing of the old.
    assert hs("keys", "http", "revoke", "alice", data_dir=data).returncode == 0
    again = generate(endpoint, "alice")
    assert again.say("pid", **header) != pid
    assert not_found(again.get(f"/v1/runs/{run_id}"), "run_not_found")


def test_a_key_file_from_before_namespaces_keeps_one_of_its_own(tmp_path) -> None:
    keys = KeyStore(tmp_path)
    key = keys.generate("old")
    path = keys.dir / "old.key"
    digest = path.read_text().splitlines()[1]
    path.write_text(f"# hermes-sup HTTP key old: sha256 of the key\n{digest}\n")
    (keys.dir / "x").mkdir()  # the directory changes: the file is read again
    tenant = keys.check(key)
    assert tenant is not None and tenant.name == "old" and not tenant.admin
    assert tenant.prefix == KeyStore(tmp_path).tenant("old").prefix  # the same every time
    assert tenant.prefix != keys.tenant("old").prefix.replace(tenant.namespace, "0" * 12)
    with pytest.raises(Exception, match="grant"):
        keys.generate("bad", grants=["telegram:* x"])


def test_one_keys_many_never_push_out_anothers() -> None:
    """What the endpoint keeps in memory is capped per key: a key that
    floods it drops its own oldest, never another key's."""
    import asyncio
    from types import SimpleNamespace

    from starlette.responses import JSONResponse

    from hermes_sup.httpapi.app import ApiSettings
    from hermes_sup.httpapi.continuity import Continuations
    from hermes_sup.httpapi.idempotency import IdempotencyCache
    from hermes_sup.httpapi.responses import ResponseStore, Stored
    from hermes_sup.httpapi.runs import Run, Runs
    from hermes_sup.httpapi.sessions import SessionRef

    ref = SessionRef("k", "k")
    store = ResponseStore(limit=2)
    store.put("alice-1", Stored({}, ref, "c", None, "alice"))
    for i in range(5):
        store.put(f"bob-{i}", Stored({}, ref, "c", None, "bob"))
    assert store.get("alice-1") is not None and store.get("bob-0") is None
    assert store.get("bob-4") is not None and len(store) == 3

    runs = Runs(SimpleNamespace(settings=ApiSettings(max_runs=2)), lambda tenant, id: None)
    for owner, n in (("alice", 1), ("bob", 5)):
        for i in range(n):
            run = Run(f"{owner}-{i}", ref, "m", 10, owner)
            run.set_status("completed")
            runs.by_id[run.id] = run
            runs._sweep(owner)
    assert sorted(runs.by_id) == ["alice-0", "bob-3", "bob-4"]

    notes = Continuations(limit=2)
    notes.leave("alice", b"a", ref, "c")
    for i in range(5):
        notes.leave("bob", bytes([i]), ref, "c")
    assert notes.take("alice", b"a") == (ref, "c") and notes.take("bob", bytes([0])) is None
    assert notes.take("alice", b"a") == (ref, None)  # again: the session, a new conversation

    cache = IdempotencyCache(limit=2)

    async def main() -> None:
        async def answer() -> JSONResponse:
            return JSONResponse({"n": len(cache)})

        first = await cache.answer("alice", "k", "fp", answer)
        for i in range(5):
            await cache.answer("bob", f"k{i}", "fp", answer)
        assert (await cache.answer("alice", "k", "fp", answer)).body == first.body
        assert len(cache) == 3

    asyncio.run(main())


def test_a_sessions_shell_finds_no_key_to_use(endpoint) -> None:
    """A session is hostile too: no key is in its environment, nor in the
    key files (out of its view sealed; only hashes in them), and the
    endpoint on the host's 127.0.0.1 is not on its network (its loopback
    is its own)."""
    data = endpoint.sup.data_dir
    alice = generate(endpoint, "alice")
    run_id = alice.post("/v1/runs", {"input": "pid"}).json()["run_id"]
    shell = {"X-Hermes-Session-Id": "shell"}
    keys_dir = KeyStore(data).dir
    found = alice.say(
        f"sh env | grep -c hsk- ; cat {keys_dir}/*.key 2>/dev/null | grep -c hsk-", **shell
    )
    assert found == "0\n0\nexit 1", found
    fetch = (
        'sh python3 -c "import sys, urllib.request as u, urllib.error as e\n'
        "try: u.urlopen(sys.argv[1])\n"
        "except e.HTTPError as x: print(x.code)\n"
        'except e.URLError as x: print(x.reason)" '
        f"{endpoint.url}/v1/runs/{run_id}"
    )
    assert alice.say(fetch, **shell) == "[Errno 111] Connection refused\nexit 0"
