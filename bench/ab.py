"""Same-run A/B of two installs of hermes-sup: alternate them, so the noise
of a shared machine falls on both alike.

    # B: a second checkout installed in its own venv, e.g.
    git worktree add /tmp/before <commit> && python3 -m venv /tmp/bv \\
        && /tmp/bv/bin/pip install -e /tmp/before
    .venv/bin/python bench/ab.py /tmp/bv/bin/python --rounds 3

Each round runs `ab.py --once` under this interpreter, then under the other:
200 spawns and 1,000 round trips with 1 and with 64 sessions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def once() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).parent))
    import run as b

    sup = b.Sup()
    try:
        spawn = b.summary(b.spawn_hermes_sup(sup, 200, "sp"))["p50_ms"]
        one = b.routed(sup, 1, 1000, 256)
        many = b.routed(sup, 64, 1000, 256)
    finally:
        sup.close()
    return {
        "spawn_p50_ms": spawn,
        "rtt1_p50_ms": one["latency"]["p50_ms"],
        "throughput1": one["throughput_per_s"],
        "rtt64_p50_ms": many["latency"]["p50_ms"],
        "throughput64": many["throughput_per_s"],
        "sup_cpu_us1": one["cpu_us_per_message"]["router"],
        "worker_cpu_us1": one["cpu_us_per_message"]["workers"],
        "client_cpu_us1": one["cpu_us_per_message"]["client"],
        "sup_cpu_us64": many["cpu_us_per_message"]["router"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("other", nargs="?", help="the python of the other install")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(once()))
        return
    if not args.other:
        parser.error("name the other install's python")
    for _ in range(args.rounds):
        for label, python in (("this", sys.executable), ("other", args.other)):
            out = subprocess.run(
                [python, __file__, "--once"], capture_output=True, text=True, check=True
            )
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            print(label, " ".join(f"{k}={v:.2f}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
