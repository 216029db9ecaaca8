"""A turn's chat identity, set in the worker's own os.environ.

A worker serves one session, so its os.environ is that session's alone:
setting the chat's HERMES_SESSION_<NAME> there before a turn gives them to
every tool, thread and child process of the turn, and to those that outlive
it (a background process, its completion watcher). The values a session was
opened with (its `session_env` option, an operator's decision) are fixed:
a turn fills only the names that were not set at the worker's start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hermes_sup.protocol.chat_identity import (
    CHAT_IDENTITY_NAMES,
    ENV_PREFIX,
    check_chat_identity,
)

log = logging.getLogger("hermes_sup.worker.identity")


def fixed_identity(environ: Mapping[str, str]) -> frozenset[str]:
    """The identity variables the session was started with (not a turn's to change)."""
    names = {ENV_PREFIX + name.upper() for name in CHAT_IDENTITY_NAMES}
    return frozenset(name for name in names if environ.get(name))


def apply_chat_identity(context: dict[str, Any] | None, fixed: frozenset[str]) -> None:
    """Set the turn's `session_env` (chat identity) in os.environ; an empty
    value unsets its name. A bad map raises ChatIdentityError (the turn fails
    with its message), before anything is set."""
    if not context or "session_env" not in context:
        return
    identity = check_chat_identity(context["session_env"], "context session_env")
    for name, value in identity.items():
        var = ENV_PREFIX + name.upper()
        if var in fixed:
            if os.environ.get(var) != value:
                log.info("kept the session's own %s over the turn's", var)
            continue
        if value:
            os.environ[var] = value
        else:
            os.environ.pop(var, None)
