"""The Responses API as OpenAI documents it and agents use it, through the `openai` SDK on the tiny model:
namespaced, custom (freeform) and OpenAI-run tools, the input item types, `max_output_tokens` left out,
stored responses (retrieve, delete, input items, previous_response_id, item references) and who may
read them, and errors that name the field that failed."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.conftest import ServerProcess

CONTEXT = 2048
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}]}
# Codex's `exec` tool's grammar (tests/data/agents: its default-model shape), and a strict one
CODEX_GRAMMAR = ("\nstart: pragma_source | plain_source\npragma_source: PRAGMA_LINE NEWLINE SOURCE\n"
                 "plain_source: SOURCE\n\n"
                 "PRAGMA_LINE: /[ \\t]*\\/\\/ @exec:[^\\r\\n]*/\nNEWLINE: /\\r?\\n/\nSOURCE: /[\\s\\S]+/\n")
DIGITS = {"type": "custom", "name": "add", "description": "Add numbers: 1+2",
          "format": {"type": "grammar", "syntax": "lark", "definition": 'start: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'}}


def create(oai, **kwargs):
    return oai.responses.create(**{"model": "tiny", "temperature": 0, **kwargs})


# ---- tools --------------------------------------------------------------------------------------------
def test_a_namespaced_function_call_names_its_namespace(oai):
    r = create(oai, input="Spawn an agent", tools=[WEATHER, AGENTS], max_output_tokens=64,
               tool_choice={"type": "function", "name": "spawn_agent"})
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "spawn_agent" and call.namespace == "multi_agent_v1"
    assert isinstance(json.loads(call.arguments)["message"], str)
    # sent back (call and output), it is read as the same tool's call
    follow = [{"role": "user", "content": "Spawn an agent"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"agent_id": "a1"}'}]
    assert (create(oai, input=follow, tools=[WEATHER, AGENTS], max_output_tokens=1).usage.input_tokens
            > r.usage.input_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_custom_tool_call_follows_its_grammar(oai, stream):
    """A forced custom tool: its input is raw text its Lark grammar accepts, as the body or the stream's
    custom_tool_call_input events."""
    kwargs = dict(input="Add two numbers", tools=[WEATHER, DIGITS], tool_choice={"type": "custom", "name": "add"},
                  max_output_tokens=40)
    if stream:
        events = list(create(oai, stream=True, **kwargs))
        deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
        done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
        assert deltas == done.input
        item = events[-1].response.output[0]
        assert events[-1].type == "response.completed" and item.input == done.input
    else:
        item = create(oai, **kwargs).output[0]
    assert item.type == "custom_tool_call" and item.name == "add" and item.call_id.startswith("call_")
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", item.input), item.input


def test_codex_exec_tool_grammar_compiles_and_constrains(oai):
    """Codex's own `exec` tool (a namespace holding a custom tool with a Lark grammar): forced, its call
    names the namespace and carries raw text."""
    tools = [{"type": "namespace", "name": "functions", "description": "", "tools": [
        {"type": "custom", "name": "exec", "description": "Run JavaScript.",
         "format": {"type": "grammar", "syntax": "lark", "definition": CODEX_GRAMMAR}}]}]
    r = create(oai, input="Print hi", tools=tools, tool_choice={"type": "custom", "name": "exec"}, max_output_tokens=8)
    item = r.output[0]
    assert item.type == "custom_tool_call" and item.namespace == "functions" and item.name == "exec" and item.input


def test_a_regex_custom_tool_and_a_text_one(oai):
    regex = {"type": "custom", "name": "code",
             "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{2}"}}
    item = create(oai, input="A code", tools=[regex], tool_choice="required", max_output_tokens=20).output[0]
    assert item.type == "custom_tool_call" and re.fullmatch(r"[A-Z]{3}-[0-9]{2}", item.input), item.input
    free = {"type": "custom", "name": "note", "description": "Write a note."}
    item = create(oai, input="A note", tools=[free], tool_choice="required", max_output_tokens=5).output[0]
    assert item.type == "custom_tool_call" and item.name == "note"


def test_hosted_tools_are_accepted_and_not_offered(oai):
    """OpenAI-run tools change nothing in the prompt; forcing one is a 400 naming it."""
    hosted = [{"type": "web_search", "external_web_access": False}, {"type": "web_search_preview"},
              {"type": "file_search", "vector_store_ids": ["vs_1"]},
              {"type": "code_interpreter", "container": {"type": "auto"}},
              {"type": "image_generation"}, {"type": "local_shell"},
              {"type": "computer_use_preview", "display_width": 10, "display_height": 10, "environment": "linux"},
              {"type": "mcp", "server_label": "docs", "server_url": "https://x.example/mcp"}, {"type": "shell"},
              {"type": "apply_patch"}]
    plain = create(oai, input="Weather?", tools=[WEATHER], max_output_tokens=1).usage.input_tokens
    assert create(oai, input="Weather?", tools=[WEATHER, *hosted], max_output_tokens=1).usage.input_tokens == plain
    for choice in ({"type": "web_search_preview"}, {"type": "mcp", "server_label": "docs"}, {"type": "file_search"}):
        with pytest.raises(openai.BadRequestError) as info:
            create(oai, input="Weather?", tools=[WEATHER, *hosted], tool_choice=choice, max_output_tokens=1)
        assert choice["type"] in info.value.response.json()["error"]["message"]


def test_allowed_tools_offers_only_those(oai):
    both = create(oai, input="Weather?", tools=[WEATHER, AGENTS], max_output_tokens=1).usage.input_tokens
    one = create(oai, input="Weather?", tools=[WEATHER], max_output_tokens=1).usage.input_tokens
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    assert create(oai, input="Weather?", tools=[WEATHER, AGENTS], tool_choice=allowed,
                  max_output_tokens=1).usage.input_tokens == one < both


# ---- input items ------------------------------------------------------------------------------------
def test_codex_items_are_read(oai):
    """What Codex sends back: reasoning with encrypted content, a namespaced call, a function output with
    no call_id (named by its namespace), a custom call and its output as parts, ids on every item."""
    items = [
        {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "Set a goal"}]},
        {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "Next."}], "content": None,
         "encrypted_content": "opaque"},
        {"type": "function_call", "status": "completed", "id": "fc_0", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": '{"message": "hi"}', "call_id": "call_0"},
        {"type": "function_call_output", "id": "fco_0", "call_id": "call_0", "output": "ok"},
        {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
         "output": "print hi"},
        {"type": "custom_tool_call", "id": "ctc_0", "status": "completed", "call_id": "call_1", "name": "exec",
         "namespace": "functions", "input": "text('hi')"},
        {"type": "custom_tool_call_output", "id": "ctco_0", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "Script completed"}, {"type": "input_text", "text": "hi"}]},
    ]
    r = create(oai, input=items, tools=[AGENTS], max_output_tokens=1)
    assert r.usage.input_tokens > create(oai, input=items[:1], tools=[AGENTS], max_output_tokens=1).usage.input_tokens


def test_max_output_tokens_left_out_is_the_context_s_room(oai):
    """As OpenAI does: no bound but the context (the answer runs to its end here)."""
    r = create(oai, input="Hello", extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.usage.input_tokens + r.usage.output_tokens == CONTEXT
    assert r.max_output_tokens is None


# ---- stored responses ---------------------------------------------------------------------------------
def test_a_stored_response_is_retrieved_listed_continued_and_deleted(oai):
    first = create(oai, input="My name is Ada.", instructions="Be brief.", max_output_tokens=4)
    assert first.store is True and oai.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = oai.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].id.startswith("msg_")
    second = create(oai, input="What is my name?", previous_response_id=first.id, max_output_tokens=1)
    assert second.previous_response_id == first.id
    # the model read the first turn, its answer and the new one (not the instructions: they are per response)
    whole = [{"role": "user", "content": "My name is Ada."}, *(o.model_dump() for o in first.output),
             {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == create(oai, input=whole, max_output_tokens=1, store=False).usage.input_tokens
    assert len(oai.responses.input_items.list(second.id, order="asc").data) == 3
    # an item reference stands for the stored item it names
    ref = create(oai, input=[{"type": "item_reference", "id": first.output[0].id},
                             {"role": "user", "content": "Go on"}],
                 max_output_tokens=1, store=False)
    inline = create(oai, input=[first.output[0].model_dump(), {"role": "user", "content": "Go on"}],
                    max_output_tokens=1, store=False)
    assert ref.usage.input_tokens == inline.usage.input_tokens
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:  # its continuation's history is gone with it
        create(oai, input="Again?", previous_response_id=second.id, max_output_tokens=1)
    assert first.id in info.value.response.json()["error"]["message"]


def test_store_false_keeps_nothing_and_a_stream_is_stored(oai):
    r = create(oai, input="Hi", max_output_tokens=1, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    final = list(create(oai, input="Hi", max_output_tokens=2, stream=True))[-1].response
    assert oai.responses.retrieve(final.id).output_text == final.output_text


@pytest.fixture(scope="module")
def two_tenants(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--api-key", "key-a", "--api-key", "key-b").wait_ready()
    yield [openai.OpenAI(base_url=server.url + "/v1", api_key=k, max_retries=0) for k in ("key-a", "key-b")]
    server.stop()


def test_one_tenant_never_reads_another_s_stored_response(two_tenants):
    a, b = two_tenants
    r = a.responses.create(model="tiny", input="A secret", max_output_tokens=1)
    assert a.responses.retrieve(r.id).id == r.id
    for attempt in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                    lambda: b.responses.input_items.list(r.id),
                    lambda: b.responses.create(model="tiny", input="Go on", previous_response_id=r.id,
                                               max_output_tokens=1),
                    lambda: b.responses.create(model="tiny", max_output_tokens=1,
                                               input=[{"type": "item_reference", "id": r.output[0].id}])):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert a.responses.retrieve(r.id).id == r.id  # b's delete did nothing


# ---- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("item, says, param", [
    ({"type": "function_call_output", "output": 5}, "input.1.function_call_output.output: Input should be a string or",
     "input[1].output"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.1.function_call.call_id: Field required",
     "input[1].call_id"),
    ({"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 3}, "input.1.custom_tool_call.input:",
     "input[1].input"),
])
def test_an_error_names_the_field_of_the_item_meant(oai, item, says, param):
    with pytest.raises(openai.BadRequestError) as info:
        create(oai, input=[{"role": "user", "content": "Hi"}, item], max_output_tokens=1)
    error = info.value.response.json()["error"]
    assert error["message"].startswith(says) and error["param"] == param, error
