"""The retry policy against real servers whose own conditions produce each status:

    429 cost_threshold_exceeded   --tenant-budget-tokens 400 --budget-window-s 3
    418 cache_pollution           --pollution-policy reject, 10 requests whose prompts differ only in a UUID
    529 overloaded                --max-waiting 0 (always), and a --max-num-seqs 1 --max-waiting 1 server kept full

Each branch is taken for its status and not for the others; the SDK's own retries are off on that path.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid

import anthropic
import httpx
import pytest

from stratum.client import DropOldestTurns, RetryBudget, RetryPolicy, derive_session_id, estimate_tokens
from stratum.client.retry import Failure, TrimChain, TruncateLongMessages
from tests.conftest import ServerProcess
from tests.test_client_sdk import make_client

TINY = ("--served-model-name", "tiny", "--kv-cache-mb", "8")


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """Three tiny servers, started together (their start-up dominates this module's time)."""
    procs = {
        "budget": ServerProcess(str(tiny_model_dir), *TINY, "--tenant-budget-tokens", "400", "--budget-window-s", "3"),
        "reject": ServerProcess(str(tiny_model_dir), *TINY, "--pollution-policy", "reject",
                                "--max-num-seqs", "1", "--max-waiting", "1"),
        "full": ServerProcess(str(tiny_model_dir), *TINY, "--max-waiting", "0"),
    }
    try:
        yield {name: p.wait_ready() for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def unique_text(n_chars: int) -> str:
    """Words that are new to the server's prefix cache, so every prompt token is computed (and charged)."""
    rng = random.Random(uuid.uuid4().int)
    words = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))))
    return " ".join(words)[:n_chars]


def posted_bodies(tap) -> list[dict]:
    return [json.loads(r.content) for r in tap.requests("POST")]


# ---- 429: wait or trim ---------------------------------------------------------------------------------
def test_429_waits_retry_after_then_succeeds(servers):
    events = []
    client, tap = make_client(servers["budget"].url, api_key="tenant-wait",
                              retry_policy=RetryPolicy(max_wait_s=5), event_hooks={"retry": events.append})
    first = client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": unique_text(250)}])
    # the measured cost (uncached prompt tokens) left less than the next request's bound in the window
    assert first.usage.input_tokens + first.usage.cache_creation_input_tokens > 200
    second = client.messages.create(model="tiny", max_tokens=2,
                                    messages=[{"role": "user", "content": unique_text(250)}])
    assert [(e.status, e.reason, e.action) for e in events] == [(429, "cost_threshold_exceeded", "wait")]
    assert 1 <= events[0].delay_s <= 3
    assert second.stratum.retries == events and second.content is not None
    statuses = [resp.status_code for r, resp, _ in tap.exchanges if r.method == "POST"]
    assert statuses == [200, 429, 200]


def test_429_trims_the_oldest_turns_when_allowed(servers):
    events = []
    policy = RetryPolicy(trim=DropOldestTurns(keep_last=1), max_wait_s=0.5)
    client, tap = make_client(servers["budget"].url, api_key="tenant-trim", retry_policy=policy,
                              event_hooks={"retry": events.append})
    history = []
    for _ in range(4):
        history += [{"role": "user", "content": unique_text(90)}, {"role": "assistant", "content": unique_text(90)}]
    messages = history + [{"role": "user", "content": "And the total?"}]

    def bound(kept: list[dict]) -> int:  # what the server reserves: counted prompt tokens + max_tokens
        r = httpx.post(servers["budget"].url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": kept},
                       headers={"x-api-key": f"counter-{uuid.uuid4().hex}"})  # counting is charged: a tenant of its own
        return r.json()["input_tokens"] + 2

    assert bound(messages) > 400 > estimate_tokens({"messages": messages, "max_tokens": 2})  # more than chars / 4
    msg = client.messages.create(model="tiny", max_tokens=2, messages=messages)
    # By chars / 4 the whole conversation fits: only the server's count (the 429's stratum_cost_tokens) makes
    # the client trim. It cannot tokenize, so a trim that still misses by the server's count is trimmed again.
    assert [(e.status, e.action) for e in events][:1] == [(429, "trim")] and events[0].delay_s == 0
    assert {e.action for e in events} == {"trim"} and len(events) <= 2
    sent = posted_bodies(tap)
    assert len(sent) == len(events) + 1 and len(sent[0]["messages"]) == 9
    kept = sent[-1]["messages"]  # oldest turns dropped, the last exchange and the question always kept
    assert 3 <= len(kept) < 9 and kept == messages[-len(kept):] and kept[0]["role"] == "user"
    assert bound(kept) <= 400
    assert msg.stratum.retries == events


def test_429_is_raised_when_retry_after_is_too_long_and_trimming_is_not_allowed(servers):
    events = []
    client, tap = make_client(servers["budget"].url, api_key="tenant-giveup",
                              retry_policy=RetryPolicy(max_wait_s=0.5), event_hooks={"retry": events.append})
    with pytest.raises(anthropic.RateLimitError) as info:  # max_tokens alone exceeds the budget
        client.messages.create(model="tiny", max_tokens=500, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["stratum_reason"] == "cost_threshold_exceeded"
    assert [(e.status, e.action) for e in events] == [(429, "give_up")]
    assert len(tap.requests("POST")) == 1


def test_other_statuses_are_not_retried(servers):
    events = []
    client, tap = make_client(servers["budget"].url, api_key="tenant-other", event_hooks={"retry": events.append})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"X-Stratum-Mode": "sideways"})
    assert events == [] and len(tap.requests("POST")) == 2


# ---- 418: deterministic session id ---------------------------------------------------------------------
def pollute(client) -> None:
    """10 requests of one session whose prompts differ only in a UUID: each misses the prefix cache."""
    for _ in range(10):
        client.messages.create(model="tiny", max_tokens=1, system=f"{uuid.uuid4()} You answer order questions.",
                               messages=[{"role": "user", "content": "Where is my parcel?"}])


def test_418_switches_to_a_deterministic_session_and_retries_once(servers):
    keys = {"tenant": "acme", "user": "42"}
    events = []
    client, tap = make_client(servers["reject"].url, api_key="tenant-418",
                              retry_policy=RetryPolicy(session_keys=keys), event_hooks={"retry": events.append})
    pollute(client)
    assert events == [] and not [r for r in tap.requests("POST") if "x-stratum-session-id" in r.headers]
    msg = client.messages.create(model="tiny", max_tokens=1, system=f"{uuid.uuid4()} You answer order questions.",
                                 messages=[{"role": "user", "content": "Where is my parcel?"}])
    sid = derive_session_id(keys)
    assert (sid == derive_session_id({"user": "42", "tenant": "acme"})
            != derive_session_id({"tenant": "acme", "user": "43"}))
    assert [(e.status, e.reason, e.action) for e in events] == [(418, "cache_pollution", "session")]
    statuses = [resp.status_code for r, resp, _ in tap.exchanges if r.method == "POST"]
    assert statuses[-2:] == [418, 200]
    retried = tap.requests("POST")[-1]
    assert retried.headers["x-stratum-session-id"] == sid
    assert json.loads(retried.content)["metadata"]["user_id"] == sid
    assert msg.stratum.session_id == sid
    # the switch sticks: the next request of these keys carries the session id from the start
    client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "thanks"}])
    assert tap.requests("POST")[-1].headers["x-stratum-session-id"] == sid and len(events) == 1


def test_418_without_session_keys_is_raised(servers):
    events = []
    client, tap = make_client(servers["reject"].url, api_key="tenant-418-nokeys", event_hooks={"retry": events.append})
    pollute(client)
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(model="tiny", max_tokens=1, system=f"{uuid.uuid4()} You answer order questions.",
                               messages=[{"role": "user", "content": "Where is my parcel?"}])
    assert info.value.status_code == 418
    assert info.value.response.headers["x-stratum-advice"] == "consider using deterministic session_id"
    assert [(e.status, e.action) for e in events] == [(418, "give_up")]
    assert len(tap.requests("POST")) == 11


# ---- 529: backoff with full jitter and a retry budget --------------------------------------------------
def test_529_backs_off_with_full_jitter_up_to_max_attempts(servers):
    events = []
    policy = RetryPolicy(max_attempts=3, backoff_base_s=0.02, backoff_max_s=0.05, rng=random.Random(7))
    client, tap = make_client(servers["full"].url, retry_policy=policy, event_hooks={"retry": events.append})
    with pytest.raises(anthropic.OverloadedError):
        client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert [(e.status, e.reason, e.action) for e in events] == (
        [(529, "overloaded", "backoff")] * 2 + [(529, "overloaded", "give_up")])
    assert 0 <= events[0].delay_s <= 0.02 and 0 <= events[1].delay_s <= 0.04
    expected = random.Random(7)
    assert [e.delay_s for e in events[:2]] == [expected.uniform(0, 0.02), expected.uniform(0, 0.04)]
    assert len(tap.requests("POST")) == 3  # no SDK retries underneath (its default would make 9)


def test_529_retry_budget_stops_a_retry_storm(servers):
    events = []
    policy = RetryPolicy(max_attempts=10, backoff_base_s=0.001, budget=RetryBudget(capacity=2, refill_per_s=0))
    client, tap = make_client(servers["full"].url, retry_policy=policy, event_hooks={"retry": events.append})
    for _ in range(3):
        with pytest.raises(anthropic.OverloadedError):
            client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert [e.action for e in events] == ["backoff", "backoff", "give_up", "give_up", "give_up"]
    assert all(e.detail == "retry budget exhausted" for e in events[2:])
    assert len(tap.requests("POST")) == 5  # 10 attempts were allowed per request; the budget allowed 2 retries in all


def test_async_client_retries_the_same_way(servers):
    from stratum.client import AsyncStratum

    async def run():
        events = []

        async def on_retry(event):  # coroutine hooks are awaited
            events.append(event)

        client = AsyncStratum(base_url=servers["full"].url, api_key="async",
                              retry_policy=RetryPolicy(max_attempts=2, backoff_base_s=0.01),
                              event_hooks={"retry": on_retry})
        with pytest.raises(anthropic.OverloadedError):
            await client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        return events

    events = asyncio.run(run())
    assert [(e.status, e.action) for e in events] == [(529, "backoff"), (529, "give_up")]


def test_529_on_a_full_queue_backs_off_until_the_queue_drains(servers):
    """One request running and one waiting fill a --max-num-seqs 1 --max-waiting 1 server; the client's
    request gets 529s and backs off until the two occupants leave, then succeeds."""
    url = servers["reject"].url
    release = threading.Event()

    def occupy():
        body = {"model": "tiny", "max_tokens": 1800, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "occupy"}]}
        with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": "occupant"}, timeout=60) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    return  # leaving closes the stream: the server aborts the request

    def health() -> dict:
        return httpx.get(url + "/health", timeout=10).json()

    occupants = []
    for field in ("running", "waiting"):
        occupants.append(threading.Thread(target=occupy, daemon=True))
        occupants[-1].start()
        deadline = time.monotonic() + 20
        while health()[field] < 1:
            assert time.monotonic() < deadline, f"no {field} occupant"
            time.sleep(0.02)

    events, outcome = [], []
    policy = RetryPolicy(max_attempts=100, backoff_base_s=0.05, backoff_max_s=0.2, budget=RetryBudget(capacity=200))
    client, tap = make_client(url, api_key="tenant-flood", retry_policy=policy, event_hooks={"retry": events.append})
    caller = threading.Thread(target=lambda: outcome.append(client.messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "my turn?"}])))
    caller.start()
    deadline = time.monotonic() + 20
    while len(events) < 3:
        assert time.monotonic() < deadline and caller.is_alive(), "the request was not turned away"
        time.sleep(0.02)
    release.set()
    caller.join(timeout=60)
    for t in occupants:
        t.join(timeout=30)
    assert outcome and outcome[0].stratum.retries == events
    assert {(e.status, e.reason, e.action) for e in events} == {(529, "overloaded", "backoff")}
    statuses = [resp.status_code for r, resp, _ in tap.exchanges if r.method == "POST"]
    assert statuses == [529] * len(events) + [200]


# ---- the policy itself ---------------------------------------------------------------------------------
def test_decide_maps_each_reason_to_its_action_only():
    params = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    policy = RetryPolicy(session_keys=["k"], rng=random.Random(0))
    cost = Failure(429, "rate_limit_error", "cost_threshold_exceeded", retry_after_s=2, remaining_tokens=0)
    assert policy.next_action(cost, 1, params).action == "wait"
    assert policy.next_action(Failure(429, "rate_limit_error"), 1, params) is None  # a 429 without the Stratum reason
    assert policy.next_action(Failure(418, "invalid_request_error", "cache_pollution"), 1, params).action == "session"
    assert policy.next_action(Failure(418), 1, params, is_session_switched=True).action == "give_up"
    assert policy.next_action(Failure(529, "overloaded_error"), 1, params).action == "backoff"
    for status in (400, 401, 404, 413, 500, 503):
        assert policy.next_action(Failure(status, "api_error"), 1, params) is None


def test_the_servers_count_scales_the_trim_target():
    body = {"type": "error", "error": {"type": "rate_limit_error", "stratum_reason": "cost_threshold_exceeded",
                                       "stratum_cost_tokens": 800}}
    failure = Failure.from_response(429, body, {"anthropic-ratelimit-tokens-remaining": "400", "retry-after": "9"})
    assert failure.cost_tokens == 800 and failure.remaining_tokens == 400
    for bad in (True, -3, "800", None):
        assert Failure.from_response(429, {"error": {**body["error"], "stratum_cost_tokens": bad}},
                                     {}).cost_tokens is None
    # the client estimates 2 x 100 + 1 = 201 tokens; the server counted 800: 400 left is 100 in the estimate's units
    params = {"max_tokens": 1, "messages": [{"role": "user", "content": "a" * 400},
                                            {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": "b" * 396}]}
    decision = RetryPolicy(trim=DropOldestTurns(), max_wait_s=1).next_action(failure, 1, params)
    assert decision.action == "trim" and decision.params["messages"] == params["messages"][2:]
    assert "400 remaining" in decision.detail


def test_trim_policies():
    long = "x" * 2000
    params = {"max_tokens": 10, "messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
                                             {"role": "user", "content": long}]}
    assert estimate_tokens(params) == -(-(2000 + 1 + 2 + 1 + 2000) // 4) + 10
    dropped = DropOldestTurns().trim(params, 600)
    assert dropped["messages"] == params["messages"][2:]
    assert DropOldestTurns().trim({"max_tokens": 1, "messages": [{"role": "user", "content": long}]}, 10) is None
    cut = TruncateLongMessages(min_chars=100).trim(params, 300)
    assert estimate_tokens(cut) <= 300 and params["messages"][0]["content"] == long  # input untouched
    chained = TrimChain((DropOldestTurns(), TruncateLongMessages(min_chars=100))).trim(params, 200)
    assert len(chained["messages"]) == 1 and estimate_tokens(chained) <= 200


def test_retry_budget_refills():
    now = [0.0]
    budget = RetryBudget(capacity=2, refill_per_s=1, clock=lambda: now[0])
    assert budget.try_acquire() and budget.try_acquire() and not budget.try_acquire()
    now[0] = 1.5
    assert budget.try_acquire() and not budget.try_acquire()
