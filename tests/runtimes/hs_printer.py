"""A runtime that writes to its own stdout (the session log), and can die
right after, to prove no line is lost."""

import os
import signal
import sys


class Printer:
    def __init__(self, session):
        self.session = session

    def run_turn(self, text, emit):
        command, _, arg = text.partition(" ")
        if command in ("print", "print-and-die"):
            n = int(arg)
            for i in range(n):
                sys.stdout.write(f"line {i:06d} of {n}\n")
            sys.stdout.flush()
            if command == "print-and-die":
                os.kill(os.getpid(), signal.SIGKILL)
            return f"printed {n}"
        return text


def make(session):
    return Printer(session)
