"""The disk tier as `stratum serve` users meet it: on by default, across a restart; hits counted as hits
by both APIs, the trace and /metrics; a tenant's prefix served to that tenant only; and on the default
model (the native step) the same greedy text whether the prefix was computed, pooled or read back."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from stratum.telemetry.trace import decode_trace
from tests.conftest import ServerProcess
from tests.test_telemetry_cost import long_text

KEYS = ("sk-tier-one", "sk-tier-two")
SYSTEM = "You are an agent with tools. " + long_text(40, tag="agent")


def tier_metrics(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("stratum_kv_tier_") and "{" in line:
            name, rest = line.split("{", 1)
            out[(name, rest.split('tier="')[1].split('"')[0])] = float(line.split()[-1])
    return out


def ask(server: ServerProcess, key: str, user: str = "What is the plan?"):
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=6, system=SYSTEM, messages=[{"role": "user", "content": user}], extra_body={"temperature": 0},
        extra_headers={"X-Stratum-Debug": "true"})
    prefill = next(s for s in decode_trace(raw.headers["x-stratum-trace"])["steps"] if s["name"] == "prefill")
    return raw.parse(), prefill


def test_a_restarted_server_reads_a_tenants_prefix_back_from_disk_for_that_tenant_only(tiny_model_dir, tmp_path):
    kv = str(tmp_path / "kv")
    args = (str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--kv-disk-dir", kv,
            *(a for k in KEYS for a in ("--api-key", k)))
    first = ServerProcess(*args).wait_ready()
    try:
        computed, prefill = ask(first, KEYS[0])
        assert computed.usage.cache_read_input_tokens == 0 and prefill["tiers"] == {"pool": 0, "disk": 0}
    finally:
        first.stop()  # SIGTERM: what is queued is written before the engine exits
    second = ServerProcess(*args).wait_ready()
    try:
        other, prefill = ask(second, KEYS[1])
        assert other.usage.cache_read_input_tokens == 0 and prefill["tiers"]["disk"] == 0
        owner, prefill = ask(second, KEYS[0])
        read = owner.usage.cache_read_input_tokens
        assert read > 0 and prefill["tiers"] == {"pool": 0, "disk": read} and prefill["disk_read_us"] > 0
        assert prefill["cache_hit_ratio"] > 0.8 and owner.content[0].text == computed.content[0].text
        chat = openai.OpenAI(base_url=second.url + "/v1", api_key=KEYS[1], max_retries=0).chat.completions.create(
            model="tiny", max_tokens=6, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the plan?"}])
        assert chat.usage.prompt_tokens_details.cached_tokens > 0  # its own first request is in the pool now
        metrics = tier_metrics(second.url)
        assert metrics[("stratum_kv_tier_hit_tokens_total", "disk")] == read
        assert metrics[("stratum_kv_tier_read_bytes_total", "disk")] > 0
        assert metrics[("stratum_kv_tier_size_bytes", "disk")] > 0 and metrics[("stratum_kv_tier_enabled", "disk")] == 1
        assert metrics[("stratum_kv_tier_written_bytes_total", "pool")] > 0
    finally:
        second.stop()


@pytest.mark.integration
def test_default_model_greedy_text_is_the_same_from_compute_pool_and_disk(real_model_path, tmp_path):
    kv = str(tmp_path / "kv")
    first = ServerProcess(str(real_model_path), "--served-model-name", "tiny", "--kv-disk-dir", kv).wait_ready(300)
    try:
        computed, _ = ask(first, "unused")
        pooled, prefill = ask(first, "unused")
        assert prefill["tiers"]["pool"] > 0
    finally:
        first.stop()
    second = ServerProcess(str(real_model_path), "--served-model-name", "tiny", "--kv-disk-dir", kv).wait_ready(300)
    try:
        from_disk, prefill = ask(second, "unused")
        assert prefill["tiers"]["disk"] > 0 and prefill["tiers"]["pool"] == 0
        assert computed.content[0].text == pooled.content[0].text == from_disk.content[0].text
    finally:
        second.stop()
