"""A runtime whose start depends on the session key: keys with "slow" in
them take half a second to start, keys with "bad" cannot start (after the
half second, if both). Its turns echo, and `sleep SECONDS` sleeps until
cancelled."""

import threading
import time


class Picky:
    def __init__(self):
        self.cancelled = threading.Event()

    def run_turn(self, text, emit):
        command, _, arg = text.partition(" ")
        if command == "sleep":
            return "cancelled" if self.cancelled.wait(float(arg)) else "slept"
        return text

    def cancel(self):
        self.cancelled.set()


def make(session):
    if "slow" in session.key:
        time.sleep(0.5)
    if "bad" in session.key:
        raise RuntimeError("this runtime refuses keys with 'bad' in them")
    return Picky()
