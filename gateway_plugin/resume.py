"""What the worker's agent is given for a turn, and for Hermes's restart continuation.

After a gateway crash or a restart that cut turns short, Hermes marks those
sessions `resume_pending` and, once started, continues each with a turn of
its own that has no text (`GatewayRunner._schedule_resume_pending_sessions`).
In process, Hermes gives its agent a recovery note in place of the empty
message (`build_resume_recovery_note`: the previous turn was interrupted,
report the restore, do not re-run old tool calls). Its proxy path, in 0.19
and in 0.21 alike, is called before that note is made and sends the empty
message as it is, which Hermes's own API server refuses ("No user message
found") as our endpoint does ("Missing 'input' field"): every such chat got
an error. The plugin gives the worker's agent the note Hermes gives its own,
made by Hermes's own function where the release has it.
"""

from __future__ import annotations

import logging
from typing import Any

from .layouts import TurnCall

log = logging.getLogger("hermes_sup.gateway_plugin")

# The note's reason when a session names none (Hermes's own default).
DEFAULT_REASON = "restart_timeout"


async def message_to_send(runner: Any, adapter: Any, call: TurnCall) -> str | None:
    """The text for the worker's agent: the turn's message (0.21: its input
    snapshot, rendered now, as upstream's proxy path renders it); for a
    restart continuation, Hermes's recovery note; None for an empty message
    of a session with nothing to continue."""
    message = call.message
    snapshot = call.input_snapshot
    if snapshot is not None:
        await snapshot.snapshot.refresh()
        message = snapshot.render(runner, timestamps=True)
    if isinstance(message, str) and message.strip():
        return message
    entry = _session_entry(runner, call)
    if entry is None or not getattr(entry, "resume_pending", False):
        return None
    reason = getattr(entry, "resume_reason", None) or DEFAULT_REASON
    # Whether a person is there to be asked (Hermes's adapter attribute):
    # a webhook's continuation finishes the work instead of asking.
    interactive = bool(getattr(adapter, "interactive_resume", True))
    log.info("hermes-sup: %s continues after a gateway restart (%s)", call.session_key, reason)
    return recovery_note(reason, interactive)


def recovery_note(reason: str, interactive: bool) -> str:
    """Hermes's recovery note for a continuation without a new message."""
    import gateway.run as gateway_run

    build = getattr(gateway_run, "build_resume_recovery_note", None)
    if callable(build):
        return str(build(reason, "", interactive=interactive))
    # A release that moved the function: the same instruction, in our words.
    what = "report that the session was restored and ask what to do next"
    if not interactive:
        what = "continue the interrupted task; nobody is there to answer"
    return (
        f"[System note: the previous turn was cut short by a gateway interruption ({reason}); "
        f"the gateway is back. Do not re-run tool calls from the history; {what}.]"
    )


def _session_entry(runner: Any, call: TurnCall) -> Any:
    """The gateway's session entry of the turn (its resume mark), if known."""
    store = getattr(runner, "session_store", None)
    lookup = getattr(store, "lookup_by_session_id", None)
    if call.session_id and callable(lookup):
        try:
            entry = lookup(call.session_id)
        except Exception as exc:  # the store's trouble: treated as no mark
            log.warning("hermes-sup: session %s not looked up: %s", call.session_id, exc)
            return None
        if entry is not None:
            return entry
    entries = getattr(store, "_entries", None)
    return entries.get(call.session_key) if isinstance(entries, dict) else None
