"""Start-up: the port answers at once (/health 503 with its stage, API routes 503 in their own error
shape, 200 only once a request would run), and a start on a machine whose native kernels are not
compiled yet serves on the provisional step while they are, then switches between steps without
failing or changing a request in flight.

The invariant across the switch: a request's tokens up to the switch are the provisional step's, and
the rest are exactly what the native step computes given those tokens (it is recomputed from them, as
after a preemption), logits bit for bit. On the tiny GGUF both steps agree on greedy tokens anyway,
so the request also equals a run entirely on either step."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch
import uvicorn

from stratum.engine import LLM
from stratum.engine.kv_view import kv_binding
from stratum.engine.sampling_params import SamplingParams
from stratum.server.startup import RETRY_AFTER_S, StartingApp
from tests.conftest import ServerProcess
from tests.factories import make_tiny_gguf

PROMPTS = ["The capital of Japan is Tokyo.", "Once upon a time there was"]
MAX_TOKENS = 12
STEPS_BEFORE_SWITCH = 4  # the prompts' prefill, then three tokens each on the PyTorch step


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)


def run(engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list:
    seqs = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.fixture
def uncompiled(monkeypatch, tmp_path):
    """This process sees a machine whose native kernels are not compiled yet (the preparing child
    finds them compiled, so it only measures and repacks), and no kernel plan."""
    from stratum.kernels import native

    monkeypatch.setenv("STRATUM_PLAN_DIR", str(tmp_path))
    monkeypatch.setattr(native, "is_built", lambda: False)


def cold_engine(tiny_gguf, **kw):
    return LLM(str(tiny_gguf), defer_kernels=True, num_kv_blocks=128, block_size=4, **kw).engine


def test_a_cold_start_serves_without_loading_the_native_kernels(tiny_gguf, uncompiled, monkeypatch):
    """Loading them would compile them in the foreground: the wait the provisional step exists to avoid."""
    from stratum.kernels import native

    monkeypatch.setattr(native, "available", lambda: pytest.fail("a cold start loaded the native kernels"))
    engine = cold_engine(tiny_gguf)
    try:
        assert engine.config.numerics.step == "pytorch" and not engine.runner.native
        run(engine, [engine.tokenizer.encode(PROMPTS[0])], max_tokens=2)
    finally:
        engine.upgrade.cancel()


def test_a_cold_engine_switches_to_the_prepared_step_with_requests_in_flight(tiny_gguf, uncompiled, tmp_path):
    # with a draft model (the file itself): it follows the target's kernels, and speculation verifies
    # only once the step is batch-invariant, so the answers are still plain decoding's; and with a disk
    # tier: the provisional step's prompt blocks are on disk before the switch, and the recomputed
    # requests must not read them (their logits are compared bit for bit below)
    engine = cold_engine(tiny_gguf, draft_model=str(tiny_gguf), speculative="draft", kv_disk_gb=1.0,
                         kv_disk_dir=str(tmp_path / "kv"))
    assert engine.upgrade is not None and not engine.runner.native  # nothing native waited for
    assert engine.kernel_choices["step"] == "pytorch" and engine.kernel_choices["native_kernels"] == "being prepared"
    provisional = engine.config.numerics
    assert provisional.step == "pytorch" and "int4" in dict(provisional.weights).values()  # from the blocks, not dense
    assert engine.speculator.draft.numerics == provisional  # the same file, by the same rule, on the same kernels
    assert "batch-invariant" in engine.kernel_choices["speculative"]["why"]
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    seqs = [engine.add_request(p, greedy()) for p in prompts]
    for _ in range(STEPS_BEFORE_SWITCH):  # a step never switches: the loop does, between steps
        engine.step()
    before = [list(s.output_token_ids) for s in seqs]
    assert all(0 < len(b) < MAX_TOKENS for b in before)
    deadline = time.monotonic() + 300
    while not engine.upgrade.is_done:
        assert time.monotonic() < deadline, f"still preparing: {engine.upgrade.stage}"
        time.sleep(0.2)
    assert engine.upgrade.error is None
    assert engine.tier.flush() and engine.tier.report()["disk"]["written_bytes"] > 0  # the provisional KV is on disk
    provisional_binding = engine.tier.binding
    assert engine.switch_kernels()
    assert engine.tier.binding != provisional_binding  # the disk tier never serves the PyTorch step's KV to it
    assert engine.upgrade is None and engine.kernel_choices["step"] == "native, packed blocks"
    assert engine.config.numerics.step == "native" and engine.config.numerics.key() != provisional.key()
    assert engine.kernel_choices["numerics"] == engine.config.numerics.key()  # the key follows the step
    assert (engine.speculator.draft.numerics == engine.config.numerics
            and engine.kernel_choices["speculative"]["mode"] == "draft")
    assert engine.block_manager.num_cached_blocks == 0  # the old pool's cache is gone with it
    finals = []
    while engine.has_unfinished():
        finals += [out for out in engine.step() if out.finished]
    assert engine.block_manager.num_used_blocks == 0  # nothing leaked
    assert all(s.num_preemptions == 1 and s.num_output_tokens == MAX_TOKENS for s in seqs)
    # the draft proposed after the switch, and was kept
    assert sum(out.stats.num_spec_accepted_tokens for out in finals) > 0

    # Up to the switch: the provisional step's tokens (another provisional engine, alone).
    alone = cold_engine(tiny_gguf)
    alone.upgrade.cancel()
    assert alone.config.numerics == provisional
    for s, b, ref in zip(seqs, before, run(alone, prompts)):
        assert s.output_token_ids[: len(b)] == b == ref.output_token_ids[: len(b)]
    # After it: what the prepared step computes from the same tokens, bit for bit.
    native = LLM(str(tiny_gguf), num_kv_blocks=128, block_size=4)
    assert native.engine.config.numerics == engine.config.numerics
    assert kv_binding(native.engine.config, native.engine.model) == engine.tier.binding
    for s, b, p in zip(seqs, before, prompts):
        ref = run(native.engine, [p + b], max_tokens=MAX_TOKENS - len(b))[0]
        assert s.output_token_ids[len(b):] == ref.output_token_ids
        for position in range(len(p) + len(b) - 1, s.num_tokens - 1):  # the logits that sampled those tokens
            assert torch.equal(s.readouts.logits[position], ref.readouts.logits[position]), position
    # And, here, what a run entirely on the prepared step gives.
    whole = run(LLM(str(tiny_gguf), num_kv_blocks=128, block_size=4).engine, prompts)
    assert [s.output_token_ids for s in seqs] == [w.output_token_ids for w in whole]


@pytest.fixture
def starting_server():
    """A StartingApp behind uvicorn on a free port, before any app is served."""
    starting = StartingApp("tiny")
    server = uvicorn.Server(uvicorn.Config(starting, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert starting.wait_listening(30)
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield starting, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_requests_during_start_up_get_503_in_their_api_shape_then_the_app_answers(starting_server, tiny_model_dir):
    from stratum.engine.thread_transport import start_thread_engine
    from stratum.engine.core import EngineCore
    from stratum.engine.config import EngineConfig
    from stratum.server.app import ServerSettings, create_app

    starting, url = starting_server
    starting.stage = "loading model"
    health = httpx.get(url + "/health")
    assert health.status_code == 503
    assert health.json()["status"] == "loading" and health.json()["stage"] == "loading model"
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503 and e.value.body["type"] == "error"  # Anthropic's error envelope
    assert e.value.body["error"]["type"] == "overloaded_error" and "loading model" in e.value.body["error"]["message"]
    assert e.value.response.headers["retry-after"] == str(RETRY_AFTER_S) and e.value.response.headers["request-id"]
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        gpt.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503 and e.value.body["type"] == "server_error"  # OpenAI's word for a 503
    assert set(e.value.body) >= {"message", "type", "param", "code"}
    assert e.value.response.headers["retry-after"] == str(RETRY_AFTER_S)

    client = start_thread_engine(EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)))
    try:
        starting.serve(create_app(client, ServerSettings(model_name="tiny")))
        assert httpx.get(url + "/health").json()["status"] == "ok"
        reply = claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.output_tokens > 0
        assert gpt.chat.completions.create(model="tiny", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}]).choices
    finally:
        client.shutdown()


def test_stratum_serve_answers_503_loading_then_200(tiny_model_dir):
    """The real command: the port answers while the engine loads, with the stage, then 200."""
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8")
    try:
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not seen or seen[-1][0] != 200):
            assert server.proc.poll() is None, server.output()
            try:
                r = httpx.get(server.url + "/health", timeout=5)
            except httpx.TransportError:  # the port is not open yet
                time.sleep(0.01)
                continue
            body = r.json()
            seen.append((r.status_code, body.get("stage") or body["status"]))
            time.sleep(0.01)
        assert seen[0][0] == 503 and seen[-1] == (200, "ok"), seen
        assert all(status == 503 for status, _ in seen[:-1])
        assert {stage for _, stage in seen[:-1]} <= {"starting engine", "loading model", "starting server",
                                                     "waiting for the engine's first report"}
    finally:
        server.stop()


def test_every_report_of_the_kernels_follows_the_switch(tiny_gguf, uncompiled, starting_server):
    """A cold start served over HTTP: once /health says the native step has taken over, a request's
    `X-Stratum-Debug: full` trace reports it and its numerics, not the provisional step the server
    started on (the engine sends its `EngineInfo` again when it switches)."""
    from stratum.engine.thread_transport import start_thread_engine
    from stratum.server.app import ServerSettings, create_app
    from stratum.telemetry.trace import decode_trace

    starting, url = starting_server
    client = start_thread_engine(cold_engine(tiny_gguf))
    try:
        starting.serve(create_app(client, ServerSettings(model_name="tiny")))
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)

        def kernels_reported() -> tuple[list[dict], dict]:
            """The hardware a request's trace reports, and /health before and after it."""
            before = httpx.get(url + "/health").json()
            raw = claude.messages.with_raw_response.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                extra_headers={"x-stratum-debug": "full"})
            return [before, httpx.get(url + "/health").json()], decode_trace(raw.headers["x-stratum-trace"])["hardware"]

        health, hardware = kernels_reported()
        if all("preparing" in h for h in health):  # still on the provisional step
            assert hardware["kernels"]["native_kernels"] == "being prepared" and hardware["dtype"] == "float32"
            assert hardware["kernels"]["step"] == "pytorch"
        deadline = time.monotonic() + 300
        while "preparing" in httpx.get(url + "/health").json():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        health, hardware = kernels_reported()
        assert not any("preparing" in h for h in health) and health[0]["step"] == "native"
        kernels = hardware["kernels"]
        assert kernels["native_kernels"] != "being prepared" and kernels["step"] == "native, packed blocks"
        assert kernels["numerics"] == client.config.numerics.key() and client.config.numerics.step == "native"
    finally:
        client.shutdown()
