"""Token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed.

Greedy rows are one argmax over the batch. Sampled rows draw from their own torch.Generator when
the request has a seed, so the result does not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from stratum.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Args:
        logits: [N, V] fp32, one row per sequence that samples this step.
    Returns:
        N token ids.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
