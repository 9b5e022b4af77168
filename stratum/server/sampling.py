"""A request's `SamplingParams`: what it asked for over the server's defaults (applied here and only
here), then fitted to its prompt and the context, each change a `replace` of the frozen params."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stratum.engine.config import ResolvedConfig
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.server.chat import Prompt
from stratum.server.errors import InvalidRequest

if TYPE_CHECKING:
    from stratum.engine.client import EngineClient

# A request without max_tokens (OpenAI's APIs, where it is optional) may generate up to the end of the
# context, as OpenAI's do: this stands for "no bound but the context", and `default_max_to_context`
# lowers it to what the prompt leaves.
TO_CONTEXT = 2**31 - 1
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a request the context cannot hold


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that omits a field gets: the model's recommended temperature and top_p; a
    `max_tokens` the API lets it omit is the context's room (`TO_CONTEXT`)."""

    temperature: float = 1.0  # Anthropic's default when a request omits it
    top_p: float = 1.0

    def apply(self, *, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
              top_k: int | None = None, stop: str | list[str] | None = None, seed: int | None = None,
              ignore_eos: bool = False, logprobs: int | None = None,
              prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's fields as sent (None: omitted) over these defaults."""
        return SamplingParams(
            max_tokens=TO_CONTEXT if max_tokens is None else max_tokens,
            temperature=self.temperature if temperature is None else temperature,
            top_p=top_p or self.top_p, top_k=top_k or 0,
            stop=[stop] if isinstance(stop, str) else list(stop or ()), seed=seed, ignore_eos=ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def defaults_of(engine: "EngineClient") -> SamplingDefaults:
    """The sampling defaults of the model an engine serves (its registered settings, else Anthropic's)."""
    return SamplingDefaults(temperature=engine.config.default_temperature, top_p=engine.config.default_top_p)


def for_prompt(sampling: SamplingParams, prompt: Prompt) -> SamplingParams:
    """The prompt's grammar; with tools, a stop at the end of a tool call when the answer may make only
    one, and the tool-call markers that are special tokens (Mistral's [TOOL_CALLS]) kept in the text, to
    be read."""
    changes: dict = {"grammar": prompt.grammar}
    stop = prompt.tool_format.stop
    if prompt.tool_names and not prompt.parallel_calls and stop is not None and stop not in sampling.stop:
        changes["stop"] = (*sampling.stop, stop)
    if prompt.tool_names and prompt.tool_format.special_tokens:
        changes["skip_special_tokens"] = False
    return replace(sampling, **changes)


def default_max_to_context(sampling: SamplingParams, config: ResolvedConfig, longest_prompt: int) -> SamplingParams:
    """A max_tokens the client did not send is what the context leaves (at least 1), and what one
    sequence's KV pool leaves where that is less (a cold start's pool)."""
    limit = min(config.max_model_len, config.num_kv_blocks * config.block_size)
    return replace(sampling, max_tokens=max(1, min(sampling.max_tokens, limit - longest_prompt)))


def fit_to_context(sampling: SamplingParams, config: ResolvedConfig,
                   num_prompt_tokens: int) -> tuple[SamplingParams, bool]:
    """The Messages API's rule: a prompt longer than the context is a 400 naming both counts, in
    Anthropic's words; a max_tokens beyond what the context leaves is lowered to it, and an answer
    that fills the context then ends with stop_reason model_context_window_exceeded.

    Returns:
        (the params, whether max_tokens was lowered).
    Raises:
        InvalidRequest: the prompt leaves no room in the context, or in what one sequence's KV pool holds.
    """
    limit = config.max_model_len
    if num_prompt_tokens > limit:
        raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens > {limit} maximum")
    room = limit - num_prompt_tokens
    if sampling.max_tokens > room and room == 0:
        raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens leave no room for output in the "
                             f"{limit}-token context")
    # one sequence holds at most the KV pool, which may be smaller than the context (a cold start's
    # PyTorch step; a pool sized by memory): a prompt it cannot hold with one token more is refused in
    # the same words, naming the pool, not the context it fits (the engine's check would name that)
    pool = config.num_kv_blocks * config.block_size
    if num_prompt_tokens >= pool:
        raise InvalidRequest(f"prompt is too long: {num_prompt_tokens} tokens > {pool - 1} maximum "
                             f"(one sequence's KV pool "
                             f"holds {pool} tokens here, fewer than the {limit}-token context)")
    room = min(room, pool - num_prompt_tokens)
    if sampling.max_tokens > room > 0:
        return replace(sampling, max_tokens=room), True
    return sampling, False


@dataclass(frozen=True, slots=True)
class OpenAILimit:
    """How an OpenAI route names what fills a context: the field holding the prompt (`messages`, `prompt`,
    `input`) and the output limit's field as the request sent it (None when it sent none)."""

    prompt_field: str
    output_field: str | None


def check_openai_context(sampling: SamplingParams, config: ResolvedConfig, num_prompt_tokens: int,
                         limit: OpenAILimit) -> None:
    """OpenAI's context rule, in OpenAI's words (litellm and the clients that compact or trim on a context
    overflow read them, with `code` context_length_exceeded): a prompt the context cannot hold with one token
    more names the prompt's field; a prompt and an output limit the client sent that do not fit together
    name the output limit's field, under the name the client used. A limit it did not send is never named
    (`default_max_to_context` fitted it).

    Raises:
        InvalidRequest: the request does not fit in the context.
    """
    size, noun = config.max_model_len, limit.prompt_field
    if num_prompt_tokens >= size:
        raise InvalidRequest(f"This model's maximum context length is {size} tokens. However, your {noun} resulted "
                             f"in {num_prompt_tokens} tokens. Please reduce the length of the {noun}.",
                             param=noun, code=CONTEXT_LENGTH_EXCEEDED)
    total = num_prompt_tokens + sampling.max_tokens
    if limit.output_field is not None and total > size:
        raise InvalidRequest(f"This model's maximum context length is {size} tokens. However, you requested {total} "
                             f"tokens ({num_prompt_tokens} in the {noun}, {sampling.max_tokens} in the completion). "
                             f"Please reduce the length of the {noun} or completion.",
                             param=limit.output_field, code=CONTEXT_LENGTH_EXCEEDED)


def check(engine: EngineClient, prompts: list[list[int]], sampling: SamplingParams) -> None:
    """Raises InvalidRequest (400) when one of the prompts can never run with these params on this engine."""
    try:
        for ids in prompts:
            engine.check_request(len(ids), sampling)
    except InvalidRequestError as e:
        raise InvalidRequest(str(e)) from None


def check_output_limit(max_tokens: int, config: ResolvedConfig, model: str) -> None:
    """Anthropic's rule: a max_tokens above the model's maximum output (here the whole context, all a
    sequence can hold) is a 400 naming both numbers, in Anthropic's words (Claude Code reads them, and
    asks again with the maximum). A max_tokens within it but beyond what the prompt leaves is served
    (`fit_to_context`).

    Raises:
        InvalidRequest: max_tokens is above the context length.
    """
    limit = config.max_model_len
    if max_tokens > limit:
        raise InvalidRequest(f"max_tokens: {max_tokens} > {limit}, which is the maximum allowed number of output "
                             f"tokens for {model}")
