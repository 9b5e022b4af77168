"""Admission by cost: each tenant's token budget over a fixed window (`CostAdmission`), what one
request holds of it (`Reservation`: upper bounds reserved before it runs, settled to its measured cost),
and the settled spending kept on disk so that a restart, even after kill -9, reads it back (`BudgetStore`)."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stratum.server.errors import RateLimited, is_openai

if TYPE_CHECKING:
    from stratum.telemetry.metrics import Metrics

log = logging.getLogger("stratum.server")

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
    settled: int = 0  # measured costs of the requests settled in this window: what `BudgetStore` keeps
    held: int = 0  # reservations of the requests still running

    @property
    def spent(self) -> int:
        return self.settled + self.held


class BudgetStore:
    """Each tenant's current window (its start, its settled tokens) in SQLite, one row per tenant.

    Durability: one write per settled request, in WAL mode with synchronous=NORMAL, which SQLite
    documents as durable across an application crash (a kill -9 loses nothing committed) but not
    across a power loss or an OS crash, which may roll back the writes since the last checkpoint
    (https://www.sqlite.org/pragma.html#pragma_synchronous). Reservations are not written: see
    `CostAdmission`. One connection, used under `CostAdmission`'s lock.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("pragma journal_mode=wal")
        self.db.execute("pragma synchronous=normal")
        self.db.execute("create table if not exists windows (tenant text primary key, start real not null, "
                        "settled integer not null)")

    def load(self, now: float, window_s: float) -> dict[str, tuple[float, int]]:
        """The windows still open at `now`, by tenant: (start, settled tokens); closed ones are deleted."""
        self.db.execute("delete from windows where start + ? <= ?", (window_s, now))
        rows = self.db.execute("select tenant, start, settled from windows").fetchall()
        return {t: (start, settled) for t, start, settled in rows}

    def save(self, tenant: str, start: float, settled: int) -> None:
        """Write the tenant's window; a failed write (a full disk) is logged, and admission goes on in memory."""
        try:
            self.db.execute("insert into windows (tenant, start, settled) values (?, ?, ?) on conflict (tenant) do "
                            "update set start = excluded.start, settled = excluded.settled", (tenant, start, settled))
        except sqlite3.Error as e:
            log.warning("admission by cost: tenant %r's spending not written to disk: %s", tenant, e)


class CostAdmission:
    """Per-tenant token budgets over a fixed window.

    With a `store`, the windows open at start-up are read back from it, and every settlement is
    written to it before `settle` returns: a restart (after a crash, kill -9 included) neither forgets
    what a tenant spent nor charges it twice. Reservations of requests in flight at a crash are
    dropped, not charged: those requests ended with the process, unanswered, and an unfinished run is
    not charged (`Reservation.settle`), as a client's disconnect is not.

    Args:
        budget_tokens: tokens a tenant may spend per window; None disables admission by cost.
        window_s: window length.
        store: where settled spending is kept across restarts; None keeps it in memory only.
    """

    def __init__(self, budget_tokens: int | None, window_s: float = 60.0, clock=time.time,
                 store: BudgetStore | None = None):
        self.budget = budget_tokens
        self.window_s = window_s
        self.clock = clock
        self.store = store
        self._windows: dict[str, _Window] = {}
        if store is not None:
            self._windows = {t: _Window(start, settled) for t, (start, settled) in
                             store.load(clock(), window_s).items()}
            if self._windows:
                log.info("admission by cost: %d tenants' open windows read back", len(self._windows))
        self._sweep_at = max(MIN_SWEEP, 2 * len(self._windows))
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
                w.held += tokens
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
            w.held = max(0, w.held - reserved)
            w.settled += actual
            if self.store is not None:
                self.store.save(tenant, w.start, w.settled)

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
