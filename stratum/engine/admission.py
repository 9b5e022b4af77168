"""Admission by cost and cache-pollution advice, decided in-process before any work is done.

Each tenant has a token budget per fixed window. A request reserves an upper bound of what it can
cost once its prompt is tokenized: its prompt tokens plus its effective max_tokens (the default
included when the client sent none). A request whose bound does not fit in what the tenant has left
is rejected, so concurrent requests can never spend more than the budget. When it finishes the
reservation is replaced by what it really cost: uncached prompt tokens + output tokens, so prompt
tokens served from the prefix cache are free.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

MIN_SWEEP = 1024  # tenants held before closed windows are swept


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
        self._sweep_at = MIN_SWEEP
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.budget is not None

    def admit(self, tenant: str, tokens: int) -> Decision:
        """Reserve `tokens` if they fit in the tenant's window, else reject. Never partially reserves."""
        return self._decide(tenant, tokens, reserve=True)

    def check(self, tenant: str, tokens: int = 0) -> Decision:
        """Whether `tokens` would fit, reserving nothing; with 0, the window as it stands (for headers)."""
        return self._decide(tenant, tokens, reserve=False)

    def _decide(self, tenant: str, tokens: int, reserve: bool) -> Decision:
        now = self.clock()
        with self._lock:
            w = self._window(tenant, now)
            reset = w.start + self.window_s
            if w.spent + tokens > self.budget:
                return Decision(False, self.budget, max(0, self.budget - w.spent), reset, max(1, int(reset - now + 0.999)))
            if reserve:
                w.spent += tokens
            return Decision(True, self.budget, self.budget - w.spent, reset)

    def settle(self, tenant: str, reserved: int, actual: int, reset_at: float | None = None) -> None:
        """Replace a reservation by the measured cost, in the window it was reserved in, if still open.

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
            w.spent = max(0, w.spent - reserved + actual)

    def _window(self, tenant: str, now: float) -> _Window:
        w = self._windows.get(tenant)
        if w is None or now >= w.start + self.window_s:
            if w is None and len(self._windows) >= self._sweep_at:  # forget closed windows: memory stays bounded
                self._windows = {t: v for t, v in self._windows.items() if now < v.start + self.window_s}
                self._sweep_at = max(MIN_SWEEP, 2 * len(self._windows))
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
