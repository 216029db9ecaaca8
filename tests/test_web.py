"""The example web front end in a real headless Chromium (driven by
Playwright): two tabs chat with two sessions, replies stream, an approval
prompt is answered with a click."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_clients import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
APP = Path(__file__).resolve().parent.parent / "examples" / "web" / "app.py"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("HSUP_REQUIRE_ALL"),
    reason="Chromium is not installed (make browser installs Debian's)",
)


@pytest.fixture
def web(supervisor, workdir):
    port = free_port()
    log = open(workdir / "web.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(APP), "--state-dir", str(supervisor.state_dir), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((workdir / "web.log").read_text()) from None
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture
def browser(workdir, monkeypatch):
    from playwright.sync_api import sync_playwright

    # The browser's profile goes under workdir, so the leak check sees Chromium too.
    monkeypatch.setenv("TMPDIR", str(workdir))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()


def session_of(page) -> str:
    return page.locator("#session").inner_text()


def say(page, text: str):
    """Type a message, send it, and return its reply bubble once it is done."""
    page.fill("#text", text)
    page.click("#send")
    bubble = page.locator(".agent").last
    bubble.locator("xpath=self::*[@data-done]").wait_for(timeout=20_000)
    return bubble


def test_two_tabs_chat_with_two_sessions_streaming_and_approving(
    web, browser, supervisor, workdir
) -> None:
    context = browser.new_context()
    tab_a, tab_b = context.new_page(), context.new_page()
    tab_a.goto(web)
    tab_b.goto(web)
    key_a, key_b = session_of(tab_a), session_of(tab_b)
    assert key_a.startswith("web:") and key_b.startswith("web:") and key_a != key_b

    # Streaming: the reply arrives as several tokens, in order.
    bubble = say(tab_a, "stream one two three four five")
    assert bubble.get_attribute("data-done") == "reply"
    assert int(bubble.get_attribute("data-tokens") or 0) == 5
    assert bubble.locator(".text").inner_text() == "one two three four five"

    # Each tab is its own session, in its own process, with its own values.
    assert say(tab_b, "env HERMES_SESSION_KEY").locator(".text").inner_text() == key_b
    assert say(tab_a, "env HERMES_SESSION_CHAT_ID").locator(".text").inner_text() == key_a
    pid_a = say(tab_a, "pid").locator(".text").inner_text()
    pid_b = say(tab_b, "pid").locator(".text").inner_text()
    assert pid_a.isdigit() and pid_b.isdigit() and pid_a != pid_b

    # An approval shows as buttons; a click answers it and the command runs.
    tab_b.fill("#text", "ask echo approved-in-the-browser")
    tab_b.click("#send")
    prompt = tab_b.locator("[data-testid=approval]").last
    prompt.wait_for(timeout=20_000)
    assert "echo approved-in-the-browser" in prompt.inner_text()
    prompt.locator("button[data-choice=once]").click()
    done = tab_b.locator(".agent").last
    done.locator("xpath=self::*[@data-done]").wait_for(timeout=20_000)
    assert done.locator("pre.output").inner_text() == "approved-in-the-browser"
    assert done.locator(".text").inner_text() == "exit 0"

    # A refusal from the supervisor shows as an error naming its code.
    tab_a.evaluate("sessionStorage.setItem('hermes-sup-session', '../bad')")
    tab_a.reload()
    bubble = say(tab_a, "pid")
    assert (
        bubble.get_attribute("data-done") == "error" and "[bad_session_key]" in bubble.inner_text()
    )
    shots = Path(os.environ.get("HSUP_SCREENSHOT_DIR") or workdir)
    tab_b.screenshot(path=str(shots / "web.png"))

    with supervisor.client() as client:
        rows = {row["key"]: row for row in client.sessions()}
    assert set(rows) == {key_a, key_b}
    context.close()
