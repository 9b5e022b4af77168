"""Agent clients as they are shipped: the Messages API as Claude Code sends it, the OpenAI Responses
API through the `openai` SDK and the OpenAI Agents SDK, and the Claude Code CLI itself (from npm).

The tiny random model checks shapes, counts and the event sequence; the real model (integration)
runs the clients end to end.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.factories import make_tiny_model_dir

CONTEXT = 2048  # the tiny model's context
WEATHER = {"name": "get_weather", "description": "Get the weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RESP_WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city",
                "parameters": WEATHER["input_schema"]}
# What Claude Code 2.1.197 sends on its first call (recorded from `claude -p` with --tools Agent), cut down
# to its shape: a system-role message after the user turn, cache_control on blocks, adaptive thinking,
# context_management, effort, metadata, the anthropic-beta header and a max_tokens far beyond the context.
CLAUDE_CODE_BETAS = ["claude-code-20250219", "context-1m-2025-08-07", "interleaved-thinking-2025-05-14",
                     "context-management-2025-06-27", "prompt-caching-scope-2026-01-05",
                     "mid-conversation-system-2026-04-07", "effort-2025-11-24"]


def claude_code_body(question: str, model: str = "claude-opus-4-8") -> dict:
    return {
        "model": model, "max_tokens": 64000,
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-02.\n</system-reminder>\n\n"},
                {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types for the Agent tool:\n- general-purpose: research."},
        ],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
                   {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }


def count(client, messages, **kwargs) -> int:
    return client.messages.count_tokens(model="tiny", messages=messages, **kwargs).input_tokens


def user(content) -> dict:
    return {"role": "user", "content": content}


# ---- the Messages API as Claude Code sends it ------------------------------------------------------
def test_claude_code_first_request_is_served(client, tiny_server):
    """The request Claude Code sends first, once refused: every field accepted. Its max_tokens (64000) is above what the
    2048-token model can hold: a 400 naming both numbers in Anthropic's words, which Claude Code reads
    (the pattern below is its own, from 2.1.332) and sends again with the maximum; that max_tokens is
    then lowered to what the prompt leaves. (Without the custom tool, whose call would end the answer
    early: the answer must fill the context.)"""
    body = claude_code_body("What is 2+2?")
    body["tools"] = [t for t in body["tools"] if "type" in t]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.beta.messages.create(**body, betas=CLAUDE_CODE_BETAS, timeout=300)
    message = info.value.body["error"]["message"]
    assert message == (f"max_tokens: 64000 > {CONTEXT}, which is the maximum allowed number of output tokens "
                       "for claude-opus-4-8")
    limit = int(re.match(r"^max_tokens: \d+ > (\d+), which is the maximum allowed number of output tokens for .+$",
                         message).group(1))
    raw = client.beta.messages.with_raw_response.create(**{**body, "max_tokens": limit}, betas=CLAUDE_CODE_BETAS,
                                                        timeout=300, extra_body={"ignore_eos": True, "temperature": 0})
    msg = raw.parse()
    assert msg.model == "claude-opus-4-8" and msg.type == "message"
    assert raw.headers["x-stratum-cost"].startswith("cache_hit_ratio=")
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens + msg.usage.cache_creation_input_tokens
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "metadata")}
    assert prompt == client.beta.messages.count_tokens(**counted, betas=CLAUDE_CODE_BETAS).input_tokens
    # ignore_eos runs it to the end of the context: Anthropic's stop reason for that
    assert msg.stop_reason == "model_context_window_exceeded"
    assert prompt + msg.usage.output_tokens == CONTEXT


def test_claude_code_first_request_streams(client):
    body = claude_code_body("What is 2+2?", model="claude-haiku-4-5")
    with client.beta.messages.stream(**{**body, "max_tokens": 8}, betas=CLAUDE_CODE_BETAS,
                                     extra_body={"temperature": 0, "ignore_eos": True}) as stream:
        final = stream.get_final_message()
    assert final.model == "claude-haiku-4-5" and final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_system_message_is_a_system_turn_in_place(client, tiny_template):
    """A system message in `messages` goes through the chat template as a system turn at its place."""
    messages = [user("What is 2+2?"), {"role": "system", "content": "Answer with a number."},
                {"role": "assistant", "content": "4"}, user("And 3+3?")]
    expected = tiny_template.encode([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "What is 2+2?"},
                                     {"role": "system", "content": "Answer with a number."},
                                     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}])
    assert count(client, messages, system="Be brief.") == len(expected)
    blocks = [messages[0], {"role": "system", "content": [{"type": "text", "text": "Answer with a number."}],
                            "cache_control": {"type": "ephemeral"}}, *messages[2:]]
    assert count(client, blocks, system="Be brief.") == len(expected)


# A template that takes a system turn only first, as Gemma's and Mistral's do.
SYSTEM_FIRST_ONLY = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                     "{{ raise_exception('System role is only allowed first') }}{% endif %}"
                     "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_late_system_message_is_folded_into_the_user_turn_where_the_template_refuses_it(tiny_template):
    from stratum.models.chat_template import ChatTemplate
    from stratum.server.chat import ChatInput, build_prompt
    from stratum.server.errors import InvalidRequest

    template = ChatTemplate(SYSTEM_FIRST_ONLY, tiny_template.tokenizer)
    chat = ChatInput([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                      {"role": "system", "content": "Answer with a number."}], pinned={2: None})
    prompt = build_prompt(template, chat)
    assert prompt.token_ids == template.encode([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "What is 2+2?\n\nAnswer with a number."}])
    assert chat.pinned == {1: None}  # the cache_control mark moved with its text
    refusing = ChatTemplate("{{ raise_exception('no chat here') }}", tiny_template.tokenizer)
    with pytest.raises(InvalidRequest, match="no chat here"):
        build_prompt(refusing, ChatInput([{"role": "user", "content": "Hi"},
                                          {"role": "system", "content": "Be brief."}]))


@pytest.mark.parametrize("block, as_text", [
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Tokyo is big."},
      "title": "Cities", "context": "An atlas", "citations": {"enabled": True}}, "Cities\nAn atlas\nTokyo is big."),
    ({"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Tokyo is big."}]}},
     "Tokyo is big."),
    ({"type": "search_result", "source": "https://atlas.example/tokyo", "title": "Tokyo",
      "content": [{"type": "text", "text": "Tokyo is big."}], "citations": {"enabled": True}},
     "Tokyo\nhttps://atlas.example/tokyo\nTokyo is big."),
    ({"type": "text", "text": "Tokyo is big.", "citations": [{"type": "char_location", "cited_text": "Tokyo",
                                                              "document_index": 0, "start_char_index": 0,
                                                              "end_char_index": 5}]},
     "Tokyo is big."),
])
def test_text_bearing_blocks_are_read_as_text(client, block, as_text):
    question = {"type": "text", "text": "How big is Tokyo?"}
    assert count(client, [user([block, question])]) == count(client, [user(as_text + "\nHow big is Tokyo?")])


def test_tool_history_blocks_are_read_as_text(client):
    """Nested tool results, server tools' calls and results, thinking, all of a recorded agent turn."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Tokyo"}}
    nested = [{"type": "text", "text": "22C"}, {"type": "search_result", "source": "s", "title": "t",
                                                 "content": [{"type": "text", "text": "sunny"}]},
              {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "humid"}},
              {"type": "tool_reference", "tool_name": "get_weather"}]
    history = [user("Weather in Tokyo?"),
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should look.", "signature": "sig"},
                                                 {"type": "redacted_thinking", "data": "xyz"}, call]},
               user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": nested}])]
    flat = [history[0], {"role": "assistant", "content": [call]},
            user([{"type": "tool_result", "tool_use_id": "toolu_1",
                   "content": "22C\nt\ns\nsunny\nhumid\nTool: get_weather"}])]
    assert count(client, history, tools=[WEATHER]) == count(client, flat, tools=[WEATHER])
    server = [user("Search the web"),
              {"role": "assistant", "content": [
                  {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "tokyo"}},
                  {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                      {"type": "web_search_result", "url": "https://x.example", "title": "X",
                       "encrypted_content": "e"}]},
                  {"type": "text", "text": "Found it."}]}]
    assert count(client, server) > count(client, server[:1]) + 10
    greedy = client.messages.create(model="tiny", max_tokens=2, messages=[*server, user("ok")])
    assert greedy.usage.output_tokens >= 1


def test_anthropic_defined_tools_are_not_offered(client):
    messages = [user("Weather in Tokyo?")]
    server_tools = [{"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"},
                    {"type": "mcp_toolset", "mcp_server_name": "docs"}]
    assert count(client, messages, tools=[WEATHER, *server_tools]) == count(client, messages, tools=[WEATHER])


@pytest.mark.parametrize("block, says", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}, "text-only"),
    ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
     "'base64'"),
    ({"type": "document", "source": {"type": "url", "url": "https://x.example/a.pdf"}}, "'url'"),
])
def test_media_this_model_cannot_read_is_a_clear_400(client, block, says):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=2,
                               messages=[user([block, {"type": "text", "text": "Read this"}])])
    message = info.value.body["error"]["message"]
    assert message.startswith("messages.0.content.0") and says in message and "text-only" in message


def test_prompt_too_long_names_the_count_that_count_tokens_gives(client):
    """Tools included: the 400 names the very count count_tokens returns, in Anthropic's words."""
    messages = [user("Tell me about Tokyo. " * 300)]
    tools = [dict(WEATHER, name=f"tool_{i}", description="A tool that does something useful. " * 10) for i in range(6)]
    counted = count(client, messages, tools=tools, system="You are an agent.")
    assert counted > CONTEXT
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="tiny", max_tokens=CONTEXT, messages=messages, tools=tools,
                                   system="You are an agent.", stream=stream, timeout=60)
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert info.value.body["error"]["message"] == f"prompt is too long: {counted} tokens > {CONTEXT} maximum"


def test_top_level_cache_control_caches_the_whole_prompt(client):
    messages = [user("Automatic caching marks the last block. " * 8)]
    first = client.messages.create(model="tiny", max_tokens=1, messages=messages,
                                   extra_body={"cache_control": {"type": "ephemeral"}})
    assert first.usage.cache_creation_input_tokens > 0
    again = client.messages.create(model="tiny", max_tokens=1, messages=messages,
                                   extra_body={"cache_control": {"type": "ephemeral"}})
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens


def test_claude_model_names_are_served(client):
    names = [m.id for m in client.models.list().data]
    assert "tiny" in names
    for name in ("claude-haiku-4-5-20251001", "claude-sonnet-4-6"):
        msg = client.messages.create(model=name, max_tokens=1, messages=[user("hi")])
        assert msg.model == name


# ---- the Responses API -----------------------------------------------------------------------------
def test_responses_create(oai):
    raw = oai.responses.with_raw_response.create(model="tiny", input="Hello", instructions="Be brief.",
                                                 max_output_tokens=6, temperature=0)
    r = raw.parse()
    assert raw.headers["x-stratum-cost"].startswith("cache_hit_ratio=")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.instructions == "Be brief."


def test_responses_input_items_match_chat_completions(oai, tiny_template):
    """Roles (developer as system), instructions first, and the same prompt chat completions builds."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
             {"role": "user", "content": "Bye"}]
    r = oai.responses.create(model="tiny", input=items, instructions="Be brief.", max_output_tokens=1)
    expected = tiny_template.encode([{"role": "system", "content": "Be brief.\nAnswer in French."},
                                     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"},
                                     {"role": "user", "content": "Bye"}])
    assert r.usage.input_tokens == len(expected)
    chat = oai.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Bye"}])
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_responses_stream_event_sequence(oai):
    events = list(oai.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}, extra_headers={"x-stratum-meta": "on"}))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.usage.output_tokens == 8
    assert events[0].response.status == "in_progress" and events[2].item.status == "in_progress"
    assert getattr(events[-1], "stratum_cost")["header"].startswith("cache_hit_ratio=")


def test_responses_function_call_round_trip(oai):
    """tool_choice required: the grammar makes the call valid; its output item goes back in as input."""
    r = oai.responses.create(model="tiny", input="Weather in Tokyo?", tools=[RESP_WEATHER], tool_choice="required",
                             max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    call = calls[0]
    assert (call.name == "get_weather" and call.call_id.startswith("call_")
            and isinstance(json.loads(call.arguments), dict))
    follow = [{"role": "user", "content": "Weather in Tokyo?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "22C and sunny"}]
    answer = oai.responses.create(model="tiny", input=follow, tools=[RESP_WEATHER], max_output_tokens=4)
    assert answer.output[0].type in ("message", "function_call") and answer.usage.input_tokens > r.usage.input_tokens


def test_responses_streamed_function_call(oai):
    events = list(oai.responses.create(model="tiny", input="Weather?", tools=[RESP_WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
                                       temperature=0, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments and isinstance(json.loads(done.arguments), dict)
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[0].arguments == done.arguments
    assert final.output[0].call_id == added[0].item.call_id


def test_responses_json_schema_format(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = oai.responses.create(model="tiny", input="2+2?", max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["answer"], int)


@pytest.mark.parametrize("body, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x.example/a.png"}]}]},
     "text-only"),
    ({"tool_choice": "required"}, "tool_choice requires tools"),
    ({"temperature": 3}, "temperature"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_responses_errors_in_openai_shape(oai, body, says):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(**{"model": "tiny", "input": "hi", **body})
    error = info.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]


def test_openai_agents_sdk_runs_an_agent(tiny_server):
    """An Agent on OpenAIResponsesModel: a forced function call, its tool run, the run's result."""
    agents = pytest.importorskip("agents", reason="the openai-agents package (test extra)")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return f"22C and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="test", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer weather questions with the tool.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "Weather in Tokyo?", run_config=agents.RunConfig(tracing_disabled=True))
    assert len(calls) == 1 and result.final_output == f"22C and sunny in {calls[0]}"


# ---- the agent CLIs themselves, from npm ------------------------------------------------------------
CLAUDE_CODE_VERSION = "2.1.332"  # what `npm install @anthropic-ai/claude-code` installs now
CODEX_VERSION = "0.171.0"
AGENTS_DATA = Path(__file__).parent / "data" / "agents"  # what both send (README there)
AGENT_CONTEXT = 32768
# the tiny agent model's EOS logit scale: answers of a few tokens (measured: 1 to 20 tokens over 20 prompts,
# mean 5.2, where 120 gave a mean of 146 and 100 ran past 2000)
AGENT_EOS_LOGIT = 170.0


def install_npm(package: str, version: str, command: str) -> Path:
    """`package`@`version` from npm, cached under $STRATUM_HOME/npm (one install, under a lock, whatever
    number of test processes ask); its `command`. Skips only where node is missing, or the package is not
    cached and npm or its registry cannot be reached."""
    from stratum.home import stratum_home

    if shutil.which("node") is None:
        pytest.skip(f"node is not installed: cannot run {package}")
    prefix = stratum_home() / "npm" / f"{package.rsplit('/', 1)[-1]}-{version}"
    binary = prefix / "node_modules" / ".bin" / command
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            if shutil.which("npm") is None:
                pytest.skip(f"npm is not installed: cannot fetch {package}@{version} (not cached in {prefix})")
            r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                                f"{package}@{version}"],
                               capture_output=True, text=True, timeout=600)
            unreachable = ("ENOTFOUND", "ECONNREFUSED", "ETIMEDOUT", "EAI_AGAIN", "ECONNRESET", "ENETUNREACH")
            if r.returncode != 0 and any(code in r.stdout + r.stderr for code in unreachable):
                pytest.skip(f"the npm registry is unreachable: {r.stderr.strip()[-300:]}")
            assert r.returncode == 0, r.stderr[-2000:]
    return binary


def install_claude_code() -> Path:
    return install_npm("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")


def install_codex() -> Path:
    return install_npm("@openai/codex", CODEX_VERSION, "codex")


def _client_env(home: Path, **extra: str) -> dict[str, str]:
    """A CLI's environment: its own HOME, loopback only."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost",
            **extra}


def run_claude(binary: Path, server: ServerProcess, home: Path, *flags: str, check: bool = True) -> dict:
    """`claude -p` non-interactively against the server: no telemetry, no update checks, no error reporting."""
    env = _client_env(home, ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="test", DISABLE_AUTOUPDATER="1",
                      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1")
    r = subprocess.run([str(binary), "-p", "What is 2+2?", "--output-format", "json", "--no-session-persistence",
                        *flags], capture_output=True, text=True, env=env, cwd=home, stdin=subprocess.DEVNULL,
                       timeout=600)
    assert r.returncode == 0 or not check, (r.stdout[-2000:], r.stderr[-2000:], server.output())
    return json.loads(r.stdout)


def run_codex(binary: Path, server: ServerProcess, home: Path, model: str | None) -> list[dict]:
    """`codex exec` non-interactively against the server, with Codex's default tools and settings: only
    the provider (the server) is configured, and the model when `model` is given (without it Codex asks
    for its own default model, and sends its tools in its other shape: tests/data/agents/README.md).
    Returns its --json events."""
    codex_home, work = home / "codex", home / "work"
    codex_home.mkdir()
    work.mkdir()
    config = (f'model = "{model}"\n' if model else "") + (
        'model_provider = "stratum"\n[model_providers.stratum]\nname = "stratum"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "STRATUM_API_KEY"\n')
    (codex_home / "config.toml").write_text(config)
    env = _client_env(home, CODEX_HOME=str(codex_home), STRATUM_API_KEY="test")
    r = subprocess.run([str(binary), "exec", "--json", "--skip-git-repo-check", "Say hello"], capture_output=True,
                       text=True, env=env, cwd=work, stdin=subprocess.DEVNULL, timeout=900)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:], server.output())
    return events


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """A tiny random model for the agent CLIs with their default tools: a 32k context; a tokenizer trained
    on what they send too, so their prompts take about as many tokens as the default model's tokenizer
    makes of them (Claude Code 2.1.332's: 12,533 against 12,532); answers that end after a few tokens, as a
    chat model's do. It answers to Claude's and OpenAI's model names, as a user serving them would set."""
    texts = [p.read_text() for p in AGENTS_DATA.glob("*/*/*.json")]
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("agent-model"), context=AGENT_CONTEXT, vocab_size=8192,
                                 eos_logit=AGENT_EOS_LOGIT, corpus=texts)
    server = ServerProcess(str(folder), "--served-model-name", "tiny-agent", "--kv-cache-mb", "64",
                           "--serve-models-matching", "claude-*", "--serve-models-matching", "gpt-*").wait_ready()
    yield server
    server.stop()


CAPTURES = sorted(AGENTS_DATA.glob("*/*/*.json"))


@pytest.mark.parametrize("capture", CAPTURES,
                         ids=[f"{c.parent.parent.name}-{c.parent.name}-{c.stem}" for c in CAPTURES])
def test_a_captured_request_is_read(agent_server, capture):
    """Each request the CLIs were recorded sending (tests/data/agents) is read as they sent it: counted
    (count_tokens; responses/input_tokens, which takes no model name: the captures name the default model)
    to the same prompt the generating route builds."""
    body = {k: v for k, v in json.loads(capture.read_text())["body"].items()
            if k not in ("stream", "max_tokens", "metadata")}
    path = "/v1/responses/input_tokens" if "input" in body else "/v1/messages/count_tokens"
    if "input" in body:
        del body["model"]
    r = httpx.post(agent_server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text[:1000]
    assert r.json()["input_tokens"] > 4000


def test_claude_code_default_tools_end_to_end(agent_server, tmp_path):
    """`claude -p` with its default tool set (its prompt is over 12k tokens): Claude Code asks for
    max_tokens 128000, reads the 400's limit, asks again with it, and completes its turn."""
    binary = install_claude_code()
    result = run_claude(binary, agent_server, tmp_path)
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    usage = result["usage"]
    prompt = (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
              + usage.get("cache_creation_input_tokens", 0))
    assert prompt > 8192 and usage["output_tokens"] > 0, usage


@pytest.mark.parametrize("model", ["tiny-agent", None], ids=["served-model", "codex-default-model"])
def test_codex_default_tools_end_to_end(agent_server, tmp_path, model):
    """`codex exec` with its default tool set, in both of its shapes: function tools, a namespace and
    web_search in `tools` (a model it does not know); an `additional_tools` item with namespaces and a
    custom tool with a Lark grammar (its own default model). Its turn completes."""
    binary = install_codex()
    events = run_codex(binary, agent_server, tmp_path, model)
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, events
    assert events[kinds.index("turn.completed")]["usage"]["input_tokens"] > 8192


@pytest.fixture(scope="module")
def extended_real_server(real_model_path):
    """The default model with its context extended to 16,384 tokens by YaRN, as docs/api.md's Codex command
    serves it: Codex's default prompt (9,215 tokens through this tokenizer) is over the trained 8,192."""
    server = ServerProcess("smollm2-135m", "--max-model-len", "16384", "--rope-scaling", "yarn").wait_ready(timeout=300)
    yield server
    server.stop()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_codex_on_the_default_model(extended_real_server, tmp_path):
    """`codex exec` on the default model with Codex's default tools and settings: a completed turn with an
    answer, the stream kept alive through the long prefill (`response.in_progress`). The long variant
    (--slow): on the loaded 2-core reference machine its 9,215-token prefill took 12 minutes (Codex,
    which reconnects after 5 minutes without an event, did not), and decoding at that context ran at
    about 1 token/s; the default run has `test_codex_default_tools_end_to_end` on a tiny model."""
    binary = install_codex()
    events = run_codex(binary, extended_real_server, tmp_path, "smollm2-135m")
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, events
    messages = [e["item"]["text"] for e in events
                if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert messages and messages[-1].strip(), events


@pytest.mark.integration
def test_claude_code_cli_end_to_end(real_server, tmp_path):
    """`claude -p` on the default model, unmodified but for `--tools ""`: its default tools are 12,532
    tokens of prompt (docs/api.md), over the 8,192-token context. Claude Code asks for max_tokens 128000 on
    a claude-* model it names itself, reads the 400 naming the model's limit, and asks again with it."""
    binary = install_claude_code()
    result = run_claude(binary, real_server, tmp_path,
                        "--system-prompt", "You are a helpful assistant. Answer briefly.", "--tools", "")
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    assert isinstance(result["result"], str) and result["result"].strip()
    assert result["usage"]["output_tokens"] > 0


@pytest.mark.integration
def test_claude_code_cli_reads_prompt_too_long(real_server, tmp_path):
    """With every built-in tool the prompt is over the context: Claude Code reads the 400 as its own
    prompt-too-long condition (it parses Anthropic's wording for the counts)."""
    binary = install_claude_code()
    result = run_claude(binary, real_server, tmp_path, "--system-prompt", "You are a helpful assistant.", check=False)
    assert result["is_error"] is True and result["api_error_status"] == 400
    assert result["terminal_reason"] == "prompt_too_long" and "limit 8192" in result["result"], result


@pytest.mark.integration
def test_responses_on_the_real_model(real_server):
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="test", max_retries=0)
    r = client.responses.create(model="smollm2-135m", input="What is the capital of Japan?",
                                instructions="Answer in one short sentence.", max_output_tokens=24, temperature=0)
    assert "Tokyo" in r.output_text
    streamed = "".join(e.delta for e in client.responses.create(
        model="smollm2-135m", input="What is the capital of Japan?", instructions="Answer in one short sentence.",
        max_output_tokens=24, temperature=0, stream=True) if e.type == "response.output_text.delta")
    assert streamed == r.output_text
