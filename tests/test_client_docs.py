"""Every ```python example in docs/client.md runs against a real `stratum serve` (the tiny model), with the
server's address in STRATUM_URL and the model in STRATUM_MODEL, as a reader would run it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "client.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    return [(text[: m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


BLOCKS = python_blocks(DOC.read_text())


def test_the_doc_has_examples_for_every_feature():
    code = "\n".join(c for _, c in BLOCKS)
    for name in ("event_hooks", "parse_stratum_cost", "RetryPolicy", "standardize_fingerprint", "SemanticCache",
                 "warmup(", "ChatStratum", "stratum_proxy_router", "ClientMetrics"):
        assert name in code, name
    assert len(BLOCKS) >= 9


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"client.md:{line}" for line, _ in BLOCKS])
def test_example_runs(line, code, tiny_server, monkeypatch, capsys):
    monkeypatch.setenv("STRATUM_URL", tiny_server.url)
    monkeypatch.setenv("STRATUM_MODEL", "tiny")
    exec(compile(code, f"{DOC}:{line}", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out  # every example shows something
