"""X-Stratum-Context-Mode: compressive. A long prompt's longest user message is cut into chunks that
the same engine summarises in-process (all chunks batched together); the answer is then generated
from the summaries, and the trace reports the ratio."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratum.engine.sampling_params import SamplingParams
from stratum.server.budget import Reservation
from stratum.server.usage import usage_of

if TYPE_CHECKING:
    from stratum.engine.client import EngineClient

SUMMARY_INSTRUCTION = "Summarize the user's text in two or three sentences. Keep names, numbers and facts."


@dataclass(frozen=True, slots=True)
class CompressionSettings:
    threshold_tokens: int = 1024  # prompts up to this long are left alone
    chunk_tokens: int = 384  # the longest user message is summarised in chunks of this many tokens
    summary_tokens: int = 64  # max_tokens of each chunk's summary (greedy)


async def compress(engine: EngineClient, settings: CompressionSettings, messages: list[dict[str, Any]],
                   request_id: str, priority: int, cache_salt: str | None,
                   reservation: Reservation) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages with the longest user message summarised, when the prompt is long (tokenizer work
    in worker threads); the summaries run at the request's priority and cache salt, their upper bound
    reserved in the request's `reservation` and their measured cost charged to it.

    Returns:
        (the messages to answer, the trace's `compression` report).
    Raises:
        RateLimited: the summaries' upper bound of cost does not fit in the tenant's budget.
    """
    template, tokenizer = engine.chat_template, engine.tokenizer
    original = len(await asyncio.to_thread(template.encode, messages))
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if original <= settings.threshold_tokens or not users:
        return messages, {"applied": False, "original_prompt_tokens": original,
                          "threshold_tokens": settings.threshold_tokens}
    target = max(users, key=lambda i: len(messages[i]["content"]))
    ids = await asyncio.to_thread(tokenizer.encode, messages[target]["content"])
    size = settings.chunk_tokens

    def summary_prompts() -> list[list[int]]:  # tokenizer work, off the event loop like the rest
        return [template.encode([{"role": "system", "content": SUMMARY_INSTRUCTION},
                                 {"role": "user", "content": tokenizer.decode(ids[i : i + size])}])
                for i in range(0, len(ids), size)]

    prompts = await asyncio.to_thread(summary_prompts)
    params = SamplingParams(max_tokens=settings.summary_tokens, temperature=0.0)
    reservation.reserve(sum(len(p) for p in prompts), len(prompts) * params.max_tokens, "its compression")

    async def summarise(i: int, prompt: list[int]) -> str:
        text = ""
        stream = engine.submit(prompt, params, request_id=f"{request_id}-summary-{i}", priority=priority,
                               cache_salt=cache_salt)
        try:
            async for out in stream:
                text = out.text
                if out.finished:
                    if out.stats is not None:
                        reservation.charge(usage_of(out))
                    break
        finally:
            await stream.close()
        return text.strip()

    summaries = await asyncio.gather(*(summarise(i, p) for i, p in enumerate(prompts)))
    compressed = [dict(m) for m in messages]
    compressed[target]["content"] = "Summary of the provided text, part by part:\n" + "\n".join(
        f"{i + 1}. {s}" for i, s in enumerate(summaries))
    after = len(await asyncio.to_thread(template.encode, compressed))
    return compressed, {"applied": True, "original_prompt_tokens": original, "compressed_prompt_tokens": after,
                        "ratio": round(after / original, 4), "chunks": len(prompts)}
