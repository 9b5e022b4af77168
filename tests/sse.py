"""Server-sent events as the tests read them off the wire."""

from __future__ import annotations

import json


def sse_events(lines) -> list[tuple[str, dict]]:
    """Parse SSE lines into (event name, data) pairs; comment lines (": ping") are skipped.

    An event without an `event:` field (OpenAI style) is named "message". `data: [DONE]` comes
    back as ("message", {"done": True}).
    """
    events: list[tuple[str, dict]] = []
    name, data = None, []
    for line in lines:
        if line == "":
            if data:
                payload = "\n".join(data)
                events.append((name or "message", {"done": True} if payload == "[DONE]" else json.loads(payload)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].lstrip(" "))
    assert not data, f"stream ended inside an event: {data}"
    return events


# what a client sends to read Stratum's own stream events (the meta events and the cost event)
META_ON = {"x-stratum-meta": "on"}


def delta_metas(events: list[tuple[str, dict]]) -> list[tuple[dict, dict]]:
    """Each content_block_delta of an Anthropic stream read with META_ON, paired with the `stratum_meta`
    event that follows it (the runtime's state at that delta); asserts every delta has one."""
    pairs = []
    for (name, data), (after, meta) in zip(events, events[1:] + [("", {})]):
        if name == "content_block_delta" and data["delta"]["type"] in ("text_delta", "input_json_delta"):
            assert after == "stratum_meta" and meta["index"] == data["index"], (name, after)
            pairs.append((data["delta"], meta["meta"]))
    return pairs
