"""What the engine hands out: per-request outputs and figures, per-step figures, and its errors.

Plain data with no torch in it, so the server side can hold it without loading the model's stack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class OrchestrationError(RuntimeError):
    """Scheduling or prefix-cache logic raised: the engine can go on in basic mode."""


class StepError(RuntimeError):
    """The model step itself raised; the requests in it cannot go on."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class MetaState(enum.Enum):
    """A request's state as its token stream drives it: the "meta tokens" of the runtime, never in the
    output text, surfaced as telemetry (`RequestOutput.state_label`: "prefill_chunk_2", "decode_step_17")."""

    QUEUED = "queued"
    PREFILL_CHUNK = "prefill_chunk"  # numbered by chunk, from 1
    PREFILL_COMPLETE = "prefill_complete"
    THINKING = "thinking"  # a reasoning model's thought, before its answer
    DECODE_STEP = "decode_step"  # numbered by the output tokens before this one
    TOOL_USE_PREPARED = "tool_use_prepared"  # the model began a tool call: KV reserved for its arguments
    FINISHED = "finished"
    POLICY_BLOCKED = "policy_blocked"  # a content policy rule ended it (set by the server's screen, not the engine)

    def label(self, index: int) -> str:
        return f"{self.value}_{index}" if self in (MetaState.PREFILL_CHUNK, MetaState.DECODE_STEP) else self.value


@dataclass(slots=True)
class RequestStats:
    """Per-request figures, taken by the code that did the work (perf_counter seconds)."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_prompt_tokens_computed: int
    num_cache_written_tokens: int
    num_output_tokens: int
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    prefill_done_time: float | None
    finish_time: float | None
    token_times: list[float]
    kv_sparsity: float | None = None
    num_kv_sparsity_samples: int = 0
    num_prefill_chunks: int = 0
    kv_bytes_at_first_token: int = 0
    num_tool_reserved_tokens: int = 0
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those the disk tier served
    disk_read_s: float = 0.0  # the wait for those reads
    # speculative decoding: tokens proposed and accepted, and the verify steps they took
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # reasoning: the thought's tokens (output tokens too), and whether its budget ended it
    num_reasoning_tokens: int = 0
    is_reasoning_cut: bool = False

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        """First scheduled prefill chunk -> first sampled token (a prefill-only request: -> end of prefill)."""
        end = self.first_token_time if self.first_token_time is not None else self.prefill_done_time
        if self.first_scheduled_time is None or end is None:
            return None
        return end - self.first_scheduled_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    delta_text: str  # the answer's new text (a reasoning model's thought is `delta_reasoning`)
    delta_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"; a failed request is a RequestFailed event
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    stats: RequestStats | None = None
    state: MetaState = MetaState.QUEUED  # the request's meta-state after this output
    state_index: int = 0  # the chunk or decode step it names
    kv_cache_efficiency: float = 0.0
    mode: str = "normal"  # "basic" when served by the degraded engine
    # With sampling.logprobs: (logprob, [(token id, logprob), ...]) per token of delta_token_ids, and
    # on the finished output the whole output's in `logprobs`.
    delta_logprobs: list | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with sampling.prompt_logprobs, on the finished output: per prompt token
    delta_reasoning: str = ""  # a reasoning model's thought: its new text, and all of it so far
    reasoning: str = ""
    embedding: list[float] | None = None  # an "embed" request's vector, a "score" request's [score]: finished only

    @property
    def state_label(self) -> str:
        """The meta-state as the wire says it ("decode_step_17")."""
        return self.state.label(self.state_index)


@dataclass(slots=True)
class StepStats:
    """One engine step, measured where it ran."""

    num_seqs: int
    num_decode_seqs: int
    num_batched_tokens: int
    step_s: float
    forward_s: float
    mask_s: float = 0.0  # grammar masks (constrained requests)
    # speculative decoding: proposed tokens verified in this step, those accepted, the requests that
    # verified, and the draft model's forwards (seconds)
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_verify_seqs: int = 0
    draft_s: float = 0.0
    planned_s: float | None = None  # the step's cost as the scheduler planned it under its time budget

