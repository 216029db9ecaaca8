"""hermes-sup's HTTP endpoint: Hermes's API-server contract, one session per
conversation.

Hermes's own front ends (the messaging gateway in proxy mode, hermes-webui
with its api_server backend) and any OpenAI-compatible client speak the
HTTP API that Hermes's API server serves (hermes-agent's
`gateway/platforms/api_server.py`). This package serves that API as a client
of the supervisor (`AsyncClient`): each conversation is a hermes-sup session,
so its own worker process, environment, working directory and HERMES_HOME;
and each bearer key is a tenant, reaching only its own sessions, runs and
responses unless granted more.

    app.py       the ASGI app (Starlette): routes, auth, errors, /v1/models,
                 /v1/capabilities, health
    chat.py      POST /v1/chat/completions, streaming and not
    runs.py      the runs API: /v1/runs, status, events, approval, stop
    responses.py the Responses API: /v1/responses (streaming and not), stored responses
    response_items.py  a response's output items (message, tool calls) and usage
    sessions.py  which session a request is (in its key's namespace), and its turn's text
    continuity.py  chats that name no session: their own, with their own history
    turns.py     reading one turn in its own task, bounded per stream
    keys.py      bearer keys (`hermes-sup keys http ...`), each a tenant
    origins.py   which browser origins may call it (403 for others), CORS
    idempotency.py  Idempotency-Key: a repeated request gets its first answer
    bodies.py    request bodies as JSON, refused when too deep or not text
    errors.py    OpenAI-style errors and statuses
    logsafe.py   log lines that no client string can break
    notices.py   GET /v1/notices and its acknowledgement: notices at least once
    notice_book.py  each key's notices, kept until acknowledged
    guard.py     uvicorn's protocol with a header timeout, a connection cap and a minimum body rate
    shares.py    each key's fair share of requests and connections
    serve.py     running it with uvicorn: beside `serve`, or on its own

Starlette and uvicorn come with the `http` extra. Only app.py, serve.py and
what they import need them: keys.py does not (`hermes-sup keys http
generate` works without them), so the names below are imported on first
use, not with the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import ApiSettings, create_app
    from .keys import KeyStore

_WHERE = {"ApiSettings": "app", "create_app": "app", "KeyStore": "keys"}

__all__ = ["ApiSettings", "KeyStore", "create_app"]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
