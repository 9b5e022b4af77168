"""The stored responses' bound and owners (server/response_store.py): the oldest dropped past the byte
bound, one owner's responses and item ids invisible to another, a dropped predecessor named."""

from __future__ import annotations

import json

import pytest

from stratum.server.errors import InvalidRequest, NotFound
from stratum.server.response_store import ResponseStore


def body(rid: str, text: str = "x" * 100) -> dict:
    return {"id": rid, "output": [{"id": f"msg_{rid}", "type": "message",
                                   "content": [{"type": "output_text", "text": text}]}]}


def size(rid: str) -> int:
    return len(json.dumps([body(rid), [{"id": "in", "type": "message"}]], ensure_ascii=False))


def test_the_oldest_is_dropped_past_the_bound():
    store = ResponseStore(max_bytes=3 * size("resp_0") + 10)
    for i in range(5):
        store.put("a", body(f"resp_{i}"), [{"id": "in", "type": "message"}], None)
    assert store.num_bytes <= store.max_bytes
    for i in (0, 1):
        with pytest.raises(NotFound):
            store.get("a", f"resp_{i}")
    assert [store.get("a", f"resp_{i}").body["id"] for i in (2, 3, 4)] == ["resp_2", "resp_3", "resp_4"]
    store.put("a", body("big", "y" * store.max_bytes), [], None)  # larger than the whole store: never kept
    with pytest.raises(NotFound):
        store.get("a", "big")
    assert store.get("a", "resp_2")  # and nothing was dropped for it


def test_owners_never_see_each_other():
    store = ResponseStore(max_bytes=1 << 20)
    store.put("a", body("resp_a"), [{"id": "msg_client", "type": "message", "text": "a's"}], None)
    store.put("b", body("resp_b"), [{"id": "msg_client", "type": "message", "text": "b's"}], None)  # the same id
    assert store.item("a", "msg_client")["text"] == "a's" and store.item("b", "msg_client")["text"] == "b's"
    for read in (lambda: store.get("b", "resp_a"), lambda: store.delete("b", "resp_a"),
                 lambda: store.history("b", "resp_a"), lambda: store.item("b", "msg_resp_a")):
        with pytest.raises(NotFound):
            read()
    store.delete("b", "resp_b")
    assert store.item("a", "msg_client")["text"] == "a's"


def test_a_continuation_whose_predecessor_is_gone_names_it():
    store = ResponseStore(max_bytes=1 << 20)
    store.put("a", body("resp_1"), [{"id": "in_1", "type": "message"}], None)
    store.put("a", body("resp_2"), [{"id": "in_2", "type": "message"}], "resp_1")
    assert [i["id"] for i in store.history("a", "resp_2")] == ["in_1", "msg_resp_1", "in_2", "msg_resp_2"]
    store.delete("a", "resp_1")
    with pytest.raises(InvalidRequest, match="'resp_2' continues 'resp_1'"):
        store.history("a", "resp_2")
