"""Per-request sampling parameters, validated when the request is admitted."""

from __future__ import annotations

from dataclasses import dataclass


# Temperatures below this sample as greedy: dividing logits by them overflows to inf/nan.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's limit


class InvalidRequestError(ValueError):
    """A request's parameters are out of range; the message names the field and the limit."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request; frozen: a changed copy is `dataclasses.replace(params, ...)`.

    temperature 0 is greedy. top_k 0 and top_p 1.0 disable those filters. max_tokens 0 prefills
    only (the prompt is computed and cached, nothing is sampled). `seed` makes sampling
    reproducible per request, independent of what else is batched with it. `grammar` restricts
    every sampled token to what the grammar accepts, and the request stops when the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logits: bool = False  # keep the fp32 logits of every prompt position and sampled token (tests)
    logprobs: int | None = None  # report each sampled token's log-probability and this many top alternatives
    # score every prompt token (and this many alternatives); the prompt is recomputed
    prompt_logprobs: int | None = None
    grammar: str | None = None  # an llguidance grammar the output must follow (see stratum.engine.grammar)

    def __post_init__(self) -> None:
        # lists are accepted (and arrive from the engine protocol's codec), kept as tuples: nothing can change them
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raises InvalidRequestError for any out-of-range field."""
        if self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"prompt logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop sequences must be non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1
