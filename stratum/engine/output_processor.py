"""The engine's output side: each step's kept tokens become what clients see.

It owns every request's output state (`OutputState`): the detokenizer and the stop rules, the
grammar's completion, the meta-state, the times and the log-probabilities. The core hands it each
token a step kept (`take`) and applies what it answers (`Taken`: a stop, a tool call begun) to the
scheduler; everything a client reads of a request (`RequestOutput`, `RequestStats`) is assembled here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from stratum.engine.detokenizer import Detokenizer
from stratum.engine.outputs import MetaState, RequestOutput, RequestStats
from stratum.engine.request import Sequence
from stratum.engine.scheduler import ScheduledSeq
from stratum.models.tokenizer import TextTokenizer

log = logging.getLogger("stratum.engine")

# KV room reserved for a tool call's arguments once the model begins one (`Taken.num_reserve_tokens`)
TOOL_RESERVE_TOKENS = 128


@dataclass(slots=True)
class OutputState:
    """One request's output side, from `add` to its last output."""

    seq: Sequence
    detok: Detokenizer
    stop_ids: frozenset[int]  # tokens that end it (the model's end-of-sequence ones unless ignore_eos)
    tool_marker: str | None  # text that begins a tool call: seen in the output -> TOOL_USE_PREPARED
    arrival_time: float
    state: MetaState = MetaState.QUEUED
    state_index: int = 0
    num_prefill_chunks: int = 0
    prefill_done_time: float | None = None  # the step that computed the last prompt token ended
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    kv_bytes_at_first_token: int = 0
    is_tool_prepared: bool = False
    logprobs: list = field(default_factory=list)  # per output token, with sampling.logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


class Taken(NamedTuple):
    """What the core does after `take`: advance the scheduler over every kept token after the first,
    hold KV ahead for a tool call's arguments, then finish the request if a stop rule said so."""

    num_kept: int  # tokens appended (those after a stop are dropped)
    finish_reason: str | None  # "stop" | "length", or None while it goes on
    num_reserve_tokens: int = 0  # a tool call began: positions past the next one to hold blocks for


class OutputProcessor:
    """Args:
        tokenizer: the model's, for incremental text.
        eos_token_ids: the model's end-of-sequence tokens.
        block_size: the KV pool's, for a request's KV efficiency.
        kv_bytes_per_block: the KV pool's bytes per block (it changes with a kernel switch).
        mode: the engine's mode now ("normal" or "basic"), stamped on each output.
        speculation: a request's speculation figures (`Speculator.counts`): proposed, accepted, steps.
    """

    def __init__(self, tokenizer: TextTokenizer, eos_token_ids: tuple[int, ...], block_size: int,
                 kv_bytes_per_block: Callable[[], int], mode: Callable[[], str],
                 speculation: Callable[[str], tuple[int, int, int]]):
        self.speculation = speculation
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size = block_size
        self.kv_bytes_per_block = kv_bytes_per_block
        self.mode = mode
        self.states: dict[str, OutputState] = {}

    def add(self, seq: Sequence, tool_marker: str | None) -> None:
        sampling = seq.sampling
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        detok = Detokenizer(self.tokenizer, list(sampling.stop), sampling.skip_special_tokens)
        self.states[seq.request_id] = OutputState(seq, detok, stop_ids, tool_marker, time.perf_counter())

    def scheduled(self, item: ScheduledSeq, now: float) -> None:
        """The step ran item: a prompt chunk is counted, the end of the prompt is timed."""
        seq, state = item.seq, self.states[item.seq.request_id]
        if item.start < seq.num_prompt_tokens:
            state.num_prefill_chunks += 1
            state.state, state.state_index = MetaState.PREFILL_CHUNK, state.num_prefill_chunks
        if state.prefill_done_time is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
            state.prefill_done_time = now

    def prefilled(self, seq: Sequence) -> None:
        """A prefill-only request (max_tokens 0) computed its prompt: it ends without a token."""
        state = self.states[seq.request_id]
        state.state = MetaState.PREFILL_COMPLETE
        state.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block()

    def take(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> Taken:
        """Append a step's kept tokens to seq one at a time, each through the stop rules, the grammar
        and the meta-state as a decode's token; tokens after a stop are dropped."""
        state = self.states[seq.request_id]
        reserve = 0
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if state.first_token_time is None:
                state.first_token_time = now
                state.state = MetaState.PREFILL_COMPLETE
                state.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block()
            else:
                state.state, state.state_index = MetaState.DECODE_STEP, seq.num_output_tokens
            seq.token_ids.append(token)
            state.token_times.append(now)
            if lp is not None:
                state.logprobs.append(lp)
            reason = self._stop(state, token)
            if reason is None and seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if (reason is None and state.tool_marker is not None and not state.is_tool_prepared
                    and state.tool_marker in state.detok.text):
                state.state, state.is_tool_prepared = MetaState.TOOL_USE_PREPARED, True
                reserve = min(seq.sampling.max_tokens - seq.num_output_tokens, TOOL_RESERVE_TOKENS)
            if reason is not None:
                return Taken(i + 1, reason)
        return Taken(len(tokens), None, reserve)

    def _stop(self, state: OutputState, token: int) -> str | None:
        """"stop" when token ends the request: a stop token, a stop string completed, or a grammar
        complete (or, a bug, rejecting a token its own mask offered)."""
        if token in state.stop_ids:
            state.stop_reason = token
            return "stop"
        state.detok.add(token)
        if state.detok.stop_hit is not None:
            state.stop_reason = state.detok.stop_hit
            return "stop"
        matcher = state.seq.sampler.matcher
        if matcher is not None:
            if not matcher.consume_token(token):
                log.error("%s: grammar rejected a sampled token: %s", state.seq.request_id, matcher.get_error())
                return "stop"
            if matcher.is_stopped():
                return "stop"
        return None

    def output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        """A running request's output for this step's new tokens."""
        return self._output(self.states[seq.request_id], new_ids, False, seq.kv_cache_efficiency(self.block_size))

    def finish(self, seq: Sequence, reason: str, new_ids: list[int], efficiency: float) -> RequestOutput:
        """The request's last output; its state is let go.

        Args:
            efficiency: its KV efficiency while it still held its blocks.
        """
        state = self.states.pop(seq.request_id)
        state.finish_reason = reason
        state.finish_time = time.perf_counter()
        state.detok.flush()
        out = self._output(state, new_ids, True, efficiency)
        state.state = MetaState.FINISHED
        return out

    def _output(self, state: OutputState, new_ids: list[int], finished: bool, efficiency: float) -> RequestOutput:
        seq = state.seq
        first = len(new_ids) == seq.num_output_tokens  # the first output with tokens: what TTFT usage reads
        delta_logprobs = None
        if seq.sampling.logprobs is not None:
            delta_logprobs = state.logprobs[len(state.logprobs) - len(new_ids):] if new_ids else []
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=state.detok.take_delta(finished),
            delta_token_ids=new_ids,
            delta_logprobs=delta_logprobs,
            logprobs=list(state.logprobs) if finished and delta_logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(seq) if finished or first else None,
            text=state.detok.text,
            token_ids=seq.output_token_ids,
            finished=finished,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            stats=self.stats(state) if finished or first else None,
            state=state.state,
            state_index=state.state_index,
            kv_cache_efficiency=efficiency,
            mode=self.mode(),
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list | None:
        """Per prompt token its (logprob, top) given the tokens before it; None for the first token."""
        if seq.sampling.prompt_logprobs is None:
            return None
        return [seq.readouts.prompt_logprobs.get(p) for p in range(seq.num_prompt_tokens)]

    def stats(self, state: OutputState) -> RequestStats:
        seq, cache = state.seq, state.seq.cache_stats
        proposed, accepted, steps = self.speculation(seq.request_id)
        return RequestStats(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(0, seq.num_cached_tokens),
            num_prompt_tokens_computed=cache.num_prompt_tokens_computed,
            num_cache_written_tokens=cache.num_cache_written_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_disk_cached_tokens=cache.num_disk_cached_tokens,
            disk_read_s=cache.disk_read_s,
            num_preemptions=seq.num_preemptions,
            arrival_time=state.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=state.first_token_time,
            prefill_done_time=state.prefill_done_time,
            finish_time=state.finish_time,
            token_times=list(state.token_times),
            kv_sparsity=seq.readouts.kv_sparsity,
            num_kv_sparsity_samples=seq.readouts.coverage_count,
            num_prefill_chunks=state.num_prefill_chunks,
            kv_bytes_at_first_token=state.kv_bytes_at_first_token,
            num_tool_reserved_tokens=seq.num_reserved_tokens,
            num_spec_proposed_tokens=proposed,
            num_spec_accepted_tokens=accepted,
            num_spec_steps=steps,
        )
