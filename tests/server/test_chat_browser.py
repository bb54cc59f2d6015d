"""The chat page in a real browser (Chromium from the Debian packages, driven by Playwright) against a real
serve-engine: the key entered, a model picked, a question typed, the streamed answer seen arriving with its
TTFT and tokens/s, a second answer stopped mid-way, no CSP violation; a screenshot is kept."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY

CHROMIUM = os.environ.get("RUNLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def test_chat_in_a_browser(browser, smollm2_server, tmp_path: Path) -> None:
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{smollm2_server.url}/")
    page.wait_for_selector("#status:has-text('API key')")  # no key yet: the page asks for one
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    # (locator waits only: the page's CSP forbids the eval behind wait_for_function, as it should)
    page.locator("#model option").first.wait_for(state="attached")
    assert page.input_value("#model") == "smollm2"
    page.fill("#temperature", "0")
    page.dispatch_event("#temperature", "change")
    assert page.is_visible("#settings")  # opened by the page when it asked for the key
    page.fill("#system", "Answer in one short sentence.")

    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    first = page.locator(".msg.assistant").nth(0)
    page.wait_for_selector(".msg.assistant >> nth=0 >> .body:not(:empty)", timeout=60_000)
    assert page.is_enabled("#stop") or first.get_attribute("data-done") is not None  # streaming, or just done
    page.wait_for_selector(".msg.assistant[data-done]", timeout=180_000)
    assert first.get_attribute("data-done") == "complete"
    assert "Paris" in first.locator(".body").inner_text()
    stats = first.locator(".stats").inner_text()
    assert "tokens" in stats and "TTFT" in stats and "tok/s" in stats, stats

    page.fill("#prompt", "Now write a very long story about a dragon who learns to bake bread.")
    page.press("#prompt", "Enter")
    second = page.locator(".msg.assistant").nth(1)
    deadline = time.monotonic() + 120
    while len(second.locator(".body").inner_text()) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(second.locator(".body").inner_text()) >= 40
    page.click("#stop")
    page.wait_for_selector(".msg.assistant >> nth=1 >> xpath=self::*[@data-done]", timeout=30_000)
    assert second.get_attribute("data-done") == "stopped" and "stopped" in second.locator(".stats").inner_text()
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    shot = Path(os.environ.get("RUNLM_TEST_ARTIFACTS", tmp_path)) / "chat_page.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:4] == b"\x89PNG"
    # no script error, no CSP violation; the one 401 is the page's first /v1/models, before the key
    assert [p for p in problems if "401" not in p] == [] and len(problems) <= 1, problems
