"""The disk tier as `stratum serve` users meet it: on by default, across a restart; hits counted as hits
by both APIs, the trace and /metrics; a tenant's prefix served to that tenant only; and on the default
model (the native step) the same greedy text whether the prefix was computed, pooled or read back."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from stratum.telemetry.trace import decode_trace
from tests.conftest import ServerProcess
from tests.test_telemetry_cost import long_text

KEYS = ("sk-tier-one", "sk-tier-two", "sk-tier-three")
SYSTEM = "You are an agent with tools. " + long_text(40, tag="agent")


def tier_metrics(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("stratum_kv_tier_") and "{" in line:
            name, rest = line.split("{", 1)
            out[(name, rest.split('tier="')[1].split('"')[0])] = float(line.split()[-1])
    return out


def written_blocks(server: ServerProcess, n: int) -> None:
    """Wait until /metrics says the disk tier holds at least n blocks."""
    deadline = time.monotonic() + 60
    while tier_metrics(server.url)[("stratum_kv_tier_blocks", "disk")] < n:
        assert time.monotonic() < deadline, f"the disk tier never reported {n} blocks"
        time.sleep(0.2)


def _prefill(headers) -> dict:
    return next(s for s in decode_trace(headers["x-stratum-trace"])["steps"] if s["name"] == "prefill")


def ask(server: ServerProcess, key: str, user: str = "What is the plan?", system: str = SYSTEM):
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=6, system=system, messages=[{"role": "user", "content": user}],
        extra_body={"temperature": 0},
        extra_headers={"X-Stratum-Debug": "true"})
    return raw.parse(), _prefill(raw.headers)


def chat(server: ServerProcess, key: str, user: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=6, temperature=0, extra_headers={"X-Stratum-Debug": "true"},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return raw.parse(), _prefill(raw.headers)


def test_a_restarted_server_reads_a_tenants_prefix_back_from_disk_for_that_tenant_only(tiny_model_dir, tmp_path):
    kv = str(tmp_path / "kv")
    args = (str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--kv-disk-dir", kv,
            *(a for k in KEYS for a in ("--api-key", k)))
    first = ServerProcess(*args).wait_ready()
    try:
        computed, prefill = ask(first, KEYS[0])
        assert computed.usage.cache_read_input_tokens == 0 and prefill["tiers"] == {"pool": 0, "disk": 0}
        chat(first, KEYS[1], "Which tools are there?")
        written_blocks(first, 2 * (prefill["computed_tokens"] // 16))  # an idle server publishes what its tier wrote
    finally:
        first.stop()  # SIGTERM: what is queued is written before the engine exits
    second = ServerProcess(*args).wait_ready()
    try:
        other, prefill = ask(second, KEYS[2])  # two other tenants' prefixes are on disk: neither is its hit
        assert other.usage.cache_read_input_tokens == 0 and prefill["tiers"] == {"pool": 0, "disk": 0}
        owner, prefill = ask(second, KEYS[0])
        read = owner.usage.cache_read_input_tokens
        assert read > 0 and prefill["tiers"] == {"pool": 0, "disk": read} and prefill["disk_read_us"] > 0
        assert prefill["cache_hit_ratio"] > 0.8 and owner.content[0].text == computed.content[0].text
        answer, prefill = chat(second, KEYS[1], "What is the plan?")  # its prefix, another user turn
        cached = answer.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and prefill["tiers"] == {"pool": 0, "disk": cached}
        metrics = tier_metrics(second.url)
        assert metrics[("stratum_kv_tier_hit_tokens_total", "disk")] == read + cached
        assert metrics[("stratum_kv_tier_read_bytes_total", "disk")] > 0
        assert metrics[("stratum_kv_tier_size_bytes", "disk")] > 0 and metrics[("stratum_kv_tier_enabled", "disk")] == 1
        assert metrics[("stratum_kv_tier_written_bytes_total", "pool")] > 0
    finally:
        second.stop()


@pytest.mark.integration
def test_default_model_greedy_text_is_the_same_from_compute_pool_and_disk(real_model_path):
    """One server on the default model (the native step) whose pool holds one prompt: computed, then the
    pool's hit, then -- once another prompt pushed it out of the pool -- the disk's: the same text."""
    server = ServerProcess(str(real_model_path), "--served-model-name", "tiny", "--kv-cache-mb", "16").wait_ready(300)
    try:
        computed, _ = ask(server, "unused")
        pooled, prefill = ask(server, "unused")
        pool_tokens = prefill["tiers"]["pool"]
        assert pool_tokens > 0
        written_blocks(server, pool_tokens // 16)
        ask(server, "unused", system="You are a different agent. " + long_text(40, tag="other"))
        assert tier_metrics(server.url)[("stratum_kv_tier_evicted_blocks_total", "pool")] > 0
        from_disk, prefill = ask(server, "unused")
        assert prefill["tiers"] == {"pool": 0, "disk": pool_tokens}
        assert computed.content[0].text == pooled.content[0].text == from_disk.content[0].text
    finally:
        server.stop()
