"""`stratum bench agent`: the session it sends, the neighbour's gaps it counts, and one run on the tiny server."""

from __future__ import annotations

import json

from stratum.bench.agent import measure, neighbour_doc, parse_args, summary
from stratum.bench.agent_session import TOOLS, make_session
from stratum.bench.wire import RequestResult


def test_the_session_is_seeded_and_each_turn_extends_the_last():
    a, b = make_session(3, 2000, 4, 100), make_session(3, 2000, 4, 100)
    assert a == b and make_session(4, 2000, 4, 100) != a
    assert len(a.turns) == 4 and a.tools == []
    for earlier, later in zip(a.turns, a.turns[1:]):
        assert later[: len(earlier)] == earlier and len(later) == len(earlier) + 2  # a call and its result
    assert all(json.dumps({"name": name})[:-1] in a.system for name, *_ in TOOLS)  # every schema in the text


def test_with_the_tools_field_the_turns_carry_openai_tool_calls():
    s = make_session(0, 2000, 3, 100, tools_in_system=False)
    assert [t["function"]["name"] for t in s.tools] == [t[0] for t in TOOLS]
    call, result = s.turns[1][2:]
    assert call["tool_calls"][0]["id"] == result["tool_call_id"] == "call_1" and result["role"] == "tool"


def test_only_gaps_inside_the_session_count_and_a_ttft_is_not_a_gap():
    r = RequestResult(conversation=1, turn=0, kind="neighbour", ttft_s=5.0, chunk_times_s=[5.0, 5.1, 5.6, 5.7, 9.0])
    doc = neighbour_doc([r], window=(5.05, 6.0))
    assert doc["gaps"] == 3 and doc["longest_gap_s"] == 0.5 and doc["longest_ttft_s"] == 5.0


def test_summary_checks_the_goals():
    turns = [{"ttft_s": 40.0, "prompt_tokens": 10_000}, {"ttft_s": 1.5}, {"ttft_s": 2.5}]
    out = summary({"turns": turns, "neighbour": {"longest_gap_s": 0.2, "p99_gap_s": 0.1}})
    assert out["later_turn_ttft_s"] == 2.5
    assert out["goals_met"] == {"first_turn_ttft_s": True, "later_turn_ttft_s": False, "neighbour_longest_gap_s": True}


def test_a_session_on_the_tiny_server(tiny_server):
    args = parse_args(["--system-tokens", "40", "--turns", "3", "--tool-result-tokens", "20", "--max-tokens", "4",
                       "--neighbour-tokens", "24", "--timeout-s", "120"])
    session = make_session(0, 40, 3, 20, num_tools=2)  # within the tiny model's 2,048 tokens
    doc = measure(tiny_server.url, None, session, args)
    assert doc["errors"] == []
    turns = doc["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] and turns[1]["cached_tokens"] > 0  # the prefix reused
    assert doc["neighbour"]["streams"] >= 1 and doc["summary"]["first_turn_ttft_s"] > 0
