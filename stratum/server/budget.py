"""Admission by cost: each tenant's token budget over a fixed window (`CostAdmission`), and what one
request holds of it (`Reservation`: upper bounds reserved before it runs, settled to its measured cost)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stratum.server.errors import RateLimited, is_openai

if TYPE_CHECKING:
    from stratum.telemetry.metrics import Metrics

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

    def reserve(self, tenant: str, tokens: int) -> Decision:
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
                return Decision(False, self.budget, max(0, self.budget - w.spent), reset,
                                max(1, int(reset - now + 0.999)))
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


def measured_cost(usage: dict[str, int]) -> int:
    """What a finished run is charged against its tenant's budget: uncached prompt tokens + output."""
    return usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["output_tokens"]


@dataclass(slots=True, eq=False)
class Reservation:
    """What one request holds of its tenant's budget. The rule: before a run (its answer; compressive
    mode's summaries) it reserves an upper bound of what the run can cost, the prompt tokens plus the
    effective max_tokens (the default included when the client sent none), and a bound that does not
    fit in what the tenant has left is a 429, so concurrent requests never spend more than the budget;
    `settle` replaces the reservations, once, with what the runs measured (`measured_cost`: prompt
    tokens the prefix cache served are free). With admission by cost off it reserves nothing."""

    admission: CostAdmission
    tenant: str
    endpoint: str  # its route: OpenAI's routes also answer with OpenAI's rate-limit headers
    metrics: Metrics
    reserved: int = 0  # upper bounds of what runs for this request
    spent: int = 0  # measured cost of the runs done for it before its answer (compressive summaries)
    reset_at: float | None = None  # the window the reservations were made in
    is_settled: bool = False

    def check(self, max_tokens: int) -> None:
        """At admission, before any tokenization: the least the request can cost (max_tokens and one
        prompt token) must fit. Reserves nothing.

        Raises:
            RateLimited: 429, it does not fit in what the tenant has left.
        """
        if not self.admission.is_enabled:
            return
        least = 1 + max_tokens
        d = self.admission.check(self.tenant, least)
        if not d.is_admitted:
            raise self._refusal(d, least, f"this request costs at least {least} tokens (max_tokens and its prompt)")

    def reserve(self, num_prompt_tokens: int, max_tokens: int, what: str = "this request") -> None:
        """Reserve the upper bound of a run: every prompt token (whether or not the cache will serve
        it) and every token it may generate.

        Raises:
            RateLimited: 429, the bound does not fit in what the tenant has left in this window.
        """
        if not self.admission.is_enabled:
            return
        bound = num_prompt_tokens + max_tokens
        d = self.admission.reserve(self.tenant, bound)
        if not d.is_admitted:
            raise self._refusal(d, bound, f"{what} may cost up to {bound} tokens ({num_prompt_tokens} prompt tokens + "
                                          f"max_tokens {max_tokens})")
        self.reserved += bound
        if self.reset_at is None:
            self.reset_at = d.reset_at

    def charge(self, usage: dict[str, int]) -> None:
        """A run done for the request before its answer (a compressive summary) measured `usage`."""
        self.spent += measured_cost(usage)

    def settle(self, usage: dict[str, int] | None) -> None:
        """Once: the reservations are replaced by what was spent plus the answer's measured cost
        (`usage`; None when the answer did not finish: an unfinished run is not charged)."""
        if self.is_settled:
            return
        self.is_settled = True
        if self.reserved:
            actual = self.spent + (measured_cost(usage) if usage is not None else 0)
            self.admission.settle(self.tenant, self.reserved, actual, self.reset_at)

    def headers(self, d: Decision | None = None) -> dict[str, str]:
        """The tenant's budget window as it stands, in Anthropic's headers (and OpenAI's on its routes)."""
        if not self.admission.is_enabled:
            return {}
        d = d or self.admission.check(self.tenant)
        headers = {
            "anthropic-ratelimit-tokens-limit": str(d.limit),
            "anthropic-ratelimit-tokens-remaining": str(d.remaining),
            "anthropic-ratelimit-tokens-reset": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d.reset_at)),
        }
        if is_openai(self.endpoint):
            headers["x-ratelimit-limit-tokens"] = str(d.limit)
            headers["x-ratelimit-remaining-tokens"] = str(d.remaining)
            headers["x-ratelimit-reset-tokens"] = f"{max(0.0, d.reset_at - time.time()):.3f}s"
        return headers

    def _refusal(self, d: Decision, tokens: int, why: str) -> RateLimited:
        self.metrics.rejections.labels("cost_threshold_exceeded").inc()
        return RateLimited(
            f"{why}, more than the {d.remaining} tokens left to this tenant in the current "
            f"{self.admission.window_s:g}s window",
            headers={"retry-after": str(d.retry_after_s), **self.headers(d)},
            extra={"stratum_reason": "cost_threshold_exceeded", "stratum_cost_tokens": tokens},
        )
