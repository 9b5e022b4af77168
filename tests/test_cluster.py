"""`stratum serve --replicas 2` on a real local Ray cluster: the official SDK against the endpoint,
routing that follows the prefix cache, per-replica health and metrics, and a replica killed mid-run.

One server for the module (Ray and Serve take about 10 s to start and 5 s to stop on 2 cores); the
fault test runs last.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import anthropic
import httpx
import pytest

from tests.conftest import ServerProcess

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed")

GREEDY = {"temperature": 0, "ignore_eos": True}
BUDGET = 6000  # tokens per tenant per minute; each test is a tenant of its own (its API key)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--replicas", "2", "--served-model-name", "tiny",
                           "--tenant-budget-tokens", str(BUDGET),
                           env={"RAY_USAGE_STATS_ENABLED": "0"})
    try:
        server.wait_ready(timeout=240)
        wait_for_replicas(server.url, 2)
        yield server
    finally:
        server.stop()


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def wait_for_replicas(url: str, n: int, timeout: float = 120.0, without: str | None = None) -> list[dict]:
    """n live replicas, none of them named `without` (a killed one, listed until Serve's health
    check notices it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = [r for r in health(url).get("replicas", []) if r["status"] == "ok"]
        if len(replicas) == n and without not in {r["replica"] for r in replicas}:
            return replicas
        time.sleep(0.5)
    raise TimeoutError(f"never saw {n} live replicas: {health(url)}")


def system_prompt(group: int, rules: int = 40) -> str:
    return f"You are assistant number {group}. " + " ".join(f"rule {group}-{i}: answer briefly." for i in range(rules))


def test_anthropic_sdk_non_streaming_and_streaming(cluster):
    client = anthropic.Anthropic(base_url=cluster.url, api_key="sdk", max_retries=0)
    names = {r["replica"] for r in health(cluster.url)["replicas"]}
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=6, extra_body=GREEDY,
                                                   messages=[{"role": "user", "content": "hello"}])
    message = raw.parse()
    assert message.usage.output_tokens == 6 and message.stop_reason == "max_tokens"
    assert raw.headers["x-stratum-replica"] in names
    assert "cache_hit_ratio=" in raw.headers["x-stratum-cost"]

    with client.messages.stream(model="tiny", max_tokens=8, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["x-stratum-replica"] in names
    assert final.usage.output_tokens == 8 and text == "".join(b.text for b in final.content)


def test_debug_trace_names_the_replica(cluster):
    r = httpx.post(cluster.url + "/v1/messages", headers={"x-stratum-debug": "true"}, timeout=30,
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    from stratum.telemetry.trace import decode_trace

    assert decode_trace(r.headers["x-stratum-trace"])["replica"] == r.headers["x-stratum-replica"]


def test_health_and_metrics_report_each_replica(cluster, tiny_model_dir):
    from stratum.engine import builder
    from stratum.engine.config import EngineConfig

    replicas = wait_for_replicas(cluster.url, 2)
    config = EngineConfig(model=str(tiny_model_dir))
    one_engine = builder.resolve(config, builder.load(config), measure=False).num_kv_blocks
    # the replicas of one machine share the default KV pool, as they share its cores
    assert len({r["pid"] for r in replicas}) == 2 and all(r["kv_blocks"]["total"] == one_engine // 2 for r in replicas)
    body = health(cluster.url)
    assert body["kv_blocks"]["total"] == sum(r["kv_blocks"]["total"] for r in replicas)
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
    for r in replicas:
        assert f'stratum_replica_alive{{replica="{r["replica"]}"}} 1.0' in metrics
    assert re.search(r"^stratum_kv_cache_cached_blocks \d", metrics, re.M)


def test_requests_follow_their_prefix(cluster):
    """Four groups, each with its own long system prompt: after its first request, every request of a
    group goes to the replica that cached the prefix and reads it from the cache."""
    client = anthropic.Anthropic(base_url=cluster.url, api_key="prefix", max_retries=0)
    served: dict[int, list[str]] = {}
    cached: dict[int, list[int]] = {}
    for turn in range(3):
        for group in range(4):
            raw = client.messages.with_raw_response.create(
                model="tiny", max_tokens=2, extra_body=GREEDY, system=system_prompt(group),
                messages=[{"role": "user", "content": f"question {turn}"}])
            served.setdefault(group, []).append(raw.headers["x-stratum-replica"])
            cached.setdefault(group, []).append(raw.parse().usage.cache_read_input_tokens)
    for group in range(4):
        assert len(set(served[group])) == 1, served
        # the template's opening is shared
        assert cached[group][0] < 64 and all(c > 800 for c in cached[group][1:]), cached
    assert len({s[0] for s in served.values()}) == 2, served  # new prefixes were spread over both replicas


def test_one_budget_per_tenant_across_replicas(cluster):
    """A tenant's spending is counted once, whichever replica serves it: with prompts spread over both
    replicas, the budget runs out when the sum does, not when either replica's share would."""
    client = anthropic.Anthropic(base_url=cluster.url, api_key="budget", max_retries=0)
    served, spent = [], 0
    for group in range(100, 120):
        try:
            raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2, extra_body=GREEDY,
                                                           system=system_prompt(group),
                                                           messages=[{"role": "user", "content": "hi"}])
        except anthropic.RateLimitError as e:
            assert e.response.json()["error"]["type"] == "rate_limit_error"
            break
        usage = raw.parse().usage
        spent += usage.input_tokens + usage.cache_creation_input_tokens + usage.output_tokens
        served.append(raw.headers["x-stratum-replica"])
    else:
        pytest.fail("the budget never ran out")
    assert len(set(served)) == 2, served
    assert BUDGET - 1000 < spent <= BUDGET, spent  # refused once the next prompt no longer fit


async def _stream_one(client: anthropic.AsyncAnthropic, i: int) -> tuple[str | None, str]:
    """(the replica that served it, if it got that far; how it ended: completed, an error answer (an
    error event in the stream, or an error status), or else the error's type: a cut or a timeout)."""
    replica = None
    try:
        # a prefix of its own, so that the requests are spread over both replicas
        async with client.messages.stream(model="tiny", max_tokens=400, extra_body=GREEDY,
                                          system=system_prompt(200 + i, rules=8),
                                          messages=[{"role": "user", "content": f"long answer {i}"}]) as stream:
            replica = stream.response.headers.get("x-stratum-replica")
            async for _ in stream.text_stream:
                pass
            await stream.get_final_message()
        return replica, "completed"
    except anthropic.APIStatusError:
        return replica, "error answer"
    except anthropic.APIError as e:
        return replica, type(e).__name__


def test_killing_a_replica_mid_run(cluster):
    """Every request on the surviving replica completes; every one on the killed replica completes or
    ends with an error event in its stream (not a cut connection); none hangs; the service keeps
    answering, and Serve brings the replica set back to two."""
    wait_for_replicas(cluster.url, 2)
    victim: dict = {}

    async def run() -> list[tuple[str | None, str]]:
        async with anthropic.AsyncAnthropic(base_url=cluster.url, api_key="kill", max_retries=0, timeout=60) as client:
            tasks = [asyncio.create_task(_stream_one(client, i)) for i in range(8)]
            await asyncio.sleep(1.0)
            replicas = (await asyncio.to_thread(health, cluster.url))["replicas"]
            victim.update(max(replicas, key=lambda r: r["running"]))  # one that is serving some of them
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    outcomes = asyncio.run(run())
    on_victim = [end for replica, end in outcomes if replica == victim["replica"]]
    survivors = [end for replica, end in outcomes if replica not in (victim["replica"], None)]
    unplaced = [end for replica, end in outcomes if replica is None]  # failed before their first byte
    assert all(end == "completed" for end in survivors), outcomes
    assert on_victim and all(end in ("completed", "error answer") for end in on_victim), outcomes
    assert all(end == "error answer" for end in unplaced), outcomes
    assert "error answer" in on_victim, outcomes  # the victim had requests in flight

    t0 = time.monotonic()
    r = httpx.post(cluster.url + "/v1/messages", timeout=30,
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 10
    assert r.headers["x-stratum-replica"] != victim["replica"]
    wait_for_replicas(cluster.url, 2, timeout=120, without=victim["replica"])  # Serve replaced the killed one


def test_ray_client_addresses_are_refused_before_anything_starts():
    from stratum.cluster import launch
    from stratum.engine.config import EngineConfig

    with pytest.raises(ValueError, match="ray://"):
        launch.start(EngineConfig(model="unused"), 2, ray_address="ray://head:10001")
