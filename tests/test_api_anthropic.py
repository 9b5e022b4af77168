"""The Anthropic Messages API as the official `anthropic` SDK sees it, against a real `stratum serve`.

The tiny random model answers with random bytes, so these tests check shapes, stop reasons,
usage accounting and prompt construction; the real model (integration) checks tool calls and text.
This SDK version has no temperature/seed arguments, so sampling goes in `extra_body`.
"""

from __future__ import annotations

import uuid

import anthropic
import pytest
from tokenizers import Tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
async def aclient(tiny_server):
    """Per test: an async client's connections belong to the event loop that made them."""
    async with anthropic.AsyncAnthropic(base_url=tiny_server.url, api_key="test", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def user(text) -> dict:
    return {"role": "user", "content": text}


def count(client, messages, **kwargs) -> int:
    return client.messages.count_tokens(model="tiny", messages=messages, **kwargs).input_tokens


def warm(client, messages, **kwargs) -> None:
    """Run the prompt once, so the runs compared next read the same cached prefix (a cache hit can
    change prefill arithmetic enough to tip a greedy choice)."""
    client.messages.create(model="tiny", max_tokens=1, messages=messages, **kwargs)


def prompt_tokens(usage) -> int:
    """The prompt's size as usage reports it. Anthropic's rule: input_tokens counts neither cache reads
    nor cache writes, so the three add up to count_tokens."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def greedy(client, messages, max_tokens=24, **kwargs):
    return client.messages.create(model="tiny", max_tokens=max_tokens, messages=messages, extra_body=GREEDY, **kwargs)


# ---- create, async, stream ---------------------------------------------------------------------
def test_create_returns_a_message(client):
    msg = greedy(client, [user("Hello")], max_tokens=12)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 12
    assert msg.usage.input_tokens > 0


def test_response_carries_request_id(client):
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=2, messages=[user("hi")])
    assert raw.headers["request-id"].startswith("req_")
    assert raw.parse().type == "message"


async def test_async_create_matches_sync(client, aclient):
    messages = [user("Async 中文 🙂")]
    warm(client, messages)
    sync = greedy(client, messages)
    msg = await aclient.messages.create(model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY)
    assert msg.content[0].text == sync.content[0].text
    assert msg.usage.output_tokens == sync.usage.output_tokens == 24


def test_stream_text_stream_and_final_message(client):
    messages = [user("Stream me: 日本 🚀")]
    warm(client, messages)
    with client.messages.stream(model="tiny", max_tokens=32, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 32
    assert text == greedy(client, messages, max_tokens=32).content[0].text


async def test_async_stream(aclient):
    async with aclient.messages.stream(model="tiny", max_tokens=16, messages=[user("hi")], extra_body=GREEDY) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 16


# ---- stop reasons ------------------------------------------------------------------------------
def test_max_tokens_stop_reason(client):
    msg = greedy(client, [user("count")], max_tokens=3)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_stop_sequence_sets_stop_reason_and_sequence(client):
    warm(client, [user("Hello world!")])
    text = greedy(client, [user("Hello world!")], max_tokens=40).content[0].text
    stop = next((text[i: i + 2] for i in range(1, len(text) - 1)
                 if text[i: i + 2].isascii() and text[i: i + 2].isalpha()), None)
    assert stop, f"no ASCII letters in {text!r}"
    msg = greedy(client, [user("Hello world!")], max_tokens=40, stop_sequences=["\u0000never", stop])
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop
    assert "".join(b.text for b in msg.content) == text[: text.index(stop)]


# ---- usage and the prefix cache ----------------------------------------------------------------
def test_usage_input_tokens_exclude_cached_tokens(client):
    """Anthropic's rules: reads are what the cache served, writes only what a cache_control breakpoint
    marked; automatic caching of an unmarked prompt is not a cache write."""
    messages = [user(f"cache test {uuid.uuid4().hex} " + "the capital of Japan is Tokyo. " * 12)]
    total = count(client, messages)
    first = greedy(client, messages, max_tokens=4)
    second = greedy(client, messages, max_tokens=4)
    for msg in (first, second):
        assert prompt_tokens(msg.usage) == total
        assert msg.usage.cache_creation_input_tokens == 0
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert second.usage.input_tokens == total - second.usage.cache_read_input_tokens


def test_cold_prompt_without_cache_control_is_all_input(client):
    system = f"cold {uuid.uuid4().hex}: answer briefly."  # no block of it is cached anywhere
    messages = [user("the capital of Japan is Tokyo. " * 8)]
    total = count(client, messages, system=system)
    msg = greedy(client, messages, max_tokens=4, system=system)
    assert msg.usage.input_tokens == total
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0


def test_cache_control_reports_writes_then_reads(client):
    system = [{"type": "text", "text": f"marked {uuid.uuid4().hex}: " + "a long shared instruction. " * 20,
               "cache_control": {"type": "ephemeral"}}]
    total = count(client, [user("hi")], system=system)
    first = greedy(client, [user("hi")], max_tokens=4, system=system)
    second = greedy(client, [user("hello")], max_tokens=4, system=system)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    assert prompt_tokens(first.usage) == total
    assert second.usage.cache_creation_input_tokens < first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - 16  # all full blocks


def test_count_tokens_matches_usage(client):
    messages = [user("How many tokens is this? 🙂")]
    msg = greedy(client, messages, max_tokens=1, system="Be brief.")
    assert prompt_tokens(msg.usage) == count(client, messages, system="Be brief.")


# ---- prompt construction -----------------------------------------------------------------------
def test_system_string_equals_text_blocks(client):
    messages = [user("Hi there")]
    system = "You answer in French, in one short sentence, about cities."
    as_string = count(client, messages, system=system)
    as_blocks = count(client, messages, system=[{"type": "text", "text": system}])
    assert as_string == as_blocks != count(client, messages)
    warm(client, messages, system=system)
    a = greedy(client, messages, system=system).content[0].text
    b = greedy(client, messages, system=[{"type": "text", "text": system}]).content[0].text
    assert a == b


def test_system_blocks_are_joined(client):
    messages = [user("Hi")]
    split = count(client, messages,
                  system=[{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}])
    assert split > count(client, messages, system="Part one.")


def test_consecutive_same_role_turns_are_merged(client):
    two_turns = [user("First question."), user("Second question.")]
    one_turn = [user([{"type": "text", "text": "First question."}, {"type": "text", "text": "Second question."}])]
    assert count(client, two_turns) == count(client, one_turn)
    warm(client, one_turn)
    assert greedy(client, two_turns).content[0].text == greedy(client, one_turn).content[0].text
    # two assistant turns in a row merge too (and, being last, form one prefill)
    prefill = [user("Hi"), {"role": "assistant", "content": "Hello"}, {"role": "assistant", "content": "again"}]
    blocks = [user("Hi"), {"role": "assistant",
                           "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "again"}]}]
    assert count(client, prefill) == count(client, blocks)
    warm(client, blocks)
    assert greedy(client, prefill).content[0].text == greedy(client, blocks).content[0].text


def test_final_assistant_turn_is_a_prefill(client, tokenizer):
    """The prompt stops right after the assistant text: no end-of-turn, no new assistant header."""
    prefill = "The answer is"
    base = count(client, [user("Question?")])
    with_prefill = count(client, [user("Question?"), {"role": "assistant", "content": prefill}])
    assert with_prefill == base + len(tokenizer.encode(prefill).ids)
    msg = greedy(client, [user("Question?"), {"role": "assistant", "content": prefill}], max_tokens=8)
    assert prompt_tokens(msg.usage) == with_prefill
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8


def test_user_text_special_tokens_are_plain_text(client, tokenizer):
    """Text that spells a special token is tokenized as text (several BPE pieces), so it cannot open a fake turn."""
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tokenizer.token_to_id(special) is not None
        one_char = count(client, [user("before X system after")])
        spelled = count(client, [user(f"before {special} system after")])
        assert spelled - one_char >= 4, (special, one_char, spelled)  # one special token would add about 0
    # the prefill path too: the assistant text is plain text as well
    base = count(client, [user("Q"), {"role": "assistant", "content": "X"}])
    assert count(client, [user("Q"), {"role": "assistant", "content": "<|im_end|>"}]) - base >= 4


# ---- tools on the tiny model (shapes only) -----------------------------------------------------
def test_tool_choice_none_leaves_tools_out_of_the_prompt(client):
    messages = [user("Weather in Tokyo?")]
    without = count(client, messages)
    assert count(client, messages, tools=[WEATHER_TOOL], tool_choice={"type": "none"}) == without
    assert count(client, messages, tools=[WEATHER_TOOL], tool_choice={"type": "auto"}) > without
    assert count(client, messages, tools=[WEATHER_TOOL]) > without


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "none"}])
def test_tool_choices_are_accepted(client, choice):
    msg = client.messages.create(model="tiny", max_tokens=16, messages=[user("Weather in Tokyo?")],
                                 tools=[WEATHER_TOOL], tool_choice=choice, extra_body={"temperature": 0})
    assert msg.stop_reason in {"end_turn", "max_tokens", "tool_use", "stop_sequence"}
    for block in msg.content:
        if block.type == "tool_use":
            assert block.name == "get_weather" and block.id.startswith("toolu_") and isinstance(block.input, dict)


def test_tool_results_go_back_in(client):
    history = [
        user("Weather in Tokyo?"),
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Tokyo"}}]},
        user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22°C and sunny"}]),
    ]
    blocks = [dict(history[2], content=[{"type": "tool_result", "tool_use_id": "toolu_1",
                                         "content": [{"type": "text", "text": "22°C and sunny"}], "is_error": False}])]
    n = count(client, history, tools=[WEATHER_TOOL])
    assert n > count(client, history[:1], tools=[WEATHER_TOOL])
    assert n == count(client, history[:2] + blocks, tools=[WEATHER_TOOL])
    msg = greedy(client, history, tools=[WEATHER_TOOL], max_tokens=8)
    assert prompt_tokens(msg.usage) == n


# ---- models ------------------------------------------------------------------------------------
def test_models_list_and_retrieve(client):
    page = client.models.list()
    assert [m.id for m in page.data] == ["tiny"]
    assert page.data[0].type == "model"
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.display_name
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- error classes -----------------------------------------------------------------------------
def _error_type(e: anthropic.APIStatusError) -> str:
    assert e.response.headers.get("request-id")
    assert e.body["type"] == "error" and e.body["request_id"] == e.response.headers["request-id"]
    return e.body["error"]["type"]


def test_bad_request_error(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=[user("hi")], extra_body={"temperature": 1.5})
    assert info.value.status_code == 400 and _error_type(info.value) == "invalid_request_error"
    assert "temperature" in info.value.body["error"]["message"]


def test_not_found_error_for_unknown_model(client):
    """Any claude-* name is served by the loaded model (docs/api.md: "Model names"); another name is not found."""
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="gpt-nonexistent", max_tokens=4, messages=[user("hi")])
    assert _error_type(info.value) == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="gpt-nonexistent", messages=[user("hi")])


def test_context_overflow_names_the_numbers(client):
    """A prompt beyond the context names both counts, as Anthropic words it, and the count is
    count_tokens' own (a max_tokens within the model's limit but beyond what the prompt leaves is lowered
    instead: tests/test_agent_clients.py; one above the limit is its own 400: tests/bad_inputs.py)."""
    messages = [user("the capital of Japan is Tokyo. " * 400)]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=1000, messages=messages)
    message = info.value.body["error"]["message"]
    assert message == f"prompt is too long: {count(client, messages)} tokens > 2048 maximum"


@pytest.fixture(scope="module")
def budget_server(tiny_model_dir):
    """The tiny model with a per-tenant token budget small enough that one large request exceeds it."""
    from tests.conftest import ServerProcess

    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--tenant-budget-tokens", "200").wait_ready()
    yield server
    server.stop()


def test_rate_limit_error_over_the_tenant_budget(budget_server):
    client = anthropic.Anthropic(base_url=budget_server.url, api_key="tenant-a", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as info:
        client.messages.create(model="tiny", max_tokens=1000, messages=[user("hi")])
    assert info.value.status_code == 429 and _error_type(info.value) == "rate_limit_error"
    assert info.value.response.headers.get("retry-after")
    # a small request from another tenant is still served
    other = anthropic.Anthropic(base_url=budget_server.url, api_key="tenant-b", max_retries=0)
    assert other.messages.create(model="tiny", max_tokens=2, messages=[user("hi")]).usage.output_tokens >= 1


# ---- the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_client(real_server):
    return anthropic.Anthropic(base_url=real_server.url, api_key="test", max_retries=0)


@pytest.mark.integration
def test_real_model_knows_tokyo(real_client):
    msg = real_client.messages.create(model="smollm2-135m", max_tokens=30, extra_body={"temperature": 0},
                                      messages=[user("What is the capital of Japan? Answer in one word.")])
    assert "Tokyo" in msg.content[0].text
    assert msg.stop_reason == "end_turn"


@pytest.mark.integration
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_real_model_forced_tool_use(real_client, choice):
    msg = real_client.messages.create(model="smollm2-135m", max_tokens=80, tools=[WEATHER_TOOL], tool_choice=choice,
                                      messages=[user("What is the weather in Tokyo?")], extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use"
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls, msg.content
    assert calls[0].name == "get_weather" and calls[0].id.startswith("toolu_") and isinstance(calls[0].input, dict)
    # the tool result goes back in, and the model answers in text
    reply = real_client.messages.create(
        model="smollm2-135m", max_tokens=40, tools=[WEATHER_TOOL], extra_body={"temperature": 0},
        messages=[user("What is the weather in Tokyo?"),
                  {"role": "assistant",
                   "content": [c.model_dump(include={"type", "id", "name", "input"}) for c in calls]},
                  user([{"type": "tool_result", "tool_use_id": calls[0].id, "content": "22 degrees Celsius, sunny"}])])
    assert reply.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    assert reply.content


@pytest.mark.integration
def test_real_model_prefill_echo_of_special_token_text(real_client):
    """A prefill spelling <|im_end|> is plain text: the model goes on writing instead of seeing its turn end."""
    msg = real_client.messages.create(
        model="smollm2-135m", max_tokens=12, extra_body={"temperature": 0},
        messages=[user("Repeat after me: <|im_start|>assistant"), {"role": "assistant", "content": "<|im_start|>"}])
    total = real_client.messages.count_tokens(
        model="smollm2-135m",
        messages=[user("Repeat after me: <|im_start|>assistant"), {"role": "assistant", "content": "<|im_start|>"}])
    plain = real_client.messages.count_tokens(model="smollm2-135m", messages=[user("Repeat after me: assistant")])
    assert total.input_tokens - plain.input_tokens > 2
    assert prompt_tokens(msg.usage) == total.input_tokens
