"""Record what an agent client (Codex CLI, Claude Code) sends, by standing in for its API server.

Every request's method, path, headers and JSON body is written to OUT/NNN-METHOD-path.json. The
server answers just enough of each API for the client to go on: /v1/responses (OpenAI Responses,
streamed or not) and /v1/messages (Anthropic Messages, streamed or not). Each --call (in order)
is made, with its --arguments, in the first answer whose request offers that tool (a function_call,
custom_tool_call or tool_use, inside its namespace where it has one); every other request gets the
text --say (after a reasoning item, with --reasoning). /v1/models and /v1/messages/count_tokens get
minimal answers; anything else a 404. Usage counts in the answers are placeholders (1 token).

Usage: python scripts/capture_agent_requests.py OUT_DIR [--port 0] [--call NAME --arguments ARGS ...]
       [--say TEXT] [--reasoning TEXT] [--replace OLD=NEW ...]    (tests/data/agents/README.md has examples)
The chosen port is printed first, as {"port": N}, then the server runs until killed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Recorder:
    """The requests seen so far and the scripted answer for the next one."""

    def __init__(self, out: Path, calls: list[tuple[str, str]], say: str, reasoning: str | None,
                 replace: list[tuple[str, str]]) -> None:
        self.out, self.calls, self.say, self.reasoning, self.replace = out, list(calls), say, reasoning, replace
        self.count = itertools.count()
        self.lock = threading.Lock()

    def record(self, method: str, path: str, headers: dict, body) -> int:
        with self.lock:
            n = next(self.count)
        route = path.split("?")[0].strip("/").replace("/", "_") or "root"
        name = f"{n:03d}-{method}-{route}.json"
        entry = {"method": method, "path": path, "headers": headers, "body": body}
        text = json.dumps(entry, indent=1, ensure_ascii=False)
        for old, new in self.replace:  # machine paths out, before anything reaches the disk
            text = text.replace(old, new)
        (self.out / name).write_text(text)
        return n

    def next_call(self, tool_names: list[str]) -> tuple[str, str] | None:
        """The next scripted (tool, arguments), taken if this request offers that tool."""
        with self.lock:
            if not self.calls or self.calls[0][0] not in tool_names:
                return None
            return self.calls.pop(0)


def responses_tools(body: dict) -> dict[str, tuple[str, str | None]]:
    """name -> (tool type, namespace or None) of every tool offered: in `tools`, or in `additional_tools`
    input items (Codex's form for its own models), namespaces opened."""
    offered = list(body.get("tools") or [])
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if item.get("type") == "additional_tools":
            offered += item.get("tools") or []
    found = {}
    for tool in offered:
        if tool.get("type") == "namespace":
            found.update({t.get("name"): (t.get("type"), tool.get("name")) for t in tool.get("tools") or []})
        else:
            found[tool.get("name")] = (tool.get("type"), None)
    return found


def responses_call(name: str, arguments: str, kind: str, namespace: str | None, n: int) -> tuple[dict, list[dict]]:
    """A function_call (JSON arguments) or custom_tool_call (free text input) item and its delta event."""
    if kind == "custom":
        item = {"type": "custom_tool_call", "id": f"ctc_{n}", "call_id": f"call_{n}", "name": name,
                "input": arguments, "status": "completed"}
        delta = {"type": "response.custom_tool_call_input.delta", "item_id": item["id"], "output_index": 0,
                 "delta": arguments}
    else:
        item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
                "arguments": arguments, "status": "completed"}
        delta = {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": 0,
                 "delta": arguments}
    if namespace:
        item["namespace"] = namespace
    return item, [delta]


def responses_answer(rec: Recorder, body: dict, n: int) -> tuple[list[dict], dict]:
    """(events, final response) of a Responses API answer: one tool call or one text message."""
    offered = responses_tools(body)
    if call := rec.next_call(list(offered)):
        item, deltas = responses_call(*call, *offered[call[0]], n)
    else:
        part = {"type": "output_text", "text": rec.say, "annotations": []}
        item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed", "content": [part]}
        deltas = [{"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0, "content_index": 0,
                   "delta": rec.say},
                  {"type": "response.output_text.done", "item_id": item["id"], "output_index": 0, "content_index": 0,
                   "text": rec.say}]
    items, events = [], []
    if rec.reasoning:  # a reasoning item first, as reasoning models answer, so the client's next turn carries it
        items.append({"type": "reasoning", "id": f"rs_{n}", "status": "completed", "encrypted_content": "opaque",
                      "summary": [{"type": "summary_text", "text": rec.reasoning}]})
    items.append(item)
    for index, out in enumerate(items):
        added = {**out, "status": "in_progress"}
        events += [{"type": "response.output_item.added", "output_index": index, "item": added},
                   *(dict(d, output_index=index) for d in (deltas if out is item else [])),
                   {"type": "response.output_item.done", "output_index": index, "item": out}]
    response = {"id": f"resp_{n}", "object": "response", "created_at": int(time.time()), "model": body.get("model"),
                "status": "completed", "output": items, "usage": {
                    "input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}}
    events = [{"type": "response.created", "response": {**response, "status": "in_progress", "output": []}},
              *events, {"type": "response.completed", "response": response}]
    return [dict(e, sequence_number=i) for i, e in enumerate(events)], response


def messages_answer(rec: Recorder, body: dict, n: int) -> tuple[list[dict], dict]:
    """(events, final message) of a Messages API answer: one tool_use block or one text block."""
    if call := rec.next_call([t.get("name") for t in body.get("tools") or []]):
        block = {"type": "tool_use", "id": f"toolu_{n}", "name": call[0], "input": json.loads(call[1])}
        delta = {"type": "input_json_delta", "partial_json": call[1]}
        start, stop_reason = {**block, "input": {}}, "tool_use"
    else:
        block = {"type": "text", "text": rec.say}
        delta = {"type": "text_delta", "text": rec.say}
        start, stop_reason = {"type": "text", "text": ""}, "end_turn"
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    message = {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": body.get("model"),
               "content": [block], "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}
    events = [{"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
              {"type": "content_block_start", "index": 0, "content_block": start},
              {"type": "content_block_delta", "index": 0, "delta": delta},
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
               "usage": {"output_tokens": 1}},
              {"type": "message_stop"}]
    return events, message


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    recorder: Recorder

    def log_message(self, format, *args) -> None:  # the files are the log
        pass

    def do_GET(self) -> None:
        self.handle_any("GET")

    def do_POST(self) -> None:
        self.handle_any("POST")

    def handle_any(self, method: str) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw.decode(errors="replace")
        path = self.path.split("?")[0]
        n = self.recorder.record(method, self.path, dict(self.headers.items()), body)
        if path.endswith("/responses") and method == "POST":
            self.answer(body, *responses_answer(self.recorder, body, n))
        elif path.endswith("/messages") and method == "POST":
            self.answer(body, *messages_answer(self.recorder, body, n))
        elif path.endswith("/messages/count_tokens"):
            self.send_json(200, {"input_tokens": 1})
        elif path.endswith("/models"):
            self.send_json(200, {"object": "list", "data": []})
        else:
            self.send_json(404, {"error": {"type": "not_found_error", "message": f"no route {path}"}})

    def answer(self, body: dict, events: list[dict], final: dict) -> None:
        if not body.get("stream"):
            self.send_json(200, final)
            return
        payload = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--call", action="append", default=[], help="a tool to call, in the first request that offers "
                        "it (repeatable: the calls are made in order, one per answer)")
    parser.add_argument("--arguments", action="append", default=[], help="each --call's arguments: JSON, or free text "
                        "for a custom tool")
    parser.add_argument("--say", default="Hello.")
    parser.add_argument("--reasoning", default=None,
                        help="open each Responses answer with a reasoning item of this summary")
    parser.add_argument("--replace", action="append", default=[], metavar="OLD=NEW",
                        help="write NEW for OLD in the recorded files (machine paths; repeatable, applied in order)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if len(args.arguments) != len(args.call):
        parser.error("give one --arguments for each --call")
    replace = [tuple(r.split("=", 1)) for r in args.replace]
    Handler.recorder = Recorder(args.out, list(zip(args.call, args.arguments)), args.say, args.reasoning, replace)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
