"""The HTTP endpoint's settings, each declared once (local/settings.py).

`ApiSettings` is what `create_app` reads. Each field declared with
`setting()` is one setting of the endpoint: a flag of `hermes-sup http`
(cli/http.py) and of the endpoint's own process (serve.py), a key of the
configuration file's `[http_api]` table (read by `hermes-sup http --config`
and by `serve` when its `http` is set), and a row of the reference. Where
the endpoint listens and which supervisor it fronts are not here: those are
the command's (`http --listen`, `serve`'s `http`).

Standard library only, like the table machinery: `config check` and the
docs read this table without the http extra installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hermes_sup.local.settings import Setting, declare, setting

__all__ = ["API_SETTINGS", "ApiSettings", "ORIGINS_ENV", "RETRY_GRACE_ENV"]

RETRY_GRACE_ENV = "HERMES_SUP_HTTP_RETRY_GRACE"
# origins.py reads it (and Hermes's own API_SERVER_CORS_ORIGINS after it).
ORIGINS_ENV = "HERMES_SUP_HTTP_CORS_ORIGINS"


@dataclass
class ApiSettings:
    """What an operator may tune (hermes-sup http --help)."""

    model: str = field(
        default="hermes-agent",
        metadata=setting("--model", "the model id clients see in /v1/models and answers"),
    )
    max_body: int = field(
        default=10_000_000,  # as Hermes's API server
        metadata=setting("--max-body", "largest request body in bytes (413 above)", minimum=1024),
    )
    body_timeout: float = field(
        default=60.0,
        metadata=setting(
            "--body-timeout", "seconds a request body may take to arrive", exclusive=True
        ),
    )
    # Below it a body holds its connection for nothing (guard.py, BodyDeadline).
    min_body_rate: int = field(
        default=1024,
        metadata=setting(
            "--min-body-rate",
            "bytes a second a request body must keep up after its first 5 s (slower is cut "
            "with 408); 0 for none",
            minimum=0,
        ),
    )
    # shares.py's KEY_REQUESTS and KEY_CONNECTIONS.
    key_requests: int = field(
        default=256,
        metadata=setting(
            "--key-requests", "requests one key may have open at once (429 above)", minimum=1
        ),
    )
    key_connections: int = field(
        default=512,
        metadata=setting(
            "--key-connections",
            "connections one key may hold; one more closes the key's longest idle, or is "
            "answered 429",
            minimum=1,
        ),
    )
    # guard.py's HEADER_TIMEOUT (a test holds them equal: guard.py needs
    # the http extra, this table must not).
    header_timeout: float = field(
        default=10.0,
        metadata=setting(
            "--header-timeout",
            "seconds a request's head may take, from when its connection is idle",
            exclusive=True,
        ),
    )
    max_connections: int | None = field(
        default=None,
        metadata=setting(
            "--max-connections",
            "connections open at once; one more makes room by closing the longest idle",
            zero="4096, or fewer as the open-file limit allows",
        ),
    )
    stall_timeout: float = field(
        default=30.0,
        metadata=setting(
            "--stall-timeout",
            "seconds a stream may go unread before its turn is cancelled",
            minimum=0.1,
        ),
    )
    keepalive: float = field(
        default=30.0,
        metadata=setting(
            "--keepalive",
            "seconds of silence on a Responses or runs stream before a comment line",
            exclusive=True,
        ),
    )
    # hermes-webui notices its Stop only when a line arrives, so a silent
    # chat completions turn must still send one often.
    chat_keepalive: float = field(
        default=1.0,
        metadata=setting(
            "--chat-keepalive",
            "the same on chat completions streams (hermes-webui sees its Stop only when a "
            "line arrives)",
            exclusive=True,
        ),
    )
    stream_queue: int = field(
        default=1024,
        metadata=setting("--stream-queue", "events waiting for one slow stream reader", minimum=1),
    )
    run_events: int = field(
        default=10_000,
        metadata=setting("--run-events", "events a run keeps for late subscribers", minimum=1),
    )
    run_ttl: float = field(
        default=3600.0,
        metadata=setting("--run-ttl", "seconds an ended run stays readable", exclusive=True),
    )
    max_runs: int = field(
        default=1000,
        metadata=setting("--max-runs", "ended runs kept at most, of each key's", minimum=1),
    )
    max_responses: int = field(
        default=1000,
        metadata=setting(
            "--max-responses",
            "stored responses kept at most (in memory), of each key's",
            minimum=1,
        ),
    )
    # At most an hour: the supervisor's orphan_grace limit.
    retry_grace: float = field(
        default=30.0,
        metadata=setting(
            "--retry-grace",
            "seconds a turn whose client hung up, or whose endpoint died, waits for a retry "
            "(the same Idempotency-Key) before it is cancelled",
            envvar=RETRY_GRACE_ENV,
            exclusive=True,
            maximum=3600,
        ),
    )
    cors_origins: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "--cors-origin",
            "browser origins (`https://app.example.com`) whose pages may call the API, `*` "
            "for any; other origins get 403, the page served beside the API needs none. "
            "The environment's is comma-separated, else Hermes's `API_SERVER_CORS_ORIGINS`",
            envvar=ORIGINS_ENV,
            metavar="ORIGIN",
        ),
    )
    # Static files served at / (no key needed for them): the command's
    # `--web` or serve's `http_web`, checked when it starts.
    web_dir: Path | None = None


# Every setting of the endpoint by its ApiSettings field name.
API_SETTINGS: dict[str, Setting] = declare(ApiSettings)
