"""A runtime whose start depends on the session key: keys starting "slow"
take half a second to start, keys starting "bad" cannot start. Its turns
echo, and `sleep SECONDS` sleeps until cancelled."""

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
    if session.key.startswith("bad"):
        raise RuntimeError("this runtime refuses keys that start with 'bad'")
    if session.key.startswith("slow"):
        time.sleep(0.5)
    return Picky()
