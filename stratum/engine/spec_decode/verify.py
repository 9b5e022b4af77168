"""Verification: which of a request's proposed tokens the target model accepts, from the logits of
the rows that computed them in one forward.

Row i of a verifying request computed the input at position start + i (its last token, then the
proposals d1..dk) and predicts the token after it. The target's own token is sampled from row i
exactly as a plain decode samples it (`sampler.sample`: the grammar's mask, temperature, top-k,
top-p, the request's generator); while it equals d(i+1), d(i+1) is accepted and row i+1 is read next.
The first token that differs, or the token after the last proposal, ends the step. So a step yields
1 + (accepted proposals) tokens, each drawn from the distribution plain decoding draws it from.

This is speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", Algorithm 2) for proposals that are single tokens, a draft distribution
q that is a point mass at d: there d is accepted with probability min(1, p(d) / q(d)) = p(d), and a
rejection resamples from norm(max(0, p - q)) = p without d. Drawing x ~ p and accepting d when x = d
does both in one draw: P(x = d) = p(d), and given x != d, x is distributed as p without d. It takes
one draw per output token, as plain decoding does, so a seeded request's answer is the same with or
without speculation (and greedy, the same argmax). Prompt lookup proposes such tokens, and so does the
draft model here (its most likely token, as llama.cpp's draft does).
"""

from __future__ import annotations

import torch

from stratum.engine import grammar
from stratum.engine.sampler import Logprobs, argmax_rows, sample


def verify(rows: torch.Tensor, seq, proposals: list[int], grammars) -> tuple[list[int], list[Logprobs | None]]:
    """The tokens one request keeps from a verify step.

    Args:
        rows: [len(proposals) + 1, V] fp32 logits, row i computed at position seq.num_computed_tokens + i.
        seq: the request (its sampling, generator and grammar matcher, at the state before the step;
            the matcher is left in that state).
        proposals: d1..dk.
        grammars: the engine's GrammarCompiler (wind-down closers), for constrained requests.
    Returns:
        (the accepted proposals followed by the target's next token; each one's log-probabilities,
        None where the request does not ask for them).
    """
    params = seq.sampling
    if seq.sampler.matcher is None and params.is_greedy and params.logprobs is None:
        target = argmax_rows(rows)  # the argmax each row's own decode would take
        n = 0
        while n < len(proposals) and target[n] == proposals[n]:
            n += 1
        return target[: n + 1], [None] * (n + 1)
    tokens: list[int] = []
    logprobs: list[Logprobs | None] = []
    consumed = 0
    try:
        for i in range(len(proposals) + 1):
            allowed = None
            if seq.sampler.matcher is not None:
                mask = _mask(seq, seq.num_output_tokens + i, grammars, rows.shape[-1])
                if i and not bool(mask.any()):  # the grammar ended with the last accepted proposal
                    break
                allowed = {0: mask}
            out = sample(rows[i : i + 1].clone(), [params], [seq.sampler.generator], allowed)
            tokens.append(out.tokens[0])
            logprobs.append(out.logprobs[0])
            if i == len(proposals) or out.tokens[0] != proposals[i]:
                break
            if seq.sampler.matcher is not None:
                if not seq.sampler.matcher.consume_token(proposals[i]):
                    break
                consumed += 1
    finally:
        if consumed:  # the engine consumes the kept tokens itself, one by one, as for a decode
            seq.sampler.matcher.rollback(consumed)
    return tokens, logprobs


def _mask(seq, num_output_tokens: int, grammars, vocab_size: int) -> torch.Tensor:
    """The tokens the grammar allows next, steered to close what is open near max_tokens, as the
    model runner computes them for a decode with num_output_tokens generated."""
    mask = grammar.allowed_tokens([seq.sampler.matcher], vocab_size)[0]
    if (seq.sampling.max_tokens - num_output_tokens <= grammar.WIND_DOWN_TOKENS
            and not seq.sampler.matcher.is_accepting()):
        mask = grammar.wind_down(mask, grammars.closers)
    return mask
