"""The example web page (examples/web: static files only) in a real
headless Chromium driven by Playwright, served by the HTTP endpoint itself
(`hermes-sup http --web`) and talking to it with fetch and SSE: two tabs
chat with two sessions, replies stream, approvals are answered with a
click, Stop cancels, a wrong key shows the endpoint's error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hermes_sup.httpapi.keys import KeyStore
from tests.test_http import wait_ready

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WEB = Path(__file__).resolve().parent.parent / "examples" / "web"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("HSUP_REQUIRE_ALL"),
    reason="Chromium is not installed (make browser installs Debian's)",
)


@pytest.fixture
def web(supervisor, workdir):
    """The endpoint in front of `supervisor`, serving examples/web at /:
    (its URL, a key, the namespace of that key's sessions)."""
    front = workdir / "front"
    keys = KeyStore(front)
    key = keys.generate("web")
    log_path = workdir / "web.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_sup.cli", "--state-dir", str(supervisor.state_dir),
             "http", "--listen", "127.0.0.1:0", "--data-dir", str(front), "--web", str(WEB)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield wait_ready(log_path, proc) + "/", key, keys.tenant("web").prefix
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left behind, even hung
            proc.wait()


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
    bubble.locator("xpath=self::*[@data-done]").wait_for(timeout=30_000)
    return bubble


def answer(page, text: str, choice: str):
    """Send a turn that asks for approval, click `choice`, and return its
    reply bubble once it is done."""
    prompts = page.locator("[data-testid=approval]")
    before = prompts.count()
    page.fill("#text", text)
    page.click("#send")
    prompt = prompts.nth(before)  # this turn's, not an earlier one
    prompt.wait_for(timeout=30_000)
    assert text.removeprefix("ask ") in prompt.inner_text()
    prompt.locator(f"button[data-choice={choice}]").click()
    done = page.locator(".agent").last
    done.locator("xpath=self::*[@data-done]").wait_for(timeout=30_000)
    return done


def test_two_tabs_chat_with_two_sessions_streaming_and_approving(
    web, browser, supervisor, workdir
) -> None:
    url, key, prefix = web
    # The page is static files, served without a key, locked to its own origin.
    with urllib.request.urlopen(url, timeout=10) as page:
        assert page.status == 200
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    context = browser.new_context()
    tab_a, tab_b = context.new_page(), context.new_page()
    for tab in (tab_a, tab_b):
        tab.goto(url)
        tab.fill("#key", key)  # pasted by the person using the page
    key_a, key_b = session_of(tab_a), session_of(tab_b)
    assert key_a.startswith("web:") and key_b.startswith("web:") and key_a != key_b

    # Streaming: the reply arrives as several deltas, in order (five words,
    # 20 ms apart; a worker may merge two that come closer under load).
    bubble = say(tab_a, "stream one two three four five")
    assert bubble.get_attribute("data-done") == "reply"
    assert 2 <= int(bubble.get_attribute("data-tokens") or 0) <= 5
    assert bubble.locator(".text").inner_text() == "one two three four five"

    # Each tab is its own session, in its own process, with its own values.
    # The page's session ids are the key's: sessions in its namespace.
    key_a, key_b = prefix + key_a, prefix + key_b
    assert say(tab_b, "env HERMES_SESSION_KEY").locator(".text").inner_text() == key_b
    assert say(tab_a, "env HERMES_SESSION_KEY").locator(".text").inner_text() == key_a
    pid_a = say(tab_a, "pid").locator(".text").inner_text()
    pid_b = say(tab_b, "pid").locator(".text").inner_text()
    assert pid_a.isdigit() and pid_b.isdigit() and pid_a != pid_b

    # An approval shows as buttons; a click answers it: allowed, the command
    # runs; denied, it does not.
    allowed = answer(tab_b, "ask touch approved-in-the-browser", "once")
    assert allowed.locator(".text").inner_text() == "exit 0"
    denied = answer(tab_b, "ask touch denied-in-the-browser", "deny")
    assert denied.locator(".text").inner_text() == "denied: touch denied-in-the-browser"
    with supervisor.client() as client:
        workspace = Path(client.inspect(key_b)["workspace"])
    assert (workspace / "approved-in-the-browser").exists()
    assert not (workspace / "denied-in-the-browser").exists()

    # Stop cancels a running turn.
    tab_a.fill("#text", "sleep 60")
    tab_a.click("#send")
    tab_a.locator(".agent").last.locator("button.stop").click()
    stopped = tab_a.locator(".agent").last
    stopped.locator("xpath=self::*[@data-done]").wait_for(timeout=30_000)
    assert stopped.get_attribute("data-done") == "cancelled"

    # A wrong key shows the endpoint's error, naming its code.
    tab_a.fill("#key", "hsk-wrong")
    bubble = say(tab_a, "pid")
    assert bubble.get_attribute("data-done") == "error"
    assert "[invalid_api_key]" in bubble.inner_text()
    shots = Path(os.environ.get("HSUP_SCREENSHOT_DIR") or workdir)
    tab_b.screenshot(path=str(shots / "web.png"))

    with supervisor.client() as client:
        rows = {row["key"]: row for row in client.sessions()}
    assert set(rows) == {key_a, key_b}
    context.close()
