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


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first most likely token id, as torch.argmax gives it: by NumPy for CPU rows (for a
    [1, 49152] row ~5 us here, torch's ~50 us, every decode step), by torch elsewhere."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return logits.numpy().argmax(axis=-1).tolist()


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
    tokens = argmax_rows(logits)
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
            nucleus, order = _nucleus(probs, p.top_p)
            tokens[i] = int(order[_draw(nucleus, generators[i])])
            if p.logprobs is not None:
                probs = torch.zeros_like(probs).scatter_(-1, order, nucleus)
        else:
            tokens[i] = _draw(probs, generators[i])
        if p.logprobs is not None:
            logprobs[i] = _report(torch.log(probs / probs.sum()), tokens[i], p.logprobs)
    return Sampled(tokens, logprobs)


# The nucleus is looked for among this many most likely tokens first (a partial sort), and the whole
# vocabulary sorted only when their mass falls short of top_p: sorting 49,152 probabilities took 3.7 ms
# on one core, the top 1,024 0.4 ms.
NUCLEUS_CANDIDATES = 1024


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the probabilities of top_p's nucleus, most likely first, the rest zeroed; their token ids)."""
    values, order = probs.topk(min(NUCLEUS_CANDIDATES, len(probs)))
    cumulative = values.cumsum(-1)
    if cumulative[-1] <= top_p and len(values) < len(probs):  # the nucleus may reach past the candidates
        values, order = probs.sort(descending=True)
        cumulative = values.cumsum(-1)
    drop = cumulative - values > top_p  # keep the smallest set whose mass reaches top_p
    return values.masked_fill(drop, 0.0), order


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to probs (unnormalized, some zero), by inverse
    transform: the first whose cumulative mass exceeds a uniform draw. torch.multinomial took 0.9–1.0
    ms per draw over a 49,152-token vocabulary on one core, this 0.05 ms (scripts/perf/sampler_bench.py)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(1, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i < len(probs):
        return i
    return int(probs.nonzero()[-1])  # u rounded up to the whole mass: the last token that can be drawn


def _report(logprobs: torch.Tensor, token: int, top: int) -> Logprobs:
    def value(x: float) -> float:
        return x if x > EXCLUDED_LOGPROB else EXCLUDED_LOGPROB

    alternatives = []
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = [(int(t), value(float(v))) for t, v in zip(ids.tolist(), values.tolist())]
    return value(float(logprobs[token])), alternatives
