"""Content policies (`stratum.server.policy`): the screen on its own (every token split, Unicode tricks,
hostile patterns), then a server with `--content-policy` through the official SDKs: a scripted model
whose answer carries a forbidden phrase split over tokens, blocked for one tenant and masked for all,
prompts refused in each API's own shape, a reload without a restart, and a 1 MB prompt."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from stratum.server.policy import (AnswerScreen, Matcher, OutputScreen, PolicyError, PolicyStore, normalize,
                                   parse_policy, prompt_texts, screen_prompt)
from tests.conftest import ServerProcess
from tests.scripted import make_scripted_model, template

KEY_A, KEY_B = "sk-policy-a", "sk-policy-b"
POLICY = {"rules": [
    {"id": "aurora", "action": "block", "terms": ["Project Aurora"], "applies_to": ["answer"], "tenants": [KEY_A]},
    {"id": "cards", "action": "mask", "pattern": r"\d{4}-\d{4}"},
    {"id": "forbidden-topic", "action": "block", "terms": ["forbidden topic", "contraband"],
     "applies_to": ["prompt"]},
    {"id": "hostile", "action": "block", "pattern": "(a+)+$", "applies_to": ["prompt"], "tenants": [KEY_B]},
]}
# each piece one token; the forbidden phrase spans three of them, the masked number two
SCRIPT = ["\n", "The launch", " code", " is", " Proj", "ect Aur", "ora", " and", " card", " 4111", "-1111", " ok."]
ANSWER = "".join(SCRIPT[1:])
USER = [{"role": "user", "content": "What is the code?"}]
GREEDY = {"temperature": 0}


def rules(*raw):
    return parse_policy({"rules": list(raw)})


def run_screen(matcher: Matcher, pieces: list[str]) -> tuple[str, str | None]:
    screen, shown = AnswerScreen(matcher), ""
    for i, piece in enumerate(pieces):
        verdict = screen.feed(piece, is_last=i == len(pieces) - 1)
        shown += verdict.text
        if verdict.blocked:
            return shown, verdict.blocked.id
    return shown, None


# ---- the screen on its own --------------------------------------------------------------------------
def test_a_phrase_split_at_every_pair_of_boundaries_never_leaks():
    matcher = Matcher(rules({"id": "b", "action": "block", "terms": ["project aurora"]},
                            {"id": "m", "action": "mask", "pattern": r"\d{4}-\d{4}"}))
    text = ANSWER
    start = text.index("Proj")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            shown, blocked = run_screen(matcher, [text[:i], text[i:j], text[j:]])
            assert blocked == "b", (i, j)
            assert shown == text[:len(shown)] and len(shown) <= start, (i, j, shown)  # a prefix, before the phrase
            assert "aurora" not in shown.lower()


def test_masking_is_the_same_at_every_split_and_complete_at_the_end():
    matcher = Matcher(rules({"id": "m", "action": "mask", "pattern": r"\d{4}-\d{4}"}))
    text = "card 4111-1111 and 4222-2222 end"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            shown, blocked = run_screen(matcher, [text[:i], text[i:j], text[j:]])
            assert blocked is None and shown == "card *** and *** end", (i, j, shown)
    shown, _ = run_screen(matcher, list(text))  # one character per token
    assert shown == "card *** and *** end"


def test_obfuscation_by_case_width_and_invisible_characters_is_caught():
    matcher = Matcher(rules({"id": "b", "action": "block", "terms": ["project aurora"]}))
    fullwidth = "\uff30\uff52\uff4f\uff4a\uff45\uff43\uff54 aurora"
    for text in ["PROJECT AURORA", "Pro\u200bject\u2060 Au\u00adrora", fullwidth, "project aur\u200dora"]:
        assert run_screen(matcher, list(text))[1] == "b", text
    accents = Matcher(rules({"id": "c", "action": "block", "terms": ["café"]}))
    assert run_screen(accents, ["the cafe\u0301 is open"])[1] == "c"  # decomposed é matches the composed term
    norm, source = normalize("A\u200bß")
    assert norm == "ass" and source == [0, 2, 2]


def test_a_block_ends_the_output_as_a_content_filter_with_what_was_released():
    from stratum.engine.outputs import RequestOutput

    screen = OutputScreen(Matcher(rules({"id": "b", "action": "block", "terms": ["aurora"]})))
    pieces = ["Hello there, ", "I will say au", "rora now", " and more"]
    shown, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        out = screen.screen(RequestOutput("r", piece, [i], text, list(range(i + 1)), finished=i == len(pieces) - 1,
                                          finish_reason="abort" if i == len(pieces) - 1 else None))
        shown.append(out)
    assert shown[2] is not None and shown[2].delta_text == ""  # the block: nothing more released
    assert shown[3].finish_reason == "content_filter" and shown[3].stop_reason == "b"
    assert "aurora" not in "".join(o.delta_text for o in shown if o) and shown[3].text.startswith("Hello")
    thinking = OutputScreen(Matcher(rules({"id": "b", "action": "block", "terms": ["aurora"]})))
    out = thinking.screen(RequestOutput("r", "", [1], "", [1], False, delta_reasoning="I recall Aur", reasoning="x"))
    assert out.delta_reasoning == "I recal" and thinking.blocked is None  # "l Aur" held: the reach is 6
    out = thinking.screen(RequestOutput("r", "", [2], "", [1, 2], True, "stop", delta_reasoning="ora", reasoning="x"))
    assert thinking.blocked.id == "b" and out.finish_reason == "content_filter" and "aur" not in out.reasoning.lower()


def test_tool_call_arguments_in_the_answer_and_the_prompt_are_screened():
    matcher = Matcher(rules({"id": "b", "action": "block", "terms": ["contraband"]}))
    call = '<tool_call>\n{"name": "ship", "arguments": {"item": "contra' + 'band"}}\n</tool_call>'
    assert run_screen(matcher, [call[:40], call[40:]])[1] == "b"
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ship", "arguments": {"item": "CONTRABAND"}}}]},
        {"role": "tool", "content": "shipped"}]
    assert screen_prompt(matcher, prompt_texts(messages)).blocked.id == "b"


def test_a_hostile_pattern_and_a_megabyte_are_linear():
    matcher = Matcher(rules({"id": "h", "action": "block", "pattern": "(a+)+$"},
                            {"id": "t", "action": "block", "terms": [f"term {i}" for i in range(5000)]}))
    text = "a" * 2**20 + "!"  # catastrophic for a backtracking engine
    t0 = time.perf_counter()
    assert screen_prompt(matcher, [text]).blocked is None
    assert screen_prompt(matcher, ["b" * 2**19 + "term 4321" + "b" * 2**19]).blocked.id == "t"
    assert time.perf_counter() - t0 < 30  # generous: a backtracking engine would not finish at all


def test_bad_policies_are_refused_with_the_rule_named():
    for bad, said in [({"id": "x", "action": "block", "pattern": "(?<=a)b"}, "not an RE2 pattern"),
                      ({"id": "x", "action": "hide", "terms": ["a"]}, "action"),
                      ({"id": "x", "action": "mask"}, "either terms or a pattern"),
                      ({"id": "x", "action": "mask", "terms": ["a"], "applies_to": ["output"]}, "applies_to")]:
        with pytest.raises(PolicyError, match=said):
            rules(bad)


def test_the_store_reloads_when_the_file_changes_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    from stratum.server import policy

    monkeypatch.setattr(policy, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"rules": [{"id": "one", "action": "block", "terms": ["a"]}]}))
    store = PolicyStore(path)
    path.write_text(json.dumps({"rules": [{"id": "two", "action": "block", "terms": ["b"]}]}))
    store.mark_stale()
    assert [r.id for r in store.current().rules] == ["two"]
    path.write_text("{ not json")
    store.mark_stale()
    assert [r.id for r in store.current().rules] == ["two"]


def test_a_yaml_policy_reads_as_its_json(tmp_path):
    pytest.importorskip("yaml")
    from stratum.server.policy import load_policy

    path = tmp_path / "policy.yaml"
    path.write_text("rules:\n  - id: cards\n    action: mask\n    pattern: '\\d{4}-\\d{4}'\n    applies_to: [answer]\n")
    assert load_policy(path) == rules({"id": "cards", "action": "mask", "pattern": r"\d{4}-\d{4}",
                                       "applies_to": ["answer"]})


# ---- a server with a policy, through the SDKs ----------------------------------------------------------
@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "policy.json"
    path.write_text(json.dumps(POLICY))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, policy_file):
    model = make_scripted_model(tmp_path_factory.mktemp("scripted"), template("qwen2.5"), [SCRIPT])
    server = ServerProcess(str(model), "--served-model-name", "tiny", "--kv-cache-mb", "8", "--api-key", KEY_A,
                           "--api-key", KEY_B, "--content-policy", str(policy_file)).wait_ready()
    yield server
    server.stop()


def blocks_come_back(server, within_s: float = 20.0) -> bool:
    """The engine's published snapshot says no request runs and no block is in use (it lags a step)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["running"] == 0 and health["kv_blocks"]["in_use"] == 0:
            return True
        time.sleep(0.2)
    return False


def claude(server, key):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def gpt(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_the_unblocked_tenant_gets_the_answer_masked(server):
    msg = claude(server, KEY_B).messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY)
    assert msg.content[0].text == ANSWER.replace("4111-1111", "***") and msg.stop_reason == "end_turn"
    with claude(server, KEY_B).messages.stream(model="tiny", max_tokens=40, messages=USER,
                                               extra_body=GREEDY) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
    assert "".join(deltas) == ANSWER.replace("4111-1111", "***") and not any("4111" in d for d in deltas)
    chat = gpt(server, KEY_B).chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                                      stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == ANSWER.replace("4111-1111", "***")


def test_a_block_mid_stream_ends_it_as_a_refusal_in_each_api(server):
    msg = claude(server, KEY_A).messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY)
    assert msg.stop_reason == "refusal" and "aur" not in json.dumps(msg.model_dump()).lower()
    assert msg.usage.output_tokens >= 6  # billed for what was generated, up to the block
    with claude(server, KEY_A).messages.stream(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY,
                                               extra_headers={"x-stratum-meta": "on"}) as stream:  # the cost event
        events = list(stream)
        final = stream.get_final_message()
    shown = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert final.stop_reason == "refusal" and "Proj" not in shown and "aur" not in shown.lower()
    assert shown.startswith("The launch")
    cost = [e for e in events if e.type == "stratum_cost"]
    assert cost and cost[0].model_dump()["policy"]["blocked"] == "aurora"
    chat = gpt(server, KEY_A).chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0)
    assert chat.choices[0].finish_reason == "content_filter" and "aur" not in chat.choices[0].message.content.lower()
    chunks = list(gpt(server, KEY_A).chat.completions.create(model="tiny", messages=USER, max_tokens=40,
                                                             temperature=0, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "content_filter"
    resp = gpt(server, KEY_A).responses.create(model="tiny", input=USER, max_output_tokens=40, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "content_filter"
    with gpt(server, KEY_A).responses.stream(model="tiny", input=USER, max_output_tokens=40, temperature=0) as s:
        events = list(s)  # (the SDK's get_final_response wants response.completed; this one is incomplete)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.response for e in events if e.type == "response.incomplete"]
    assert done and done[0].incomplete_details.reason == "content_filter" and "aur" not in streamed.lower()
    assert blocks_come_back(server)  # the aborted requests' blocks are back
    metrics = httpx.get(server.url + "/metrics").text
    assert 'stratum_policy_matches_total{action="block",rule="aurora",scope="answer"' in metrics


def test_a_blocked_prompt_is_refused_before_prefill_in_each_apis_shape(server):
    asked = [{"role": "user", "content": "Tell me about the Forbidden\u200b Topic."}]
    raw = claude(server, KEY_B).messages.with_raw_response.create(model="tiny", max_tokens=40, messages=asked)
    msg = raw.parse()
    assert raw.status_code == 200 and msg.stop_reason == "refusal" and msg.content == []
    assert msg.usage.input_tokens == 0 and msg.usage.output_tokens == 0  # nothing was computed
    assert raw.headers["x-stratum-policy"] == "forbidden-topic" and "about the" not in raw.http_response.text
    with claude(server, KEY_B).messages.stream(model="tiny", max_tokens=40, messages=asked) as stream:
        assert stream.get_final_message().stop_reason == "refusal"
    system = gpt(server, KEY_A).chat.completions.create(model="tiny", max_tokens=40, messages=[
        {"role": "system", "content": "Discuss contraband freely."}, *USER])
    assert system.choices[0].finish_reason == "content_filter"
    tool_result = gpt(server, KEY_A).chat.completions.create(model="tiny", max_tokens=40, messages=[
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "the CONTRABAND list"}],
        tools=[{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}])
    assert tool_result.choices[0].finish_reason == "content_filter"
    text = gpt(server, KEY_A).completions.create(model="tiny", prompt="about contraband", max_tokens=5)
    assert text.choices[0].finish_reason == "content_filter"
    resp = gpt(server, KEY_A).responses.create(model="tiny", input="a forbidden topic", max_output_tokens=40)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "content_filter"


def test_logprobs_are_refused_where_answers_are_screened(server):
    with pytest.raises(openai.BadRequestError, match="content policy"):
        gpt(server, KEY_B).chat.completions.create(model="tiny", messages=USER, max_tokens=4, logprobs=True)


def test_per_tenant_rules_and_a_megabyte_prompt_under_a_hostile_pattern(server):
    big = [{"role": "user", "content": "a" * 2**20}]  # the hostile rule is KEY_B's; (a+)+$ matches it
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY_B, max_retries=0, timeout=120)
    t0 = time.perf_counter()
    assert client.messages.create(model="tiny", max_tokens=4, messages=big).stop_reason == "refusal"
    assert time.perf_counter() - t0 < 60  # generous: screened in linear time, not backtracked
    ok = claude(server, KEY_A).messages.create(model="tiny", max_tokens=4, messages=[
        {"role": "user", "content": "aaaa"}], extra_body=GREEDY)
    assert ok.stop_reason != "refusal"  # KEY_A has no such rule


def test_the_policy_reloads_without_a_restart(server, policy_file):
    changed = {"rules": [*POLICY["rules"], {"id": "launch", "action": "mask", "terms": ["launch code"]}]}
    policy_file.write_text(json.dumps(changed))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            msg = claude(server, KEY_B).messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY)
            if msg.content[0].text.startswith("The ***"):
                break
            time.sleep(0.5)
        assert msg.content[0].text == "The *** is Project Aurora and card *** ok."
    finally:
        policy_file.write_text(json.dumps(POLICY))


def test_a_bad_policy_file_stops_the_start_up(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"rules": [{"id": "x", "action": "block", "pattern": "(?<=a)b"}]}))
    done = subprocess.run([sys.executable, "-m", "stratum.cli", "serve", "--model", str(tiny_model_dir),
                           "--content-policy", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "rule 'x': not an RE2 pattern" in done.stderr


def test_stratum_chat_and_the_console_show_a_refusal_as_one(server):
    import io
    import shutil

    from stratum.client import terminal

    asked = "Tell me about contraband."  # refused before prefill: a mid-stream block's events, at any sampling
    out = io.StringIO()
    assert terminal.repl(server.url, "tiny", KEY_A, 40, None, stdin=io.StringIO(asked + "\n"), out=out) == 0
    assert "[refused by the server's content policy: rule forbidden-topic]" in out.getvalue()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("no chromium on this machine")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/console")
            page.evaluate(f"localStorage.setItem('stratum-api-key', '{KEY_A}')")
            page.reload()
            page.fill("#prompt", asked)
            page.click("#send")
            page.wait_for_selector(".turn.assistant[data-done='true']", timeout=60_000)
            refusal = page.inner_text(".turn.assistant .refusal")
            assert refusal == "Refused by the server's content policy (rule forbidden-topic)"
        finally:
            browser.close()
