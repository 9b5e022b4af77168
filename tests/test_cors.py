"""Browsers admitted by origin (`--allowed-origin`): the preflight every API route answers, as llama-server's
CORS tests expect it and with the headers the SDKs' browser modes send; a page on another origin calling
the API from headless Chromium (allowed, and refused); off by default; '*' refused on a keyed server."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import sys
import threading

import httpx
import pytest

from tests.conftest import ServerProcess, _free_port

KEY = "sk-cors-test"
SDK_HEADERS = ["x-api-key", "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
               "authorization", "content-type", "x-stainless-os", "x-stainless-retry-count", "x-stratum-debug"]
ROUTES = ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/completions", "/v1/responses",
          "/v1/models", "/v1/responses/resp_x"]
PAGE = b"<!doctype html><title>another origin</title><p>a page that calls Stratum</p>"


@pytest.fixture(scope="module")
def page_port():
    """A tiny web server for the page: http://127.0.0.1:PORT is allowed, http://localhost:PORT is not."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", _free_port()), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def cors_server(tiny_model_dir, page_port):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--api-key", KEY,
                           "--allowed-origin", f"http://127.0.0.1:{page_port}",
                           "--allowed-origin", "https://app.example").wait_ready()
    yield server
    server.stop()


def preflight(url: str, origin: str, method: str = "POST", headers: list[str] = SDK_HEADERS) -> httpx.Response:
    return httpx.options(url, headers={"origin": origin, "access-control-request-method": method,
                                       "access-control-request-headers": ", ".join(headers)})


def test_every_api_route_answers_the_preflight(cors_server):
    for route in ROUTES:
        r = preflight(cors_server.url + route, "https://app.example", "DELETE" if "resp_" in route else "POST")
        assert r.status_code == 200, (route, r.text)
        assert r.headers["access-control-allow-origin"] == "https://app.example"  # echoed, not *
        assert r.headers["access-control-allow-credentials"] == "true"
        methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
        assert {"GET", "POST", "DELETE"} <= methods
        allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
        assert set(SDK_HEADERS) <= allowed, route


def test_a_refused_origin_gets_no_allowance(cors_server):
    r = preflight(cors_server.url + "/v1/messages", "https://evil.example")
    assert "access-control-allow-origin" not in r.headers and r.status_code == 400
    r = httpx.get(cors_server.url + "/v1/models", headers={"origin": "https://evil.example", "x-api-key": KEY})
    assert "access-control-allow-origin" not in r.headers


def test_answers_expose_the_request_id_and_stratum_headers(cors_server):
    r = httpx.post(cors_server.url + "/v1/messages", headers={"origin": "https://app.example", "x-api-key": KEY},
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"request-id", "x-stratum-cost", "x-stratum-trace", "x-stratum-mode", "x-stratum-policy"} <= exposed
    assert {h for h in r.headers if h.startswith("x-stratum-")} <= exposed  # every one this answer carries


def test_the_negotiation_options_route_keeps_working(cors_server):
    r = httpx.options(cors_server.url + "/v1/messages", headers={"x-stratum-negotiate": "v1", "x-api-key": KEY})
    assert r.status_code == 200 and r.headers["x-stratum-supported"] == "v1"


def test_cors_is_off_by_default(tiny_server):
    r = preflight(tiny_server.url + "/v1/messages", "https://app.example")
    assert "access-control-allow-origin" not in r.headers


def test_any_origin_is_refused_on_a_keyed_server_unless_meant(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "stratum.cli", "serve", "--model", str(tiny_model_dir),
                           "--api-key", KEY, "--allowed-origin", "*"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--allow-any-origin-with-keys" in done.stderr
    from argparse import Namespace

    from stratum.cli import _refuse_any_origin

    meant = Namespace(api_key=[KEY], cors_origin=["*"], allow_any_origin_with_keys=True)
    assert _refuse_any_origin(meant) is None
    assert _refuse_any_origin(Namespace(api_key=None, cors_origin=["*"], allow_any_origin_with_keys=False)) is None


# ---- a real browser on another origin -------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CALL = """async (url) => {
  try {
    const r = await fetch(url + "/v1/messages", {method: "POST", headers: {
      "content-type": "application/json", "x-api-key": "%s", "anthropic-version": "2023-06-01",
      "anthropic-dangerous-direct-browser-access": "true", "x-stainless-os": "Linux"},
      body: JSON.stringify({model: "tiny", max_tokens: 2, messages: [{role: "user", content: "hi"}]})});
    const body = await r.json();
    return {status: r.status, type: body.type, requestId: r.headers.get("request-id"),
            cost: r.headers.get("x-stratum-cost")};
  } catch (e) { return {error: String(e)}; }
}""" % KEY


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")
def test_a_page_on_another_origin_calls_the_api_only_when_allowed(cors_server, page_port):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{page_port}/")
            allowed = page.evaluate(CALL, cors_server.url)
            assert allowed.get("status") == 200 and allowed["type"] == "message", allowed
            assert allowed["requestId"] and allowed["cost"].startswith("cache_hit_ratio=")  # exposed to the page
            page.goto(f"http://localhost:{page_port}/")  # another origin, not allowed
            refused = page.evaluate(CALL, cors_server.url)
            assert "error" in refused and "Failed to fetch" in refused["error"], refused
        finally:
            browser.close()
