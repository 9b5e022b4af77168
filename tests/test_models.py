"""Several models behind one server (`server/models.py`), through the official anthropic, openai and
ollama clients: every model listed, each request on the model it names (two tiny random models of
different shapes answer differently), an unknown name each API's 404, a model started on first use,
unloaded after its keep-alive (the server's or the request's), the least recently used idle model
unloaded to make room within --models-memory-mb and never one with a request in flight, a request for
a loading model waiting (or a 503 with retry-after past --model-load-wait-s), and the cost header,
/metrics and /health per model."""

from __future__ import annotations

import os
import signal
import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import ServerProcess
from tests.factories import make_tiny_model_dir

HI = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Three tiny random models of two shapes, in one folder (a --models-dir), named a, b and c."""
    root = tmp_path_factory.mktemp("models")
    make_tiny_model_dir(root / "a", seed=0)
    make_tiny_model_dir(root / "b", seed=1, hidden=32)
    make_tiny_model_dir(root / "c", seed=2, hidden=32, num_layers=1)
    return root


@pytest.fixture(scope="module")
def two(model_dirs):
    """a (the default) and b, by NAME=PATH; b starts on first use."""
    server = ServerProcess(f"tiny-a={model_dirs / 'a'}", "--model", f"tiny-b={model_dirs / 'b'}",
                           "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def states(server) -> dict[str, str]:
    return {m["name"]: m["state"] for m in health(server)["models"]}


def wait_for(server, name: str, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while states(server)[name] != state:
        assert time.monotonic() < deadline, f"{name} never {state}: {health(server)}"
        time.sleep(0.1)


def ask(server, model: str, headers: dict | None = None, max_tokens: int = 6):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    return client.messages.with_raw_response.create(model=model, max_tokens=max_tokens, messages=HI,
                                                    extra_body={"temperature": 0}, extra_headers=headers or {})


def test_every_model_is_listed_by_each_api(two):
    oai = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oai.models.list()] == ["tiny-a", "tiny-b"]
    client = anthropic.Anthropic(base_url=two.url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-a", "tiny-b"]
    assert client.models.retrieve("tiny-b").id == "tiny-b"
    tags = ollama.Client(host=two.url).list().models
    assert [m.model for m in tags] == ["tiny-a:latest", "tiny-b:latest"] and all(m.size > 0 for m in tags)


def test_a_request_runs_on_the_model_it_names_started_on_first_use(two):
    assert states(two) == {"tiny-a": "loaded", "tiny-b": "unloaded"}
    assert [m.model for m in ollama.Client(host=two.url).ps().models] == ["tiny-a:latest"]
    raw_b = ask(two, "tiny-b")
    assert raw_b.parse().model == "tiny-b" and raw_b.headers["x-stratum-cost"].endswith(",model=tiny-b")
    raw_a = ask(two, "tiny-a")
    assert raw_a.headers["x-stratum-cost"].endswith(",model=tiny-a")
    # two models of different shapes, greedy: their answers differ, as their engines do
    assert raw_a.parse().content[0].text != raw_b.parse().content[0].text
    body = health(two)
    pids = {m["name"]: m["engine_pid"] for m in body["models"]}
    assert body["status"] == "ok" and states(two) == {"tiny-a": "loaded", "tiny-b": "loaded"}
    assert pids["tiny-a"] == body["engine_pid"] != pids["tiny-b"]
    assert sorted(m.model for m in ollama.Client(host=two.url).ps().models) == ["tiny-a:latest", "tiny-b:latest"]
    # the other APIs, on the second model
    oai = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model="tiny-b", messages=HI, max_tokens=6, temperature=0)
    assert chat.model == "tiny-b" and chat.choices[0].message.content == raw_b.parse().content[0].text
    said = ollama.Client(host=two.url).chat(model="tiny-b:latest", messages=HI, options={"temperature": 0,
                                                                                        "num_predict": 6})
    assert said.message.content == raw_b.parse().content[0].text
    metrics = httpx.get(two.url + "/metrics").text
    assert 'stratum_model_request_count_total{model="tiny-b"}' in metrics
    assert 'stratum_model_state{model="tiny-b",state="loaded"} 1.0' in metrics


def test_an_unknown_model_is_each_apis_404_and_claude_names_run_on_the_first(two):
    client = anthropic.Anthropic(base_url=two.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error" and "tiny-b" in e.value.message
    oai = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="nope", messages=HI, max_tokens=4)
    assert e.value.code == "model_not_found"
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=two.url).chat(model="nope", messages=HI)
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    assert httpx.get(two.url + "/v1/models/nope").status_code == 404
    raw = ask(two, "claude-haiku-4-5")
    assert raw.parse().model == "claude-haiku-4-5" and raw.headers["x-stratum-cost"].endswith(",model=tiny-a")


def test_a_request_keep_alive_of_zero_unloads_its_model_after_it(two):
    ask(two, "tiny-b", headers={"X-Stratum-Keep-Alive": "0"})
    wait_for(two, "tiny-b", "unloaded", timeout=15)
    # Ollama's keep_alive: an empty chat loads the model, and 0 unloads it
    client = ollama.Client(host=two.url)
    assert client.chat(model="tiny-b", messages=[]).done_reason == "load"
    assert states(two)["tiny-b"] == "loaded"
    assert client.chat(model="tiny-b", messages=[], keep_alive=0).done_reason == "unload"
    wait_for(two, "tiny-b", "unloaded", timeout=15)
    # the first model stays loaded whatever a request says
    ask(two, "tiny-a", headers={"X-Stratum-Keep-Alive": "0"})
    time.sleep(0.5)
    assert states(two)["tiny-a"] == "loaded"
    status = httpx.post(two.url + "/v1/messages", headers={"X-Stratum-Keep-Alive": "soon"},
                        json={"model": "tiny-b", "max_tokens": 2, "messages": HI})
    assert status.status_code == 400 and status.json()["error"]["type"] == "invalid_request_error"


def test_a_batch_runs_each_request_on_the_model_it_names(two):
    client = anthropic.Anthropic(base_url=two.url, api_key="unused", max_retries=0)
    params = [{"model": m, "max_tokens": 6, "temperature": 0, "messages": HI} for m in ("tiny-a", "tiny-b", "nope")]
    batch = client.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": p} for i, p in enumerate(params)])
    deadline = time.monotonic() + 120
    while client.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["r2"].type == "errored" and results["r2"].error.type == "not_found_error"
    for i, name in enumerate(("tiny-a", "tiny-b")):
        message, cost = results[f"r{i}"].message, results[f"r{i}"].model_extra["stratum_cost"]
        assert message.model == name and cost["header"].endswith(f",model={name}")
        assert message.content[0].text == ask(two, name).parse().content[0].text


def test_requests_for_a_loading_model_wait_for_it_and_it_loads_once(two):
    ask(two, "tiny-b", headers={"X-Stratum-Keep-Alive": "0"})
    wait_for(two, "tiny-b", "unloaded", timeout=15)
    loads = next(m for m in health(two)["models"] if m["name"] == "tiny-b")["loads"]
    results: list = []

    def one():
        results.append(ask(two, "tiny-b").parse().content[0].text)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3 and len(set(results)) == 1
    entry = next(m for m in health(two)["models"] if m["name"] == "tiny-b")
    assert entry["state"] == "loaded" and entry["in_flight"] == 0 and entry["loads"] == loads + 1


def entry(server, name: str) -> dict:
    return next(m for m in health(server)["models"] if m["name"] == name)


def test_each_models_engine_is_supervised_on_its_own(two):
    ask(two, "tiny-b")
    dead, first = entry(two, "tiny-b")["engine_pid"], entry(two, "tiny-a")["engine_pid"]
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while entry(two, "tiny-b").get("engine_pid") in (dead, None):
        assert time.monotonic() < deadline, health(two)
        time.sleep(0.2)
    assert ask(two, "tiny-b").parse().model == "tiny-b"
    assert entry(two, "tiny-a")["engine_pid"] == first == health(two)["engine_pid"]


def test_the_least_recently_used_idle_model_makes_room(model_dirs):
    """--models-dir names b and c by folder (a, the first, is named too: served once); a budget of two
    models' footprints (an 8 MiB pool each)."""
    server = ServerProcess(f"a={model_dirs / 'a'}", "--models-dir", str(model_dirs), "--kv-cache-mb", "8",
                           "--models-memory-mb", "18").wait_ready()
    try:
        assert states(server) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
        ask(server, "b")
        assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        ask(server, "a")  # b is now the least recently used
        ask(server, "c")
        assert states(server) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        ask(server, "b")  # a is the least recently used now (the first model too, when room is needed)
        assert states(server) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        raw = ask(server, "a")  # started again on its next request, in place of c (used before b)
        assert raw.headers["x-stratum-cost"].endswith(",model=a")
        assert states(server) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    finally:
        server.stop()


def test_a_model_with_a_request_in_flight_is_never_evicted(model_dirs):
    """A budget of one model: b waits for a's stream to end before a is unloaded to make room for it.
    Then b's engine dies, with restarts off: b answers 503, and a takes its place."""
    server = ServerProcess(f"a={model_dirs / 'a'}", "--model", f"b={model_dirs / 'b'}", "--kv-cache-mb", "8",
                           "--models-memory-mb", "10", "--engine-restarts", "0").wait_ready()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        greedy_to_the_end = {"ignore_eos": True, "temperature": 0}
        with client.messages.stream(model="a", max_tokens=1900, messages=HI, extra_body=greedy_to_the_end) as s:
            next(iter(s))  # a is generating
            done: list = []
            waiter = threading.Thread(target=lambda: done.append(ask(server, "b").parse().model))
            waiter.start()
            deadline = time.monotonic() + 10
            while states(server)["b"] != "loading":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
            assert states(server) == {"a": "loaded", "b": "loading"} and not done
            text = "".join(s.text_stream)
        assert text
        waiter.join(60)
        assert done == ["b"] and states(server) == {"a": "unloaded", "b": "loaded"}
        # an engine that died, not restarted (--engine-restarts 0): its model answers 503, and its memory
        # goes to the next model asked for
        os.kill(entry(server, "b")["engine_pid"], signal.SIGKILL)
        time.sleep(1)
        with pytest.raises(anthropic.InternalServerError) as e:
            ask(server, "b")
        assert e.value.status_code == 503
        assert ask(server, "a").parse().model == "a" and states(server) == {"a": "loaded", "b": "unloaded"}
    finally:
        server.stop()


def test_past_the_load_wait_a_request_gets_503_and_an_idle_model_unloads_after_keep_alive(model_dirs, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    server = ServerProcess(f"a={model_dirs / 'a'}", "--model", f"b={model_dirs / 'b'}", "--model", f"x={broken}",
                           "--kv-cache-mb", "8", "--model-load-wait-s", "0.05", "--keep-alive", "1s").wait_ready()
    try:
        first = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"model": "b", "max_tokens": 2, "messages": HI})
        assert first.status_code == 503 and int(first.headers["retry-after"]) >= 1
        assert first.json()["error"]["type"] == "server_error" and "still loading" in first.json()["error"]["message"]
        wait_for(server, "b", "loaded")  # the load went on
        assert ask(server, "b").parse().model == "b"
        wait_for(server, "b", "unloaded", timeout=10)  # --keep-alive 1s after its last request
        bad = httpx.post(server.url + "/v1/messages", timeout=30, json={"model": "x", "max_tokens": 2, "messages": HI})
        assert bad.status_code == 503
        wait_for(server, "x", "failed")
        entry = next(m for m in health(server)["models"] if m["name"] == "x")
        assert entry["error"] and health(server)["status"] == "ok"
    finally:
        server.stop()


def test_info_reports_each_model_by_its_served_name(model_dirs, capsys):
    import json

    from stratum.cli import main

    assert main(["info", "--model", f"a={model_dirs / 'a'}", "--models-dir", str(model_dirs), "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    shapes = {m["name"]: (m["checkpoint"]["hidden"], m["checkpoint"]["layers"]) for m in report["models"]}
    assert shapes == {"a": (64, 2), "b": (32, 2), "c": (32, 1)} and report["cpu_count"]


def test_keep_alive_reads_as_ollamas_durations_and_model_names_as_name_equals_model():
    import math

    from stratum.server.models import keep_alive_seconds, parse_model_arg

    assert [keep_alive_seconds(v) for v in ("5m", "1h30m", "90", "0", 0, "1.5s", None)] == [
        300, 5400, 90, 0, 0, 1.5, None]
    assert keep_alive_seconds("-1") == keep_alive_seconds(-5) == keep_alive_seconds("-1m") == math.inf
    for bad in ("soon", "5 m", "m", "", "nan"):
        with pytest.raises(ValueError):
            keep_alive_seconds(bad)
    assert parse_model_arg("coder=/models/q.gguf") == ("coder", "/models/q.gguf")
    assert parse_model_arg("smollm2-135m") == (None, "smollm2-135m")
    assert parse_model_arg("./a=b.gguf") == (None, "./a=b.gguf")


def test_an_encoder_serves_embeddings_beside_a_chat_model_whose_context_flags_are_the_chat_models(model_dirs,
                                                                                                    tmp_path):
    """A RAG pipeline's two halves behind one server: the context flags (here past the encoder's 512
    positions, with YaRN, which learned positions cannot take) are the generator's, and the encoder keeps its own."""
    from tests.encoders import make_bert_dir

    encoder = make_bert_dir(tmp_path / "encoder")
    server = ServerProcess(f"tiny-a={model_dirs / 'a'}", "--model", f"embed={encoder}", "--kv-cache-mb", "8",
                           "--max-model-len", "4096", "--rope-scaling", "yarn").wait_ready()
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in oai.models.list()] == ["tiny-a", "embed"]
        raw = oai.embeddings.with_raw_response.create(model="embed", input=["the sea", "a boat"])
        vectors = raw.parse()
        assert [len(d.embedding) for d in vectors.data] == [64, 64] and vectors.model == "embed"
        assert raw.headers["x-stratum-cost"].endswith(",model=embed")
        chat = oai.chat.completions.create(model="tiny-a", messages=HI, max_tokens=4, temperature=0)
        assert chat.model == "tiny-a" and chat.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError) as e:  # an encoder generates nothing; a chat model embeds nothing
            oai.chat.completions.create(model="embed", messages=HI, max_tokens=4)
        assert e.value.code == "model_not_supported"
        with pytest.raises(openai.BadRequestError):
            oai.embeddings.create(model="tiny-a", input="the sea")
        client = ollama.Client(host=server.url)
        assert len(client.embed(model="embed", input="the sea").embeddings[0]) == 64
        assert client.show("embed").capabilities == ["embedding"]
        assert "embedding" not in client.show("tiny-a").capabilities
        assert states(server) == {"tiny-a": "loaded", "embed": "loaded"}
        assert httpx.get(server.url + "/v1/models/embed").json()["id"] == "embed"
    finally:
        server.stop()
