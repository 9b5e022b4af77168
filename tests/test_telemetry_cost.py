"""Cost telemetry checked from first principles (docs/telemetry.md).

Every figure a response reports is recomputed here from things the test itself knows: prompts built
token by token so the shared prefix is known, wall-clock bounds the test measured, and the documented
pricing formulas written out again below (not imported from the code under test).
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
import time
import uuid

import anthropic
import httpx
import pytest
import torch

from stratum.client.cost import parse_stratum_cost
from stratum.engine.output_processor import TOOL_RESERVE_TOKENS
from stratum.engine.outputs import MetaState
from stratum.telemetry.cost import ArticleFormula, CostFields, TokenPricing, pricing_from_spec
from tests.conftest import ServerProcess
from tests.factories import rereads
from tests.sse import META_ON, delta_metas, sse_events

BLOCK = 16  # EngineConfig.block_size
TRACE_STEP_KEYS = {
    "queue": {"name", "duration_us"},
    "prefill": {"name", "duration_us", "cache_hit", "cache_hit_ratio", "cached_tokens", "computed_tokens", "chunks",
                "tiers", "disk_read_us", "memory_used_mb"},
    "decode_loop": {"name", "duration_us", "tokens", "kv_sparsity", "kv_sparsity_samples", "tokens_per_second",
                    "speculative", "thinking", "inter_token"},
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- helpers shared with the other telemetry test modules ---------------------------------------------
def parse_cost(value: str) -> dict[str, float]:
    """`cache_hit_ratio=0.82,prefill_latency_us=14200,kv_sparsity=0.33` -> dict, parsed independently of the code."""
    fields = dict(part.split("=", 1) for part in value.split(","))
    assert set(fields) <= {"cache_hit_ratio", "prefill_latency_us", "kv_sparsity", "spec_proposed_tokens",
                           "spec_accepted_tokens"}, value
    out = {k: float(v) for k, v in fields.items()}
    out.setdefault("kv_sparsity", None)
    return out


def decode(trace: str) -> dict:
    return json.loads(base64.b64decode(trace))


def article_usd(cost: dict, base_rate=0.001, latency_premium=0.0001, hit_discount=1.0, sparsity_penalty=0.02) -> float:
    """docs/telemetry.md, "Pricing": the article formula; an unmeasured kv_sparsity counts as 1."""
    sparsity = 1.0 if cost["kv_sparsity"] is None else cost["kv_sparsity"]
    return (base_rate + (cost["prefill_latency_us"] / 10000) * latency_premium
            - cost["cache_hit_ratio"] * 0.0005 * hit_discount + (1 - sparsity) * sparsity_penalty)


def tokens_usd(usage: dict, input_per_mtok: float, cached_input_per_mtok: float, output_per_mtok: float) -> float:
    """docs/telemetry.md: USD per million uncached input (cache writes are uncached), cached input and output tokens."""
    return (uncached_tokens(usage) * input_per_mtok + usage["cache_read_input_tokens"] * cached_input_per_mtok
            + usage["output_tokens"] * output_per_mtok) / 1e6


def uncached_tokens(usage) -> int:
    """Prompt tokens that went through the forward. Anthropic's input_tokens counts neither cache reads
    nor cache writes, so the writes are added back."""
    u = usage if isinstance(usage, dict) else usage_dict(usage)
    return u["input_tokens"] + u["cache_creation_input_tokens"]


def prompt_tokens(usage) -> int:
    u = usage if isinstance(usage, dict) else usage_dict(usage)
    return uncached_tokens(u) + u["cache_read_input_tokens"]


USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def usage_dict(usage) -> dict[str, int]:
    """The four usage counts of an SDK Usage object (the SDK model has more, optional, fields)."""
    return {k: getattr(usage, k) for k in USAGE_KEYS}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def unique_system(tag: str) -> str:
    # the nonce sits right after "<|im_start|>system\n", so no other request shares even the first block
    return f"{uuid.uuid4().hex[:12]} {tag}"


def long_text(n_words: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i} is {i * 7 % 100}" for i in range(n_words))


# ---- units: the header and the pricing formulas ---------------------------------------------------------
def test_cost_header_round_trip_and_docs_example():
    """The server writes the header (CostFields), the client parses it (parse_stratum_cost)."""
    doc = "cache_hit_ratio=0.82,prefill_latency_us=14200,kv_sparsity=0.33"
    assert CostFields(0.82, 14200, 0.33).header() == doc
    parsed = parse_stratum_cost(doc)
    assert (parsed.cache_hit_ratio, parsed.prefill_latency_us, parsed.kv_sparsity) == (0.82, 14200, 0.33)
    assert parsed.header() == doc
    unmeasured = CostFields(0.5, 10, None)
    assert unmeasured.header() == "cache_hit_ratio=0.5,prefill_latency_us=10"
    assert parse_stratum_cost(unmeasured.header()).kv_sparsity is None
    with pytest.raises(ValueError):
        parse_stratum_cost("cache_hit_ratio")


def test_article_formula_matches_docs():
    # docs example: 0.001 + 1.42 * 0.0001 - 0.82 * 0.0005 + 0.67 * 0.02
    fields = CostFields(0.82, 14200, 0.33)
    assert ArticleFormula().price(fields, {}) == pytest.approx(0.014132, abs=1e-12)
    assert ArticleFormula().price(fields, {}) == pytest.approx(article_usd(fields.as_dict()), abs=1e-15)
    # with the default parameters the estimate is never negative: the minimum is a full hit at zero latency
    assert ArticleFormula().price(CostFields(1.0, 0, None), {}) == pytest.approx(0.0005)
    custom = pricing_from_spec("article:base_rate=0.002,latency_premium=0.0003,hit_discount=2,sparsity_penalty=0.05")
    assert custom == ArticleFormula(0.002, 0.0003, 2.0, 0.05)
    assert custom.price(fields, {}) == pytest.approx(article_usd(fields.as_dict(), 0.002, 0.0003, 2.0, 0.05), abs=1e-15)


def test_token_pricing_and_spec_parsing():
    usage = {"input_tokens": 1000, "cache_read_input_tokens": 4000, "output_tokens": 250,
             "cache_creation_input_tokens": 320}
    p = pricing_from_spec("tokens:input_per_mtok=3,cached_input_per_mtok=0.3,output_per_mtok=15")
    assert p == TokenPricing(3.0, 0.3, 15.0)
    assert p.price(CostFields(0, 0, None), usage) == pytest.approx(tokens_usd(usage, 3, 0.3, 15), abs=1e-15)
    assert pricing_from_spec("article") == ArticleFormula()
    assert pricing_from_spec("tokens") == TokenPricing()
    with pytest.raises(ValueError):
        pricing_from_spec("per-request")


# ---- cache_hit_ratio from a prefix the test constructed ----------------------------------------------
def shared_prefix_pair(template, k: int) -> tuple[list, list, list[int], list[int]]:
    """Messages A and B whose prompt token ids share exactly k full blocks plus part of the next one
    (which B reads too: A's next block is full, cached, and its shared slots are copied).

    The B prompt is A's user text cut at some character and given a different tail; the cut is chosen
    by tokenizing, so the test knows the shared prefix exactly, not approximately.
    """
    system = unique_system("You answer questions about numbers.")
    base = long_text(80)
    msgs_a = [{"role": "system", "content": system}, {"role": "user", "content": base}]
    ids_a = template.encode(msgs_a)
    for cut in range(1, len(base)):
        msgs_b = [{"role": "system", "content": system},
                  {"role": "user", "content": base[:cut] + " ZZZ completely different ending QQQ"}]
        ids_b = template.encode(msgs_b)
        shared = common_prefix(ids_a, ids_b)
        if shared // BLOCK == k and shared % BLOCK != 0 and len(ids_b) > (k + 1) * BLOCK:
            return msgs_a, msgs_b, ids_a, ids_b
    raise AssertionError(f"no cut gives exactly {k} shared blocks")


@pytest.mark.parametrize("k", [2, 5])
def test_cache_hit_ratio_from_a_known_shared_prefix(tiny_server, client, tiny_template, k):
    msgs_a, msgs_b, ids_a, ids_b = shared_prefix_pair(tiny_template, k)
    assert len(ids_a) > (k + 1) * BLOCK
    for msgs, ids in ((msgs_a, ids_a), (msgs_b, ids_b)):
        counted = client.messages.count_tokens(model="tiny", system=msgs[0]["content"], messages=msgs[1:])
        assert counted.input_tokens == len(ids)

    raw_a = client.messages.with_raw_response.create(model="tiny", max_tokens=4, system=msgs_a[0]["content"],
                                                     messages=msgs_a[1:], extra_headers={"x-stratum-debug": "true"})
    a = raw_a.parse()
    # A starts with a fresh nonce: nothing cached, and every full prompt block is new in the cache
    assert a.usage.cache_read_input_tokens == 0
    assert a.usage.cache_creation_input_tokens == 0  # no cache_control: automatic caching is not a cache write
    assert a.usage.input_tokens == len(ids_a)
    assert parse_cost(raw_a.headers["x-stratum-cost"])["cache_hit_ratio"] == 0

    raw_b = client.messages.with_raw_response.create(model="tiny", max_tokens=4, system=msgs_b[0]["content"],
                                                     messages=msgs_b[1:], extra_headers={"x-stratum-debug": "true"})
    b = raw_b.parse()
    cached = common_prefix(ids_a, ids_b)  # k full blocks, and the slots of the next that A's cached block shares
    assert cached // BLOCK == k and cached % BLOCK
    assert b.usage.cache_read_input_tokens == cached
    assert b.usage.cache_creation_input_tokens == 0
    assert b.usage.input_tokens == len(ids_b) - cached
    cost = parse_cost(raw_b.headers["x-stratum-cost"])
    assert cost["cache_hit_ratio"] == round(cached / len(ids_b), 4)
    assert abs(cost["cache_hit_ratio"] - cached / len(ids_b)) <= 5e-5
    prefill = decode(raw_b.headers["x-stratum-trace"])["steps"][1]
    assert prefill["cache_hit"] is True
    assert prefill["cached_tokens"] == cached
    assert prefill["computed_tokens"] == len(ids_b) - cached
    assert prefill["cache_hit_ratio"] == cost["cache_hit_ratio"]


def test_identical_request_hits_at_least_90_percent(client, tiny_template):
    system, text = unique_system("Repeat after me."), long_text(60)
    n = len(tiny_template.encode([{"role": "system", "content": system}, {"role": "user", "content": text}]))
    assert n >= 160
    ratios = []
    for _ in range(2):
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2, system=system,
                                                       messages=[{"role": "user", "content": text}])
        ratios.append(parse_cost(raw.headers["x-stratum-cost"])["cache_hit_ratio"])
        usage = raw.parse().usage
    assert ratios[0] == 0
    assert ratios[1] >= 0.9
    # at least one token is always computed; the first run's 2 tokens may have filled the tail's block
    assert usage.cache_read_input_tokens == rereads(n, 2)


# ---- prefill_latency_us, the trace and its documented keys --------------------------------------------
def test_prefill_latency_within_observed_wall_clock(client):
    system, text = unique_system("Latency."), long_text(40)
    t0 = time.perf_counter()
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=8, system=system,
                                                   messages=[{"role": "user", "content": text}],
                                                   extra_headers={"x-stratum-debug": "true"})
    round_trip_us = (time.perf_counter() - t0) * 1e6
    cost = parse_cost(raw.headers["x-stratum-cost"])
    assert 0 < cost["prefill_latency_us"] <= round_trip_us
    steps = decode(raw.headers["x-stratum-trace"])["steps"]
    assert steps[1]["duration_us"] == cost["prefill_latency_us"]
    assert 0 <= steps[0]["duration_us"] and 0 <= steps[2]["duration_us"]
    assert sum(s["duration_us"] for s in steps) <= round_trip_us + 3  # each step is rounded to the microsecond


def test_trace_documents_every_step(client, tiny_server, tiny_model_dir):
    system, text = unique_system("Trace."), long_text(40)
    n_out = 17
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=n_out, system=system,
                                                   messages=[{"role": "user", "content": text}],
                                                   extra_headers={"x-stratum-debug": "full"},
                                                   extra_body={"ignore_eos": True, "temperature": 0})
    msg = raw.parse()
    doc = decode(raw.headers["x-stratum-trace"])
    assert doc["version"] == "1"
    assert doc["trace_id"].startswith("trace_") and len(doc["trace_id"]) > len("trace_")
    assert [s["name"] for s in doc["steps"]] == ["queue", "prefill", "decode_loop"]
    for step in doc["steps"]:
        assert set(step) == TRACE_STEP_KEYS[step["name"]], step
    queue, prefill, decode_loop = doc["steps"]
    prompt = prompt_tokens(msg.usage)
    assert doc["usage"] == usage_dict(msg.usage)
    assert doc["cost"] == parse_cost(raw.headers["x-stratum-cost"])
    assert prefill["chunks"] == math.ceil(prefill["computed_tokens"] / 512)  # --max-batched-tokens 512 per step
    assert prefill["computed_tokens"] + prefill["cached_tokens"] == prompt
    assert sum(prefill["tiers"].values()) == prefill["cached_tokens"] and set(prefill["tiers"]) == {"pool", "disk"}
    # memory_used_mb: the KV bytes of the blocks held at the first token (the prompt's blocks)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    hw = doc["hardware"]
    per_block = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * BLOCK
                 * ITEMSIZE[hw["dtype"]])
    assert prefill["memory_used_mb"] == round(math.ceil(prompt / BLOCK) * per_block / 2**20, 4)
    assert decode_loop["tokens"] == msg.usage.output_tokens - 1 == n_out - 1
    assert 0 < decode_loop["kv_sparsity"] <= 1
    assert decode_loop["kv_sparsity"] == doc["cost"]["kv_sparsity"]
    # sampled at the first token and at every 8th output token after it
    assert decode_loop["kv_sparsity_samples"] == (n_out - 1) // 8 + 1
    assert decode_loop["tokens_per_second"] == pytest.approx(
        decode_loop["tokens"] / (decode_loop["duration_us"] / 1e6), rel=1e-3)
    gaps = decode_loop["inter_token"]  # one per output after the first (speculation may bring several tokens)
    assert 0 < gaps["gaps"] <= decode_loop["tokens"] and gaps["max_ms"] >= gaps["p99_ms"] >= 0
    assert gaps["mean_ms"] * gaps["gaps"] <= decode_loop["duration_us"] / 1e3 + 0.01 * gaps["gaps"]
    # X-Stratum-Debug: full adds the hardware
    assert isinstance(hw["threads"], int) and hw["threads"] >= 1
    assert hw["rss_mb"] > 0
    assert hw["process_cpu_seconds"] >= 0
    assert hw["device"] in ("cpu", "cuda") or hw["device"].startswith("cuda")
    assert "kernels" in hw
    plain = client.messages.with_raw_response.create(model="tiny", max_tokens=1,
                                                     messages=[{"role": "user", "content": "x"}],
                                                     extra_headers={"x-stratum-debug": "true"})
    assert "hardware" not in decode(plain.headers["x-stratum-trace"])
    none = client.messages.with_raw_response.create(model="tiny", max_tokens=1,
                                                    messages=[{"role": "user", "content": "x"}])
    assert "x-stratum-trace" not in none.headers
    assert "x-stratum-cost" in none.headers


def test_default_article_estimate_recomputes_from_reported_fields(client):
    for _ in range(2):  # a miss, then a hit: the hit discount is exercised too
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=4,
                                                       system="Recompute the article price.",
                                                       messages=[{"role": "user", "content": long_text(30)}],
                                                       extra_headers={"x-stratum-debug": "true"})
        doc = decode(raw.headers["x-stratum-trace"])
        assert doc["pricing"] == {"name": "article", "base_rate": 0.001, "latency_premium": 0.0001, "hit_discount": 1.0,
                                  "sparsity_penalty": 0.02}
        header = parse_cost(raw.headers["x-stratum-cost"])
        assert doc["final_cost_estimate"] == pytest.approx(article_usd(header), abs=1e-9)
    assert header["cache_hit_ratio"] > 0


PRICING_SPECS = {
    "tokens": "tokens:input_per_mtok=3,cached_input_per_mtok=0.3,output_per_mtok=15",
    "article": "article:base_rate=0.002,latency_premium=0.0003,hit_discount=2,sparsity_penalty=0.05",
}


@pytest.fixture(scope="module", params=sorted(PRICING_SPECS))
def priced_server(request, tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--pricing", PRICING_SPECS[request.param]).wait_ready()
    yield request.param, server
    server.stop()


def expected_usd(kind: str, cost: dict, usage: dict) -> float:
    if kind == "tokens":
        return tokens_usd(usage, 3, 0.3, 15)
    return article_usd(cost, 0.002, 0.0003, 2, 0.05)


def test_configured_pricing_recomputes_from_reported_fields(priced_server):
    kind, server = priced_server
    c = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
    kwargs = dict(model="tiny", max_tokens=6, system="Pricing check.",
                  messages=[{"role": "user", "content": long_text(30)}],
                  extra_headers={"x-stratum-debug": "true"})
    for _ in range(2):
        raw = c.messages.with_raw_response.create(**kwargs)
        doc = decode(raw.headers["x-stratum-trace"])
        usage = usage_dict(raw.parse().usage)
        assert doc["pricing"]["name"] == kind
        assert doc["usage"] == usage
        assert doc["final_cost_estimate"] == pytest.approx(
            expected_usd(kind, parse_cost(raw.headers["x-stratum-cost"]), usage), abs=1e-9)
    assert usage["cache_read_input_tokens"] > 0
    # a warm-up never samples: kv_sparsity is omitted from the header, null in the trace, and priced as 1
    raw = c.messages.with_raw_response.create(**{**kwargs, "max_tokens": 0})
    doc = decode(raw.headers["x-stratum-trace"])
    assert "kv_sparsity" not in raw.headers["x-stratum-cost"]
    assert doc["cost"]["kv_sparsity"] is None and doc["steps"][2]["kv_sparsity"] is None
    assert doc["final_cost_estimate"] == pytest.approx(
        expected_usd(kind, doc["cost"], usage_dict(raw.parse().usage)), abs=1e-9)
    # the stream's last event carries the same estimate
    with httpx.stream("POST", server.url + "/v1/messages",
                      json={**{k: v for k, v in kwargs.items() if k != "extra_headers"}, "stream": True},
                      headers=META_ON, timeout=60) as r:
        events = sse_events(r.iter_lines())
    cost_event = [d for n, d in events if n == "stratum_cost"][0]
    usage = [d for n, d in events if n == "message_delta"][0]["usage"]
    assert cost_event["final_cost_estimate"] == pytest.approx(expected_usd(kind, cost_event["cost"], usage), abs=1e-9)


def test_openai_responses_carry_the_cost(tiny_server):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "cost on the OpenAI side"}]}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, headers={"x-stratum-debug": "true"}, timeout=60)
    assert r.status_code == 200
    cost = parse_cost(r.headers["x-stratum-cost"])
    doc = decode(r.headers["x-stratum-trace"])
    assert doc["cost"] == cost
    assert prompt_tokens(doc["usage"]) == r.json()["usage"]["prompt_tokens"]
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [d for _, d in sse_events(r.iter_lines())]
    assert not [c for c in chunks if set(c) - {"id", "object", "created", "model", "choices", "usage", "done"}]
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=META_ON, timeout=60) as r:
        chunks = [d for _, d in sse_events(r.iter_lines())]
    final = [c for c in chunks if "stratum_cost" in c]
    assert len(final) == 1
    assert final[0]["stratum_cost"]["final_cost_estimate"] == pytest.approx(
        article_usd(final[0]["stratum_cost"]["cost"]), abs=1e-9)


# ---- streaming: a meta event after every delta, the stratum_cost event, and the SDK --------------------------
def test_stream_meta_states_and_cost_event(tiny_server):
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Hello world!"}]}
    with httpx.stream("POST", tiny_server.url + "/v1/messages", json=body,
                      headers={"x-stratum-debug": "true", **META_ON}, timeout=60) as r:
        assert r.status_code == 200
        early = parse_cost(r.headers["x-stratum-cost"])
        assert r.headers["x-stratum-mode"] == "normal"
        events = sse_events(r.iter_lines())
    names = [n for n, _ in events]
    assert names[-2:] == ["stratum_cost", "message_stop"]
    assert names.count("stratum_cost") == 1
    metas = [meta for _, meta in delta_metas(events)]
    assert metas and not [d for n, d in events if n == "content_block_delta" and "meta" in d["delta"]]
    states = [m["stratum_state"] for m in metas]
    assert states[0] == "prefill_complete"
    steps = [int(s.removeprefix("decode_step_")) for s in states[1:]]
    assert all(s.startswith("decode_step_") for s in states[1:]), states
    assert steps == sorted(set(steps)) and steps[0] >= 1 and steps[-1] <= 23
    assert all(0 < m["kv_cache_efficiency"] <= 1 for m in metas)
    cost = [d for n, d in events if n == "stratum_cost"][0]
    assert set(cost) >= {"type", "cost", "header", "final_cost_estimate", "mode", "trace"}
    assert parse_cost(cost["header"]) == cost["cost"]
    # the headers went out after prefill: their hit ratio and prefill latency are the final ones
    assert early["cache_hit_ratio"] == cost["cost"]["cache_hit_ratio"]
    assert early["prefill_latency_us"] == cost["cost"]["prefill_latency_us"]
    doc = decode(cost["trace"])
    assert doc["cost"] == cost["cost"] and doc["final_cost_estimate"] == cost["final_cost_estimate"]
    assert doc["usage"] == [d for n, d in events if n == "message_delta"][0]["usage"]


def test_sdk_parses_streams_with_meta_and_cost_event(client):
    kwargs = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "Hello world!"}],
                  extra_body={"temperature": 0, "ignore_eos": True})
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 16
    assert [e.type for e in client.messages.create(stream=True, **kwargs)].count("stratum_cost") == 0
    raw_events = list(client.messages.create(stream=True, extra_headers=META_ON, **kwargs))
    types = [e.type for e in raw_events]
    assert "stratum_cost" in types and types[-1] == "message_stop"
    cost_event = raw_events[types.index("stratum_cost")].model_dump()
    assert 0 <= cost_event["cost"]["cache_hit_ratio"] <= 1
    metas = [e.model_dump() for e in raw_events if e.type == "stratum_meta"]
    assert metas[0]["meta"]["stratum_state"] == "prefill_complete"


# ---- tool_use_prepared -------------------------------------------------------------------------------
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


FORCED_TOOL_MAX_TOKENS = 60


@pytest.fixture(scope="module")
def forced_tool_stream(real_server) -> list[tuple[str, dict]]:
    body = {"model": "smollm2-135m", "max_tokens": FORCED_TOOL_MAX_TOKENS, "temperature": 0, "tools": [WEATHER_TOOL],
            "stream": True, "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    with httpx.stream("POST", real_server.url + "/v1/messages", json=body, headers=META_ON, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    return events


@pytest.mark.integration
def test_forced_tool_call_reserves_kv_for_its_arguments(forced_tool_stream):
    """The reservation is visible from outside: the blocks held at the end are sized for the reserved
    argument tokens, so kv_cache_efficiency is computed over more slots than the tokens need."""
    events = forced_tool_stream
    usage = [d for n, d in events if n == "message_delta"][0]["usage"]
    prompt = prompt_tokens(usage)
    n_out = usage["output_tokens"]
    assert n_out < FORCED_TOOL_MAX_TOKENS  # the call closed before the limit, inside the reservation
    reserve = min(FORCED_TOOL_MAX_TOKENS - 1, 128)  # reserved at the first sampled token
    computed = prompt  # at that moment the prompt is computed and the first sampled token is not yet
    # the tool block's first delta carries the meta of the output where the call began (tool_use_prepared)
    efficiency = [meta["kv_cache_efficiency"] for delta, meta in delta_metas(events)
                  if delta["type"] == "input_json_delta"][0]
    assert efficiency == round(computed / (math.ceil((prompt + 1 + reserve) / BLOCK) * BLOCK), 4)
    assert efficiency < computed / (math.ceil((computed + 1) / BLOCK) * BLOCK)


@pytest.mark.integration
def test_forced_tool_stream_meta_shows_tool_use_prepared(forced_tool_stream):
    states = [meta["stratum_state"] for _, meta in delta_metas(forced_tool_stream)]
    assert "tool_use_prepared" in states, states


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from stratum.engine.config import EngineConfig
    from stratum.engine import EngineCore
    from stratum.models.loader import load_checkpoint

    return EngineCore(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64),
                     checkpoint=load_checkpoint(tiny_model_dir))


def run_to_end(engine, seq, on_step=None) -> list:
    outs = []
    while engine.has_unfinished():
        for out in engine.step():
            outs.append(out)
        if on_step:
            on_step(seq)
        engine.block_manager.check_integrity()
    return outs


def test_engine_reserves_kv_for_tool_arguments(tiny_engine):
    from stratum.engine.sampling_params import SamplingParams

    engine = tiny_engine
    ids = engine.tokenizer.encode(long_text(20))
    max_tokens = 40
    seq = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             tool_marker="")
    seen = []

    def watch(s):
        seen.append((s.num_computed_tokens, len(s.block_table), s.num_reserved_tokens))

    outs = run_to_end(engine, seq, watch)
    # the empty marker (a forced tool call) is seen on the first sampled token
    computed, num_blocks, reserved = seen[0]
    assert outs[0].state is MetaState.TOOL_USE_PREPARED
    assert reserved == max_tokens - 1 == seq.num_reserved_tokens
    assert num_blocks == math.ceil((computed + 1 + reserved) / BLOCK)
    assert num_blocks > math.ceil((computed + 1) / BLOCK)
    assert outs[-1].finished and outs[-1].stats.num_tool_reserved_tokens == reserved
    assert [o.state_label for o in outs[1:]] == [f"decode_step_{n}" for n in range(1, max_tokens)]
    # every block is back: nothing in use, all free or cached
    bm = engine.block_manager
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks


def test_engine_reservation_is_capped_and_absent_without_a_call(tiny_engine):
    from stratum.engine.sampling_params import SamplingParams

    engine = tiny_engine
    ids = engine.tokenizer.encode(long_text(10))
    seq = engine.add_request(ids, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True), tool_marker="")
    engine.step()
    assert seq.num_reserved_tokens == TOOL_RESERVE_TOKENS == 128
    assert len(seq.block_table) == math.ceil((len(ids) + 1 + 128) / BLOCK)
    engine.abort(seq.request_id)
    plain = engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               tool_marker="<tool_call>")
    outs = run_to_end(engine, plain)
    assert plain.num_reserved_tokens == 0 and MetaState.TOOL_USE_PREPARED not in [o.state for o in outs]
    assert engine.block_manager.num_used_blocks == 0


# ---- `stratum trace decode` ----------------------------------------------------------------------------
def test_trace_decode_cli_prints_the_json(client, capsys):
    from stratum.cli import main

    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2,
                                                   messages=[{"role": "user", "content": "trace me"}],
                                                   extra_headers={"x-stratum-debug": "true"})
    value = raw.headers["x-stratum-trace"]
    done = subprocess.run([sys.executable, "-m", "stratum.cli", "trace", "decode", value], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == decode(value)
    assert main(["trace", "decode", f"x-stratum-trace: {value}"]) == 0
    assert json.loads(capsys.readouterr().out) == decode(value)
    assert main(["trace", "decode", "not base64!"]) == 1
    assert "not a Stratum trace" in capsys.readouterr().err


def test_attention_coverage_counts_the_positions_that_hold_the_mass():
    """kv_sparsity's sample: per head, the fewest context positions whose attention holds `mass`, as a
    share of the context, averaged over the heads."""
    from stratum.layers.attention import attention_coverage

    k = torch.zeros(10, 1, 4)
    k[3, 0, 0] = 100.0  # one key the first query attends to almost alone
    q = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]])  # two heads on one KV head: peaked, and uniform
    assert attention_coverage(q, k, 1.0, mass=0.85) == pytest.approx((1 / 10 + 9 / 10) / 2)
    assert attention_coverage(q, k[:1], 1.0) == 1.0  # a first token: its one position is all its context
