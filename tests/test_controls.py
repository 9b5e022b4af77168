"""Controls a caller can use: cache modes, system-prompt hints, compressive context, warm-up, pins, negotiation.

Each control is checked by its measured effect (cache_read_input_tokens, the trace, /health), not by
the header that names it alone.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import anthropic
import httpx
import pytest

from tests.conftest import ServerProcess
from tests.factories import rereads
from tests.test_telemetry_cost import BLOCK, decode, long_text, parse_cost, prompt_tokens, unique_system

COMPRESS_THRESHOLD = 1024  # CompressionSettings.threshold_tokens
COMPRESS_CHUNK = 384  # CompressionSettings.chunk_tokens


def create(client, system: str | list, text: str, max_tokens: int = 2, headers: dict | None = None, **extra):
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=max_tokens, system=system,
                                                   messages=[{"role": "user", "content": text}],
                                                   extra_headers=headers or {}, **extra)
    return raw, raw.parse()


def kv_blocks(url: str) -> dict[str, int]:
    return httpx.get(url + "/health", timeout=10).json()["kv_blocks"]


def prompt_len(template, system: str, text: str) -> int:
    return len(template.encode([{"role": "system", "content": system}, {"role": "user", "content": text}]))


# ---- negotiation -----------------------------------------------------------------------------------
def test_options_negotiates_v1(tiny_server):
    r = httpx.options(tiny_server.url + "/v1/messages", headers={"X-Stratum-Negotiate": "v1"})
    assert r.status_code == 200
    assert r.headers["x-stratum-supported"] == "v1"
    plain = httpx.options(tiny_server.url + "/v1/messages")
    assert plain.status_code == 200 and "x-stratum-supported" not in plain.headers
    other = httpx.options(tiny_server.url + "/v1/messages", headers={"X-Stratum-Negotiate": "v9"})
    assert "x-stratum-supported" not in other.headers


# ---- X-Stratum-Mode and the system-prompt hints -----------------------------------------------------
def test_bypass_neither_reads_nor_writes_the_cache(tiny_server, client, tiny_template):
    system, text = unique_system("Bypass."), long_text(40)
    n = prompt_len(tiny_template, system, text)
    before = kv_blocks(tiny_server.url)
    raw, msg = create(client, system, text, headers={"x-stratum-mode": "bypass"})
    assert raw.headers["x-stratum-cache-mode"] == "bypass"
    assert parse_cost(raw.headers["x-stratum-cost"])["cache_hit_ratio"] == 0
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0
    # It adds no cached block (under pressure from the tests before it, it may evict others' to run).
    after_bypass = kv_blocks(tiny_server.url)
    assert after_bypass["cached"] <= before["cached"]
    # nothing was written: the same prompt afterwards misses and creates every block itself
    raw, msg = create(client, system, text)
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.input_tokens == n
    written = msg.usage.output_tokens
    # cached automatically, by it: into free blocks first, then in place of evicted ones
    assert kv_blocks(tiny_server.url)["cached"] >= after_bypass["cached"] + min(n // BLOCK, after_bypass["free"])
    # and nothing is read, even though the prompt is now cached
    raw, msg = create(client, system, text, headers={"x-stratum-mode": "bypass"})
    assert parse_cost(raw.headers["x-stratum-cost"])["cache_hit_ratio"] == 0
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.input_tokens == n
    raw, msg = create(client, system, text)
    assert msg.usage.cache_read_input_tokens == rereads(n, written)


@pytest.mark.parametrize("system_hint, header, mode", [
    ("Use aggressive caching for repeated queries.", None, "aggressive"),
    ("Use aggressive caching for repeated queries.", "bypass", "bypass"),  # headers override hints
    ("Use aggressive caching for repeated queries.", "default", "default"),
    ("Be brief.", "aggressive", "aggressive"),
    ("Be brief.", None, "default"),
])
def test_cache_mode_from_hints_and_headers(client, system_hint, header, mode):
    headers = {"x-stratum-debug": "true", **({"x-stratum-mode": header} if header else {})}
    raw, _ = create(client, system_hint, "hello", headers=headers)
    assert raw.headers["x-stratum-cache-mode"] == mode
    assert decode(raw.headers["x-stratum-trace"])["cache_mode"] == mode


def test_high_value_hint_gives_top_priority(client):
    raw, _ = create(client, "This is a high-value request; spare no resources.", "hello",
                    headers={"x-stratum-debug": "true"})
    assert decode(raw.headers["x-stratum-trace"])["priority"] == -100
    raw, _ = create(client, "Be brief.", "hello", headers={"x-stratum-debug": "true"})
    assert decode(raw.headers["x-stratum-trace"])["priority"] == 0


@pytest.mark.parametrize("header, value", [("x-stratum-mode", "turbo"), ("x-stratum-context-mode", "lossy")])
def test_unknown_control_values_are_rejected(client, header, value):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, "Be brief.", "hello", headers={header: value})
    assert value in e.value.body["error"]["message"]


# ---- compressive context ---------------------------------------------------------------------------
def prompt_of_exactly(template, n_tokens: int) -> str:
    """A user text whose chat prompt (default system) is exactly n_tokens long."""
    words = long_text(600, tag="fact")

    def size(cut: int) -> int:
        return len(template.encode([{"role": "user", "content": words[:cut]}]))

    lo, hi = 0, len(words)  # the shortest cut reaching n_tokens, then a few characters either side
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if size(mid) < n_tokens else (lo, mid)
    for cut in range(max(0, lo - 8), lo + 8):
        if size(cut) == n_tokens:
            return words[:cut]
    raise AssertionError(f"no cut near {lo} gives {n_tokens} tokens")


def compressive(client, text: str):
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": text}],
        extra_headers={"x-stratum-context-mode": "compressive", "x-stratum-debug": "true"})
    msg = raw.parse()
    return decode(raw.headers["x-stratum-trace"])["compression"], prompt_tokens(msg.usage)


def test_compressive_mode_shrinks_a_long_prompt(client, tiny_template):
    text = prompt_of_exactly(tiny_template, COMPRESS_THRESHOLD + 1)
    assert client.messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": text}]).input_tokens == COMPRESS_THRESHOLD + 1
    comp, prompt_tokens = compressive(client, text)
    assert comp["applied"] is True
    assert comp["original_prompt_tokens"] == COMPRESS_THRESHOLD + 1
    assert comp["compressed_prompt_tokens"] < comp["original_prompt_tokens"]
    assert comp["ratio"] == round(comp["compressed_prompt_tokens"] / comp["original_prompt_tokens"], 4)
    assert comp["chunks"] == math.ceil(len(tiny_template.tokenizer.encode(text)) / COMPRESS_CHUNK)
    # the answer really was generated from the compressed prompt
    assert prompt_tokens == comp["compressed_prompt_tokens"]


def test_compressive_mode_leaves_a_short_prompt_alone(client, tiny_template):
    text = prompt_of_exactly(tiny_template, COMPRESS_THRESHOLD)
    comp, prompt_tokens = compressive(client, text)
    assert comp == {"applied": False, "original_prompt_tokens": COMPRESS_THRESHOLD,
                    "threshold_tokens": COMPRESS_THRESHOLD}
    assert prompt_tokens == COMPRESS_THRESHOLD


# ---- warm-up -------------------------------------------------------------------------------------------
def test_max_tokens_zero_prefills_and_the_next_request_hits(client, tiny_template):
    system, text = unique_system("Warm me up."), long_text(30)
    n = prompt_len(tiny_template, system, text)
    raw, msg = create(client, system, text, max_tokens=0)
    assert msg.content == [] and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 0
    assert msg.usage.cache_creation_input_tokens == (n // BLOCK) * BLOCK > 0
    raw, msg = create(client, system, text, max_tokens=4)
    assert msg.usage.cache_read_input_tokens == rereads(n, 0) > 0
    assert msg.usage.cache_creation_input_tokens == 0


def test_warmup_command_reports_created_tokens(tiny_server, client, tiny_template, tmp_path):
    prompts = [{"system": unique_system(f"Warm-up file {i}."),
                "messages": [{"role": "user", "content": long_text(20 + i)}]}
               for i in range(2)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    done = subprocess.run([sys.executable, "-m", "stratum.cli", "warmup", str(path), "--url", tiny_server.url,
                           "--model", "tiny"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    sizes = [prompt_len(tiny_template, p["system"], p["messages"][0]["content"]) for p in prompts]
    assert report["prompts"] == 2 and report["failed"] == 0
    assert report["cache_creation_input_tokens"] == sum((n // BLOCK) * BLOCK for n in sizes)
    for p, n in zip(prompts, sizes):
        _, msg = create(client, p["system"], p["messages"][0]["content"])
        assert msg.usage.cache_read_input_tokens == rereads(n, 0)


# ---- pins survive a flooded pool -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_kv_server(tiny_model_dir):
    # the pool alone: what a flood evicts from it must be gone, not read back from the disk tier
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "1",
                           "--dtype", "float32", "--kv-disk-gb", "0").wait_ready()
    yield server
    server.stop()


def test_pins_survive_a_flooded_pool(small_kv_server, tiny_template):
    c = anthropic.Anthropic(base_url=small_kv_server.url, api_key="test", max_retries=0)
    total = kv_blocks(small_kv_server.url)["total"]
    question, other = long_text(8, tag="q"), long_text(8, tag="z")
    # cache_control on the system block pins the prompt through the end of the system message
    s_pinned = unique_system("Pinned system prompt. " + long_text(25, tag="rule"))
    pinned_prefix = tiny_template.encode([{"role": "system", "content": s_pinned}], add_generation_prompt=False)
    block = {"type": "text", "text": s_pinned, "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    _, msg = create(c, [block], question)
    assert msg.usage.cache_creation_input_tokens > 0
    # the control: the same shape without cache_control
    s_control = unique_system("Control system prompt. " + long_text(25, tag="rule"))
    create(c, s_control, question)
    # max_tokens 0 pins the whole prompt; aggressive mode pins prompt and output
    s_warm, s_aggr = unique_system("Warm."), unique_system("Aggressive.")
    warm_text, aggr_text = long_text(20, tag="w"), long_text(20, tag="a")
    create(c, s_warm, warm_text, max_tokens=0)
    raw, _ = create(c, s_aggr, aggr_text, max_tokens=8, headers={"x-stratum-mode": "aggressive"})
    assert raw.headers["x-stratum-cache-mode"] == "aggressive"

    flood_text = long_text(110, tag="flood")
    per_flood = prompt_len(tiny_template, "x" * 12, flood_text) // BLOCK
    for _ in range(2 * total // per_flood + 2):  # twice the pool: every unpinned block is evicted
        _, msg = create(c, unique_system("Flood."), flood_text)
        assert msg.usage.cache_read_input_tokens == 0

    _, msg = create(c, s_control, other)
    assert msg.usage.cache_read_input_tokens == 0  # the flood evicted it
    _, msg = create(c, [block], other)
    assert msg.usage.cache_read_input_tokens == (len(pinned_prefix) // BLOCK) * BLOCK > 0
    _, msg = create(c, s_warm, warm_text)
    assert msg.usage.cache_read_input_tokens == rereads(prompt_len(tiny_template, s_warm, warm_text), 0)
    _, msg = create(c, s_aggr, aggr_text)
    # its output was pinned too, so the block holding the prompt's tail stays cached once it is full
    assert msg.usage.cache_read_input_tokens == rereads(prompt_len(tiny_template, s_aggr, aggr_text), 8)
    health = kv_blocks(small_kv_server.url)
    assert health["free"] + health["cached"] + health["in_use"] == health["total"]
