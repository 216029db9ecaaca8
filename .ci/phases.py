"""Times the phases of a `make --trace` run, read from its output on stdin.

Every line is passed through as it comes. make's trace names each target
as it starts updating it ("Makefile:92: update target 'lint' due to: ...");
pytest-xdist says when its workers have collected the suite ("2 workers
[976 items]"), which ends collection and starts the tests. At the end, one
line per phase with how long it took: where a slow CI run spent its time.
"""

from __future__ import annotations

import re
import sys
import time

TARGET = re.compile(rb"^\S+:\d+: (?:update )?target '([^']+)'")
COLLECTED = re.compile(rb"^\d+ workers \[\d+ items?\]")


def main() -> None:
    """Pass stdin through; print each phase's time when it ends."""
    started = last = time.monotonic()
    phase = "start"
    phases: list[tuple[str, float]] = []
    out = sys.stdout.buffer

    def begin(name: str) -> None:
        nonlocal phase, last
        now = time.monotonic()
        phases.append((phase, now - last))
        phase, last = name, now

    for line in sys.stdin.buffer:
        out.write(line)
        out.flush()
        target = TARGET.match(line)
        if target is not None:
            begin(target.group(1).decode(errors="replace"))
        elif COLLECTED.match(line):
            # The `test` target's own recipe is the suite: until its workers
            # have collected, it was collecting.
            phase = "test: collection"
            begin("test: tests")
    begin("end")
    print("phases (seconds):")
    for name, seconds in phases:
        if seconds >= 0.05:
            print(f"  {name:<28} {seconds:8.1f}")
    print(f"  {'total':<28} {time.monotonic() - started:8.1f}")


if __name__ == "__main__":
    main()
