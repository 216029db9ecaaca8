"""The supervisor's log lines: secrets are masked."""

from __future__ import annotations


def test_log_lines_mask_secrets() -> None:
    from hermes_sup.local.logfmt import kv

    line = kv(
        "spawned",
        session="alice",
        api_key="sk-abcdef1234567890",
        note="uses sk-live1234567890xyz",
        token="t0ps3cret",
        pid=42,
    )
    assert "abcdef1234567890" not in line and "live1234567890xyz" not in line
    assert "t0ps3cret" not in line
    assert "session=alice" in line and "pid=42" in line and "api_key=[redacted]" in line
