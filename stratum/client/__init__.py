"""Client-side helpers for applications talking to a Stratum server (docs/client.md).

Names are loaded on first access, so `stratum warmup` and cost parsing stay light: importing this package
loads neither torch nor the engine, and the anthropic SDK only with `Stratum` / `AsyncStratum`. The
integrations are separate modules with their own optional dependencies: `stratum.client.langchain`,
`stratum.client.proxy` (FastAPI), `stratum.client.prometheus`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Eager, and light (httpx only): the function `warmup` must shadow the submodule of the same name.
from stratum.client.warmup import WarmupReport, awarmup, read_prompts, warmup, warmup_http

_EXPORTS = {
    "stratum.client.cost": ("StratumCost", "StratumInfo", "StratumMeta", "decode_trace", "parse_stratum_cost"),
    "stratum.client.fingerprint": ("DEFAULT_PATTERNS", "FingerprintPattern", "Fingerprinter",
                                   "standardize_fingerprint"),
    "stratum.client.retry": ("DropOldestTurns", "RetryBudget", "RetryEvent", "RetryPolicy", "TrimChain",
                             "TruncateLongMessages", "derive_session_id", "estimate_tokens"),
    "stratum.client.sdk": ("AsyncStratum", "AsyncStratumStream", "Stratum", "StratumMessage", "StratumStream"),
    "stratum.client.semantic_cache": ("CacheLookup", "MiniLMEmbedder", "SemanticCache"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "AsyncStratum",
    "AsyncStratumStream",
    "CacheLookup",
    "DEFAULT_PATTERNS",
    "DropOldestTurns",
    "FingerprintPattern",
    "Fingerprinter",
    "MiniLMEmbedder",
    "RetryBudget",
    "RetryEvent",
    "RetryPolicy",
    "SemanticCache",
    "Stratum",
    "StratumCost",
    "StratumInfo",
    "StratumMessage",
    "StratumMeta",
    "StratumStream",
    "TrimChain",
    "TruncateLongMessages",
    "WarmupReport",
    "awarmup",
    "decode_trace",
    "derive_session_id",
    "estimate_tokens",
    "parse_stratum_cost",
    "read_prompts",
    "standardize_fingerprint",
    "warmup",
    "warmup_http",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stratum.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
