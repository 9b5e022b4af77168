"""Message Batches through the official SDK: the API's shape, durability across SIGKILL, exactly-once results."""

from __future__ import annotations

import time

import anthropic
import pytest

from tests.conftest import ServerProcess


def params(i: int, max_tokens: int = 6) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"request number {i}: the capital of Japan is"}]}


def interactive(client, i: int, max_tokens: int = 6):
    body = params(i, max_tokens)
    return client.messages.create(model=body["model"], max_tokens=max_tokens, messages=body["messages"],
                                  extra_body={"temperature": 0})


def wait_ended(client, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} did not end: {batch}")


def test_a_batch_runs_and_its_results_match_interactive_requests(client):
    batch = client.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": params(i)} for i in range(6)] + [
        {"custom_id": "bad", "params": {"model": "tiny", "max_tokens": -1, "messages": []}}])
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    batch = wait_ended(client, batch.id)
    assert batch.request_counts.succeeded == 6 and batch.request_counts.errored == 1
    assert batch.request_counts.processing == 0 and batch.ended_at is not None
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == {f"r{i}" for i in range(6)} | {"bad"}
    assert results["bad"].type == "errored" and results["bad"].error.type == "invalid_request_error"
    assert results["r0"].model_extra["stratum_cost"]["header"].startswith("cache_hit_ratio=")
    for i in range(6):
        message = results[f"r{i}"].message
        alone = interactive(client, i)
        assert message.content[0].text == alone.content[0].text
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
            alone.usage.input_tokens + alone.usage.cache_read_input_tokens


def test_list_cancel_delete(client):
    ids = [client.messages.batches.create(requests=[{"custom_id": "a", "params": params(i, 4)}]).id for i in range(3)]
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.messages.batches.list(limit=2, after_id=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    assert [b.id for b in client.messages.batches.list(limit=5, before_id=ids[0]).data] == ids[::-1][:2]
    big = client.messages.batches.create(requests=[{"custom_id": f"b{i}", "params": params(i, 200)} for i in range(40)])
    with pytest.raises(anthropic.BadRequestError, match="cancel it first"):
        client.messages.batches.delete(big.id)
    canceled = client.messages.batches.cancel(big.id)
    assert canceled.processing_status in ("canceling", "ended") and canceled.cancel_initiated_at is not None
    ended = wait_ended(client, big.id)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.canceled + counts.succeeded == 40
    assert {r.result.type for r in client.messages.batches.results(big.id)} <= {"canceled", "succeeded"}
    assert client.messages.batches.delete(big.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(big.id)
    for batch_id in ids:
        wait_ended(client, batch_id)


def test_bad_batches_are_refused(client):
    with pytest.raises(anthropic.BadRequestError, match="unique"):
        client.messages.batches.create(requests=[{"custom_id": "x", "params": params(0)}] * 2)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[{"custom_id": "no spaces", "params": params(0)}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_nope")


def test_a_batch_survives_sigkill_with_each_result_once(tiny_model_dir, tmp_path):
    """50 requests; the server is killed with SIGKILL mid-batch and restarted on the same data dir: the
    batch ends with 50 results, each custom_id once, each equal to the same request sent interactively."""
    args = (str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--data-dir", str(tmp_path))
    server = ServerProcess(*args).wait_ready()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        batch = client.messages.batches.create(
            requests=[{"custom_id": f"req-{i}", "params": params(i, 24)} for i in range(50)])
        deadline = time.monotonic() + 60
        while client.messages.batches.retrieve(batch.id).request_counts.succeeded < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.proc.kill()  # SIGKILL: no drain, no shutdown hook
        server.proc.wait()
    done_before = None
    server = ServerProcess(*args).wait_ready()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        done_before = client.messages.batches.retrieve(batch.id).request_counts
        assert done_before.succeeded < 50, "the kill came too late to test anything"
        ended = wait_ended(client, batch.id)
        assert ended.request_counts.succeeded == 50 and ended.request_counts.processing == 0
        results = list(client.messages.batches.results(batch.id))
        assert sorted(r.custom_id for r in results) == sorted(f"req-{i}" for i in range(50))
        for r in results:
            i = int(r.custom_id.split("-")[1])
            assert r.result.type == "succeeded"
            assert r.result.message.content[0].text == interactive(client, i, 24).content[0].text
    finally:
        server.stop()


def test_a_batch_ends_however_its_requests_fail(tiny_model_dir):
    """A request refused for what it is (a 4xx) is errored at once, with the error; one the server fails
    (a 5xx: here every route raises, STRATUM_FAULT_INJECT=route) is tried again with backoff a bounded
    number of times, then errored; the log has one line per failure, and the batch ends."""
    from stratum.server.batches import MAX_FAILURES

    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           env={"STRATUM_FAULT_INJECT": "route"}).wait_ready()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        batch = client.messages.batches.create(requests=[
            {"custom_id": "unbounded", "params": {**params(0), "top_k": 2**64}},
            {"custom_id": "server-fails", "params": params(1)}])
        ended = wait_ended(client, batch.id, timeout=90)
        results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
        unbounded, fails = results["unbounded"], results["server-fails"]
        assert unbounded.type == "errored" and unbounded.error.type == "invalid_request_error"
        assert "top_k" in str(unbounded.error.model_dump())
        assert fails.type == "errored" and fails.error.type == "api_error"
        assert ended.request_counts.errored == 2
        server.log.flush()
        log = open(server.log.name).read()
        assert log.count("stratum.batches: batch request") == MAX_FAILURES, log[-3000:]
        assert f"failed ({MAX_FAILURES} of {MAX_FAILURES})" in log and "unbounded" not in log
    finally:
        server.stop()
