"""What the endpoint says of itself: `/health`, `/v1/models` and
`/v1/capabilities` (Hermes's capabilities contract)."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hermes_sup.client import ClientError
from hermes_sup.local.version import version

from .api import Api
from .errors import ApiError

# A run's Idempotency-Key holds as long as the supervisor's turn journal
# keeps its turn: the session's newest turns (PROTOCOL.md, "Turn ids"), a
# count, not a time, and across restarts of the endpoint and the supervisor.
RUNS_IDEMPOTENCY = {
    "supported": True,
    "durable": True,
    "retention_seconds": None,
    "retention_turns": 128,
}


class Info:
    """The routes that describe the endpoint (no turn runs for them)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def health(self, request: Request) -> Response:
        """Alive, and whether the supervisor answers (503 if not). As
        Hermes's own, `version` is the Hermes version (the hermes-agent the
        supervisor's workers load), here when there is one; `hermes_sup` is
        ours."""
        body: dict[str, Any] = {"status": "ok", "platform": "hermes-agent", "version": version()}
        try:
            pong = await self.api.client().ping(timeout=5.0)
            body.update(await self.api.agent_info(pong.pid))
        except (ClientError, ApiError) as exc:
            starting = isinstance(exc, ApiError) and exc.code == "starting"
            body["status"] = (
                "starting" if starting else "unavailable"
            )  # starting: how far, in error
            body["error"] = str(exc)
            return JSONResponse(body, 503, headers={"Retry-After": "5"})
        return JSONResponse(body)

    async def models(self, request: Request) -> Response:
        """The one model clients see."""
        name = self.api.settings.model
        now = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": now,
                        "owned_by": "hermes",
                        "permission": [],
                        "root": name,
                        "parent": None,
                    }
                ],
            }
        )

    async def capabilities(self, request: Request) -> Response:
        """What works here (`capabilities_of`)."""
        try:
            pong = await self.api.client().ping(timeout=5.0)
            agent = await self.api.agent_info(pong.pid)
        except (ClientError, ApiError):
            agent = {}
        return JSONResponse(capabilities_of(self.api, agent))


def capabilities_of(api: Api, agent: dict[str, Any]) -> dict[str, Any]:
    """What this endpoint serves, in Hermes's capabilities contract: only
    what works here is advertised. `agent`: what the supervisor said of its
    workers (api.agent_info), or nothing if it did not answer."""
    endpoints = {
        "health": ("GET", "/health"),
        "models": ("GET", "/v1/models"),
        "chat_completions": ("POST", "/v1/chat/completions"),
        "responses": ("POST", "/v1/responses"),
        "runs": ("POST", "/v1/runs"),
        "run_status": ("GET", "/v1/runs/{run_id}"),
        "run_events": ("GET", "/v1/runs/{run_id}/events"),
        "run_approval": ("POST", "/v1/runs/{run_id}/approval"),
        "run_stop": ("POST", "/v1/runs/{run_id}/stop"),
        "run_media": ("GET", "/v1/runs/{run_id}/media/{media_id}"),
    }
    return {
        "object": "hermes.api_server.capabilities",
        "platform": "hermes-agent",
        "model": api.settings.model,
        "auth": {"type": "bearer", "required": True},
        "runtime": {
            "mode": "server_agent",
            "tool_execution": "server",
            "split_runtime": False,
            "isolation": "process_per_session",
            "description": (
                "hermes-sup: each conversation is served by its own Hermes agent in its own "
                "process, with its own environment, working directory and HERMES_HOME."
            ),
            # "root"/"user": each session sealed in namespaces of its own;
            # None: unsealed, and `warning` says why and what it means.
            "sealed": agent.get("sealed"),
            "warning": agent.get("warning"),
        },
        "features": {
            "chat_completions": True,
            "chat_completions_streaming": True,
            "responses_api": True,
            "responses_streaming": True,
            "run_submission": True,
            "runs_idempotency": RUNS_IDEMPOTENCY,
            "run_status": True,
            "run_events_sse": True,
            "run_stop": True,
            # Upstream's POST /v1/runs/{id}/steer: not served (runs.py).
            "run_steer": False,
            "run_approval_response": True,
            # approval.request names its request, and an answer naming it
            # reaches it or none (runs.py): hermes-webui then sends the id.
            "approval_identity_v1": True,
            "tool_progress_events": True,
            "approval_events": True,
            "session_resources": False,
            "session_chat": False,
            "session_chat_streaming": False,
            "session_fork": False,
            "admin_config_rw": False,
            "jobs_admin": False,
            "memory_write_api": False,
            "skills_api": False,
            "audio_api": False,
            "realtime_voice": False,
            "session_continuity_header": "X-Hermes-Session-Id",
            "session_key_header": "X-Hermes-Session-Key",
            "cors": bool(api.settings.cors_origins),
        },
        "endpoints": {
            name: {"method": method, "path": path} for name, (method, path) in endpoints.items()
        },
    }
