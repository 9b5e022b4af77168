"""Cache-pollution advice: a session whose prompts keep missing the prefix cache while differing only in
high-entropy values (UUIDs, timestamps, ids) is told so (418, or the x-stratum-advice header)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict, deque

from stratum.server.errors import CachePollution

# High-entropy spans that defeat prefix caching when they vary per request.
ENTROPY_PATTERNS = (
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",  # UUID
    r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?",  # ISO 8601 timestamp
    r"\b1[5-9]\d{8}(?:\d{3})?\b",  # Unix time in s or ms
    r"\b[0-9a-fA-F]{16,}\b",  # long hex ids, hashes
)
_ENTROPY = re.compile("|".join(f"(?:{p})" for p in ENTROPY_PATTERNS))


def mask_high_entropy(text: str) -> str:
    return _ENTROPY.sub("<*>", text)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class PollutionDetector:
    """Flags a session whose last `window` requests all missed the cache (hit ratio < threshold) while
    their prompts differed only in high-entropy spans (UUIDs, timestamps, hex ids).

    Policy: "reject" answers the next request of that session with 418; "advise" only adds the
    x-stratum-advice header; "off" does nothing. Prompts are kept as digests, and only the
    `max_sessions` most recently seen sessions are kept, so memory stays bounded however many
    sessions clients invent.
    """

    ADVICE = "consider using deterministic session_id"

    def __init__(self, policy: str = "advise", window: int = 10, threshold: float = 0.05, max_sessions: int = 4096):
        if policy not in ("reject", "advise", "off"):
            raise ValueError(f"pollution policy must be reject, advise or off, not {policy!r}")
        self.policy = policy
        self.window = window
        self.threshold = threshold
        self.max_sessions = max_sessions
        # session -> its last `window` requests as (cache_hit_ratio, prompt digest, masked prompt digest)
        self._sessions: OrderedDict[str, deque] = OrderedDict()
        self._lock = threading.Lock()

    def is_polluted(self, session: str) -> bool:
        if self.policy == "off":
            return False
        with self._lock:
            recent = list(self._sessions.get(session, ()))
        if len(recent) < self.window or any(hit >= self.threshold for hit, _, _ in recent):
            return False
        raws = {raw for _, raw, _ in recent}
        masked = {m for _, _, m in recent}
        return len(raws) > 1 and len(masked) == 1

    def refuse(self, session: str) -> CachePollution:
        """The 418 for a polluting session under the reject policy; the session starts over."""
        self.reset(session)
        return CachePollution(
            "the last requests of this session missed the prefix cache and differ only in high-entropy values "
            "(UUIDs, timestamps, ids); " + self.ADVICE,
            headers={"x-stratum-advice": self.ADVICE}, extra={"stratum_reason": "cache_pollution"})

    def record(self, session: str, cache_hit_ratio: float, prompt_text: str) -> None:
        if self.policy == "off":
            return
        entry = (cache_hit_ratio, _digest(prompt_text), _digest(mask_high_entropy(prompt_text)))
        with self._lock:
            recent = self._sessions.pop(session, None) or deque(maxlen=self.window)
            recent.append(entry)
            self._sessions[session] = recent
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def reset(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)
