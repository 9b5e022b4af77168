"""The console in a real browser: headless Chromium (Debian's), driven by Playwright. Skipped where
either is missing; `make test` installs Playwright, and Chromium where the machine lets it."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
# STRATUM_SCREENSHOTS=docs writes the pages' screenshots where the README and docs/reference.md name them
SHOTS = Path(os.environ.get("STRATUM_SCREENSHOTS") or tempfile.mkdtemp(prefix="stratum-console-"))


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_chat_page_streams_an_answer_with_its_cost(browser, tiny_server):
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    page.goto(tiny_server.url + "/console")
    page.wait_for_function("document.getElementById('model').textContent.length > 0")
    page.fill("#prompt", "What is the capital of Japan?")
    page.click("#send")
    page.wait_for_selector(".turn.assistant[data-done='true']", timeout=60_000)
    assert page.inner_text(".turn.assistant .answer").strip()
    cost = page.inner_text(".turn.assistant .cost")
    assert re.search(r"x-stratum-cost: cache_hit_ratio=[0-9.]+,prefill_latency_us=\d+", cost), cost
    assert page.locator(".turn.assistant .timeline span").count() >= 2  # queue / prefill / decode
    assert "prefill_complete" in page.inner_text(".turn.assistant .meta")
    page.screenshot(path=str(SHOTS / "console-chat.png"), full_page=True)
    page.close()


def test_dashboard_moves_with_traffic_and_agrees_with_metrics(browser, tiny_server):
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    page.goto(tiny_server.url + "/console/dashboard")
    page.wait_for_function("Number(document.body.dataset.ticks || 0) >= 1")
    before = int(page.inner_text("#card-requests"))
    for i in range(3):
        httpx.post(tiny_server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 8, "messages": [
            {"role": "user", "content": f"dashboard traffic {i}"}]}, timeout=60).raise_for_status()
    page.wait_for_function(f"Number(document.getElementById('card-requests').textContent) >= {before + 3}",
                           timeout=10_000)
    shown = int(page.inner_text("#card-requests"))
    metrics = httpx.get(tiny_server.url + "/metrics").text
    answered = sum(float(v) for v in re.findall(r'^stratum_request_count_total\{[^}]*status="ok"[^}]*\} (\S+)$',
                                                metrics, re.M))
    assert shown == int(answered)
    assert float(page.inner_text("#card-throughput")) > 0
    stats = httpx.get(tiny_server.url + "/console/stats").json()
    assert stats["itl_ms"]["p50"] > 0 and stats["ttft_ms"]["p50"] > 0 and stats["requests_total"] == shown
    page.screenshot(path=str(SHOTS / "console-dashboard.png"), full_page=True)
    page.close()


def test_console_is_off_when_asked(tiny_model_dir):
    from tests.conftest import ServerProcess

    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--console", "off").wait_ready()
    try:
        assert httpx.get(server.url + "/console").status_code == 404
    finally:
        server.stop()


def test_the_model_picker_lists_every_model_with_its_state_and_chats_with_the_one_chosen(browser, tmp_path):
    from tests.conftest import ServerProcess
    from tests.factories import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", seed=1, hidden=32)
    first = make_tiny_model_dir(tmp_path / "first", seed=0)
    server = ServerProcess(f"first={first}", "--model", f"other={other}", "--kv-cache-mb", "8").wait_ready()
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        page.goto(server.url + "/console")
        page.wait_for_function("document.getElementById('model').options.length === 2")
        assert page.eval_on_selector_all("#model option", "os => os.map(o => o.textContent)") == [
            "first", "other (unloaded)"]
        page.select_option("#model", "other")
        page.fill("#prompt", "hello")
        page.click("#send")
        page.wait_for_selector(".turn.assistant[data-done='true']", timeout=60_000)
        assert page.inner_text(".turn.assistant .cost").split(" · ")[0].endswith(",model=other")
        page.goto(server.url + "/console/dashboard")
        page.wait_for_function("document.querySelectorAll('#models tr').length === 2")
        rows = page.eval_on_selector_all("#models tr", "rs => rs.map(r => [...r.children].map(c => c.textContent))")
        assert [r[:2] for r in rows] == [["first", "loaded"], ["other", "loaded"]]
        page.close()
    finally:
        server.stop()
