"""Ollama's API through the official `ollama` Python client: chat and generate (NDJSON streams and one
body), options as sampling, `format` JSON and schemas, tools with object arguments, `think` on a
reasoning model (a scripted Qwen3, `tests/scripted.py`) and refused on one that does not reason, the
model routes (version, tags, ps, show), and every error in Ollama's shape with its status."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.conftest import ServerProcess
from tests.scripted import QWEN3_ADDED, make_scripted_model, template
from tests.test_reasoning import THOUGHT, TOOL_AFTER_THOUGHT
from tests.test_structured import NESTED

GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return ollama.Client(host=tiny_server.url)


def hi(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- the model routes ----------------------------------------------------------------------------------
def test_version_tags_ps_and_show_describe_the_served_model(tiny, tiny_server):
    assert httpx.get(tiny_server.url + "/").text == "Ollama is running"
    assert httpx.head(tiny_server.url + "/api/version").status_code == 200
    assert tiny._request_raw("GET", "/api/version").json()["version"]
    models = tiny.list().models
    assert [m.model for m in models] == ["tiny:latest"]
    m = models[0]
    assert m.size > 0 and len(m.digest) == 64 and m.modified_at is not None
    assert m.details.family == "llama" and m.details.parameter_size and m.details.quantization_level
    running = tiny.ps().models
    assert [r.model for r in running] == ["tiny:latest"] and running[0].context_length > 0
    for name in ("tiny", "tiny:latest"):
        shown = tiny.show(name)
        assert shown.modelinfo["general.architecture"] == "llama"
        assert shown.modelinfo["llama.context_length"] > 0 and shown.modelinfo["general.parameter_count"] > 0
        assert shown.capabilities == ["completion", "tools"] and shown.template and shown.details.family == "llama"


# ---- chat and generate ---------------------------------------------------------------------------------
def test_chat_streamed_and_not_say_the_same_with_the_figures_last(tiny, tiny_server):
    options = {**GREEDY, "num_predict": 6}
    whole = tiny.chat(model="tiny", messages=hi(), options=options, stream=False)
    chunks = list(tiny.chat(model="tiny", messages=hi(), options=options, stream=True))
    assert whole.message.role == "assistant" and whole.done and whole.done_reason == "length"
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.done_reason == "length" and last.eval_count == 6 and last.prompt_eval_count > 0
    for figure in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[figure], int) and last[figure] > 0
    assert last.total_duration >= last.prompt_eval_duration + last.eval_duration and last.load_duration == 0
    # a body without `stream` streams, as Ollama's server does (its Python client sends stream: false)
    with httpx.stream("POST", tiny_server.url + "/api/chat", json={"model": "tiny", "messages": hi(),
                                                                   "options": options}) as r:
        assert r.headers["content-type"] == "application/x-ndjson" and "x-stratum-cost" in r.headers
        lines = [json.loads(line) for line in r.iter_lines()]
    assert all("stratum_meta" not in line and "stratum_cost" not in line for line in lines)  # exactly Ollama's
    meta = httpx.post(tiny_server.url + "/api/chat", headers={"x-stratum-meta": "on"},
                      json={"model": "tiny", "messages": hi(), "options": options}).text.splitlines()
    assert "stratum_meta" in json.loads(meta[0]) and "stratum_cost" in json.loads(meta[-1])


def test_generate_continues_its_context_and_reads_raw_prompts(tiny):
    options = {**GREEDY, "num_predict": 4}
    first = tiny.generate(model="tiny", prompt="Once upon a time", system="Be brief.", options=options, stream=False)
    assert first.done and first.eval_count == 4 and first.context[-4:] and len(first.context) > 4
    streamed = list(tiny.generate(model="tiny", prompt="Once upon a time", system="Be brief.", options=options,
                                  stream=True))
    assert "".join(c.response for c in streamed) == first.response and streamed[-1].context == first.context
    follow = tiny.generate(model="tiny", prompt="And then?", context=first.context, options=options, stream=False)
    assert follow.prompt_eval_count > len(first.context) and follow.context[:len(first.context)] == first.context
    raw = tiny.generate(model="tiny", prompt="Once upon a time", raw=True, options=options, stream=False)
    assert raw.prompt_eval_count < first.prompt_eval_count  # no template around it
    # nothing to generate: Ollama's way to load a model, answered at once
    assert tiny.generate(model="tiny").done_reason == "load"
    assert tiny.chat(model="tiny", messages=[], keep_alive=0).done_reason == "unload"


def test_options_are_the_sampling(tiny):
    def text(seed, **extra):
        return tiny.chat(model="tiny", messages=hi(), stream=False,
                         options={"temperature": 1.0, "seed": seed, "num_predict": 8, **extra}).message.content

    assert text(7) == text(7) and text(11) == text(11)
    assert len({text(seed) for seed in (1, 2, 3, 4)}) > 1
    assert tiny.chat(model="tiny", messages=hi(), stream=False, options={"num_predict": 3}).eval_count == 3
    # what the sampler has not are accepted (clients send Ollama's defaults), and the keep_alive forms too
    kept = tiny.chat(model="tiny", messages=hi(), stream=False, keep_alive="5m", options={
        **GREEDY, "num_predict": 3, "repeat_penalty": 1.1, "min_p": 0.05, "num_ctx": 2048, "top_k": 40, "top_p": 0.9})
    assert kept.eval_count == 3
    assert tiny.chat(model="tiny", messages=hi(), stream=False, keep_alive=-1, options={"num_predict": 1}).done
    # nulls are absent fields, as Ollama's server reads them: `stream` null streams
    nulls = tiny._request_raw("POST", "/api/chat", json={"model": "tiny", "messages": hi(), "stream": None,
                                                         "format": None, "think": None, "options": {
                                                             "num_predict": 2, "temperature": None}})
    assert [json.loads(line)["done"] for line in nulls.text.splitlines()][-1] is True


def test_logprobs_score_each_token_best_first(tiny):
    kwargs = dict(model="tiny", messages=hi(), options={**GREEDY, "num_predict": 5}, logprobs=True, top_logprobs=3)
    whole = tiny.chat(**kwargs, stream=False)
    assert len(whole.logprobs) == 5
    for entry in whole.logprobs:
        alternatives = [a.logprob for a in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == pytest.approx(alternatives[0], abs=1e-4)  # greedy: the best one was sampled
    streamed = [e for c in tiny.chat(**kwargs, stream=True) for e in c.logprobs or []]
    def scores(entries):
        return [(e.token, round(e.logprob, 4)) for e in entries]

    assert scores(streamed) == scores(whole.logprobs)
    assert "".join(e.token for e in whole.logprobs) == whole.message.content
    generated = tiny.generate(model="tiny", prompt="hi", options={**GREEDY, "num_predict": 4}, logprobs=True,
                              stream=False)
    assert len(generated.logprobs) == 4 and all(not e.top_logprobs for e in generated.logprobs)
    assert tiny.chat(model="tiny", messages=hi(), options={"num_predict": 2}, stream=False).logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_format_json_and_schemas_hold_the_answer(tiny, stream):
    def answer(fmt, **kwargs):
        options = {"seed": 3, "num_predict": 160}
        if stream:
            return "".join(c.message.content for c in tiny.chat(model="tiny", messages=hi("json"), format=fmt,
                                                                 options=options, stream=True))
        return tiny.chat(model="tiny", messages=hi("json"), format=fmt, options=options, stream=False).message.content

    jsonschema.validate(json.loads(answer(NESTED)), NESTED)
    assert isinstance(json.loads(answer("json")), dict)
    generated = tiny.generate(model="tiny", prompt="json", format=NESTED, options={"seed": 4, "num_predict": 160},
                              stream=False)
    jsonschema.validate(json.loads(generated.response), NESTED)
    raw = tiny.generate(model="tiny", prompt="{", raw=True, format=NESTED, options={"seed": 5, "num_predict": 160},
                        stream=False)
    jsonschema.validate(json.loads(raw.response), NESTED)


# ---- a reasoning model: think, and tools after the thought -----------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_scripted_model(tmp_path_factory.mktemp("thought"), template("qwen3"), [THOUGHT], added=QWEN3_ADDED)
    server = ServerProcess(str(path), "--served-model-name", "qwen3-tiny", "--kv-cache-mb", "8").wait_ready()
    yield ollama.Client(host=server.url)
    server.stop()


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory):
    path = make_scripted_model(tmp_path_factory.mktemp("tools"), template("qwen3"), [TOOL_AFTER_THOUGHT],
                               added=QWEN3_ADDED)
    server = ServerProcess(str(path), "--served-model-name", "qwen3-tiny", "--kv-cache-mb", "8").wait_ready()
    yield ollama.Client(host=server.url)
    server.stop()


def test_think_returns_the_thought_apart(qwen3):
    r = qwen3.chat(model="qwen3-tiny", messages=USER, think=True, options=GREEDY, stream=False)
    assert r.message.thinking == "Let me see about it" and r.message.content == "The answer is Paris."
    chunks = list(qwen3.chat(model="qwen3-tiny", messages=USER, think=True, options=GREEDY, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == "Let me see about it"
    assert "".join(c.message.content or "" for c in chunks) == "The answer is Paris."
    off = qwen3.chat(model="qwen3-tiny", messages=USER, think=False, options=GREEDY, stream=False)
    assert off.message.thinking is None and off.message.content == "The answer is Paris."
    g = qwen3.generate(model="qwen3-tiny", prompt=USER[0]["content"], think="high", options=GREEDY, stream=False)
    assert g.thinking == "Let me see about it" and g.response == "The answer is Paris."
    assert "thinking" in qwen3.show("qwen3-tiny").capabilities
    # the thought goes back in with the turn it came with
    again = qwen3.chat(model="qwen3-tiny", think=True, options=GREEDY, stream=False, messages=[
        *USER, {"role": "assistant", "content": r.message.content, "thinking": r.message.thinking},
        {"role": "user", "content": "And of Spain?"}])
    assert again.message.thinking


def get_weather(city: str) -> str:
    """Weather in a city.

    Args:
      city: the city
    """
    return f"22C in {city}"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_carry_object_arguments_and_their_results_go_back(qwen3_tools, stream):
    kwargs = dict(model="qwen3-tiny", messages=USER, tools=[get_weather], options=GREEDY, think=True)
    if stream:
        chunks = list(qwen3_tools.chat(**kwargs, stream=True))
        calls = [c for chunk in chunks for c in chunk.message.tool_calls or []]
        thinking = "".join(chunk.message.thinking or "" for chunk in chunks)
        assert chunks[-1].done_reason == "stop"
    else:
        r = qwen3_tools.chat(**kwargs, stream=False)
        calls, thinking = r.message.tool_calls, r.message.thinking
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert thinking == "I should look it up"
    result = get_weather(**calls[0].function.arguments)
    follow = qwen3_tools.chat(model="qwen3-tiny", tools=[get_weather], options={**GREEDY, "num_predict": 40},
                              stream=False, messages=[
                                  *USER, {"role": "assistant", "content": "", "tool_calls": calls},
                                  {"role": "tool", "tool_name": "get_weather", "content": result}])
    assert follow.done and follow.prompt_eval_count > qwen3_tools.chat(**kwargs, stream=False).prompt_eval_count


# ---- errors, in Ollama's shape ---------------------------------------------------------------------------
def status_of(call) -> tuple[int, str]:
    with pytest.raises(ollama.ResponseError) as e:
        call()
    return e.value.status_code, e.value.error


def test_errors_are_ollamas(tiny, tiny_server):
    assert status_of(lambda: tiny.chat(model="nope", messages=hi())) == (404, "model 'nope' not found")
    assert status_of(lambda: tiny.show("llama3.2"))[0] == 404
    assert status_of(lambda: tiny.chat(model="tiny", messages=hi(), think=True)) == (
        400, '"tiny" does not support thinking')
    assert status_of(lambda: tiny.embed(model="tiny", input="hello")) == (400, '"tiny" does not support embeddings')
    assert status_of(lambda: tiny.embeddings(model="tiny", prompt="hello"))[0] == 400
    for call in (lambda: tiny.pull("llama3.2"), lambda: tiny.delete("tiny"), lambda: tiny.copy("tiny", "x"),
                 lambda: tiny.push("tiny"), lambda: tiny.create("x", from_="tiny")):
        status, error = status_of(call)
        assert status == 400 and "serves the models it was started with (tiny:latest)" in error
    status, error = status_of(lambda: tiny.chat(model="tiny", messages=hi(), options={"temperature": "hot"}))
    assert status == 400 and "temperature" in error
    assert status_of(lambda: tiny.chat(model="tiny", messages=hi(), keep_alive="soon"))[0] == 400
    assert status_of(lambda: tiny.chat(model="tiny", messages=hi(), options={"temperature": 5}))[0] == 400
    for options in ({"top_k": 2**64}, {"num_predict": 2**64}):  # numbers past what the engine carries: a 400
        status, error = status_of(lambda: tiny.chat(model="tiny", messages=hi(), options=options))
        assert status == 400 and next(iter(options)) in error
    assert status_of(lambda: tiny.generate(model="tiny", prompt="hi", context=[2**64]))[0] == 400
    for r in (httpx.post(tiny_server.url + "/api/chat", content=b"{not json"),
              httpx.post(tiny_server.url + "/api/chat", json={"model": "tiny", "messages": "hi"})):
        assert r.status_code == 400 and set(r.json()) == {"error"}
    unknown = httpx.get(tiny_server.url + "/api/nothing")
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
    assert httpx.head(tiny_server.url + "/api/hello").status_code == 404  # Claude Code's probe: harmless


def test_keys_tenants_and_admission_speak_ollama(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--api-key", "k1", "--tenant-budget-tokens", "200").wait_ready()
    try:
        keyed = ollama.Client(host=server.url, headers={"Authorization": "Bearer k1"})
        assert keyed.chat(model="tiny", messages=hi(), options={"num_predict": 2}, stream=False).eval_count == 2
        assert status_of(lambda: ollama.Client(host=server.url).list())[0] == 401
        wrong = ollama.Client(host=server.url, headers={"Authorization": "Bearer no"})
        assert status_of(lambda: wrong.list())[0] == 401
        status, error = status_of(lambda: keyed.chat(model="tiny", messages=hi(), options={"num_predict": 500}))
        assert status == 429 and error
    finally:
        server.stop()
    full = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                         "--max-waiting", "0").wait_ready()
    try:  # a full queue is Ollama's "server busy", 503
        status, error = status_of(lambda: ollama.Client(host=full.url).chat(model="tiny", messages=hi()))
        assert status == 503 and "queue" in error
    finally:
        full.stop()


def test_the_real_model_answers_through_ollamas_client(real_server):
    client = ollama.Client(host=real_server.url)
    assert client.show("smollm2-135m:latest").details.parameter_size == "134.52M"
    r = client.chat(model="smollm2-135m", messages=USER, options={**GREEDY, "num_predict": 30}, stream=False)
    assert "Paris" in r.message.content and r.done_reason == "stop"
    # the same engine and sampling behind both APIs: the same greedy answer
    same = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x").chat.completions.create(
        model="smollm2-135m", messages=USER, temperature=0, max_tokens=30)
    assert same.choices[0].message.content == r.message.content
    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}
    g = client.generate(model="smollm2-135m", prompt="Name a colour.", format=colour,
                        options={**GREEDY, "num_predict": 40}, stream=False)
    jsonschema.validate(json.loads(g.response), colour)
