"""The debug trace (`x-stratum-trace`): base64 of a JSON document built from measured figures."""

from __future__ import annotations

import base64
import binascii
import json
import os
import uuid
from typing import TYPE_CHECKING, Any

from stratum.telemetry.cost import CostFields, PricingModel

if TYPE_CHECKING:  # importable without torch: the client decodes traces with this module
    from stratum.engine import RequestStats

TRACE_VERSION = "1"


def build_trace(stats: "RequestStats", cost: CostFields, usage: dict[str, int], pricing: PricingModel,
                extra: dict[str, Any] | None = None, hardware: dict[str, Any] | None = None) -> dict[str, Any]:
    """Steps: queue, prefill, decode_loop; final_cost_estimate from the reported fields only."""
    queue_us = round((stats.queue_s or 0.0) * 1e6)
    decode_s = (stats.finish_time - stats.first_token_time) if stats.first_token_time and stats.finish_time else 0.0
    decode_tokens = max(0, stats.num_output_tokens - 1)
    doc: dict[str, Any] = {
        "version": TRACE_VERSION,
        "trace_id": "trace_" + uuid.uuid4().hex[:16],
        "steps": [
            {"name": "queue", "duration_us": queue_us},
            {"name": "prefill", "duration_us": cost.prefill_latency_us, "cache_hit": cost.cache_hit_ratio > 0,
             "cache_hit_ratio": cost.cache_hit_ratio, "cached_tokens": stats.num_cached_tokens,
             "computed_tokens": stats.num_prompt_tokens_computed, "chunks": stats.num_prefill_chunks,
             "tiers": {"pool": stats.num_cached_tokens - stats.num_disk_cached_tokens,
                       "disk": stats.num_disk_cached_tokens},
             "disk_read_us": round(stats.disk_read_s * 1e6),
             "memory_used_mb": round(stats.kv_bytes_at_first_token / 2**20, 4)},
            {"name": "decode_loop", "duration_us": round(decode_s * 1e6), "tokens": decode_tokens,
             "kv_sparsity": cost.kv_sparsity, "kv_sparsity_samples": stats.num_kv_sparsity_samples,
             "tokens_per_second": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
             "speculative": speculative_view(stats), "inter_token": gaps_view(stats.token_times),
             "thinking": {"tokens": stats.num_reasoning_tokens, "ended_by_budget": stats.is_reasoning_cut}},
        ],
        "cost": cost.as_dict(),
        "usage": usage,
        "pricing": pricing.describe(),
        "final_cost_estimate": round(pricing.price(cost, usage), 10),
    }
    if extra:
        doc.update(extra)
    if hardware is not None:
        doc["hardware"] = hardware
    return doc


def speculative_view(stats: "RequestStats") -> dict[str, Any]:
    """The request's speculative decoding: tokens proposed, accepted, and the verify steps they took
    (docs/telemetry.md)."""
    proposed, accepted, steps = stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens, stats.num_spec_steps
    return {"proposed_tokens": proposed, "accepted_tokens": accepted, "verify_steps": steps,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "tokens_per_verify_step": round((accepted + steps) / steps, 3) if steps else None}


def gaps_view(token_times: list[float]) -> dict[str, Any]:
    """The gaps between the request's consecutive output tokens (the `stratum_inter_token_latency_seconds`
    histogram observes the same ones): how many, the longest, p99 (nearest rank) and the mean, in ms."""
    gaps = sorted(b - a for a, b in zip(token_times, token_times[1:]))
    if not gaps:
        return {"gaps": 0, "max_ms": None, "p99_ms": None, "mean_ms": None}
    p99 = gaps[min(len(gaps) - 1, max(0, -(-99 * len(gaps) // 100) - 1))]
    return {"gaps": len(gaps), "max_ms": round(gaps[-1] * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
            "mean_ms": round(sum(gaps) / len(gaps) * 1e3, 3)}


def encode_trace(doc: dict[str, Any]) -> str:
    return base64.b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()


def decode_trace(value: str) -> dict[str, Any]:
    """Raises ValueError when value is not base64 of a JSON object."""
    try:
        doc = json.loads(base64.b64decode(value.strip(), validate=True))
    except (binascii.Error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"not a Stratum trace: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a Stratum trace: not a JSON object")
    return doc


def hardware_view(info, snapshot, cpu_seconds: float | None = None,
                  wall_seconds: float | None = None) -> dict[str, Any]:
    """`X-Stratum-Debug: full`: the engine's threads, kernels, memory and mode (from its last published
    snapshot), and the CPU time this request's handling took.

    Args:
        info: the engine's EngineInfo; snapshot: its latest EngineSnapshot.
    """
    config = info.config
    view: dict[str, Any] = {
        "device": config.device,
        "dtype": config.dtype,
        "threads": snapshot.threads,
        "kernels": info.kernel_choices,
        "rss_mb": snapshot.rss_mb,
        "engine_mode": snapshot.mode,
    }
    if cpu_seconds is not None:
        view["process_cpu_seconds"] = round(cpu_seconds, 4)
        if wall_seconds:
            view["cpu_utilization"] = round(cpu_seconds / wall_seconds / (os.cpu_count() or 1), 4)
    if snapshot.gpu_memory_allocated_mb is not None:
        view["gpu_memory_allocated_mb"] = snapshot.gpu_memory_allocated_mb
    return view
