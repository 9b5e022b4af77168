"""Request-fingerprint standardisation: the built-in patterns on a corpus of positive and negative cases, the
function and decorator forms, and, against a real server, ten requests that differ only in a UUID becoming
cache hits after the first."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from stratum.client import DEFAULT_PATTERNS, Fingerprinter, FingerprintPattern, Stratum, standardize_fingerprint

# (text, standardised text): positives first, then text that must stay as it is.
CORPUS = [
    ("id 550e8400-e29b-41d4-a716-446655440000 ok", "id <UUID_1> ok"),
    ("ID {6F9619FF-8B86-D011-B42D-00C04FC964FF}", "ID {<UUID_1>}"),
    ("trace=1b4e28ba-2fa1-11d2-883f-0016d3cca427;", "trace=<UUID_1>;"),
    ("at 2024-05-01T10:22:05Z.", "at <TIMESTAMP_1>."),
    ("at 2024-05-01T10:22:05.123456+02:00", "at <TIMESTAMP_1>"),
    ("logged 2024-05-01 10:22:05,123 INFO", "logged <TIMESTAMP_1> INFO"),
    ("at 2024-05-01 10:22", "at <TIMESTAMP_1>"),
    ("compact 20240501T102205Z", "compact <TIMESTAMP_1>"),
    ("Date: Tue, 1 Jul 2003 10:52:37 +0200", "Date: <TIMESTAMP_1>"),
    ("Last-Modified: Sun, 06 Nov 1994 08:49:37 GMT", "Last-Modified: <TIMESTAMP_1>"),
    ("ctime Wed Jun 30 21:49:08 1993", "ctime <TIMESTAMP_1>"),
    ("date(1) says Mon Jan  2 15:04:05 MST 2006", "date(1) says <TIMESTAMP_1>"),
    ("epoch 1700000000.", "epoch <EPOCH_1>."),
    ("ms 1700000000123 and us 1700000000123456", "ms <EPOCH_1> and us <EPOCH_2>"),
    ("float time 1700000000.25 s", "float time <EPOCH_1> s"),
    ("sha 3f786850e387550fdab836ed7e6dc881de23001b", "sha <HEX_1>"),
    ("addr 0xdeadbeef12345678", "addr <HEX_1>"),
    ("req_0123456789abcdef0123 failed", "req_<HEX_1> failed"),
    ("Bearer eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
     "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
     "Bearer <JWT_1>"),
    ("key sk-proj-A1b2C3d4E5f6G7h8I9j0KlMnOpQr used", "key <TOKEN_1> used"),
    ("ulid 01ARZ3NDEKTSV4RRFFQ69G5FAV", "ulid <ID_1>"),
    ("same 550e8400-e29b-41d4-a716-446655440000 and 550e8400-e29b-41d4-a716-446655440000 and "
     "6ba7b810-9dad-11d1-80b4-00c04fd430c8", "same <UUID_1> and <UUID_1> and <UUID_2>"),
    ("both 2024-05-01T10:22:05Z and 1700000000", "both <TIMESTAMP_1> and <EPOCH_1>"),
    # negatives: low-entropy or meaningful values stay
    ("on 2024-05-01 we met", None),
    ("version 1.2.3 build 20240501", None),
    ("phone +1 415 555 0100", None),
    ("order 12345 of 999999999", None),
    ("number 9999999999 is past 2033", None),
    ("deadbeefcafebabe has no digit", None),
    ("internationalization and pneumonoultramicroscopicsilicovolcanoconiosis", None),
    ("getUserAccountSettingsById is camelCase", None),
    ("path /usr/local/lib/python3.11/site-packages", None),
    ("ratio 0.8241 at 10:22", None),
    ("years 2024 and 1999", None),
    ("git short sha a1b2c3d", None),
    ("ISBN 978-3-16-148410-0", None),
    ("IPv4 192.168.1.1 port 8080", None),
    ("1000000000000000000000 grains of sand", None),
    ("The quick brown fox jumps over the lazy dog.", None),
]


@pytest.mark.parametrize("text, expected", CORPUS)
def test_builtin_patterns_on_the_corpus(text, expected):
    assert standardize_fingerprint(text) == (text if expected is None else expected)


def test_corpus_size():
    assert sum(e is not None for _, e in CORPUS) >= 15 and sum(e is None for _, e in CORPUS) >= 15
    assert {p.name for p in DEFAULT_PATTERNS} >= {"uuid", "iso8601", "rfc2822", "epoch", "hex", "jwt", "token"}


def test_request_numbering_spans_system_and_messages_and_restores():
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    request = {"model": "m", "max_tokens": 5, "system": f"Session {a}.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": f"Ticket {b}, session {a}"}]},
                            {"role": "assistant", "content": f"Noted {b}"}]}
    fp = Fingerprinter()
    out = fp.standardize(request)
    assert out["system"] == "Session <UUID_1>."
    assert out["messages"][0]["content"][0]["text"] == "Ticket <UUID_2>, session <UUID_1>"
    assert out["messages"][1]["content"] == "Noted <UUID_2>"
    assert out["model"] == "m" and request["system"] == f"Session {a}."  # a copy; the input is untouched
    text, mapping = fp.standardize_text(f"Ticket {b}, session {a}")
    assert mapping == {"<UUID_1>": b, "<UUID_2>": a}
    assert Fingerprinter.restore(text, mapping) == f"Ticket {b}, session {a}"


def test_patterns_are_configurable():
    fp = Fingerprinter(extra_patterns=[("order", r"ORD-\d{6}")], disable={"epoch"})
    assert fp.standardize("ORD-123456 at 1700000000") == "<ORDER_1> at 1700000000"
    only = Fingerprinter(patterns=[FingerprintPattern("ticket", re.compile(r"T#\d+"), "TICKET")])
    assert (only.standardize("T#42 550e8400-e29b-41d4-a716-446655440000")
            == "<TICKET_1> 550e8400-e29b-41d4-a716-446655440000")
    assert standardize_fingerprint("T#7", patterns=only) == "<TICKET_1>"


def test_decorator_sync_and_async():
    seen = []

    @standardize_fingerprint
    def send(*, system, messages):
        seen.append((system, messages))

    @standardize_fingerprint(patterns=Fingerprinter(disable={"uuid"}))
    async def asend(*, messages):
        seen.append(messages)

    send(system="at 2024-05-01T10:22:05Z",
         messages=[{"role": "user", "content": "id 550e8400-e29b-41d4-a716-446655440000"}])
    asyncio.run(asend(messages=[{"role": "user", "content": "id 550e8400-e29b-41d4-a716-446655440000 at 1700000000"}]))
    assert seen[0] == ("at <TIMESTAMP_1>", [{"role": "user", "content": "id <UUID_1>"}])
    assert seen[1] == [{"role": "user", "content": "id 550e8400-e29b-41d4-a716-446655440000 at <EPOCH_1>"}]


def _ten_uuid_requests(client: Stratum, nonce: str) -> list[float]:
    ratios = []
    for _ in range(10):
        msg = client.messages.create(
            model="tiny", max_tokens=1,
            system=f"{uuid.uuid4()} [{nonce}]: you are the order desk of a small shop; answer briefly.",
            messages=[{"role": "user", "content": "Where is my parcel? It was due yesterday."}])
        ratios.append(msg.stratum.cost.cache_hit_ratio)
    return ratios


def test_ten_requests_differing_only_in_uuids_become_cache_hits(tiny_server):
    plain = Stratum(base_url=tiny_server.url, api_key="fp-plain")
    assert _ten_uuid_requests(plain, uuid.uuid4().hex[:8]) == [0.0] * 10  # the control: every one misses

    client = Stratum(base_url=tiny_server.url, api_key="fp", fingerprint=True)
    ratios = _ten_uuid_requests(client, uuid.uuid4().hex[:8])
    # the first computes the prompt (its run nonce is new); the nine after it find it in the prefix cache
    assert ratios[0] < 0.5 and all(r > 0.5 for r in ratios[1:]), ratios
