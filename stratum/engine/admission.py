"""Admission by cost and cache-pollution advice, decided in-process before any work is done.

A request's cost is estimated from its body alone (no tokenization): prompt characters / 4 plus
max_tokens, in tokens. Each tenant has a token budget per fixed window. A request that would take
the tenant over budget is rejected; one that is admitted is charged the estimate, and on finishing
the estimate is replaced by what it really cost: uncached prompt tokens + output tokens, so prompt
tokens served from the prefix cache are free.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # the usual English rule of thumb for BPE vocabularies; an estimate only


@dataclass(frozen=True, slots=True)
class Decision:
    is_admitted: bool
    limit: int
    remaining: int
    reset_at: float  # wall clock (time.time()) when the window resets
    retry_after_s: int = 0


@dataclass
class _Window:
    start: float
    spent: int = 0


class CostAdmission:
    """Per-tenant token budgets over a fixed window.

    Args:
        budget_tokens: tokens a tenant may spend per window; None disables admission by cost.
        window_s: window length.
    """

    def __init__(self, budget_tokens: int | None, window_s: float = 60.0, clock=time.time):
        self.budget = budget_tokens
        self.window_s = window_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.budget is not None

    @staticmethod
    def estimate(prompt_chars: int, max_tokens: int) -> int:
        return -(-prompt_chars // CHARS_PER_TOKEN) + max_tokens

    def admit(self, tenant: str, estimate: int) -> Decision:
        """Charge `estimate` if it fits in the tenant's window, else reject. Never partially charges."""
        now = self.clock()
        with self._lock:
            w = self._window(tenant, now)
            reset = w.start + self.window_s
            if w.spent + estimate > self.budget:
                return Decision(False, self.budget, max(0, self.budget - w.spent), reset, max(1, int(reset - now + 0.999)))
            w.spent += estimate
            return Decision(True, self.budget, self.budget - w.spent, reset)

    def settle(self, tenant: str, estimate: int, actual: int, reset_at: float | None = None) -> None:
        """Replace a charged estimate by the measured cost, in the window it was charged in, if still open.

        Args:
            reset_at: the admitting Decision's reset_at, which identifies that window; a request that
                outlived its window must not change the tenant's next one.
        """
        with self._lock:
            w = self._windows.get(tenant)
            if w is None or self.clock() >= w.start + self.window_s:
                return
            if reset_at is not None and w.start + self.window_s != reset_at:
                return
            w.spent = max(0, w.spent - estimate + actual)

    def _window(self, tenant: str, now: float) -> _Window:
        w = self._windows.get(tenant)
        if w is None or now >= w.start + self.window_s:
            w = self._windows[tenant] = _Window(now)
        return w


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


@dataclass
class _Session:
    recent: deque = field(default_factory=lambda: deque(maxlen=10))  # (cache_hit_ratio, raw text, masked text)


class PollutionDetector:
    """Flags a session whose last `window` requests all missed the cache (hit ratio < threshold) while
    their prompts differed only in high-entropy spans (UUIDs, timestamps, hex ids).

    Policy: "reject" answers the next request of that session with 418; "advise" only adds the
    x-stratum-advice header; "off" does nothing.
    """

    ADVICE = "consider using deterministic session_id"

    def __init__(self, policy: str = "advise", window: int = 10, threshold: float = 0.05):
        if policy not in ("reject", "advise", "off"):
            raise ValueError(f"pollution policy must be reject, advise or off, not {policy!r}")
        self.policy = policy
        self.window = window
        self.threshold = threshold
        self._sessions: dict[str, _Session] = defaultdict(_Session)
        self._lock = threading.Lock()

    def is_polluted(self, session: str) -> bool:
        if self.policy == "off":
            return False
        with self._lock:
            recent = list(self._sessions[session].recent)
        if len(recent) < self.window or any(hit >= self.threshold for hit, _, _ in recent):
            return False
        raws = {raw for _, raw, _ in recent}
        masked = {m for _, _, m in recent}
        return len(raws) > 1 and len(masked) == 1

    def record(self, session: str, cache_hit_ratio: float, prompt_text: str) -> None:
        if self.policy == "off":
            return
        with self._lock:
            s = self._sessions[session]
            s.recent = deque(s.recent, maxlen=self.window)
            s.recent.append((cache_hit_ratio, prompt_text, mask_high_entropy(prompt_text)))

    def reset(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)
