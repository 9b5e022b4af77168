"""Admission by cost (429), queue limits (529) and cache-pollution advice (418), decided before any work.

A request reserves an upper bound of its cost, as documented: its prompt tokens (what count_tokens
says) + its effective max_tokens. After it finishes, the reservation becomes what it measured:
uncached prompt tokens + output tokens.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratum.server.budget import CostAdmission
from stratum.server.pollution import PollutionDetector, mask_high_entropy
from tests.conftest import ServerProcess
from tests.test_telemetry_cost import long_text, uncached_tokens

BUDGET = 400
WINDOW_S = 60.0
ADVICE = "consider using deterministic session_id"


# ---- units ---------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_cost_admission_windows_and_settlement():
    clock = FakeClock()
    adm = CostAdmission(100, window_s=10, clock=clock)
    d = adm.reserve("a", 60)
    assert d.is_admitted and d.remaining == 40 and d.limit == 100 and d.reset_at == 1010.0
    clock.t = 1003.2
    d = adm.reserve("a", 41)  # over by one: rejected, nothing charged
    assert not d.is_admitted and d.remaining == 40 and d.retry_after_s == 7
    assert adm.check("a", 40).is_admitted and adm.check("a").remaining == 40  # check reserves nothing
    assert not adm.check("a", 41).is_admitted
    assert adm.reserve("a", 40).is_admitted  # exactly the remainder fits
    assert not adm.reserve("a", 1).is_admitted
    assert adm.reserve("b", 100).is_admitted  # tenants are separate
    adm.settle("a", 40, 10)  # measured cost replaces the estimate
    assert adm.reserve("a", 30).remaining == 0
    clock.t = 1010.0  # a new window
    d = adm.reserve("a", 100)
    assert d.is_admitted and d.reset_at == 1020.0
    assert not CostAdmission(None).is_enabled


@pytest.mark.parametrize("text, masked", [
    ("id 123e4567-e89b-12d3-a456-426614174000 done", "id <*> done"),
    ("at 2024-05-01T12:34:56Z ok", "at <*> ok"),
    ("at 2024-05-01 12:34:56.123+02:00 ok", "at <*> ok"),
    ("unix 1714566896 and ms 1714566896123", "unix <*> and ms <*>"),
    ("sha deadbeefdeadbeefdeadbeef0123", "sha <*>"),
])
def test_mask_high_entropy_masks_ids_and_times(text, masked):
    assert mask_high_entropy(text) == masked


@pytest.mark.parametrize("text", [
    "The year 2024 had 365 days and 12345 visitors.",
    "short hex deadbeef and words",
    "order number 42, see section 3.1",
])
def test_mask_high_entropy_keeps_ordinary_text(text):
    assert mask_high_entropy(text) == text


def test_pollution_detector_needs_ten_misses_differing_only_in_entropy():
    det = PollutionDetector("reject")
    for i in range(9):
        det.record("s", 0.0, f"{uuid.uuid4()} tell me a joke")
        assert not det.is_polluted("s")
    det.record("s", 0.0, f"{uuid.uuid4()} tell me a joke")
    assert det.is_polluted("s")
    assert not det.is_polluted("other")
    det.reset("s")
    assert not det.is_polluted("s")

    hit = PollutionDetector("advise")
    for i in range(10):
        hit.record("s", 0.05 if i == 3 else 0.0, f"{uuid.uuid4()} tell me a joke")  # one request hit the cache
    assert not hit.is_polluted("s")
    hit.record("s", 0.0, f"{uuid.uuid4()} tell me a joke")  # it slides out of the last 10
    for _ in range(3):
        hit.record("s", 0.0, f"{uuid.uuid4()} tell me a joke")
    assert hit.is_polluted("s")

    words = PollutionDetector("reject")
    for w in ["apples", "pears", "plums", "figs", "dates", "limes", "kiwis", "grapes", "melons", "lemons"]:
        words.record("s", 0.0, f"tell me about {w}")
    assert not words.is_polluted("s")

    same = PollutionDetector("reject")
    for _ in range(10):
        same.record("s", 0.0, "123e4567-e89b-12d3-a456-426614174000 the same text each time")
    assert not same.is_polluted("s")  # identical prompts are not "differing only in entropy"

    off = PollutionDetector("off")
    for _ in range(10):
        off.record("s", 0.0, f"{uuid.uuid4()} tell me a joke")
    assert not off.is_polluted("s")
    with pytest.raises(ValueError):
        PollutionDetector("block")


# ---- helpers ---------------------------------------------------------------------------------------
def metric(url: str, name: str, **labels) -> float:
    """One sample's value from /metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def bound(url: str, b: dict) -> int:
    """The reservation a request makes: its prompt tokens, counted by the server, + max_tokens. (Counting
    is charged to its tenant: each count is a tenant of its own, a fresh key, so no test's budget pays.)"""
    r = httpx.post(url + "/v1/messages/count_tokens",
                   json={k: v for k, v in b.items() if k in ("model", "messages", "system")},
                   headers={"x-api-key": f"counter-{uuid.uuid4().hex}"}, timeout=60)
    return r.json()["input_tokens"] + b["max_tokens"]


def body(text: str | list[str], max_tokens: int, system: str | None = None, user_id: str | None = None) -> dict:
    """A list of texts becomes alternating user / assistant turns."""
    texts = [text] if isinstance(text, str) else text
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    b = {"model": "tiny", "max_tokens": max_tokens, "messages": messages}
    if system:
        b["system"] = system
    if user_id:
        b["metadata"] = {"user_id": user_id}
    return b


def post(url: str, b: dict, headers: dict | None = None) -> httpx.Response:
    # httpx, not the SDK, where the tenant must be metadata.user_id: the SDK always sends an API key,
    # which takes precedence
    return httpx.post(url + "/v1/messages", json=b, headers=headers or {}, timeout=60)


def spent(r: httpx.Response) -> int:
    """The measured cost a finished request is settled at: uncached prompt tokens + output tokens."""
    u = r.json()["usage"]
    return uncached_tokens(u) + u["output_tokens"]


def check_rejection(r: httpx.Response, remaining: int) -> None:
    assert r.status_code == 429, r.text
    err = r.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == "rate_limit_error"
    assert err["error"]["stratum_reason"] == "cost_threshold_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
    assert int(r.headers["anthropic-ratelimit-tokens-limit"]) == BUDGET
    assert int(r.headers["anthropic-ratelimit-tokens-remaining"]) == remaining
    reset = datetime.strptime(r.headers["anthropic-ratelimit-tokens-reset"],
                              "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert time.time() - 1 <= reset.timestamp() <= time.time() + WINDOW_S + 1
    assert r.headers.get("request-id")


# ---- admission by cost ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def budget_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--tenant-budget-tokens", str(BUDGET), "--budget-window-s", str(WINDOW_S),
                           "--pollution-policy", "off").wait_ready()
    yield server
    server.stop()


def test_exactly_the_over_budget_requests_are_rejected(budget_server):
    url, user = budget_server.url, "alice"
    system, first = "You count things.", "How many legs does a spider have?"
    r1 = post(url, body(first, 8, system, user))
    assert r1.status_code == 200, r1.text
    remaining = BUDGET - spent(r1)  # the reservation was replaced by the measured cost
    assert int(r1.headers["anthropic-ratelimit-tokens-remaining"]) == remaining
    # a conversation: the bound counts the whole templated prompt, system prompt included
    turns = [first, "Eight.", "Now count the legs of two spiders."]
    over = remaining + 1 - bound(url, body(turns, 0, system, user))
    assert over > 0
    check_rejection(post(url, body(turns, over, system, user)), remaining)
    r3 = post(url, body(turns, over - 1, system, user))  # exactly the remaining budget: admitted
    assert r3.status_code == 200, r3.text
    remaining = max(0, remaining - spent(r3))
    one_over = max(0, remaining + 1 - bound(url, body("ok?", 0, None, user)))
    check_rejection(post(url, body("ok?", one_over, None, user)), remaining)


FILL = long_text(28, tag="fill")  # about 280 tokens of the tiny model: with FILL_MAX_TOKENS, a bound of exactly BUDGET


@pytest.fixture(scope="module")
def fill_max_tokens(budget_server) -> int:
    n = BUDGET - bound(budget_server.url, body(FILL, 0))
    assert 0 < n < BUDGET // 2
    return n


def test_tenants_are_separate(budget_server, fill_max_tokens):
    url = budget_server.url
    fill = body(FILL, fill_max_tokens, None, "carol")
    first = post(url, fill)
    assert first.status_code == 200
    check_rejection(post(url, fill), max(0, BUDGET - spent(first)))
    # another user id has its own budget
    assert post(url, body(FILL, fill_max_tokens, None, "dave")).status_code == 200
    # so does each API key, which takes precedence over metadata.user_id
    kwargs = dict(model="tiny", max_tokens=fill_max_tokens, messages=[{"role": "user", "content": FILL}],
                  metadata={"user_id": "carol"})
    keyed = anthropic.Anthropic(base_url=url, api_key="key-one", max_retries=0)
    assert keyed.messages.create(**kwargs).usage.output_tokens >= 1
    with pytest.raises(anthropic.RateLimitError) as e:
        keyed.messages.create(**kwargs)
    assert e.value.body["error"]["stratum_reason"] == "cost_threshold_exceeded"
    assert int(e.value.response.headers["retry-after"]) >= 1
    other = anthropic.Anthropic(base_url=url, api_key="key-two", max_retries=0)
    assert other.messages.create(**kwargs).usage.output_tokens >= 1


def test_rejected_requests_do_no_work(budget_server, fill_max_tokens):
    url = budget_server.url
    fill = body(FILL, fill_max_tokens, None, "erin")
    assert post(url, fill).status_code == 200
    before = {name: metric(url, name) for name in ("stratum_prompt_tokens_total", "stratum_cache_query_count_total",
                                                   "stratum_engine_steps")}
    rejected = metric(url, "stratum_admission_rejections_total", reason="cost_threshold_exceeded")
    answered = metric(url, "stratum_request_count_total", endpoint="/v1/messages", status="429")
    blocks = httpx.get(url + "/health").json()["kv_blocks"]
    for _ in range(3):
        assert post(url, fill).status_code == 429
    assert {name: metric(url, name) for name in before} == before
    assert metric(url, "stratum_admission_rejections_total", reason="cost_threshold_exceeded") == rejected + 3
    assert metric(url, "stratum_request_count_total", endpoint="/v1/messages", status="429") == answered + 3
    assert httpx.get(url + "/health").json()["kv_blocks"] == blocks


def test_streams_are_admitted_by_cost_too(budget_server, fill_max_tokens):
    url = budget_server.url
    fill = body(FILL, fill_max_tokens, None, "frank")
    assert post(url, fill).status_code == 200
    with httpx.stream("POST", url + "/v1/messages", json={**fill, "stream": True}, timeout=60) as r:
        assert r.status_code == 429
        assert r.headers["anthropic-ratelimit-tokens-limit"] == str(BUDGET)


def test_concurrent_requests_cannot_overrun_the_budget(budget_server):
    """Through the OpenAI endpoint, as a client that sends no max_tokens: each request may generate to the end
    of the context, so none fits; with max_tokens, only as many as the budget holds run, however concurrent."""
    import concurrent.futures

    import openai

    client = openai.OpenAI(base_url=budget_server.url + "/v1", api_key="overrun-tenant", max_retries=0)

    def ask(max_tokens: int | None):
        extra = {"max_tokens": max_tokens} if max_tokens is not None else {}
        try:
            return client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}],
                extra_body={"ignore_eos": True}, **extra)
        except openai.RateLimitError as e:
            return e

    for max_tokens in (None, 100):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(ask, [max_tokens] * 4))
        ok = [r.parse() for r in results if not isinstance(r, openai.RateLimitError)]
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        if max_tokens is None:
            assert not ok
        else:  # as many as their bounds fit in the budget: two or three of the four
            assert ok and len(ok) == BUDGET // (ok[0].usage.prompt_tokens + max_tokens) < 4
        assert sum(c.usage.total_tokens - c.usage.prompt_tokens_details.cached_tokens for c in ok) <= BUDGET
        for e in refused:
            assert e.code == "cost_threshold_exceeded"
            assert "max_tokens" in e.message
            assert int(e.response.headers["x-ratelimit-limit-tokens"]) == BUDGET
        for r in results:
            if not isinstance(r, openai.RateLimitError):  # successful responses say where the budget stands
                assert int(r.headers["anthropic-ratelimit-tokens-limit"]) == BUDGET
                assert 0 <= int(r.headers["x-ratelimit-remaining-tokens"]) < BUDGET


def test_prompts_are_counted_in_tokens_not_characters(budget_server):
    """100 emoji are 25 tokens by the old characters / 4 rule, and hundreds of byte tokens in fact."""
    url = budget_server.url
    emoji = body("\U0001F600" * 100, 100, None, "emoji-user")
    assert bound(url, emoji) > BUDGET > len("\U0001F600" * 100) // 4 + 100
    check_rejection(post(url, emoji), BUDGET)


def test_refusals_after_admission_carry_the_tenants_window_too(budget_server):
    r = post(budget_server.url, body("x " * 2100, 1, None, "long-prompt-user"))  # over the 2,048-token context
    assert r.status_code == 400, r.text
    assert int(r.headers["anthropic-ratelimit-tokens-remaining"]) == BUDGET  # refused: nothing reserved


def test_streams_carry_the_tenants_window(budget_server):
    with httpx.stream("POST", budget_server.url + "/v1/messages", json={**body("Hi there.", 4, None, "stream-user"),
                                                                       "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert int(r.headers["anthropic-ratelimit-tokens-limit"]) == BUDGET
        # at the start of a stream the request's bound is still reserved
        assert int(r.headers["anthropic-ratelimit-tokens-remaining"]) <= BUDGET - 4 - 1
        r.read()


@pytest.fixture(scope="module")
def no_waiting_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--max-waiting", "0").wait_ready()
    yield server
    server.stop()


def test_full_queue_is_529_before_any_work(no_waiting_server):
    url = no_waiting_server.url
    r = post(url, body("hello", 4))
    assert r.status_code == 529
    assert r.json()["error"]["type"] == "overloaded_error"
    assert int(r.headers["retry-after"]) >= 1
    assert metric(url, "stratum_admission_rejections_total", reason="queue_full") == 1
    assert metric(url, "stratum_engine_steps") == 0 and metric(url, "stratum_prompt_tokens_total") == 0


# ---- the 418 policy ------------------------------------------------------------------------------------
def session_prompt(variant: str) -> dict:
    # the variable part opens the prompt, so even the first KV block differs and the cache misses
    return body("Summarise the weather report for today.", 2, f"{variant} Session of the weather assistant.",
                "sess-user")


def run_session(url: str, variants: list[str]) -> list[httpx.Response]:
    return [post(url, session_prompt(v)) for v in variants]


def uuids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


@pytest.fixture(scope="module")
def reject_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--pollution-policy", "reject").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def off_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--pollution-policy", "off").wait_ready()
    yield server
    server.stop()


def test_reject_policy_answers_418_after_ten_polluted_requests(reject_server):
    url = reject_server.url
    rejected = metric(url, "stratum_admission_rejections_total", reason="cache_pollution")
    first = run_session(url, uuids(10))
    for r in first:
        assert r.status_code == 200 and "x-stratum-advice" not in r.headers
        assert float(r.headers["x-stratum-cost"].split(",")[0].split("=")[1]) < 0.05
    r = post(url, session_prompt(str(uuid.uuid4())))
    assert r.status_code == 418
    assert r.headers["x-stratum-advice"] == ADVICE
    assert r.json()["error"]["stratum_reason"] == "cache_pollution"
    assert metric(url, "stratum_admission_rejections_total", reason="cache_pollution") == rejected + 1
    # the session's history is forgotten: the next request is served again
    r = post(url, session_prompt(str(uuid.uuid4())))
    assert r.status_code == 200 and "x-stratum-advice" not in r.headers
    # another session is unaffected
    other = body("Summarise the weather report for today.", 2, f"{uuid.uuid4()} Session of the weather assistant.",
                 "other-user")
    assert post(url, other).status_code == 200


def test_the_session_header_names_the_session(reject_server):
    """x-stratum-session-id takes precedence over metadata.user_id, which differs on every request here."""
    url, headers = reject_server.url, {"x-stratum-session-id": "hdr-session"}

    def request(i: int) -> httpx.Response:
        b = body("Summarise the weather report for today.", 2, f"{uuid.uuid4()} Session of the weather assistant.",
                 f"user-{i}")
        return post(url, b, headers)

    assert [request(i).status_code for i in range(10)] == [200] * 10
    r = request(10)
    assert r.status_code == 418 and r.headers["x-stratum-advice"] == ADVICE


def test_prompts_differing_in_words_never_trigger(reject_server):
    words = ["Apples", "Pears", "Plums", "Figs", "Dates", "Limes", "Kiwis", "Grapes", "Melons", "Lemons", "Cherries"]
    responses = [post(reject_server.url, body("Summarise the report.", 2, f"{w} session.", "words-user"))
                 for w in words]
    assert [r.status_code for r in responses] == [200] * 11
    assert not any("x-stratum-advice" in r.headers for r in responses)


def test_advise_policy_only_adds_the_header(tiny_server):
    url = tiny_server.url  # the default policy is advise
    before = metric(url, "stratum_pollution_advice_total")

    def payload(variant: str) -> dict:
        return body("Summarise the weather report for today.", 2, f"{variant} Session of the weather assistant.",
                    "advise-user")

    for v in uuids(10):
        r = post(url, payload(v))
        assert r.status_code == 200 and "x-stratum-advice" not in r.headers
    for v in uuids(2):
        r = post(url, payload(v))
        assert r.status_code == 200
        assert r.headers["x-stratum-advice"] == ADVICE
    assert metric(url, "stratum_pollution_advice_total") == before + 2


def test_off_policy_does_nothing(off_server):
    responses = run_session(off_server.url, uuids(12))
    assert [r.status_code for r in responses] == [200] * 12
    assert not any("x-stratum-advice" in r.headers for r in responses)


def test_a_request_refused_after_admission_is_not_charged(budget_server):
    """A 400 raised after the budget check (here an unknown X-Stratum-Mode) did no work, so it must not
    keep its estimate charged: the tenant's whole budget is still there afterwards."""
    url = budget_server.url
    fill = body(FILL, 10, None, "gina")
    r = post(url, fill, headers={"x-stratum-mode": "turbo"})
    assert r.status_code == 400
    r = post(url, fill)
    assert r.status_code == 200, r.text


def test_settlement_never_touches_a_later_window():
    """docs: the estimate is replaced by the measured cost "in the window it was charged in, if still open"."""
    clock = FakeClock(1000.0)
    adm = CostAdmission(100, window_s=10, clock=clock)
    first = adm.reserve("a", 60)  # a long request, charged in the first window
    clock.t = 1012.0
    assert adm.reserve("a", 70).remaining == 30  # a new window, charged 70
    adm.settle("a", 60, 5, first.reset_at)  # the first request finishes now: its window is closed
    d = adm.reserve("a", 31)
    assert not d.is_admitted and d.remaining == 30
