"""The soak's report: turns by outcome, the faults caused, the
supervisor's RSS and fds over time (and their slope over the second half
of the load), its warnings; the summary printed and the plot drawn.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine, pct
from bench.soak_faults import CONFIGS
from bench.soak_load import Soak, TurnRecord
from hermes_sup.supervisor.turns import DEDUP_ENTRIES


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return 0.0
    return 60 * sum((t - mx) * (v - my) for t, v in points) / den


def log_summary(path: Path) -> dict[str, Any]:
    """Counts of the supervisor's warning and error lines by event name."""
    counts: Counter[str] = Counter()
    tracebacks = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split(" ", 5)
        if len(parts) >= 5 and parts[2] in ("WARNING", "ERROR", "CRITICAL"):
            counts[f"{parts[2]} {parts[4]}"] += 1
        if line.startswith("Traceback"):
            tracebacks += 1
    return {"by_event": dict(counts.most_common()), "tracebacks": tracebacks}


def report(soak: Soak, args: argparse.Namespace, log: dict[str, Any]) -> dict[str, Any]:
    """The figures: turns by outcome, faults caused, RSS and fds over time."""
    turns = soak.turns
    for rec in turns:  # a closed client's turn counts as ended once the watcher saw its final
        if rec.outcome == "disconnected" and rec.id in soak.finals:
            rec.code = soak.finals[rec.id]
    disconnected = [r for r in turns if r.outcome == "disconnected"]
    unconfirmed = [r for r in disconnected if r.id not in soak.finals]
    ran = [r for r in turns if r.ran and r.outcome in ("reply", "error")]
    seen = sum(1 for r in ran if r.id in soak.finals)
    lost = [r for r in turns if r.outcome == "lost"] + unconfirmed
    errors = Counter(r.code for r in turns if r.outcome == "error")
    load_s = args.minutes * 60
    in_load = [s for s in soak.samples if s["t"] <= load_s]
    half = [s for s in in_load if s["t"] >= load_s / 2]
    rss_slope = slope_per_minute([(s["t"], s["rss_kib"]) for s in half])
    fd_slope = slope_per_minute([(s["t"], s["fds"]) for s in half])
    first, last = soak.samples[0], soak.samples[-1]
    cpu_s = last["cpu_s"] - first["cpu_s"]
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "args": vars(args),
        "configs": CONFIGS,
        "summary": {
            "turns_sent": len(turns),
            "replied": sum(1 for r in turns if r.outcome == "reply"),
            "failed_with_reason": sum(errors.values()),
            "failed_by_code": dict(errors.most_common()),
            "client_errors": dict(Counter(r.code for r in turns if r.outcome == "client_error")),
            "disconnected": len(disconnected),
            "disconnected_final_seen": len(disconnected) - len(unconfirmed),
            "disconnected_final_by_code": dict(
                Counter(r.code for r in disconnected if r.id in soak.finals)
            ),
            "lost": len(lost),
            "watch_saw_finals_of_started_turns": f"{seen}/{len(ran)}",
            "watch_error": soak.watch_error,
            "drained_after_load_s": round(soak.drained_at - load_s, 1),
            # The supervisor remembers the last DEDUP_ENTRIES sends for
            # resends: its memory grows until then, so the slope below says
            # whether it is flat only once that many were sent before the
            # second half began.
            "sends_before_second_half": sum(1 for r in turns if r.sent < load_s / 2),
            "resend_cache_entries": DEDUP_ENTRIES,
            "by_kind": {
                kind: dict(Counter(r.outcome if r.outcome != "error" else r.code for r in rows))
                for kind, rows in sorted(_group(turns).items())
            },
            "reply_seconds_p50_p99_by_kind": {
                kind: [round(pct(d, 50), 2), round(pct(d, 99), 2)]
                for kind, rows in sorted(_group(turns).items())
                if (d := [r.ended - r.sent for r in rows if r.outcome == "reply" and r.ended])
            },
            "faults": dict(Counter(c.what for c in soak.chaos)),
            "sigkills_done": sum(
                1 for c in soak.chaos if c.what == "sigkill" and c.result.startswith("pid")
            ),
            "supervisor": {
                "rss_mib_start": first["rss_kib"] / 1024,
                "rss_mib_max": max(s["rss_kib"] for s in soak.samples) / 1024,
                "rss_mib_end": last["rss_kib"] / 1024,
                "rss_slope_kib_per_min_second_half": round(rss_slope, 1),
                "fds_start": first["fds"],
                "fds_max": max(s["fds"] for s in soak.samples),
                "fds_end": last["fds"],
                "fds_slope_per_min_second_half": round(fd_slope, 2),
                "threads_max": max(s["threads"] for s in soak.samples),
                "cpu_percent_of_one_core": round(
                    100 * cpu_s / max(1e-9, last["t"] - first["t"]), 1
                ),
            },
        },
        "lost_turns": [asdict(r) for r in lost],
        "supervisor_log": log,
        "chaos": [asdict(c) for c in soak.chaos],
        "samples": soak.samples,
        "turns": [asdict(r) for r in turns],
    }


def _group(turns: list[TurnRecord]) -> dict[str, list[TurnRecord]]:
    out: dict[str, list[TurnRecord]] = {}
    for rec in turns:
        out.setdefault(rec.kind, []).append(rec)
    return out


# ---------------------------------------------------------------- the plot


def plot(result: dict[str, Any], path: Path) -> str:
    """RSS and fds of the supervisor over time, with the faults marked, and
    the turns ended every 10 s by outcome. matplotlib when installed (the
    `bench` extra), else a plain SVG beside where the PNG would be."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(plot_svg(result))
        return str(svg)
    samples = result["samples"]
    load_min = result["args"]["minutes"]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(
        4, 1, figsize=(10, 9.5), sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.4, 3]}
    )
    fig.suptitle(
        f"hermes-sup soak: {result['summary']['turns_sent']} turns, "
        f"{result['summary']['lost']} lost; supervisor RSS slope over the second half "
        f"{result['summary']['supervisor']['rss_slope_kib_per_min_second_half']:+.0f} KiB/min"
    )
    ax = axes[0]
    ax.plot(t, [s["rss_kib"] / 1024 for s in samples], color="tab:blue")
    ax.set_ylabel("supervisor RSS, MiB")
    ax.set_ylim(bottom=0)
    ax = axes[1]
    ax.plot(t, [s["fds"] for s in samples], color="tab:orange", label="supervisor open fds")
    live = [s for s in samples if "sessions_live" in s]
    if live:
        ax.plot(
            [s["t"] / 60 for s in live],
            [s["sessions_live"] for s in live],
            color="tab:gray",
            linewidth=1,
            label="live sessions",
        )
    ax.set_ylabel("count")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    # The faults, one row each.
    ax = axes[2]
    rows = [
        ("sigkill", "SIGKILL", "tab:red"),
        ("kill", "kill", "tab:purple"),
        ("kill_purge", "kill --purge", "tab:brown"),
        ("reload", "reload", "tab:green"),
        ("disconnect", "client closed", "tab:gray"),
    ]
    ax.eventplot(
        [[c["t"] / 60 for c in result["chaos"] if c["what"] == what] for what, _, _ in rows],
        colors=[color for _, _, color in rows],
        lineoffsets=list(range(len(rows))),
        linelengths=0.7,
        linewidths=0.8,
    )
    ax.set_yticks(list(range(len(rows))), [label for _, label, _ in rows], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.invert_yaxis()
    ax = axes[3]
    bucket = 10.0
    n = int(max(s["t"] for s in samples) // bucket) + 1
    kinds = ("reply", "error", "disconnected", "client_error", "lost")
    counts = {k: [0] * n for k in kinds}
    for rec in result["turns"]:
        end = rec["ended"] if rec["ended"] is not None else rec["sent"]
        counts.setdefault(rec["outcome"], [0] * n)
        if rec["outcome"] in counts:
            counts[rec["outcome"]][min(n - 1, int(end // bucket))] += 1
    xs = [i * bucket / 60 for i in range(n)]
    bottom = [0] * n
    for k, color in zip(kinds, ("tab:green", "tab:red", "tab:gray", "gold", "black"), strict=True):
        ax.bar(xs, counts[k], width=bucket / 60, bottom=bottom, align="edge", color=color, label=k)
        bottom = [b + c for b, c in zip(bottom, counts[k], strict=True)]
    ax.set_ylim(0, max(bottom) * 1.3 + 1)  # room for the legend
    ax.set_ylabel("turns ended / 10 s")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    for a in axes:
        a.axvline(load_min, color="black", linestyle="--", linewidth=1)
        a.grid(alpha=0.3)
    axes[0].annotate(" load ends", (load_min, 0.05), xycoords=("data", "axes fraction"), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_svg(result: dict[str, Any]) -> str:
    """RSS and fds over time as two polylines, for a machine without matplotlib."""
    samples = result["samples"]
    width, height, pad = 800, 200, 40
    tmax = max(s["t"] for s in samples) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height}">']
    for row, (key, label, scale) in enumerate((("rss_kib", "RSS MiB", 1024), ("fds", "fds", 1))):
        values = [s[key] / scale for s in samples]
        vmax = max(values) or 1.0
        top = row * height
        points = " ".join(
            f"{pad + (s['t'] / tmax) * (width - 2 * pad):.1f},"
            f"{top + height - pad - (v / vmax) * (height - 2 * pad):.1f}"
            for s, v in zip(samples, values, strict=True)
        )
        parts.append(f'<polyline fill="none" stroke="black" points="{points}"/>')
        parts.append(f'<text x="{pad}" y="{top + 20}">{label} (max {vmax:.0f})</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def print_summary(result: dict[str, Any], plot_path: str) -> None:
    """The summary of a soak, a few lines for a person."""
    s = result["summary"]
    sup = s["supervisor"]
    print(
        f"turns sent {s['turns_sent']}: replied {s['replied']}, "
        f"failed with a reason {s['failed_with_reason']}, "
        f"client closed mid-turn {s['disconnected']} "
        f"(supervisor's final seen for {s['disconnected_final_seen']}), "
        f"client errors {sum(s['client_errors'].values())}, LOST {s['lost']}"
    )
    print(f"  failed by code: {s['failed_by_code']}")
    if s["client_errors"]:
        print(f"  client errors: {s['client_errors']}")
    print(
        f"  watcher saw the final of {s['watch_saw_finals_of_started_turns']} started turns"
        + (f"; watch ended: {s['watch_error']}" if s["watch_error"] else "")
    )
    print(f"  faults: {s['faults']} ({s['sigkills_done']} workers SIGKILLed)")
    print(f"  by kind: {json.dumps(s['by_kind'])}")
    print(f"  reply seconds p50/p99 by kind: {s['reply_seconds_p50_p99_by_kind']}")
    if s["sends_before_second_half"] < s["resend_cache_entries"]:
        print(
            f"  note: {s['sends_before_second_half']} sends before the second half, fewer than "
            f"the {s['resend_cache_entries']} the supervisor remembers for resends: its memory "
            "is still filling that cache, so the RSS slope cannot show flat yet"
        )
    print(
        f"supervisor RSS {sup['rss_mib_start']:.1f} -> max {sup['rss_mib_max']:.1f} -> "
        f"end {sup['rss_mib_end']:.1f} MiB; slope over the second half "
        f"{sup['rss_slope_kib_per_min_second_half']:+.1f} KiB/min"
    )
    print(
        f"supervisor fds {sup['fds_start']} -> max {sup['fds_max']} -> end {sup['fds_end']}; "
        f"slope over the second half {sup['fds_slope_per_min_second_half']:+.2f}/min; "
        f"threads max {sup['threads_max']}; CPU {sup['cpu_percent_of_one_core']}% of a core"
    )
    if result["supervisor_log"].get("by_event"):
        print(f"  supervisor warnings/errors: {result['supervisor_log']['by_event']}")
    if result["supervisor_log"].get("tracebacks"):
        print(f"  supervisor tracebacks: {result['supervisor_log']['tracebacks']}")
    print(f"full results: {RESULTS / 'soak.json'}; plot: {plot_path}")
