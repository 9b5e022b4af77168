"""The engine: one step is schedule -> run -> postprocess.

`LLMEngine` is synchronous. `LLM` is the offline API (generate a list of prompts to completion).
`AsyncEngine` runs the step loop in its own thread and hands each request an async iterator of
outputs; the server sits on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace

import torch

from stratum.block_manager import BlockManager
from stratum.config import EngineConfig, SchedulerConfig
from stratum.detokenizer import Detokenizer
from stratum.layers.kernels import KernelPlan, attach_int4, attach_q8_head, select_plan
from stratum.layers import native
from stratum.layers.quant import Int8Weight, is_packable
from stratum.model_runner import ModelRunner
from stratum.models.chat_template import ChatTemplate
from stratum.models.llama import LlamaForCausalLM
from stratum.models.loader import Checkpoint, load_checkpoint
from stratum.sampling_params import InvalidRequestError, SamplingParams
from stratum.scheduler import Scheduler, SchedulerOutput
from stratum.sequence import CachePolicy, Sequence, SequenceStatus

log = logging.getLogger("stratum.engine")

# A step with this many tokens is prefill-heavy: its large matmuls are compute-bound and gain from
# every core, while small decode steps lose more to thread synchronisation than they gain.
PREFILL_STEP_TOKENS = 128


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class OrchestrationError(RuntimeError):
    """Scheduling or prefix-cache logic raised: the engine can go on in basic mode."""


class StepError(RuntimeError):
    """The model step itself raised; the requests in it cannot go on."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


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
    delta_text: str
    delta_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    stats: RequestStats | None = None
    error: str | None = None
    state: str = ""  # the request's meta-token state after this output
    kv_cache_efficiency: float = 0.0
    mode: str = "normal"  # "basic" when served by the degraded engine


@dataclass(slots=True)
class StepStats:
    """One engine step, measured where it ran."""

    num_seqs: int
    num_decode_seqs: int
    num_batched_tokens: int
    step_s: float
    forward_s: float

    @property
    def overhead_s(self) -> float:
        return self.step_s - self.forward_s


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: Detokenizer
    stop_ids: set[int]


class LLMEngine:
    """Owns the model, the KV pool, the scheduler and the tokenizer of one process.

    Args:
        config: engine settings; "auto" values are resolved here.
        checkpoint: an already-loaded checkpoint (tests build tiny ones); else config.model is loaded.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        self.config = config = config.resolve()
        torch.set_num_threads(config.num_threads)
        self._threads = config.num_threads
        torch.manual_seed(config.seed)
        if checkpoint is None:
            from stratum.models.registry import resolve_model_path

            checkpoint = load_checkpoint(resolve_model_path(config.model))
        self.checkpoint = checkpoint
        self.model_config = mc = checkpoint.config
        self.model_name = config.model
        self.tokenizer = checkpoint.tokenizer
        self.chat_template = ChatTemplate(checkpoint.chat_template, checkpoint.tokenizer)
        self.device = torch.device(config.device)
        self.kernel_plan = self._select_kernels(config, checkpoint)
        self.config = config = replace(config, dtype=self.kernel_plan.dtype)
        self.dtype = config.torch_dtype
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        model = LlamaForCausalLM(mc, max_positions=self.max_model_len)
        model.load_weights(dict(checkpoint.weights))
        model.cast_weights(self.dtype)
        self.model = model.to(device=self.device).eval()
        checkpoint.weights.clear()  # the model holds them now
        self.int4_bytes = attach_int4(self.model, checkpoint.quantized, self.kernel_plan.int4_max_tokens, checkpoint.cache_dir)
        attach_q8_head(self.model, checkpoint.quantized, self.kernel_plan.q8_max_rows)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:  # the low-latency hint's output projection
            head = self.model.lm_head.weight if self.model.lm_head is not None else self.model.embed_tokens.weight
            self.model.lm_head_int8 = Int8Weight(head)
        checkpoint.quantized.clear()
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_mb)
        fault = os.environ.get("STRATUM_FAULT_INJECT") or None  # tests: "scheduler" or "cache"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_cache, fault=fault)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, fault=fault)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.device, self.dtype)
        self.requests: dict[str, _Request] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        self.num_steps = 0
        self.mode = "normal"
        self.degraded_reason: str | None = None
        self.tool_reserve_tokens = 128
        self.kv_bytes_per_block = self.runner.kv_cache_bytes // num_blocks

    @staticmethod
    def _select_kernels(config: EngineConfig, checkpoint: Checkpoint) -> KernelPlan:
        mc = checkpoint.config
        if config.device != "cpu":
            dtype = "bfloat16" if config.dtype == "auto" else config.dtype
            return KernelPlan(config.device, dtype, config.num_threads, 0, source="default")
        from stratum.models.registry import stratum_home

        can_pack = any(is_packable(t.qtype) for t in checkpoint.quantized.values())
        if config.int4_max_tokens is not None and config.dtype != "auto":  # fully specified: nothing to measure
            plan = KernelPlan("cpu", config.dtype, config.num_threads, 0, source="configured")
        else:
            plan = select_plan(stratum_home(), mc.hidden_size, mc.intermediate_size, config.num_threads, can_pack, config.dtype)
        if config.int4_max_tokens is not None:  # the configured row limit holds for both packed formats
            rows = config.int4_max_tokens if plan.dtype == "bfloat16" else 0
            plan = replace(plan, int4_max_tokens=rows if can_pack else 0, q8_max_rows=rows if native.available() else 0,
                           source="configured")
        return plan

    @property
    def kernel_choices(self) -> dict:
        plan = self.kernel_plan
        native_attention = self.runner.native
        return {"dtype": plan.dtype, "int4_max_tokens": plan.int4_max_tokens, "int4_mb": round(self.int4_bytes / 2**20, 1),
                "q8_output_max_rows": self.model.q8_max_rows if self.model.lm_head_q8 is not None else 0,
                "low_latency_lm_head": "int8" if self.model.lm_head_int8 is not None else None,
                "threads": plan.threads, "native_kernels": native.status() if self.device.type == "cpu" else "cpu only",
                "attention": ("native paged decode" if native_attention else "paged gather") + " + cascade, torch sdpa prefill",
                "source": plan.source}

    def _blocks_for_memory(self, megabytes: int) -> int:
        mc = self.model_config
        per_block = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * self.config.block_size * self.dtype.itemsize
        return max(16, megabytes * 2**20 // per_block)

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Raises InvalidRequestError when the request can never run (too long, bad params)."""
        sampling.validate()
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty")
        total = num_prompt_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds the context length of {self.max_model_len} tokens"
            )
        if -(-total // self.config.block_size) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens exceeds the KV pool ({self.block_manager.num_blocks} blocks "
                f"of {self.config.block_size})"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        cache_policy: CachePolicy | None = None,
        tool_marker: str | None = None,
        pin_prefixes: list[tuple[int, float]] | None = None,
        low_latency: bool = False,
    ) -> Sequence:
        """Validate and queue one request.

        Raises:
            InvalidRequestError: out-of-range parameters or too long for the context.
            Whatever the scheduler's admission hook raises.
        """
        self.check_request(len(prompt_token_ids), sampling)
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):  # else the step fails for the whole batch
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        seq = Sequence(
            request_id, list(prompt_token_ids), sampling, self.config.block_size,
            priority=priority, cache_salt=cache_salt, cache_policy=cache_policy or CachePolicy(),
            tool_marker=tool_marker, pin_prefixes=list(pin_prefixes or []), is_low_latency=low_latency,
        )
        if sampling.seed is not None:
            seq.generator = torch.Generator().manual_seed(sampling.seed)
        self.scheduler.add(seq)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids)
        detok = Detokenizer(self.tokenizer, list(sampling.stop), sampling.skip_special_tokens)
        self.requests[request_id] = _Request(seq, detok, stop_ids)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state and return every block it held."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess.

        Raises:
            OrchestrationError: scheduling or prefix-cache logic failed (the caller may degrade).
            StepError: the model step failed; it names the requests that were in it.
        """
        t0 = time.perf_counter()
        try:
            sched = self.scheduler.schedule()
        except Exception as e:
            raise OrchestrationError(f"scheduler: {type(e).__name__}: {e}") from e
        self._set_threads(sched.num_batched_tokens)
        try:
            result = self.runner.execute(sched)
        except Exception as e:
            raise StepError([s.seq.request_id for s in sched.scheduled], e) from e
        try:
            outputs = self._postprocess(sched, result.sampled)
        except Exception as e:
            raise OrchestrationError(f"postprocess: {type(e).__name__}: {e}") from e
        step_s = time.perf_counter() - t0
        if not sched.is_empty:
            self.num_steps += 1
            num_decode = sum(1 for s in sched.scheduled if s.is_decode)
            self.step_stats.append(StepStats(len(sched.scheduled), num_decode, sched.num_batched_tokens, step_s, result.forward_s))
        return outputs

    def _set_threads(self, num_tokens: int) -> None:
        """Compute-bound prefill steps use every core; decode-bound steps leave the configured ones free."""
        threads = self.config.prefill_threads if num_tokens >= PREFILL_STEP_TOKENS else self.config.num_threads
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def _postprocess(self, sched: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        now = time.perf_counter()
        bm = self.block_manager
        outputs = []
        for item in sched.scheduled:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                seq.num_prefill_chunks += 1
                seq.state = f"prefill_chunk_{seq.num_prefill_chunks}"
            prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_prompt_tokens_computed += min(item.num_new_tokens, prompt_left)
            seq.num_computed_tokens += item.num_new_tokens
            if seq.prefill_done_time is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.prefill_done_time = now
            policy = seq.cache_policy
            in_prompt = seq.num_computed_tokens <= seq.num_prompt_tokens
            bm.cache_computed_blocks(seq, policy.pin_ttl_s if in_prompt or policy.pin_output else 0.0)
            if seq.pin_prefixes:
                self._pin_prefixes(seq)
            req = self.requests[seq.request_id]
            token = sampled.get(seq.request_id)
            if token is None:
                if seq.num_computed_tokens >= seq.num_tokens and seq.sampling.max_tokens == 0:
                    seq.state = "prefill_complete"
                    seq.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block
                    outputs.append(self._finish(req, "length", running=True))
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.state = "prefill_complete"
                seq.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block
            else:
                seq.state = f"decode_step_{seq.num_output_tokens}"
            seq.token_ids.append(token)
            seq.token_times.append(now)
            reason = None
            if token in req.stop_ids:
                reason, seq.stop_reason = "stop", token
            else:
                req.detok.add(token)
                if req.detok.stop_hit is not None:
                    reason, seq.stop_reason = "stop", req.detok.stop_hit
            if reason is None and seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if reason is None and seq.tool_marker is not None and not seq.is_tool_prepared and seq.tool_marker in req.detok.text:
                self._prepare_tool_use(seq)
            if reason is not None:
                outputs.append(self._finish(req, reason, running=True, last_token=token))
            else:
                outputs.append(self._output(req, [token], finished=False))
        return outputs

    def _pin_prefixes(self, seq: Sequence) -> None:
        """Pin the prompt prefixes a request asked for (cache_control) once they are computed and cached."""
        keep = []
        for num_tokens, ttl in seq.pin_prefixes:
            if num_tokens <= seq.num_computed_tokens:
                self.block_manager.cache.pin(seq.full_block_hashes()[: num_tokens // self.config.block_size], ttl)
            else:
                keep.append((num_tokens, ttl))
        seq.pin_prefixes = keep

    def _prepare_tool_use(self, seq: Sequence) -> None:
        """The model began a tool call: reserve KV room for its arguments now, so they decode without stalls."""
        seq.state = "tool_use_prepared"
        seq.is_tool_prepared = True
        budget = seq.sampling.max_tokens - seq.num_output_tokens
        reserve = min(budget, self.tool_reserve_tokens)
        if reserve > 0 and self.block_manager.allocate(seq, 1 + reserve):
            seq.num_tool_reserved_tokens = reserve

    def _finish(self, req: _Request, reason: str, running: bool = False, last_token: int | None = None) -> RequestOutput:
        seq = req.seq
        efficiency = seq.kv_cache_efficiency(self.config.block_size)
        if running:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        req.detok.flush()
        out = self._output(req, [last_token] if last_token is not None else [], finished=True, efficiency=efficiency)
        seq.state = "finished"
        return out

    def _output(self, req: _Request, new_ids: list[int], finished: bool, efficiency: float | None = None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=req.detok.take_delta(finished),
            delta_token_ids=new_ids,
            text=req.detok.text,
            token_ids=seq.output_token_ids,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            stats=self.request_stats(seq) if finished or len(new_ids) == seq.num_output_tokens else None,
            state=seq.state,
            kv_cache_efficiency=seq.kv_cache_efficiency(self.config.block_size) if efficiency is None else efficiency,
            mode=self.mode,
        )

    def request_stats(self, seq: Sequence) -> RequestStats:
        return RequestStats(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(0, seq.num_cached_tokens),
            num_prompt_tokens_computed=seq.num_prompt_tokens_computed,
            num_cache_written_tokens=seq.num_cache_written_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            prefill_done_time=seq.prefill_done_time,
            finish_time=seq.finish_time,
            token_times=list(seq.token_times),
            kv_sparsity=seq.kv_sparsity,
            num_kv_sparsity_samples=seq.coverage_count,
            num_prefill_chunks=seq.num_prefill_chunks,
            kv_bytes_at_first_token=seq.kv_bytes_at_first_token,
            num_tool_reserved_tokens=seq.num_tool_reserved_tokens,
        )

    # ---- degraded basic mode ---------------------------------------------------------------------
    def enter_basic_mode(self, reason: str) -> None:
        """Scheduler or cache logic failed: keep serving FIFO, one sequence at a time, without the prefix cache.

        Every unfinished request is kept and recomputed from its tokens under a fresh block manager.
        """
        log.error("entering basic mode: %s", reason)
        pending = sorted(self.scheduler.waiting + self.scheduler.running, key=lambda s: s.arrival_order)
        self.mode = "basic"
        self.degraded_reason = reason
        self.block_manager = BlockManager(self.block_manager.num_blocks, self.config.block_size, enable_prefix_cache=False)
        basic = SchedulerConfig(max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens, max_num_seqs=1,
                                max_waiting=self.config.scheduler.max_waiting, watermark_blocks=0)
        self.scheduler = Scheduler(basic, self.block_manager, fifo=True)
        for seq in pending:
            seq.block_table, seq.num_computed_tokens, seq.num_inserted_blocks = [], 0, 0
            seq.status = SequenceStatus.WAITING
            self.scheduler.waiting.append(seq)


class LLM:
    """Offline generation: `LLM("smollm2-135m").generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = "smollm2-135m", checkpoint: Checkpoint | None = None, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config), checkpoint=checkpoint)
        self._ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together. Strings are tokenized as plain text."""
        sampling = sampling or SamplingParams()
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        order = []
        for i, prompt in enumerate(prompts):
            ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(ids, params[i], request_id=rid, priority=priorities[i] if priorities else 0)
            order.append(rid)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in order]

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None) -> RequestOutput:
        ids = self.engine.chat_template.encode(messages)
        return self.generate([ids], sampling)[0]


class AsyncEngine:
    """The engine loop in its own thread; requests are async iterators of RequestOutput.

    The thread owns the LLMEngine: every add and abort is handed to it through a queue and applied
    between steps, so the scheduler and the KV pool are only ever touched by one thread.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="stratum-engine", daemon=True)
        self._stopped = False
        self.error: BaseException | None = None
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + sum(1 for c in self._commands if c[0] == "add")

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None, **kwargs):
        """Queue a request and yield its outputs as they are produced.

        Raises (before the first yield): whatever `LLMEngine.add_request` raises. If the caller stops
        iterating (a client disconnect), the request is aborted and its blocks freed.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._streams[request_id] = (loop, queue)
        self._submit(("add", request_id, prompt_token_ids, sampling, kwargs, added))
        finished = False
        try:
            await added
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def call(self, fn, *args):
        """Run fn(engine, *args) on the engine thread between steps; returns a future."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, args, fut))
        return fut

    def shutdown(self) -> None:
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=10)

    def _submit(self, command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _apply(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, ids, sampling, kwargs, added = command
            loop = self._streams[rid][0] if rid in self._streams else None
            try:
                self.engine.add_request(ids, sampling, request_id=rid, **kwargs)
                result = None
            except Exception as e:  # rejected at admission: the caller gets the typed error
                result = e
            if loop is not None:
                loop.call_soon_threadsafe(_settle, added, result)
        elif kind == "abort":
            self.engine.abort(command[1])
        elif kind == "call":
            _, fn, args, fut = command
            try:
                fut.set_result(fn(self.engine, *args))
            except Exception as e:
                fut.set_exception(e)

    def _run(self) -> None:
        while not self._stopped:
            with self._wake:
                while not self._commands and not self.engine.has_unfinished() and not self._stopped:
                    self._wake.wait()
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                self._apply(command)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except StepError as e:  # fail the requests of that step, keep serving the rest
                log.exception("model step failed")
                self._fail(e.request_ids, e)
                continue
            except OrchestrationError as e:
                log.exception("orchestration failed")
                if self.engine.mode == "normal":  # degrade, keep every request, and go on serving
                    self.engine.enter_basic_mode(str(e))
                else:  # already basic: fail the requests in flight, never the process
                    self._fail(list(self.engine.requests), e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
            self._deliver(rid, RuntimeError(f"engine step failed: {error}"))


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
