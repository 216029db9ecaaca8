"""A runtime whose every answer carries terminal control sequences (a window
title, an OSC 52 clipboard write, a screen clear, a C1 CSI), in its log, its
output and streamed events, and its reply: what a hostile or careless
program in a session can print."""

import sys

HOSTILE = "A\x1b]0;pwned\x07B\x1b]52;c;ZXZpbA==\x07C\x1b[2JD\x9b31mE"


class Controls:
    def __init__(self, session):
        self.session = session

    def run_turn(self, text, emit):
        sys.stdout.write(f"log {HOSTILE}\n")
        sys.stdout.flush()
        emit("output", f"out {HOSTILE}")
        emit("token", f"tok {HOSTILE}")
        return f" reply {HOSTILE}"


def make(session):
    return Controls(session)
