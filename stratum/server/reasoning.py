"""Reasoning on the serving side: what each API asks of a model's thought (`Thinking`), the budget an
effort stands for, and the signature on a thinking block that lets the server tell, when a client
sends the block back, that the model thought it (`ThoughtSigner`).

Budgets by effort (OpenAI's `reasoning_effort`, the Responses API's `reasoning.effort`, Anthropic's
`output_config.effort`, Ollama's `think` levels), in thought tokens: `EFFORT_BUDGETS`; "none" turns
thinking off, and the highest efforts leave it to max_tokens.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

EFFORT_BUDGETS: dict[str, int | None] = {
    "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": None, "max": None,
}
SIGNATURE_VERSION = b"\x01"  # the first byte of a signature: which key scheme signed it


@dataclass(frozen=True, slots=True)
class Thinking:
    """What a request asks of a reasoning model's thought.

    enabled: True on, False off (the template's switch, or the thought closed in the prompt), None as
        the model's template does by default.
    budget: thought tokens before the runtime ends the thought (None: the server's default).
    """

    enabled: bool | None = None
    budget: int | None = None

    @classmethod
    def of_effort(cls, effort: str | None) -> "Thinking":
        """An effort level: "none" is off, the others a budget (`EFFORT_BUDGETS`); None asks nothing."""
        if effort is None:
            return cls()
        if effort == "none":
            return cls(enabled=False)
        return cls(enabled=True, budget=EFFORT_BUDGETS.get(effort))


class ThoughtSigner:
    """Signs a thought's text with a key of this machine's (`$STRATUM_HOME/secrets/thinking.key`, made
    on first use, readable by its user only) and checks a signature sent back with it: HMAC-SHA-256, so
    a client can neither forge a thought nor alter one the model wrote."""

    def __init__(self, home: Path):
        self.path = Path(home) / "secrets" / "thinking.key"
        self._key: bytes | None = None

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = self._load()
        return self._key

    def _load(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            pass
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = secrets.token_bytes(32)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        try:
            os.link(tmp, self.path)  # the first process to make one wins; every other reads it
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return self.path.read_bytes()

    def sign(self, thought: str) -> str:
        digest = hmac.new(self.key, thought.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        return base64.b64encode(SIGNATURE_VERSION + digest).decode()

    def verify(self, thought: str, signature: str | None) -> bool:
        return bool(signature) and hmac.compare_digest(self.sign(thought), signature)
