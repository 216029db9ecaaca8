"""A runtime whose turn holds the GIL for minutes (catastrophic regex
backtracking runs in C without releasing it), so the worker's main loop
cannot heartbeat: a real hang, not a stopped process."""

import re


class GilHog:
    def __init__(self, session):
        self.session = session

    def run_turn(self, text, emit):
        if text == "hang":
            re.match(r"(a+)+$", "a" * 64 + "b")
        return text


def make(session):
    return GilHog(session)
