"""The page at `/` of `kvmux http` in a real browser: Debian's chromium
driven by Playwright (executable_path: nothing is downloaded), on a real
gateway, broker, worker and model. KVMUX_PAGE_SCREENSHOTS=DIR saves the
chat and the dashboard there (README's docs/images/page-*.png)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import KEY, free_tcp_port, kvmux_command, wait_healthy

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is absent: scripts/system-deps --test installs it"
)
SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
REPLY_S = 120_000  # ms: a reply on 2 busy cores


class Gateway:
    """`kvmux http` in front of a stack on one port, stopped and started
    again there (a page keeps talking to the same address)."""

    def __init__(self, stack, tmp: Path, keys: list[str]):
        args = ["--endpoint", stack.frontend, "--port", str(free_tcp_port())]
        if keys:
            (tmp / "keys").write_text("".join(f"{key}\n" for key in keys))
            args += ["--api-key-file", str(tmp / "keys")]
        self.cmd = kvmux_command("http", *args)
        self.base = f"http://127.0.0.1:{args[3]}"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_healthy(self.proc, self.base)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def get(url: str, key: str | None = None, **headers: str) -> tuple[int, dict]:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Not under `make test`'s OpenBLAS preload: Debian's chromium dies at launch with it.
        env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), env=env)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def gateway(shared_stack, tmp_path_factory):
    gateway = Gateway(shared_stack, tmp_path_factory.mktemp("page"), [])
    yield gateway
    gateway.stop()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 820})
    yield context.new_page()
    context.close()


def screenshot(page, name: str) -> None:
    where = os.environ.get("KVMUX_PAGE_SCREENSHOTS")
    if where:
        page.screenshot(path=str(Path(where) / f"page-{name}.png"))


def settings(page, **values) -> None:
    if not page.locator("#settings").evaluate("details => details.open"):
        page.click("#settings summary")
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def reply_lengths(page) -> list[int]:
    """The last reply's text length as it streams, until it ends."""
    from playwright.sync_api import expect

    body = page.locator(".message.assistant .body").last
    lengths = []
    deadline = time.monotonic() + REPLY_S / 1000
    while page.locator("#stop").is_enabled() and time.monotonic() < deadline:
        lengths.append(len(body.inner_text()))
        time.sleep(0.05)
    expect(page.locator("#stop")).to_be_disabled()
    lengths.append(len(body.inner_text()))
    return lengths


def test_the_page_is_served_with_its_files_and_no_other_script(gateway, page):
    status, _ = get(f"{gateway.base}/v1/kvmux/stats")
    assert status == 200
    response = page.goto(gateway.base)
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert page.title() == "kvmux"
    assert page.locator("#session-line").inner_text().startswith("A new chat")


def test_markdown_is_rendered_and_html_from_the_model_never_runs(gateway, page):
    reply = "\n".join(
        [
            "**Bold** and *italic*, `<b>code</b>` and a [link](https://example.com/x).",
            '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>',
            "[bad](javascript:window.pwned=3) and snake_case_name stay text.",
            "- one",
            "- two",
            "```python",
            "print('<i>hi</i>')",
            "```",
        ]
    )
    stored = [{"id": "c1", "title": "md", "session": None, "messages": [{"role": "assistant", "content": reply}]}]
    page.goto(gateway.base)
    page.evaluate(
        "c => { localStorage.setItem('kvmux.conversations', c); localStorage.setItem('kvmux.active', '\"c1\"') }",
        json.dumps(stored),
    )
    page.reload()
    body = page.locator(".message.assistant .body")
    assert body.locator("strong").inner_text() == "Bold"
    assert body.locator("em").inner_text() == "italic"
    assert body.locator("p code").first.inner_text() == "<b>code</b>"
    assert body.locator("a").count() == 1
    assert body.locator("a").get_attribute("href") == "https://example.com/x"
    assert body.locator("ul li").all_inner_texts() == ["one", "two"]
    assert body.locator("pre code").inner_text() == "print('<i>hi</i>')"
    assert body.locator("img, script, b, i").count() == 0
    assert "snake_case_name" in body.inner_text() and "<script>" in body.inner_text()
    assert page.evaluate("window.pwned") is None


def test_a_chat_streams_stops_regenerates_and_resumes_after_a_reload_and_a_gateway_restart(gateway, page):
    from playwright.sync_api import expect

    page.goto(gateway.base)
    settings(page, temperature=0, max_tokens=40)
    send(page, "Write a Python function that adds two numbers.")
    lengths = reply_lengths(page)
    assert lengths[-1] > 0 and len({n for n in lengths if n}) > 1, f"the reply did not stream: {lengths}"
    expect(page.locator("#session-id")).to_have_text(SESSION_ID)
    session = page.locator("#session-id").inner_text()
    expect(page.locator("#session-line")).to_contain_text("history tokens")
    expect(page.locator(".message.assistant pre code")).to_have_count(1)  # the model writes Markdown
    screenshot(page, "chat")

    # stop mid-way: the session survives it
    settings(page, max_tokens=400)
    send(page, "Tell me a long story about a dragon.")
    expect(page.locator(".message.assistant .body").last).not_to_be_empty(timeout=REPLY_S)
    page.click("#stop")
    expect(page.locator(".message.assistant .foot").last).to_contain_text("stopped")
    expect(page.locator("#stop")).to_be_disabled()
    settings(page, max_tokens=16)
    send(page, "Thanks.")
    assert reply_lengths(page)[-1] > 0
    assert page.locator("#session-id").inner_text() == session

    page.click("#regenerate")  # the session rewound to before "Thanks.", which goes again
    assert reply_lengths(page)[-1] > 0
    assert page.locator("#session-id").inner_text() == session  # the same session: nothing prefilled again
    shown = page.locator(".message").count()

    page.reload()
    expect(page.locator("#conversation-list .title").first).to_have_text(
        "Write a Python function that adds two numbers."
    )
    expect(page.locator(".message")).to_have_count(shown)
    assert page.locator("#session-id").inner_text() == session
    expect(page.locator("#conversation-list .meta").first).to_contain_text("tokens")

    gateway.stop()
    gateway.start()
    send(page, "One more thing.")
    assert reply_lengths(page)[-1] > 0
    assert page.locator("#session-id").inner_text() == session
    assert not page.locator("#status").inner_text()


def test_the_dashboard_counts_a_new_chat_on_a_phone_with_the_keyboard(gateway, browser):
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 375, "height": 740})
    page = context.new_page()
    try:
        page.goto(gateway.base)
        focused = set()
        for _ in range(30):
            page.keyboard.press("Tab")
            focused.add(page.evaluate("document.activeElement.id"))
        assert {"tab-chat", "tab-dashboard", "new-chat", "prompt", "send"} <= focused
        assert page.evaluate("document.documentElement.scrollWidth") <= 375

        page.focus("#tab-dashboard")
        page.keyboard.press("Enter")
        sessions = page.locator("[data-stat=sessions] .value")
        expect(sessions).to_have_text(re.compile(r"^\d+$"))
        before = sessions.inner_text()
        assert page.evaluate("document.documentElement.scrollWidth") <= 375

        page.focus("#tab-chat")
        page.keyboard.press("Enter")
        page.focus("#new-chat")
        page.keyboard.press("Enter")
        settings(page, temperature=0, max_tokens=8)
        expect(page.locator("#model option")).to_have_count(2)  # the daemon's default, and its one model by name
        page.select_option("#model", index=1)
        send(page, "Hi!")
        assert reply_lengths(page)[-1] > 0

        page.click("#tab-dashboard")
        expect(sessions).not_to_have_text(before, timeout=10_000)
        expect(page.locator("#workers tbody tr")).to_have_count(1)
        expect(page.locator("#models tbody tr td").nth(1)).to_have_text("resident")
        expect(page.locator("#plot-ttft")).to_have_attribute("aria-label", re.compile(r"replies; last"))
        page.set_viewport_size({"width": 1200, "height": 820})
        page.wait_for_timeout(2500)  # a poll at this width: the plots redrawn
        screenshot(page, "dashboard")
    finally:
        context.close()


def test_with_keys_the_page_asks_for_one_and_no_key_sees_anothers_session(shared_stack, tmp_path, browser):
    from playwright.sync_api import expect

    gateway = Gateway(shared_stack, tmp_path, [KEY, "sk-other"])
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(gateway.base)
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        expect(page.locator("#key-dialog")).to_be_hidden()
        settings(page, temperature=0, max_tokens=8)
        send(page, "Hello there.")
        assert reply_lengths(page)[-1] > 0
        expect(page.locator("#session-id")).to_have_text(SESSION_ID)
        session = page.locator("#session-id").inner_text()

        url = f"{gateway.base}/v1/kvmux/sessions"
        status, info = get(f"{url}/{session}", KEY)
        assert status == 200 and info["history_tokens"] > 0 and info["kv_live_bytes"] > 0
        assert info["state"] in ("live", "hibernated")
        assert session in {s["session_id"] for s in get(url, KEY)[1]["data"]}
        assert get(f"{url}/{session}", "sk-other")[0] == 404
        assert session not in {s["session_id"] for s in get(url, "sk-other")[1]["data"]}
        assert get(f"{url}/{session}")[0] == 401
        assert get(f"{gateway.base}/v1/kvmux/stats")[0] == 401

        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-other", "X-Kvmux-Session": session}
        request = urllib.request.Request(f"{gateway.base}/v1/chat/completions", data=body, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 404
        headers["Authorization"] = f"Bearer {KEY}"  # its own key continues it
        request = urllib.request.Request(f"{gateway.base}/v1/chat/completions", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.headers["X-Kvmux-Session"] == session and json.loads(reply.read())["choices"]
    finally:
        context.close()
        gateway.stop()
