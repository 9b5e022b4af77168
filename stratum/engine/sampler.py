"""Token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed, a grammar
mask and log-probabilities.

Greedy rows are one argmax over the batch. Sampled rows draw from their own torch.Generator when
the request has a seed, so the result does not depend on what else shares the batch. A row with a
grammar mask samples only the tokens its grammar accepts. Log-probabilities come from the exact
distribution a token was drawn from: after the mask, temperature, top-k and top-p for a sampled
row; the (masked) model distribution for a greedy one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stratum.engine.sampling_params import SamplingParams

# What a token the distribution excludes reports as its log-probability: JSON has no -inf (vLLM's convention).
EXCLUDED_LOGPROB = -9999.0

# One sampled token's log-probability and the distribution's top alternatives, [(token id, logprob), ...]
Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[Logprobs | None] = field(default_factory=list)  # per row; None where not asked for


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           allowed: dict[int, torch.Tensor] | None = None) -> Sampled:
    """Args:
        logits: [N, V] fp32, one row per sequence that samples this step (modified in place by masks).
        allowed: row -> [V] bool, the tokens a grammar accepts there.
    Returns:
        N token ids, and each row's log-probabilities where its params ask for them.
    """
    for i, mask in (allowed or {}).items():
        logits[i].masked_fill_(~mask, float("-inf"))
    tokens = logits.argmax(dim=-1).tolist()
    logprobs: list[Logprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.is_greedy:
            if p.logprobs is not None:
                logprobs[i] = _report(torch.log_softmax(logits[i], dim=-1), tokens[i], p.logprobs)
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
        if p.logprobs is not None:
            logprobs[i] = _report(torch.log(probs / probs.sum()), tokens[i], p.logprobs)
    return Sampled(tokens, logprobs)


def _report(logprobs: torch.Tensor, token: int, top: int) -> Logprobs:
    def value(x: float) -> float:
        return x if x > EXCLUDED_LOGPROB else EXCLUDED_LOGPROB

    alternatives = []
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = [(int(t), value(float(v))) for t, v in zip(ids.tolist(), values.tolist())]
    return value(float(logprobs[token])), alternatives
