"""Commands that talk with a session: send a turn, cancel it, answer an
approval, attach a terminal to it, and follow its events.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from typing import Any

import click

from .common import (
    RAW,
    SESSION,
    Exit,
    complete_sessions,
    connect,
    new_session_options,
    options_from,
    start_hint,
)
from .options import (
    SECONDS,
    client_options,
)
from .show import (
    use_color,
)
from .terminal import Screen, is_terminal


@client_options
@click.command()
@SESSION
@click.argument("text")
@new_session_options
@click.option(
    "--turn-timeout",
    type=SECONDS,
    default=None,
    help="Cancel the turn and give up after this many seconds.",
)
@click.option(
    "--turn-id",
    default=None,
    metavar="ID",
    help="The turn's id (1 to 64 characters; default: a fresh one). Sending the same id "
    "again never runs the turn twice: it joins the running turn or prints its recorded end.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print every event, then the reply, as JSON lines."
)
@RAW
@click.pass_context
def send(
    ctx: click.Context,
    session: str,
    text: str,
    session_env: tuple[str, ...],
    workspace: str | None,
    runtime: str | None,
    turn_timeout: float | None,
    turn_id: str | None,
    as_json: bool,
    raw: bool,
) -> None:
    """Send TEXT to SESSION, print its streamed output, then its reply.

    What the turn does besides (queued, tools, retries) shows on stderr. An
    approval request is asked at the terminal (once, session, deny); without
    one, send says how to answer (hermes-sup approve) and exits 1 if nobody
    did in time. Ctrl-C cancels the turn (never the session) and exits 130.

    Options for a new session (--session-env, --workspace, --runtime) apply
    when its worker starts; a running session with other options refuses.

    \b
    Examples:
      hermes-sup send alice 'setenv COLOR blue'
      hermes-sup send alice 'sh echo $COLOR; pwd'
      hermes-sup send alice 'ask touch x'          # asks you to approve
      hermes-sup send bob --workspace /srv/projects/acme 'sh ls'
      hermes-sup send alice --turn-id order-42 'sh ./place-order'   # safe to retry
    """
    if turn_id is not None and not 0 < len(turn_id) <= 64:
        raise click.BadParameter("must be 1 to 64 characters", param_hint="--turn-id")
    from .send import Sender

    options = options_from(session_env, workspace, runtime)
    body: dict[str, Any] = {"text": text}
    if options:
        body["options"] = options
    # Sent while the supervisor starts, a turn waits for it (within its timeout).
    with connect(ctx, wait_start=turn_timeout) as client:
        code = Sender(
            client=client,
            key=session,
            body=body,
            screen=Screen(raw),
            interactive=is_terminal(sys.stdin) and not as_json,
            as_json=as_json,
            turn_timeout=turn_timeout,
            hint_prefix=start_hint(ctx),
            turn_id=turn_id,
        ).run()
    sys.exit(code)


@click.group()
def turn() -> None:
    """What became of a turn, by its id (hermes-sup send --turn-id)."""


@client_options
@turn.command(name="status")
@SESSION
@click.argument("turn_id", metavar="TURN")
@click.option("--json", "as_json", is_flag=True, help="Print every field as JSON.")
@click.pass_context
def turn_status(ctx: click.Context, session: str, turn_id: str, as_json: bool) -> None:
    """Say what became of turn TURN of SESSION: queued, running (and on
    which node), ended (with its reply or error), interrupted (it started
    and its supervisor stopped before it ended: it will not run again), or
    unknown (it never started: sending it again runs it once).

    Exits 0 if the turn ended with a reply, 5 while it is queued or running,
    4 if it is unknown, 1 otherwise.

    \b
    Examples:
      hermes-sup turn status alice order-42
    """
    with connect(ctx) as client:
        state = client.turn_status(session, turn_id)
    if as_json:
        click.echo(json.dumps(state, indent=2))
    else:
        click.echo(turn_line(session, state))
    outcome = state.get("outcome") or {}
    if state["state"] == "ended" and outcome.get("kind") == "reply":
        sys.exit(Exit.OK)
    sys.exit(
        {"queued": Exit.PENDING, "running": Exit.PENDING, "unknown": Exit.UNKNOWN}.get(
            state["state"], Exit.ERROR
        )
    )


def turn_line(session: str, state: dict[str, Any]) -> str:
    """One line for a turn's state."""
    head = f"{session}: turn {state['turn']} {state['state']}"
    node = f" on node {state['node']}" if state.get("node") else ""
    if state["state"] in ("queued", "running"):
        return head + node
    if state["state"] == "unknown":
        since = state.get("since")
        older = (
            f" (turns before {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))} "
            "are no longer recorded)"
            if since
            else ""
        )
        return head + ": it never started here; sending it again runs it once" + older
    outcome = state.get("outcome") or {}
    body = outcome.get("body")
    if state["state"] == "interrupted":
        return head + node + ": it started and its supervisor stopped before it ended"
    if body is None:
        return head + node + f": its answer ({outcome.get('size')} bytes) was not kept"
    if outcome.get("kind") == "reply":
        return head + node + f": reply {str(body.get('text', ''))[:200]!r}"
    return head + node + f": {body.get('code')}: {body.get('message')}"


@client_options
@click.command()
@SESSION
@click.option("--turn", default=None, help="Cancel this queued turn (its send id) instead.")
@click.pass_context
def cancel(ctx: click.Context, session: str, turn: str | None) -> None:
    """Cancel SESSION's running turn (the session keeps running).

    The turn's own client gets its end (a reply or an error) as usual.

    \b
    Examples:
      hermes-sup cancel alice
    """
    with connect(ctx) as client:
        cancelled = client.cancel(session, turn)
    if cancelled is None:
        raise click.ClickException(
            f"session {session!r} has no "
            + ("such queued turn" if turn else "running turn")
            + " to cancel"
        )
    click.echo(f"{session}: cancelled turn {cancelled}")


@client_options
@click.command()
@SESSION
@click.argument("choice", type=click.Choice(["once", "session", "always", "deny"]))
@click.option(
    "--id",
    "approval",
    default=None,
    help="Answer only this request (the id send and attach show), never a later one.",
)
@click.pass_context
def approve(ctx: click.Context, session: str, choice: str, approval: str | None) -> None:
    """Answer SESSION's waiting approval request: once, session, always or deny.

    Without --id it answers the oldest request waiting.

    \b
    Examples:
      hermes-sup approve alice once
      hermes-sup approve alice deny --id probe-3
    """
    with connect(ctx) as client:
        answered = client.approve(session, choice, approval=approval)
    click.echo(f"{session}: answered {answered}")


@client_options
@click.command()
@click.argument("session", required=False, shell_complete=complete_sessions)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@click.option("--replay", default=0, show_default=True, help="Recent events to show first.")
@RAW
@click.pass_context
def events(ctx: click.Context, session: str | None, as_json: bool, replay: int, raw: bool) -> None:
    """Print the live events of SESSION, or of every session, until Ctrl-C:
    state changes, turns from any client, what they stream, their ends.

    \b
    Examples:
      hermes-sup events
      hermes-sup events alice --json
    """
    from .send import event_json
    from .tool_lines import one_line as short

    screen = Screen(raw)
    with connect(ctx) as client:
        stream = client.watch(session, replay=max(0, replay))
        try:
            for event in stream:
                if as_json:
                    item = event_json(event)
                    if event.type == "state":
                        del item["turn"]  # a change of state belongs to no turn
                    item["time"] = time.time()
                    click.echo(json.dumps(item, default=str), color=True)
                    continue
                data = event.data
                if event.type == "state" and isinstance(data, dict):
                    text = f"{data.get('previous')} -> {data.get('state')}"
                    if data.get("reason"):
                        text += f" ({data['reason']})"
                elif event.type in ("output", "token") and isinstance(data, str):
                    text = data
                else:
                    text = short(data, 200)
                stamp = time.strftime("%H:%M:%S")
                screen.out(f"{stamp} {event.session or '-'} {event.type} {text}")
        except KeyboardInterrupt:
            pass
        finally:
            stream.close()


@client_options
@click.command()
@SESSION
@click.option(
    "--read-only", is_flag=True, help="Only watch: nothing typed is sent, Ctrl-C detaches."
)
@click.option("--create", is_flag=True, help="Start SESSION if it does not exist yet.")
@click.option("--replay", default=50, show_default=True, help="Recent events to show first.")
@RAW
@click.pass_context
def attach(
    ctx: click.Context, session: str, read_only: bool, create: bool, replay: int, raw: bool
) -> None:
    """Watch SESSION live and talk to it, like tmux attach.

    Shows the session's recent events, then everything it produces, including
    turns sent by other clients. Each line you type is sent as a turn. A key
    the supervisor does not know is refused unless --create.

    \b
    Keys:
      Ctrl-D      detach (the session keeps running); Ctrl-] then Enter too
      Ctrl-C      cancel the running turn (never the session); read-only: detach
      /approve once|session|always, /deny   answer an approval request

    \b
    Examples:
      hermes-sup attach alice
      hermes-sup attach alice --read-only
      hermes-sup attach tg:42 --create
      hermes-sup attach alice --connection web-eu.json
    """
    from .attach import Attached

    if create and read_only:
        raise click.UsageError("--create starts a session; a --read-only attach changes nothing")
    key = session
    with connect(ctx) as client:
        # Also fails now, with a clear message, if the supervisor is not there.
        known = any(r["key"] == key for r in client.sessions(prefix=key))
        if not known:
            if not create:
                raise click.ClickException(
                    f"no session {key!r} (`{start_hint(ctx)} list` shows them); "
                    f"to start it, use: {start_hint(ctx)} attach --create {shlex.quote(key)}"
                )
            client.open(key)
        code = Attached(client, key, read_only, use_color(ctx), Screen(raw)).run(replay)
    sys.exit(code)
