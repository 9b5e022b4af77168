"""Graceful drain: on SIGTERM the server refuses new requests (503) and says it is draining on /health,
lets in-flight requests finish up to --drain-timeout-s, ends the rest with an error event (or an error
body), and exits 0. Every stream ends with its final event or an error event, never cut off."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.sse import sse_events

DRAIN_S = 2.0


@pytest.fixture
def start(tiny_model_dir):
    """start(drain_s): a server of this test's own, since the test ends it; stopped if the test fails."""
    servers = []

    def start(drain_s: float) -> ServerProcess:
        servers.append(ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                                     "--drain-timeout-s", str(drain_s)).wait_ready())
        return servers[-1]

    yield start
    for server in servers:
        if server.proc.poll() is None:
            server.proc.kill()


class Stream(threading.Thread):
    """One streamed request, read to whatever end it gets; `started` is set at its first text."""

    def __init__(self, url: str, api: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.api, self.max_tokens = url, api, max_tokens
        self.started = threading.Event()
        self.events: list[tuple[str, dict]] = []
        self.status: int | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        messages = [{"role": "user", "content": "Tell me a very long story."}]
        if self.api == "anthropic":
            path, body = "/v1/messages", {"model": "tiny", "max_tokens": self.max_tokens, "messages": messages}
        else:
            path, body = "/v1/chat/completions", {"model": "tiny", "max_tokens": self.max_tokens, "messages": messages}
        lines = []
        try:
            with httpx.stream("POST", self.url + path, json={**body, "stream": True, "ignore_eos": True},
                              timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data:") and ("text_delta" in line or '"content"' in line):
                        self.started.set()
        except Exception as e:  # a cut connection: what this test exists to rule out
            self.error = e
        self.started.set()
        self.events = sse_events(lines + [""])

    @property
    def ending(self) -> str:
        """completed, error (with a shutdown message) or cut."""
        if self.error is not None or not self.events:
            return "cut"
        name, data = self.events[-1]
        if self.api == "anthropic":
            if name == "message_stop":
                return "completed"
            if name == "error" and "shutting down" in data["error"]["message"]:
                return "error"
        else:
            if data.get("done"):
                return "completed"
            if "error" in data and "shutting down" in data["error"]["message"]:
                return "error"
        return "cut"


def wait_draining(server: ServerProcess, timeout: float = 15.0) -> httpx.Response:
    """/health once it says the server is draining (the signal is handled on the server's event loop)."""
    deadline = time.monotonic() + timeout
    while (health := httpx.get(server.url + "/health", timeout=5)).json()["status"] != "draining":
        assert time.monotonic() < deadline, f"still not draining after {timeout}s: {health.json()}"
        time.sleep(0.05)
    return health


def run_streams(server: ServerProcess, max_tokens: int, n: int = 8) -> list[Stream]:
    streams = [Stream(server.url, "anthropic" if i % 2 == 0 else "openai", max_tokens) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    return streams


def test_long_streams_end_with_an_error_event_after_the_drain_timeout(start):
    server = start(DRAIN_S)
    streams = run_streams(server, max_tokens=1800)  # far longer than the drain
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    health = wait_draining(server)
    assert health.status_code == 503
    assert health.json()["in_flight"] == len(streams)
    refused = httpx.post(server.url + "/v1/messages",
                         json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                         timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "api_error"
    assert "shutting down" in refused.json()["error"]["message"]
    for s in streams:
        s.join(30)
    assert [s.ending for s in streams] == ["error"] * len(streams)
    assert server.proc.wait(30) == 0
    assert DRAIN_S <= time.monotonic() - t0 < DRAIN_S + 15
    log = server.output()
    assert "Traceback" not in log and "draining 8 requests" in log and "ended 8 requests" in log


def test_streams_that_finish_within_the_drain_complete(start):
    server = start(60)
    streams = run_streams(server, max_tokens=150, n=4)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.join(60)
    assert [s.ending for s in streams] == ["completed"] * len(streams)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - t0 < 30  # it exits once they are done, not at the drain timeout
    assert "Traceback" not in server.output()


def test_a_second_signal_exits_at_once(start):
    """Drained, these streams would run to their end (60 s allowed); a second signal ends the
    server before they can."""
    server = start(60)
    streams = run_streams(server, max_tokens=1800, n=2)
    server.proc.send_signal(signal.SIGTERM)
    wait_draining(server)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(20) == 0
    for s in streams:
        s.join(20)
        assert not s.is_alive()
    assert "completed" not in [s.ending for s in streams], [s.events[-1:] for s in streams]
