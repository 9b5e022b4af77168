"""The engine's output side: each step's kept tokens become what clients see.

It owns every request's output state (`OutputState`): the detokenizer, the thought told from the
answer (`reasoning.ThoughtSplitter`) and its budget, the stop rules, the grammar's completion, the
meta-state, the times and the log-probabilities. The core hands it each token a step kept (`take`)
and applies what it answers (`Taken`: a stop, a tool call begun) to the scheduler; everything a
client reads of a request (`RequestOutput`, `RequestStats`) is assembled here.

    token -> Detokenizer -> text -> ThoughtSplitter -> thought (the reasoning channel)
                                                    -> answer -> StopStrings -> the text channel
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from stratum.engine.detokenizer import Detokenizer, StopStrings
from stratum.engine.outputs import MetaState, RequestOutput, RequestStats
from stratum.engine.reasoning import Phase, Reasoning, ThoughtSplitter
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
    answer: StopStrings  # the answer's text, cut at a stop string
    stop_ids: frozenset[int]  # tokens that end it (the model's end-of-sequence ones unless ignore_eos)
    tool_marker: str | None  # text that begins a tool call: seen in the answer -> TOOL_USE_PREPARED
    arrival_time: float
    reasoning: Reasoning | None = None
    splitter: ThoughtSplitter | None = None  # with reasoning: the thought told from the answer
    thought: str = ""  # the thought so far, as released
    thought_emitted: int = 0  # characters of `thought` already in an output
    num_thought_tokens: int = 0
    is_thought_cut: bool = False  # the budget ended the thought (the engine wrote its end marker)
    deferred_matcher: object = None  # a grammar for the answer, attached once the thought is over
    answer_from: int = 0  # the first output token of the answer (the grammar consumes from there)
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

    @property
    def is_thinking(self) -> bool:
        return self.splitter is not None and self.splitter.phase is Phase.THINKING


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

    def add(self, seq: Sequence, tool_marker: str | None, reasoning: Reasoning | None = None) -> None:
        """Take a request's output side. With reasoning, a grammar the request has waits for the answer:
        the thought is never constrained."""
        sampling = seq.sampling
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        detok = Detokenizer(self.tokenizer, sampling.skip_special_tokens)
        state = OutputState(seq, detok, StopStrings(list(sampling.stop)), stop_ids, tool_marker, time.perf_counter(),
                            reasoning)
        if reasoning is not None:
            state.splitter = ThoughtSplitter(reasoning.start, reasoning.end, reasoning.is_open)
            state.deferred_matcher, seq.sampler.matcher = seq.sampler.matcher, None
        self.states[seq.request_id] = state

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
        """Append a step's kept tokens to seq one at a time, each through the thought's split, the stop
        rules, the grammar and the meta-state as a decode's token; tokens after a stop, or after the
        thought's budget is spent, are dropped."""
        state = self.states[seq.request_id]
        reserve = 0
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if state.first_token_time is None:
                state.first_token_time = now
                state.state = MetaState.PREFILL_COMPLETE
                state.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block()
            elif state.is_thinking:
                state.state = MetaState.THINKING
            else:
                state.state, state.state_index = MetaState.DECODE_STEP, seq.num_output_tokens
            seq.token_ids.append(token)
            state.token_times.append(now)
            if lp is not None:
                state.logprobs.append(lp)
            forced = seq.sampler.forced_token_ids
            if forced and forced[0] == token:
                forced.pop(0)
            reason = self._stop(state, token)
            if reason is None and seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if (reason is None and state.tool_marker is not None and not state.is_tool_prepared
                    and state.tool_marker in state.answer.text):
                state.state, state.is_tool_prepared = MetaState.TOOL_USE_PREPARED, True
                reserve = min(seq.sampling.max_tokens - seq.num_output_tokens, TOOL_RESERVE_TOKENS)
            if reason is not None:
                return Taken(i + 1, reason)
            if self._spent(state):
                return Taken(i + 1, None)
        return Taken(len(tokens), None, reserve)

    def _stop(self, state: OutputState, token: int) -> str | None:
        """"stop" when token ends the request: a stop token, a stop string completed in the answer, or
        the answer's grammar complete (or, a bug, rejecting a token its own mask offered)."""
        if token in state.stop_ids:
            state.stop_reason = token
            return "stop"
        text = state.detok.add(token)
        verdict: str | None = None
        grammar_done = False  # the grammar has seen this token already
        if state.splitter is None:
            state.answer.add(text)
        else:
            if not text and state.reasoning.marker_token_ids:  # a marker the vocabulary holds as a special token
                text = state.reasoning.marker_token_ids.get(token, "")
            was_thinking = state.is_thinking
            thought, answer = state.splitter.feed(text)
            state.thought += thought
            state.answer.add(answer)
            if was_thinking or state.is_thinking:
                state.num_thought_tokens += 1
            if state.deferred_matcher is not None and state.splitter.phase is Phase.ANSWER:
                state.answer_from = state.seq.num_output_tokens if was_thinking else 0
                verdict, grammar_done = self._attach_grammar(state), True
        if state.answer.stop_hit is not None:
            state.stop_reason = state.answer.stop_hit
            return "stop"
        if grammar_done or state.seq.sampler.matcher is None or state.is_thinking:
            return verdict
        return self._consume(state, [token])

    def _attach_grammar(self, state: OutputState) -> str | None:
        """The thought is over: the answer's grammar applies from here, to the answer's tokens so far."""
        seq = state.seq
        seq.sampler.matcher, state.deferred_matcher = state.deferred_matcher, None
        return self._consume(state, seq.output_token_ids[state.answer_from:])

    @staticmethod
    def _consume(state: OutputState, tokens: list[int]) -> str | None:
        matcher = state.seq.sampler.matcher
        for token in tokens:
            if not matcher.consume_token(token):
                log.error("%s: grammar rejected a sampled token: %s", state.seq.request_id, matcher.get_error())
                return "stop"
        return "stop" if matcher.is_stopped() else None

    @staticmethod
    def _spent(state: OutputState) -> bool:
        """The thought reached its budget: the engine writes its end marker next (the sampler is given
        the marker's tokens), and the rest of this step's tokens are dropped. True when it did now."""
        budget = state.reasoning.budget if state.reasoning is not None else None
        if budget is None or not state.is_thinking or state.is_thought_cut or state.num_thought_tokens < budget:
            return False
        state.is_thought_cut = True
        state.seq.sampler.forced_token_ids[:] = state.reasoning.end_token_ids
        return True

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
        if state.answer.stop_hit is None:
            rest = state.detok.flush()
            if state.splitter is not None:
                thought, answer = state.splitter.feed(rest)
                held_thought, held_answer = state.splitter.flush()
                state.thought += thought + held_thought
                rest = answer + held_answer
            state.answer.add(rest)
        out = self._output(state, new_ids, True, efficiency)
        state.state = MetaState.FINISHED
        return out

    def _output(self, state: OutputState, new_ids: list[int], finished: bool, efficiency: float) -> RequestOutput:
        seq = state.seq
        first = len(new_ids) == seq.num_output_tokens  # the first output with tokens: what TTFT usage reads
        delta_logprobs = None
        if seq.sampling.logprobs is not None:
            delta_logprobs = state.logprobs[len(state.logprobs) - len(new_ids):] if new_ids else []
        delta_reasoning = state.thought[state.thought_emitted:]
        state.thought_emitted = len(state.thought)
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=state.answer.take_delta(finished),
            delta_reasoning=delta_reasoning,
            reasoning=state.thought,
            delta_token_ids=new_ids,
            delta_logprobs=delta_logprobs,
            logprobs=list(state.logprobs) if finished and delta_logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(seq) if finished or first else None,
            text=state.answer.text,
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
            num_reasoning_tokens=state.num_thought_tokens,
            is_reasoning_cut=state.is_thought_cut,
        )
