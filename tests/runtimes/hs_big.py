"""A runtime whose answers can be as large as asked: `reply N` answers N
characters, `event N` streams one `output` event of N characters and then
answers `done`, `pid` answers its pid; anything else is echoed."""

import os


class Big:
    def __init__(self, session):
        self.session = session

    def run_turn(self, text, emit):
        command, _, arg = text.partition(" ")
        if command == "reply":
            return "r" * int(arg)
        if command == "event":
            emit("output", "e" * int(arg))
            emit("output", "small")
            return "done"
        if command == "pid":
            return str(os.getpid())
        return text


def make(session):
    return Big(session)
