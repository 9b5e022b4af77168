"""Cache warm-up: prefill and pin prompts with `max_tokens: 0`, Anthropic's own prefill-only semantics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import httpx

from stratum.client.cost import StratumCost


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """One prompt per line: plain text (a user message) or a JSON object with `messages` (and `system`).

    Raises:
        ValueError: a JSON line without a messages list.
    """
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            obj = json.loads(line)
            if not isinstance(obj.get("messages"), list):
                raise ValueError(f"{path}:{n}: a JSON line needs a messages list")
            prompts.append(obj)
        else:
            prompts.append({"messages": [{"role": "user", "content": line}]})
    return prompts


def warmup_http(url: str, model: str, prompts: list[dict[str, Any]], api_key: str | None = None,
                timeout: float = 300.0) -> dict[str, Any]:
    """Send each prompt with max_tokens 0. Reports the cache_creation_input_tokens the server measured."""
    headers = {"x-api-key": api_key} if api_key else {}
    created = cached = failed = 0
    results = []
    with httpx.Client(base_url=url, timeout=timeout, headers=headers) as client:
        for p in prompts:
            r = client.post("/v1/messages", json={"model": model, "max_tokens": 0, **p})
            if r.status_code != 200:
                failed += 1
                results.append({"status": r.status_code, "error": r.text[:200]})
                continue
            usage = r.json()["usage"]
            created += usage.get("cache_creation_input_tokens", 0)
            cached += usage.get("cache_read_input_tokens", 0)
            results.append({"status": 200, "usage": usage, "x-stratum-cost": r.headers.get("x-stratum-cost")})
    return {"prompts": len(prompts), "failed": failed, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached, "results": results}


@dataclass(frozen=True, slots=True)
class WarmupResult:
    status: int  # 200, or the error's status (0 for a connection error)
    usage: dict[str, int] | None = None
    cost: StratumCost | None = None  # the response's x-stratum-cost (kv_sparsity is None: nothing was sampled)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What a warm-up produced, as the server measured it."""

    num_prompts: int
    num_failed: int
    cache_creation_input_tokens: int  # prompt tokens newly written into the prefix cache (and pinned)
    cache_read_input_tokens: int  # prompt tokens that were already cached
    results: tuple[WarmupResult, ...]


def _prompt_kwargs(prompt: str | Mapping[str, Any], model: str | None) -> dict[str, Any]:
    kwargs = {"messages": [{"role": "user", "content": prompt}]} if isinstance(prompt, str) else dict(prompt)
    kwargs.setdefault("model", model)
    if kwargs["model"] is None:
        raise ValueError("warmup needs a model: pass model= or put one in each prompt")
    kwargs["max_tokens"] = 0
    return kwargs


def _usage_of(message) -> dict[str, int]:
    return {k: v for k, v in message.usage.model_dump().items() if isinstance(v, int)}


def _report(results: list[WarmupResult]) -> WarmupReport:
    ok = [r.usage for r in results if r.usage is not None]
    return WarmupReport(len(results), len(results) - len(ok), sum(u.get("cache_creation_input_tokens", 0) for u in ok),
                        sum(u.get("cache_read_input_tokens", 0) for u in ok), tuple(results))


def _failure(e: Exception) -> WarmupResult:
    return WarmupResult(getattr(e, "status_code", 0), error=f"{type(e).__name__}: {e}"[:300])


def warmup(client, prompts: Iterable[str | Mapping[str, Any]], model: str | None = None) -> WarmupReport:
    """Prefill and pin each prompt with `max_tokens: 0` through an anthropic-SDK client (Stratum or plain).

    Args:
        client: `stratum.client.Stratum` (or `anthropic.Anthropic`) pointed at the server.
        prompts: user-message strings, or dicts of `messages.create` arguments (`messages`, `system`, ...).
        model: the model, unless each prompt dict names one.
    Returns:
        A WarmupReport; a prompt the server refused is a failed result in it, never dropped.
    Raises:
        ValueError: no model for a prompt.
    """
    import anthropic

    results = []
    for p in prompts:
        kwargs = _prompt_kwargs(p, model)
        try:
            message = client.messages.create(**kwargs)
        except anthropic.APIError as e:
            results.append(_failure(e))
            continue
        results.append(_result(message))
    return _report(results)


async def awarmup(client, prompts: Iterable[str | Mapping[str, Any]], model: str | None = None) -> WarmupReport:
    """warmup() for `AsyncStratum` / `anthropic.AsyncAnthropic`; prompts are sent one after another."""
    import anthropic

    results = []
    for p in prompts:
        kwargs = _prompt_kwargs(p, model)
        try:
            message = await client.messages.create(**kwargs)
        except anthropic.APIError as e:
            results.append(_failure(e))
            continue
        results.append(_result(message))
    return _report(results)


def _result(message) -> WarmupResult:
    info = getattr(message, "stratum", None)
    return WarmupResult(200, _usage_of(message), info.header_cost if info is not None else None)
