"""What a caller asks of the runtime for one request: X-Stratum-* headers and system-prompt hints
(`Controls`), and the cache policy they come to."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from starlette.requests import Request

from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.server.errors import InvalidRequest

HINT_AGGRESSIVE = "use aggressive caching for repeated queries"
HINT_LOW_LATENCY = "prioritize low-latency over accuracy"
HINT_HIGH_VALUE = "this is a high-value request; spare no resources"
# request priorities: lower runs first
TOP_PRIORITY = -100  # a high-value request
BATCH_PRIORITY = 100  # a Message Batches request: below interactive requests (0)


class CacheMode(enum.Enum):
    """How a request uses the prefix cache (X-Stratum-Mode, or the aggressive-caching hint); its value
    is what the X-Stratum-Cache-Mode header and the trace say."""

    DEFAULT = "default"
    AGGRESSIVE = "aggressive"  # pins the prompt and the output
    BYPASS = "bypass"  # reads and writes nothing


@dataclass(frozen=True, slots=True)
class Controls:
    """What a request's X-Stratum-* headers and system-prompt hints ask of the runtime."""

    cache_mode: CacheMode = CacheMode.DEFAULT
    priority: int = 0
    is_low_latency: bool = False
    is_high_value: bool = False
    debug: str | None = None  # None | "true" | "full"
    is_compressive: bool = False  # X-Stratum-Context-Mode: compressive
    is_meta: bool = False  # X-Stratum-Meta: on, or X-Stratum-Negotiate: v1: the stream carries Stratum's events

    def cache_policy(self, sampling: SamplingParams, aggressive_ttl_s: float, warmup_ttl_s: float) -> CachePolicy:
        """Bypass reads and writes nothing; aggressive mode pins the prompt and the output; a warm-up
        (max_tokens 0, nothing scored) pins the prompt."""
        if self.cache_mode is CacheMode.BYPASS:
            return CachePolicy.bypass()
        if self.cache_mode is CacheMode.AGGRESSIVE:
            return CachePolicy(pin_ttl_s=aggressive_ttl_s, pin_output=True)
        if sampling.max_tokens == 0 and sampling.prompt_logprobs is None:
            return CachePolicy(pin_ttl_s=warmup_ttl_s)
        return CachePolicy()


def check_control_headers(request: Request) -> None:
    """Reject malformed X-Stratum-* control headers before admission charges anything."""
    mode = request.headers.get("x-stratum-mode", "").strip().lower()
    if mode and mode not in {m.value for m in CacheMode}:
        raise InvalidRequest(f"X-Stratum-Mode must be aggressive, bypass or default, not {mode!r}")
    context = request.headers.get("x-stratum-context-mode", "").strip().lower()
    if context and context != "compressive":
        raise InvalidRequest(f"X-Stratum-Context-Mode must be compressive, not {context!r}")


def controls_of(request: Request, system_text: str, is_batch: bool) -> Controls:
    """System-prompt hints first, then headers, which override them; a batch request runs at the batch priority."""
    lowered = system_text.lower()
    cache_mode = CacheMode.AGGRESSIVE if HINT_AGGRESSIVE in lowered else CacheMode.DEFAULT
    is_high_value = HINT_HIGH_VALUE in lowered
    priority = TOP_PRIORITY if is_high_value else 0
    mode = request.headers.get("x-stratum-mode", "").strip().lower()
    if mode:  # checked at admission (`check_control_headers`)
        cache_mode = CacheMode(mode)
    if is_batch:
        priority = BATCH_PRIORITY
    debug = request.headers.get("x-stratum-debug", "").strip().lower()
    is_compressive = request.headers.get("x-stratum-context-mode", "").strip().lower() == "compressive"
    return Controls(cache_mode, priority, HINT_LOW_LATENCY in lowered, is_high_value,
                    ("full" if debug == "full" else "true") if debug in ("true", "1", "full") else None, is_compressive,
                    asks_for_meta(request))


def asks_for_meta(request: Request) -> bool:
    """Whether a stream may carry what no API defines (the meta events, the cost event): only when the client
    said it reads them, so that a client or framework that merges and validates what it receives sees
    exactly the API's events."""
    meta = request.headers.get("x-stratum-meta", "").strip().lower()
    return meta in ("on", "true", "1") or request.headers.get("x-stratum-negotiate", "").strip().lower() == "v1"
