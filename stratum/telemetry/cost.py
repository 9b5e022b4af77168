"""The `x-stratum-cost` header and the pricing formulas that turn it into dollars.

Every field is measured by the code that did the work (see docs/telemetry.md):
    cache_hit_ratio     prompt tokens served from the prefix cache / prompt tokens
    prefill_latency_us  first scheduled prefill chunk -> first sampled token (engine wall clock)
    kv_sparsity         attention coverage: share of cached positions holding 90% of the attention mass
    spec_proposed_tokens, spec_accepted_tokens
                        speculative decoding: tokens proposed and verified, and those kept (only when
                        the request verified any)
    thinking_tokens, thinking_budget_hit
                        a reasoning model's thought: its tokens, and 1 when its budget ended it (only
                        when the model thought)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # keep this module importable without torch (the client parses the same header)
    from stratum.engine import RequestStats


@dataclass(frozen=True, slots=True)
class CostFields:
    cache_hit_ratio: float
    prefill_latency_us: int
    kv_sparsity: float | None  # None when no sample was taken (a request that never sampled)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    thinking_tokens: int = 0
    thinking_budget_hit: int = 0

    @classmethod
    def from_stats(cls, s: "RequestStats") -> "CostFields":
        ratio = s.num_cached_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0
        latency = round(s.prefill_s * 1e6) if s.prefill_s is not None else 0
        return cls(round(ratio, 4), latency, None if s.kv_sparsity is None else round(s.kv_sparsity, 4),
                   s.num_spec_proposed_tokens, s.num_spec_accepted_tokens, s.num_reasoning_tokens,
                   int(s.is_reasoning_cut))

    def header(self) -> str:
        """`cache_hit_ratio=0.82,prefill_latency_us=14200,kv_sparsity=0.33[,spec_proposed_tokens=40,spec_accepted_tokens=31]`
        (kv_sparsity omitted when unmeasured, the speculative counts when nothing was proposed)."""
        return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.as_dict().items()
                        if v is not None)

    def as_dict(self) -> dict:
        d = asdict(self)
        if not self.spec_proposed_tokens:
            del d["spec_proposed_tokens"], d["spec_accepted_tokens"]
        if not self.thinking_tokens:
            del d["thinking_tokens"], d["thinking_budget_hit"]
        return d


class PricingModel(Protocol):
    name: str

    def price(self, cost: CostFields, usage: dict[str, int]) -> float: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class ArticleFormula:
    """The source article's per-request formula, in USD:

        base_rate + (prefill_latency_us / 10000) * latency_premium
                  - cache_hit_ratio * 0.0005 * hit_discount
                  + (1 - kv_sparsity) * sparsity_penalty

    Defaults: latency_premium $0.0001 and sparsity_penalty $0.002 per 0.1 of sparsity are the
    article's own figures; base_rate and hit_discount are ours. An unmeasured kv_sparsity counts as 1.
    """

    base_rate: float = 0.001
    latency_premium: float = 0.0001
    hit_discount: float = 1.0
    sparsity_penalty: float = 0.02
    name: str = "article"

    def price(self, cost: CostFields, usage: dict[str, int]) -> float:
        sparsity = 1.0 if cost.kv_sparsity is None else cost.kv_sparsity
        return (self.base_rate + (cost.prefill_latency_us / 10000) * self.latency_premium
                - cost.cache_hit_ratio * 0.0005 * self.hit_discount + (1 - sparsity) * self.sparsity_penalty)

    def describe(self) -> dict:
        return {"name": self.name, "base_rate": self.base_rate, "latency_premium": self.latency_premium,
                "hit_discount": self.hit_discount, "sparsity_penalty": self.sparsity_penalty}


@dataclass(frozen=True)
class TokenPricing:
    """Per-token prices in USD per million tokens: uncached input, cached input, output."""

    input_per_mtok: float = 0.10
    cached_input_per_mtok: float = 0.01
    output_per_mtok: float = 0.40
    name: str = "tokens"

    def price(self, cost: CostFields, usage: dict[str, int]) -> float:
        uncached = usage["input_tokens"] + usage["cache_creation_input_tokens"]
        return (uncached * self.input_per_mtok + usage["cache_read_input_tokens"] * self.cached_input_per_mtok
                + usage["output_tokens"] * self.output_per_mtok) / 1e6

    def describe(self) -> dict:
        return {"name": self.name, "input_per_mtok": self.input_per_mtok,
                "cached_input_per_mtok": self.cached_input_per_mtok, "output_per_mtok": self.output_per_mtok}


def pricing_from_spec(spec: str) -> PricingModel:
    """`article[:base_rate=..,latency_premium=..,hit_discount=..,sparsity_penalty=..]` or
    `tokens[:input_per_mtok=..,cached_input_per_mtok=..,output_per_mtok=..]`."""
    name, _, params = spec.partition(":")
    kwargs = {k: float(v) for k, v in (p.split("=", 1) for p in params.split(",") if p)}
    if name == "article":
        return ArticleFormula(**kwargs)
    if name == "tokens":
        return TokenPricing(**kwargs)
    raise ValueError(f"unknown pricing model {name!r} (article or tokens)")
