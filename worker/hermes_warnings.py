"""Warnings Hermes prints wrongly under the supervisor, kept from the
worker log; each one's own docstring says why it is wrong here.
"""

from __future__ import annotations

import os
from typing import Any


def quiet_own_terminal_cwd() -> None:
    """Keep Hermes from calling the supervisor's TERMINAL_CWD deprecated.

    At import, gateway.run warns (in colour, on stderr: the top of every
    worker log) that "TERMINAL_CWD found in .env is deprecated" whenever
    the variable is set and config.yaml names no terminal cwd: it takes any
    TERMINAL_CWD for one a user left in HERMES_HOME/.env. Ours is the
    supervisor's (the session's workspace, supervisor/environment.py), and
    there is no such .env. So the check runs with TERMINAL_CWD hidden while
    it still holds the value it has now, before .env is loaded; one that
    the session's .env changed is warned about as before. Call before
    gateway.run is imported, with the session's environment in place."""
    import functools

    import hermes_cli.config as config

    check = config.warn_deprecated_cwd_env_vars
    if hasattr(check, "__wrapped__"):
        return  # wrapped already (the sealed zygote's, inherited)
    ours = os.environ.get("TERMINAL_CWD")

    @functools.wraps(check)
    def without_ours(*args: Any, **kwargs: Any) -> Any:
        if ours is None or os.environ.get("TERMINAL_CWD") != ours:
            return check(*args, **kwargs)
        del os.environ["TERMINAL_CWD"]
        try:
            return check(*args, **kwargs)
        finally:
            os.environ["TERMINAL_CWD"] = ours

    config.warn_deprecated_cwd_env_vars = without_ours
