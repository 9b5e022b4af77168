"""A request's figures from its engine outputs: Anthropic's usage (`usage_of`), which pricing and the
budget read too, and one output standing for the n choices of a request (`merge`)."""

from __future__ import annotations

from dataclasses import replace

from stratum.engine.outputs import RequestOutput, RequestStats


def usage_of(out: RequestOutput, breakpoint: int = 0) -> dict[str, int]:
    """Anthropic's usage: cache reads are the prompt tokens the prefix cache served; cache writes are
    the tokens up to the request's last cache_control breakpoint (a warm-up or aggressive mode marks the
    whole prompt) that it wrote to the cache (they are pinned now); input_tokens is the rest. Automatic
    caching of unmarked prompts is not a cache write here (`stratum_cost.cache_written_tokens` reports it)."""
    s = out.stats
    written_end = s.num_cached_tokens + s.num_cache_written_tokens  # full blocks this request cached
    created = max(0, min(breakpoint, written_end) - s.num_cached_tokens)
    return {
        "input_tokens": s.num_prompt_tokens - s.num_cached_tokens - created,
        "output_tokens": s.num_output_tokens,
        "cache_read_input_tokens": s.num_cached_tokens,
        "cache_creation_input_tokens": created,
    }


def merge(outs: list[RequestOutput], n: int = 1) -> RequestOutput:
    """One output standing for the choices of a request (n samples of each of its prompts), for usage
    and telemetry: each prompt counted once (as its first sample read it), the work and the output
    tokens of all of them."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    stats = [o.stats for o in outs]
    s0 = stats[0]
    merged = RequestStats(
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats[::n]),
        num_cached_tokens=sum(s.num_cached_tokens for s in stats[::n]),
        num_prompt_tokens_computed=sum(s.num_prompt_tokens_computed for s in stats),
        num_cache_written_tokens=sum(s.num_cache_written_tokens for s in stats),
        num_output_tokens=sum(s.num_output_tokens for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats), arrival_time=min(s.arrival_time for s in stats),
        first_scheduled_time=min((s.first_scheduled_time for s in stats if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in stats if s.first_token_time), default=None),
        prefill_done_time=max((s.prefill_done_time for s in stats if s.prefill_done_time), default=None),
        finish_time=max((s.finish_time for s in stats if s.finish_time), default=None),
        token_times=sorted(t for s in stats for t in s.token_times), kv_sparsity=s0.kv_sparsity,
        num_kv_sparsity_samples=s0.num_kv_sparsity_samples, num_prefill_chunks=s0.num_prefill_chunks,
        kv_bytes_at_first_token=sum(s.kv_bytes_at_first_token for s in stats),
        num_tool_reserved_tokens=sum(s.num_tool_reserved_tokens for s in stats),
        num_disk_cached_tokens=sum(s.num_disk_cached_tokens for s in stats[::n]),
        num_reasoning_tokens=sum(s.num_reasoning_tokens for s in stats),
        is_reasoning_cut=any(s.is_reasoning_cut for s in stats),
        disk_read_s=max(s.disk_read_s for s in stats))
    return replace(first, stats=merged, kv_cache_efficiency=sum(o.kv_cache_efficiency for o in outs) / len(outs))
