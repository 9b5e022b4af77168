"""Retry that reads the reason a Stratum server gave, as a policy object the client consults after each failure.

    429 rate_limit_error, stratum_reason cost_threshold_exceeded
        -> trim the context (if a TrimPolicy is allowed and it brings the estimate under the remaining
           budget) and retry at once; else wait `retry-after` (up to max_wait_s) and retry
    418 cache_pollution -> switch to a deterministic session id derived from the caller's keys, retry once
    529 overloaded_error -> exponential backoff with full jitter
    anything else -> not retried by this policy

Every retry takes a token from a RetryBudget (a token bucket shared by all requests of a client), so a
client in trouble cannot turn into a retry storm. The decision is a pure function of the failure and the
request (`RetryPolicy.next_action`); the clients only sleep and resend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

log = logging.getLogger("stratum.client.retry")

# The client cannot run the server's tokenizer: it estimates a prompt at ceil(chars / 4) tokens and, once
# a 429 says what the server counted (error.stratum_cost_tokens, docs/telemetry.md), scales to that count.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """One decision of the policy, delivered to the `retry` hook, `RetryPolicy.on_retry` and the log."""

    attempt: int  # the attempt that failed, from 1
    status: int
    reason: str  # cost_threshold_exceeded | cache_pollution | overloaded
    action: str  # wait | trim | session | backoff | give_up
    delay_s: float = 0.0
    detail: str = ""
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed response said, read from its status, error body and headers."""

    status: int
    error_type: str | None = None
    stratum_reason: str | None = None
    retry_after_s: float | None = None
    remaining_tokens: int | None = None
    request_id: str | None = None
    cost_tokens: int | None = None  # what the server counted the refused request at

    @classmethod
    def from_response(cls, status: int, body: Any, headers: Mapping[str, str]) -> "Failure":
        error = body.get("error") if isinstance(body, Mapping) else None
        error = error if isinstance(error, Mapping) else {}
        cost = error.get("stratum_cost_tokens")
        return cls(status, error.get("type"), error.get("stratum_reason"), _float(headers.get("retry-after")),
                   _int(headers.get("anthropic-ratelimit-tokens-remaining")), headers.get("request-id"),
                   cost if isinstance(cost, int) and not isinstance(cost, bool) and cost > 0 else None)

    @property
    def reason(self) -> str | None:
        """The retryable reason, or None for a failure this policy does not retry."""
        if self.status == 429 and self.stratum_reason == "cost_threshold_exceeded":
            return "cost_threshold_exceeded"
        if self.status == 418:
            return "cache_pollution"
        if self.status == 529 or self.error_type == "overloaded_error":
            return "overloaded"
        return None


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def _int(v: str | None) -> int | None:
    f = _float(v)
    return int(f) if f is not None else None


class RetryBudget:
    """A token bucket: each retry takes one token; tokens come back at `refill_per_s` up to `capacity`.

    Shared by every request of a client (and its copies), so under a sustained outage the client retries at
    most `refill_per_s` times per second in total, however many requests are failing.
    """

    def __init__(self, capacity: float = 10.0, refill_per_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.clock = clock
        self._tokens = capacity
        self._stamp = clock()
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> float:
        with self._lock:
            self._refill()
            return self._tokens

    def try_acquire(self) -> bool:
        """Take one token if there is one. Never blocks."""
        with self._lock:
            self._refill()
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.refill_per_s)
        self._stamp = now


# ---- trimming ------------------------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, Mapping):
            if isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif "content" in block:
                parts.append(_content_text(block["content"]))
    return "\n".join(parts)


def prompt_chars(params: Mapping[str, Any]) -> int:
    """Characters of the prompt as the server counts them for admission: system and message texts."""
    texts = [_content_text(params["system"])] if params.get("system") else []
    texts += [_content_text(m.get("content")) for m in params.get("messages") or []]
    return len("\n".join(texts))


def estimate_tokens(params: Mapping[str, Any]) -> int:
    """The server's admission estimate of a request: ceil(prompt chars / 4) + max_tokens."""
    return math.ceil(prompt_chars(params) / CHARS_PER_TOKEN) + int(params.get("max_tokens") or 0)


class TrimPolicy(Protocol):
    def trim(self, params: Mapping[str, Any], target_tokens: int) -> dict[str, Any] | None:
        """Return request params whose estimate_tokens is at most target_tokens if possible, or at least
        smaller than before; None when there is nothing left to trim. Never modifies `params`."""


@dataclass(frozen=True)
class DropOldestTurns:
    """Drop the oldest turns (a user turn and the assistant turn after it) until the request fits.
    The last `keep_last` messages are always kept, and the conversation still starts with a user turn."""

    keep_last: int = 1

    def trim(self, params: Mapping[str, Any], target_tokens: int) -> dict[str, Any] | None:
        messages = list(params.get("messages") or [])
        last_cut = len(messages) - max(1, self.keep_last)  # messages[last_cut:] are always kept
        cuts = [i for i in range(1, last_cut + 1) if messages[i].get("role") == "user"]
        if not cuts:
            return None
        for i in cuts:  # the fewest turns dropped that makes it fit, else as many as allowed
            if estimate_tokens({**params, "messages": messages[i:]}) <= target_tokens:
                return {**params, "messages": messages[i:]}
        return {**params, "messages": messages[cuts[-1]:]}


@dataclass(frozen=True)
class TruncateLongMessages:
    """Cut the middle out of the longest string messages (keeping head and tail) until the request fits.
    A message is never cut below `min_chars`."""

    min_chars: int = 200
    marker: str = "\n[...]\n"

    def trim(self, params: Mapping[str, Any], target_tokens: int) -> dict[str, Any] | None:
        messages = [dict(m) for m in params.get("messages") or []]
        excess = (estimate_tokens(params) - target_tokens) * CHARS_PER_TOKEN
        changed = False
        for i in sorted(range(len(messages)), key=lambda i: -len(_content_text(messages[i].get("content")))):
            if excess <= 0:
                break
            text = messages[i].get("content")
            if not isinstance(text, str) or len(text) <= self.min_chars:
                continue
            keep = max(self.min_chars, len(text) - excess - len(self.marker))
            if keep >= len(text):
                continue
            head = keep // 2
            messages[i]["content"] = text[:head] + self.marker + text[len(text) - (keep - head):]
            excess -= len(text) - len(messages[i]["content"])
            changed = True
        return {**params, "messages": messages} if changed else None


@dataclass(frozen=True)
class TrimChain:
    """Try each policy in turn, feeding each the previous one's result, until the request fits."""

    policies: tuple[TrimPolicy, ...]

    def trim(self, params: Mapping[str, Any], target_tokens: int) -> dict[str, Any] | None:
        current, changed = dict(params), False
        for p in self.policies:
            if estimate_tokens(current) <= target_tokens:
                break
            out = p.trim(current, target_tokens)
            if out is not None:
                current, changed = out, True
        return current if changed else None


# ---- sessions ------------------------------------------------------------------------------------------
def derive_session_id(keys: Mapping[str, Any] | Sequence[Any] | str) -> str:
    """A deterministic session id from caller-supplied keys (e.g. {"tenant": "acme", "user": "42"}): the
    same keys give the same id in every process, different keys different ids."""
    canonical = json.dumps(sorted((str(k), str(v)) for k, v in keys.items()) if isinstance(keys, Mapping)
                           else [keys] if isinstance(keys, str) else [str(k) for k in keys], separators=(",", ":"))
    return "ses_" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


# ---- the policy ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # wait | trim | session | backoff | give_up
    delay_s: float = 0.0
    params: dict[str, Any] | None = None  # the trimmed request, for "trim"
    session_id: str | None = None  # for "session"
    detail: str = ""


@dataclass
class RetryPolicy:
    """How a Stratum client retries. One instance may be shared by several clients (they then share the budget).

    Args:
        max_attempts: attempts per request in total, first included (429 and 529 branches).
        max_wait_s: the longest `retry-after` the policy waits out on a 429; a longer one is raised at once.
        trim: allowed context trimming on a 429 (None: never trim, only wait).
        session_keys: the keys a 418 derives the deterministic session id from (None: a 418 is raised).
        backoff_base_s, backoff_max_s: 529 backoff: attempt n sleeps uniform(0, min(max, base * 2**(n-1))).
        budget: the retry token bucket.
        on_retry: called with every RetryEvent (retries and give-ups); events are also logged on
            `stratum.client.retry` (INFO for retries, WARNING for give-ups).
        rng: the jitter's random source (seed it for reproducible delays).
    """

    max_attempts: int = 4
    max_wait_s: float = 30.0
    trim: TrimPolicy | None = None
    session_keys: Mapping[str, Any] | Sequence[Any] | str | None = None
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    budget: RetryBudget = field(default_factory=RetryBudget)
    on_retry: Callable[[RetryEvent], None] | None = None
    rng: random.Random = field(default_factory=random.Random)

    def next_action(self, failure: Failure, attempt: int, params: Mapping[str, Any],
               session_keys: Mapping[str, Any] | Sequence[Any] | str | None = None,
               is_session_switched: bool = False) -> Decision | None:
        """What to do after `attempt` failed with `failure`. None: not this policy's failure (raise it as is).

        Args:
            params: the request that failed (trimming works on it).
            session_keys: per-call keys, overriding the policy's.
            is_session_switched: this request already switched session once (a second 418 is raised).
        """
        reason = failure.reason
        if reason is None:
            return None
        if reason == "cache_pollution":
            keys = session_keys if session_keys is not None else self.session_keys
            if is_session_switched:
                return Decision("give_up", detail="418 again after switching to a deterministic session id")
            if keys is None:
                return Decision("give_up", detail="418 and no session keys to derive a deterministic session id from")
            decision = Decision("session", session_id=derive_session_id(keys))
        elif attempt >= self.max_attempts:
            return Decision("give_up", detail=f"{attempt} attempts made (max_attempts={self.max_attempts})")
        elif reason == "cost_threshold_exceeded":
            decision = self._on_cost(failure, params)
            if decision.action == "give_up":
                return decision
        else:
            cap = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
            decision = Decision("backoff", delay_s=self.rng.uniform(0, cap), detail=f"full jitter over [0, {cap:g}] s")
        if not self.budget.try_acquire():
            return Decision("give_up", detail="retry budget exhausted")
        return decision

    def _on_cost(self, failure: Failure, params: Mapping[str, Any]) -> Decision:
        remaining = failure.remaining_tokens
        if self.trim is not None and remaining is not None:
            before = estimate_tokens(params)
            target, scaled = remaining, ""
            if failure.cost_tokens:  # the server's remaining budget, in this estimate's units
                target = remaining * before // failure.cost_tokens
                scaled = f" ({target} in estimate units: the server counted {failure.cost_tokens})"
            trimmed = self.trim.trim(params, target)
            if trimmed is not None:
                after = estimate_tokens(trimmed)
                if after <= target:
                    return Decision("trim", params=trimmed,
                                    detail=f"estimate {before} -> {after} tokens, {remaining} remaining{scaled}")
        wait = failure.retry_after_s if failure.retry_after_s is not None else 1.0
        if wait > self.max_wait_s:
            return Decision("give_up", detail=f"retry-after {wait:g} s exceeds max_wait_s={self.max_wait_s:g}")
        return Decision("wait", delay_s=wait, detail=f"retry-after {wait:g} s")

    def report(self, event: RetryEvent) -> None:
        """Log the event and call on_retry."""
        level = logging.WARNING if event.action == "give_up" else logging.INFO
        log.log(level, "stratum retry: attempt %d got %d (%s) -> %s %.3fs %s", event.attempt, event.status,
                event.reason, event.action, event.delay_s, event.detail)
        if self.on_retry is not None:
            self.on_retry(event)
