"""Rotary position embeddings in the rotate-half convention, with the checkpoint's frequency scaling
(Llama 3's, stored factors) or the one a user asks to extend the context (linear, YaRN)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], after the checkpoint's RoPE scaling.

    The "llama3" rule follows Meta's reference `apply_scaling` (llama-models, Llama 3.1): wavelengths
    longer than original_max / low_freq_factor are divided by `factor`, shorter than
    original_max / high_freq_factor are kept, and the band between is interpolated smoothly.
    "yarn" is YaRN's "NTK-by-parts" (Peng et al. 2023, arXiv:2309.00071, sec. 3.2): a frequency that
    turns more than beta_fast (32) times over the original context is kept, one that turns less than
    beta_slow (1) times is divided by `factor`, and the dimensions between are blended linearly.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = _kind(scaling)
    if kind == "freq_factors":  # per-frequency divisors stored in the checkpoint (GGUF rope_freqs)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "yarn":
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq.float()


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings", 8192))
    fast, slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):  # whole dimensions, as the paper's code has it (a checkpoint may say otherwise)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _kind(scaling: dict[str, Any] | None) -> str | None:
    """The scaling's name: transformers' `rope_type`, or the older `type` key."""
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's scale of q and k (so of the attention logits, squared): 0.1 ln(factor) + 1 (the paper's
    eq. 22, for sqrt(1/t)), unless the checkpoint gives its own; 1 for every other scaling."""
    if _kind(scaling) != "yarn":
        return 1.0
    return float(scaling.get("attention_factor") or 0.1 * math.log(float(scaling["factor"])) + 1.0)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table for every position up to `max_positions` (scaled by YaRN's attention
    factor where it applies, so every path that reads the tables, the native step's too, applies it)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        scale = attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for this step's tokens, [T, 1, head_dim / 2]; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, head_dim], computed in fp32."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
