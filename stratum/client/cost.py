"""Typed views of what a Stratum server reports: the `x-stratum-cost` header, stream `meta`, debug traces,
and the `.stratum` object on every client response. Standalone on purpose: it imports neither torch nor the
engine, so an application can parse costs without the runtime installed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from stratum.telemetry.trace import decode_trace  # noqa: F401  (re-exported: the server's own decoder)

COST_HEADER = "x-stratum-cost"
TRACE_HEADER = "x-stratum-trace"
MODE_HEADER = "x-stratum-mode"
CACHE_MODE_HEADER = "x-stratum-cache-mode"
ADVICE_HEADER = "x-stratum-advice"
SESSION_HEADER = "x-stratum-session-id"
_REQUIRED = ("cache_hit_ratio", "prefill_latency_us")
_OPTIONAL = ("kv_sparsity", "spec_proposed_tokens", "spec_accepted_tokens")


@dataclass(frozen=True, slots=True)
class StratumCost:
    """One `x-stratum-cost` value. Definitions: docs/telemetry.md.

    `extra` keeps fields this client does not know yet, verbatim, so a newer server loses nothing.
    """

    cache_hit_ratio: float
    prefill_latency_us: int
    kv_sparsity: float | None = None  # None when the server took no sample (e.g. max_tokens 0)
    # speculative decoding: tokens proposed and verified, and those kept (None: nothing was proposed)
    spec_proposed_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    extra: tuple[tuple[str, str], ...] = ()

    @property
    def is_cache_hit(self) -> bool:
        """Any prompt token came from the prefix cache (the server's `cache_hit` label)."""
        return self.cache_hit_ratio > 0

    @property
    def prefill_latency_s(self) -> float:
        return self.prefill_latency_us / 1e6

    def header(self) -> str:
        """The header value, in the server's own format:
        `cache_hit_ratio=0.82,prefill_latency_us=14200,kv_sparsity=0.33`."""
        parts = [f"cache_hit_ratio={self.cache_hit_ratio:g}", f"prefill_latency_us={self.prefill_latency_us}"]
        if self.kv_sparsity is not None:
            parts.append(f"kv_sparsity={self.kv_sparsity:g}")
        if self.spec_proposed_tokens is not None:
            parts += [f"spec_proposed_tokens={self.spec_proposed_tokens}",
                      f"spec_accepted_tokens={self.spec_accepted_tokens}"]
        parts += [f"{k}={v}" for k, v in self.extra]
        return ",".join(parts)

    def as_dict(self) -> dict[str, Any]:
        d = {"cache_hit_ratio": self.cache_hit_ratio, "prefill_latency_us": self.prefill_latency_us,
             "kv_sparsity": self.kv_sparsity}
        if self.spec_proposed_tokens is not None:
            d.update(spec_proposed_tokens=self.spec_proposed_tokens, spec_accepted_tokens=self.spec_accepted_tokens)
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StratumCost":
        """From the `cost` object of a `stratum_cost` event. Raises ValueError if a required field is missing."""
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"stratum cost lacks {', '.join(missing)}")
        sparsity = d.get("kv_sparsity")
        proposed, accepted = d.get("spec_proposed_tokens"), d.get("spec_accepted_tokens")
        extra = tuple((str(k), str(v)) for k, v in d.items() if k not in (*_REQUIRED, *_OPTIONAL))
        return cls(float(d["cache_hit_ratio"]), int(float(d["prefill_latency_us"])),
                   None if sparsity is None else float(sparsity), None if proposed is None else int(proposed),
                   None if proposed is None else int(accepted or 0), extra)


def parse_stratum_cost(header: str) -> StratumCost:
    """Parse an `x-stratum-cost` header value.

    Args:
        header: `key=value` pairs separated by commas; `kv_sparsity` may be absent.
    Returns:
        A StratumCost whose `.header()` reproduces the value.
    Raises:
        ValueError: a part without `=`, a non-numeric known field, or a missing required field.
    """
    fields: dict[str, str] = {}
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"malformed x-stratum-cost part {part!r} in {header!r}")
        fields[key] = value
    try:
        return StratumCost.from_dict(fields)
    except ValueError as e:
        raise ValueError(f"malformed x-stratum-cost {header!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class StratumMeta:
    """One `stratum_meta` event of a stream (the runtime's state at the delta before it), as the server sent it."""

    stratum_state: str  # queued, prefill_chunk_K, prefill_complete, decode_step_N, tool_use_prepared, finished
    kv_cache_efficiency: float | None
    index: int | None = None  # the content block the delta belongs to

    @property
    def step(self) -> int | None:
        """N of `decode_step_N` or K of `prefill_chunk_K`; None for the other states."""
        head, _, tail = self.stratum_state.rpartition("_")
        return int(tail) if head in ("decode_step", "prefill_chunk") and tail.isdigit() else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, meta: Mapping[str, Any], index: int | None = None) -> "StratumMeta":
        eff = meta.get("kv_cache_efficiency")
        return cls(str(meta.get("stratum_state", "")), None if eff is None else float(eff), index)


@dataclass(slots=True)
class StratumInfo:
    """What Stratum reported about one response: `.stratum` on every message and stream of the client.

    For a stream, `header_cost` is what the headers said after prefill; `final_cost`, `final_cost_estimate`
    and (with X-Stratum-Debug) `trace` arrive with the `stratum_cost` event just before `message_stop`,
    and `is_final` turns True then.
    """

    header: str | None = None
    header_cost: StratumCost | None = None
    final_cost: StratumCost | None = None
    final_cost_estimate: float | None = None  # USD, by the server's pricing model
    mode: str | None = None  # engine mode: normal | basic
    cache_mode: str | None = None  # default | aggressive | bypass
    advice: str | None = None
    trace: dict[str, Any] | None = None
    request_id: str | None = None
    session_id: str | None = None  # the x-stratum-session-id this client sent, if any
    usage: dict[str, int] = field(default_factory=dict)
    metas: list[StratumMeta] = field(default_factory=list)
    retries: list[Any] = field(default_factory=list)  # RetryEvents taken before this response
    is_final: bool = False

    @property
    def cost(self) -> StratumCost | None:
        """The most complete cost known: the final one for a finished stream, else the header's."""
        return self.final_cost or self.header_cost

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], is_stream: bool = False) -> "StratumInfo":
        """Raises ValueError on a malformed x-stratum-cost or x-stratum-trace."""
        header = headers.get(COST_HEADER)
        trace = headers.get(TRACE_HEADER)
        info = cls(header=header, header_cost=parse_stratum_cost(header) if header else None,
                   mode=headers.get(MODE_HEADER), cache_mode=headers.get(CACHE_MODE_HEADER),
                   advice=headers.get(ADVICE_HEADER), trace=decode_trace(trace) if trace else None,
                   request_id=headers.get("request-id"), is_final=not is_stream)
        if info.trace is not None:
            info.final_cost_estimate = info.trace.get("final_cost_estimate")
        return info

    def apply_final(self, event: Mapping[str, Any]) -> None:
        """Take the body of a `stratum_cost` event."""
        if event.get("cost") is not None:
            self.final_cost = StratumCost.from_dict(event["cost"])
        elif event.get("header"):
            self.final_cost = parse_stratum_cost(event["header"])
        if event.get("final_cost_estimate") is not None:
            self.final_cost_estimate = float(event["final_cost_estimate"])
        self.mode = event.get("mode", self.mode)
        if event.get("trace"):
            self.trace = decode_trace(event["trace"])
        self.is_final = True

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: costs as dicts, retries as dicts."""
        return {
            "header": self.header, "cost": self.cost.as_dict() if self.cost else None,
            "header_cost": self.header_cost.as_dict() if self.header_cost else None,
            "final_cost": self.final_cost.as_dict() if self.final_cost else None,
            "final_cost_estimate": self.final_cost_estimate, "mode": self.mode, "cache_mode": self.cache_mode,
            "advice": self.advice, "trace": self.trace, "request_id": self.request_id, "session_id": self.session_id,
            "usage": dict(self.usage), "num_metas": len(self.metas),
            "retries": [asdict(r) for r in self.retries], "is_final": self.is_final,
        }
