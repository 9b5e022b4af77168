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
             "memory_used_mb": round(stats.kv_bytes_at_first_token / 2**20, 4)},
            {"name": "decode_loop", "duration_us": round(decode_s * 1e6), "tokens": decode_tokens,
             "kv_sparsity": cost.kv_sparsity, "kv_sparsity_samples": stats.num_kv_sparsity_samples,
             "tokens_per_second": round(decode_tokens / decode_s, 3) if decode_s > 0 else None},
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


def hardware_view(engine, cpu_seconds: float | None = None, wall_seconds: float | None = None) -> dict[str, Any]:
    """`X-Stratum-Debug: full`: threads, kernels, RSS, process CPU time, GPU memory and utilisation."""
    import psutil
    import torch

    proc = psutil.Process(os.getpid())
    view: dict[str, Any] = {
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "kernels": getattr(engine, "kernel_choices", {}),
        "rss_mb": round(proc.memory_info().rss / 2**20, 1),
        "engine_mode": engine.mode,
    }
    if cpu_seconds is not None:
        view["process_cpu_seconds"] = round(cpu_seconds, 4)
        if wall_seconds:
            view["cpu_utilization"] = round(cpu_seconds / wall_seconds / (os.cpu_count() or 1), 4)
    if engine.device.type == "cuda":
        view["gpu_name"] = torch.cuda.get_device_name(engine.device)
        view["gpu_memory_allocated_mb"] = round(torch.cuda.memory_allocated(engine.device) / 2**20, 1)
        view["gpu_memory_reserved_mb"] = round(torch.cuda.memory_reserved(engine.device) / 2**20, 1)
        try:
            view["gpu_utilization"] = torch.cuda.utilization(engine.device)
        except Exception as e:  # needs pynvml; say why it is missing instead of inventing it
            view["gpu_utilization"] = None
            view["gpu_utilization_error"] = type(e).__name__
    return view
