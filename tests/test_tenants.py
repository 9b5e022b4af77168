"""Tenant isolation in the prefix cache: with API keys, each key is a tenant whose cached prompts no other
key can hit, so neither the cost header nor the timing of a prefill reveals them (the side channel of
CVE-2025-46570). --share-prefix-cache opts into one cache for all keys, and says so at start-up."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import ServerProcess
from tests.test_telemetry_cost import long_text

KEYS = ("sk-tenant-one", "sk-tenant-two", "sk-tenant-three")
MEMO = "Confidential memo. " + long_text(40, tag="memo")  # ~400 tokens of the tiny model: many full blocks


def keyed_server(tiny_model_dir, *extra: str) -> ServerProcess:
    return ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                         *(a for k in KEYS for a in ("--api-key", k)), *extra).wait_ready()


@pytest.fixture(scope="module")
def isolated_server(tiny_model_dir):
    server = keyed_server(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir):
    server = keyed_server(tiny_model_dir, "--share-prefix-cache")
    yield server
    server.stop()


def ask(server: ServerProcess, key: str, text: str):
    """(cache_hit_ratio from x-stratum-cost, usage) of one request."""
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=1,
                                                   messages=[{"role": "user", "content": text}])
    fields = dict(f.split("=") for f in raw.headers["x-stratum-cost"].split(","))
    return float(fields["cache_hit_ratio"]), raw.parse().usage


def test_another_tenant_never_hits_a_tenants_prompt(isolated_server):
    ask(isolated_server, KEYS[0], MEMO)
    ratio, usage = ask(isolated_server, KEYS[0], MEMO)  # the owner hits its own cache
    assert ratio > 0.8 and usage.cache_read_input_tokens > 0
    ratio, usage = ask(isolated_server, KEYS[1], MEMO)  # the same text from another key: a cold prompt
    assert ratio == 0 and usage.cache_read_input_tokens == 0
    guess = MEMO[:120] + " and a guessed continuation of the memo."  # a third key probing for a prefix
    ratio, usage = ask(isolated_server, KEYS[2], guess)
    assert ratio == 0 and usage.cache_read_input_tokens == 0
    ratio, _ = ask(isolated_server, KEYS[0], MEMO[:120] + " the owner's own variation.")
    assert ratio > 0  # the owner's guess of its own prefix still hits


def test_isolation_is_said_at_startup(isolated_server):
    assert "each key is a tenant with a prefix cache of its own" in isolated_server.output()


def test_shared_cache_lets_keys_hit_each_other(shared_server):
    ask(shared_server, KEYS[0], MEMO)
    ratio, usage = ask(shared_server, KEYS[1], MEMO)
    assert ratio > 0.8 and usage.cache_read_input_tokens > 0
    assert "the prefix cache is SHARED across keys" in shared_server.output()
