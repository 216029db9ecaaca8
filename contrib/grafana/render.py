"""Draw docs/img/dashboard.png: four of the Grafana dashboard's panels,
computed from a real supervisor's /metrics scraped while a mixed load runs.

This is not a Grafana screenshot: the series are the dashboard's queries
(sessions by state, turns a second by outcome, turn duration p50/p95 from
the histogram's buckets, spawns and exits a second) evaluated here on
scrapes taken every second, and drawn with matplotlib in the dashboard's
layout. Run from the checkout, in the venv with the metrics and docs extras:

    python contrib/grafana/render.py [--seconds 90] [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from hermes_sup.client import Client, SupervisorError

Sample = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(text: str) -> Sample:
    """Prometheus' text format -> {(name, labels): value}; comments skipped."""
    out: Sample = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = []
        for part in rest.rstrip("}").split('",') if rest else []:
            key, _, val = part.partition("=")
            labels.append((key, val.strip('"')))
        out[(name, frozenset(labels))] = float(value)
    return out


def load(state: Path, stop: threading.Event, seed: int) -> None:
    """One client's mixed traffic: quick and slow turns, now and then a kill."""
    rng = random.Random(seed)
    with Client(str(state)) as hs:
        while not stop.is_set():
            key = f"user{rng.randrange(24)}"
            try:
                if rng.random() < 0.04:
                    hs.kill(key)
                else:
                    text = rng.choice(
                        ["pid", "sh echo hi", "sleep 0.3", "sleep 1.5", "stream a b c"]
                    )
                    hs.run(key, text)
            except SupervisorError:
                pass
            stop.wait(rng.uniform(0.05, 0.4))


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over (le, count increase) pairs, as Prometheus does."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


def main() -> None:
    """Run the supervisor and the load, scrape, draw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hsup-render-"))
    state, data, port = root / "state", root / "data", free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "hermes_sup.cli", "serve", "--state-dir", str(state),
         "--data-dir", str(data), "--metrics", str(port), "--max-sessions", "16"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[tuple[float, Sample]] = []
    stop = threading.Event()
    clients: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # Clients join one by one over the first third, so the load rises.
        clients = [threading.Thread(target=load, args=(state, stop, n)) for n in range(6)]
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            joined = int((time.monotonic() - start) / (args.seconds / 3) * len(clients)) + 1
            for thread in clients[:joined]:
                if not thread.is_alive() and thread.ident is None:
                    thread.start()
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            scrapes.append((time.monotonic() - start, parse(text)))
            time.sleep(1.0)
    finally:
        stop.set()
        for thread in clients:
            if thread.ident is not None:
                thread.join(30)
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    draw(scrapes, args.out)
    print(f"{args.out}: {len(scrapes)} scrapes over {args.seconds:.0f} s")


def draw(scrapes: list[tuple[float, Sample]], out: Path) -> None:
    """The four panels, in the dashboard's dark theme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10  # scrapes: a rate over the last 10 s, as rate(...[10s])
    times = [t for t, _ in scrapes]
    states: dict[str, list[float]] = defaultdict(list)
    outcomes: dict[str, list[float]] = defaultdict(list)
    exits: dict[str, list[float]] = defaultdict(list)
    spawns, p50, p95, rt = [], [], [], []
    for i, (_, now) in enumerate(scrapes):
        then = scrapes[max(0, i - window)][1]
        span = max(scrapes[i][0] - scrapes[max(0, i - window)][0], 1e-9)
        for (name, labels), value in now.items():
            d = dict(labels)
            if name == "hermes_sup_sessions":
                states[d["state"]].append(value)
        for (name, labels), value in now.items():
            d = dict(labels)
            rate = (value - then.get((name, labels), 0.0)) / span
            if name == "hermes_sup_turns_total":
                outcomes[d["outcome"]] += [0.0] * (i - len(outcomes[d["outcome"]])) + [rate]
            if name == "hermes_sup_exits_total":
                exits[d["reason"]] += [0.0] * (i - len(exits[d["reason"]])) + [rate]
        spawns.append(
            (now.get(("hermes_sup_spawns_total", frozenset()), 0.0)
             - then.get(("hermes_sup_spawns_total", frozenset()), 0.0)) / span
        )  # fmt: skip
        buckets = [
            (float(dict(labels)["le"]), value - then.get((name, labels), 0.0))
            for (name, labels), value in now.items()
            if name == "hermes_sup_turn_seconds_bucket"
        ]
        p50.append(quantile(0.5, buckets))
        p95.append(quantile(0.95, buckets))
        rt.append(times[i])
    for series in (outcomes, exits):
        for key in series:
            series[key] += [0.0] * (len(times) - len(series[key]))
    plt.style.use("dark_background")
    fig, axes = plt.subplots(2, 2, figsize=(12, 6.5), dpi=100)
    fig.patch.set_facecolor("#111217")
    panels = [
        (axes[0][0], "Sessions by state", "sessions"),
        (axes[0][1], "Turns by outcome", "turns/s"),
        (axes[1][0], "Turn duration", "seconds"),
        (axes[1][1], "Spawns and exits", "workers/s"),
    ]
    for ax, title, unit in panels:
        ax.set_facecolor("#181b1f")
        ax.set_title(title, loc="left", fontsize=11, color="#ccccdc")
        ax.set_ylabel(unit, fontsize=8, color="#8e8e9e")
        ax.tick_params(labelsize=8, colors="#8e8e9e")
        ax.grid(color="#2c3235", linewidth=0.6)
        for side in ax.spines.values():
            side.set_color("#2c3235")
    order = ["busy", "idle", "starting", "stopping", "exited", "backoff", "failed"]
    shown = [s for s in order if any(states.get(s, []))]
    axes[0][0].stackplot(times, *[states[s] for s in shown], labels=shown, alpha=0.7)
    axes[0][1].stackplot(times, *outcomes.values(), labels=list(outcomes), alpha=0.7)
    axes[1][0].plot(rt, [v if v is not None else float("nan") for v in p50], label="p50")
    axes[1][0].plot(rt, [v if v is not None else float("nan") for v in p95], label="p95")
    axes[1][1].plot(times, spawns, label="spawned")
    for reason, values in exits.items():
        axes[1][1].plot(times, values, label=f"exit: {reason}")
    for ax, _, _ in panels:
        ax.legend(fontsize=7, loc="upper left", frameon=False)
        ax.set_xlabel("seconds into the run", fontsize=8, color="#8e8e9e")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor=fig.get_facecolor())


if __name__ == "__main__":
    main()
