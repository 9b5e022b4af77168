"""What a crash leaves behind: a tenant's budget window read back after kill -9 of the server (spending
kept, reservations in flight dropped), and an engine process that comes back after kill -9 (the
request it was streaming ends with an error, /health says restarting then ok, the next request runs and
the disk tier serves the new engine what the dead one computed), or stays dead in a crash loop."""

from __future__ import annotations

import os
import signal
import time

import anthropic
import httpx
import pytest

from stratum.engine.supervisor import RestartPolicy, Supervisor
from stratum.server.budget import BudgetStore, CostAdmission
from tests.conftest import ServerProcess
from tests.sse import sse_events
from tests.test_admission import FakeClock
from tests.test_disk_tier_server import ask, written_blocks
from tests.test_lifecycle import TOO_LONG, at_rest, remaining

BUDGET = 2000  # below the tiny model's max_tokens cap, so that a request can ask for more than is left
KEY = "sk-crash-one"
STORY = {"model": "tiny", "max_tokens": 1500, "ignore_eos": True, "stream": True,
         "messages": [{"role": "user", "content": "Tell me a very long story."}]}


# ---- units -----------------------------------------------------------------------------------------
def test_a_new_admission_on_the_same_store_continues_the_window(tmp_path):
    """Settled spending is read back; a reservation still held when the first one stopped is not; a
    window that closed meanwhile is gone, and a settlement in it never reaches the store."""
    clock = FakeClock(1000.0)
    first = CostAdmission(100, window_s=10, clock=clock, store=BudgetStore(tmp_path / "b.sqlite3"))
    a = first.reserve("a", 30)
    first.settle("a", 30, 12, a.reset_at)
    first.reserve("a", 40)  # in flight at the "crash"
    first.settle("b", 0, 0)  # b has no window: nothing written
    b = first.reserve("b", 50)
    first.settle("b", 50, 50, b.reset_at)
    assert first.check("a").remaining == 100 - 12 - 40

    clock.t = 1005.0
    second = CostAdmission(100, window_s=10, clock=clock, store=BudgetStore(tmp_path / "b.sqlite3"))
    d = second.check("a")
    assert d.remaining == 88 and d.reset_at == 1010.0  # the same window, its settled 12 only
    assert second.check("b").remaining == 50
    assert not second.reserve("a", 89).is_admitted and second.reserve("a", 88).is_admitted

    clock.t = 1010.0  # both windows closed: a third start reads nothing back
    third = CostAdmission(100, window_s=10, clock=clock, store=BudgetStore(tmp_path / "b.sqlite3"))
    assert third.check("a").remaining == 100 and third.check("b").remaining == 100
    rows = BudgetStore(tmp_path / "b.sqlite3").db.execute("select count(*) from windows").fetchone()[0]
    assert rows == 0


def test_the_supervisor_backs_off_and_gives_up_on_a_crash_loop():
    clock = FakeClock(0.0)
    sup = Supervisor(RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.5, max_backoff_s=1.5), clock=clock)
    assert sup.view().state == "running"
    assert sup.died("one") == 0.5 and sup.view().state == "restarting" and sup.view().retry_after_s >= 1
    clock.t = 2.0
    sup.restarted(1)
    assert sup.view().num_restarts == 1 and sup.view().last_restart_s == 2.0 and sup.view().state == "running"
    clock.t = 10.0
    assert sup.died("two") == 1.0
    assert sup.died("a restart failed") == 1.5  # doubled, then capped
    clock.t = 11.0
    assert sup.died("four") is None and sup.view().state == "given_up"
    assert "died 4 times within 60s" in sup.given_up and "four" in sup.given_up

    forgetful = Supervisor(RestartPolicy(max_restarts=1, window_s=60), clock=clock)
    assert forgetful.died("one") is not None
    forgetful.restarted(2)
    clock.t = 200.0  # the first death is out of the window: this is not a loop
    assert forgetful.died("two") is not None
    assert Supervisor(RestartPolicy(max_restarts=0)).died("x") is None


# ---- budgets across kill -9 of the server ----------------------------------------------------------
def _budget_server(model, data_dir) -> ServerProcess:
    return ServerProcess(str(model), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--api-key", KEY,
                         "--tenant-budget-tokens", str(BUDGET), "--budget-window-s", "3600",
                         "--data-dir", str(data_dir)).wait_ready()


def spend(url: str, text: str) -> int:
    """One short answer for the tenant, at rest afterwards; its measured cost (uncached prompt + output)."""
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    u = client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": text}]).usage
    at_rest(url)
    return u.input_tokens + u.cache_creation_input_tokens + u.output_tokens


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_budget_survives_kill_9_of_the_server(tiny_model_dir, tmp_path):
    """Spend, hold a long stream's reservation, kill -9 the server: the restarted server (same data dir)
    says the same remaining tokens as before the stream (spending kept, the reservation of the request
    the crash ended dropped), refuses what no longer fits with 429, and charges on from there."""
    data = tmp_path / "data"
    first = _budget_server(tiny_model_dir, data)
    try:
        cost = spend(first.url, "before the crash")
        left = remaining(first.url, KEY)
        assert left == BUDGET - cost and cost > 0
        engine_pid = httpx.get(first.url + "/health", timeout=10).json()["engine_pid"]
        with httpx.stream("POST", first.url + "/v1/messages", json=STORY, headers={"x-api-key": KEY},
                          timeout=60) as r:
            lines = r.iter_lines()
            while "text_delta" not in next(lines):
                pass
            assert remaining(first.url, KEY) < left  # the stream's reservation is held
            first.proc.send_signal(signal.SIGKILL)
            assert first.proc.wait(10) == -signal.SIGKILL
    except httpx.HTTPError:
        pass  # the stream's connection reset by the kill
    finally:
        first.stop()
    assert _gone(engine_pid), "the engine process outlived its killed server"

    second = _budget_server(tiny_model_dir, data)
    try:
        assert remaining(second.url, KEY) == left
        client = anthropic.Anthropic(base_url=second.url, api_key=KEY, max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as refused:  # the least it can cost is left + 1
            client.messages.create(model="tiny", max_tokens=left, messages=[{"role": "user", "content": "x"}])
        assert refused.value.response.headers["anthropic-ratelimit-tokens-remaining"] == str(left)
        again = spend(second.url, "after the crash")
        assert remaining(second.url, KEY) == left - again
    finally:
        second.stop()


# ---- the engine process comes back -----------------------------------------------------------------
def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def _until(url: str, status: str, timeout: float = 60.0) -> list[str]:
    """Poll /health until it says status; the statuses seen on the way, in order, without repeats."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not seen or seen[-1] != status:
        assert time.monotonic() < deadline, f"/health never said {status}: {seen}"
        now = _health(url).json()["status"]
        if not seen or seen[-1] != now:
            seen.append(now)
        time.sleep(0.02)
    return seen


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def test_an_idle_engine_killed_comes_back_warm(server):
    """kill -9 of an idle engine process: /health says restarting (503, retry-after), then ok with a new
    pid and a restart counted in /health and /metrics; the prompt the dead engine computed is read back
    from the disk tier by the new one, and answers the same."""
    computed, prefill = ask(server, "k")
    assert computed.usage.cache_read_input_tokens == 0
    written_blocks(server, prefill["computed_tokens"] // 16)
    before = _health(server.url).json()
    os.kill(before["engine_pid"], signal.SIGKILL)
    r = _health(server.url)
    while r.json()["status"] == "ok":  # the death is seen as soon as the pipe closes
        r = _health(server.url)
    assert r.status_code == 503 and r.json()["status"] == "restarting", r.json()
    assert int(r.headers["retry-after"]) >= 1 and "exited with code -9" in r.json()["error"]
    _until(server.url, "ok")
    after = _health(server.url).json()
    assert after["engine_pid"] != before["engine_pid"] and after["restarts"] == before["restarts"] + 1
    assert after["last_restart_s"] > 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f"stratum_engine_restarts {float(after['restarts'])}" in metrics
    warm, prefill = ask(server, "k")
    assert warm.usage.cache_read_input_tokens > 0 and prefill["tiers"]["disk"] > 0
    assert warm.content[0].text == computed.content[0].text


def test_a_stream_the_engine_dies_under_ends_with_an_error_and_the_next_request_runs(server):
    """kill -9 of the engine while it streams: the stream's last event is an API error; a request sent
    at once waits for the new engine (within --restart-wait-s) and is answered."""
    pid = _health(server.url).json()["engine_pid"]
    with httpx.stream("POST", server.url + "/v1/messages", json=STORY, timeout=60) as r:
        lines = r.iter_lines()
        while "text_delta" not in next(lines):
            pass
        os.kill(pid, signal.SIGKILL)
        events = sse_events(lines)
    assert r.status_code == 200 and events[-1][0] == "error", events[-3:]
    assert events[-1][1]["error"]["type"] == "api_error" and "engine" in events[-1][1]["error"]["message"]
    client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    answer = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.output_tokens == 4
    assert _health(server.url).json()["engine_pid"] != pid


def test_a_crash_loop_ends_dead_with_its_reason(tiny_model_dir):
    """Every engine started after the first dies as it starts: after --engine-restarts 2 failed restarts
    the engine stays dead, /health says why, and requests get 503 at once; while it was still restarting,
    a request (no wait) got 503 with retry-after."""
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--engine-restarts", "2", "--restart-wait-s", "0",
                           env={"STRATUM_FAULT_INJECT": "start_death:1"}).wait_ready()
    try:
        os.kill(_health(server.url).json()["engine_pid"], signal.SIGKILL)
        while _health(server.url).json()["status"] == "ok":
            time.sleep(0.01)
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
        if "restarting" in r.json()["error"]["message"]:
            assert int(r.headers["retry-after"]) >= 1
        seen = _until(server.url, "dead", timeout=120)
        assert "ok" not in seen, seen
        health = _health(server.url)
        error = health.json()["error"]
        assert health.status_code == 503 and "died 3 times" in error and "--engine-restarts 2" in error, error
        assert health.json()["restarts"] == 0
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/messages", json=body, timeout=10)
        assert r.status_code == 503 and "died 3 times" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5.0  # refused, not left waiting for an engine that will not come
    finally:
        server.stop()
    assert "injected death at the start of engine process 1" in server.output()


def test_restarts_off_leave_a_dead_engine_dead(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--engine-restarts", "0").wait_ready()
    try:
        os.kill(_health(server.url).json()["engine_pid"], signal.SIGKILL)
        assert _until(server.url, "dead")[-1] == "dead"
        assert "restarts are off" in _health(server.url).json()["error"]
        r = httpx.post(server.url + "/v1/messages", timeout=10,
                       json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": TOO_LONG}]})
        assert r.status_code == 503
    finally:
        server.stop()
