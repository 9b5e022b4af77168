"""The server's settings (`ServerSettings`), as `stratum serve` gives them; frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from stratum.server.auth import key_digests
from stratum.server.policy import PolicyStore
from stratum.server.sampling import SamplingDefaults
from stratum.telemetry.cost import ArticleFormula, PricingModel


@dataclass(frozen=True)
class ServerSettings:
    """Args:
        model_name: the id clients send in `model`; aliases are accepted too.
        model_patterns: globs of other model names served by the first model (`models.ModelSet.find`).
        api_keys: accepted keys; empty means no authentication. Only their SHA-256 digests are kept.
        max_body_bytes: request bodies above this get 413 before any parsing.
        max_header_bytes, max_header_count: requests whose headers are larger, or more, get 431 (`app.Envelope`,
            whatever the pieces they arrived in).
        header_wait_s: a stream waits this long for prefill before sending headers without its figures.
        default_temperature, default_top_p: what a request that omits them samples with (the model's
            recommended settings; `sampling_defaults`).
        tenant_budget_tokens: admission by cost, tokens per tenant per window; None disables it.
        pollution_policy: reject (418), advise (header only) or off.
        share_prefix_cache: with API keys, let every key hit every other key's cached prompts (one
            organisation, several keys); by default each key is a tenant with a cache of its own.
        body_timeout_s: a request body that stalls this long between chunks gets 408.
        cors_origins: web origins allowed to call the API from a browser ("*" for any); none by default.
        content_policy: the content policy, loaded from its file (`policy.PolicyStore`, which reloads it);
            None screens nothing.
        data_dir: where Message Batches and the tenants' settled budget windows are kept (SQLite); None
            serves no batches and keeps budgets in memory only.
        console: serve the console pages under /console (its figures need a key when keys are set).
        batch_ttl_s, batch_retention_s: a batch expires this long after creation; its results are kept
            this long after it ends.
        responses_store_bytes: stored Responses API responses are kept in memory up to this many bytes
            of JSON, the oldest dropped first.
        reasoning_format: "auto" returns a reasoning model's thought apart from its answer; "none" leaves
            it in the answer's text.
        restart_wait_s: a request that arrives while a dead engine is being replaced waits this long for
            it, then gets 503 with Retry-After.
        reasoning_budget: thought tokens before the runtime ends a thought, where a request sets none
            (None: no budget).
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    model_patterns: tuple[str, ...] = ("claude-*",)
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 32 * 1024
    max_header_count: int = 256
    ping_interval_s: float = 5.0
    header_wait_s: float = 2.0
    default_temperature: float = 1.0  # Anthropic's default when a request omits it
    default_top_p: float = 1.0
    tenant_budget_tokens: int | None = None
    budget_window_s: float = 60.0
    pollution_policy: str = "advise"
    share_prefix_cache: bool = False
    body_timeout_s: float = 30.0
    cors_origins: tuple[str, ...] = ()
    content_policy: PolicyStore | None = None
    data_dir: Path | None = None
    console: bool = False
    batch_ttl_s: float = 86400.0
    batch_retention_s: float = 29 * 86400.0
    max_batch_bytes: int = 256 * 2**20  # Anthropic's limit on a batch's body
    responses_store_bytes: int = 64 * 2**20
    reasoning_format: str = "auto"
    reasoning_budget: int | None = None
    restart_wait_s: float = 5.0
    pricing: PricingModel = field(default_factory=ArticleFormula)
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    @property
    def key_digests(self) -> tuple[bytes, ...]:
        return key_digests(self.api_keys)

    @property
    def isolate_tenants(self) -> bool:
        """Keys are tenants, and one tenant's prompts must never be observable by another through the
        prefix cache (its hit ratio, its timing). Without keys every client is one trust domain."""
        return bool(self.api_keys) and not self.share_prefix_cache

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What every generating route fills an omitted sampling field with."""
        return SamplingDefaults(temperature=self.default_temperature, top_p=self.default_top_p)
