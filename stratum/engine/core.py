"""The synchronous engine: one step is schedule -> run -> commit -> postprocess.

`LLMEngine` owns the model, the KV pool, the scheduler and the tokenizer of one process. The
scheduler owns the accounting; the engine runs the model step, hands the step back to the scheduler,
then turns sampled tokens into outputs (detokenization, stop conditions, the meta-state machine).
It also owns the degraded basic mode.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from itertools import islice

import torch

from stratum.engine import builder
from stratum.engine.block_manager import BlockManager
from stratum.engine.config import EngineConfig, SchedulerConfig
from stratum.engine.detokenizer import Detokenizer
from stratum.engine.disk_store import open_store
from stratum.engine.disk_tier import DiskTier
from stratum.engine.kv_view import kv_binding
from stratum.engine.grammar import GrammarCompiler
from stratum.engine.model_runner import ModelRunner
from stratum.engine.outputs import OrchestrationError, RequestOutput, RequestStats, StepError, StepStats
from stratum.engine.prepare import KernelUpgrade
from stratum.engine.protocol import EngineSnapshot, KVBlocks
from stratum.engine.request import CachePolicy, Sequence, SequenceStatus
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.engine.scheduler import Scheduler, SchedulerOutput
from stratum.engine.spec_decode import SpecConfig, Speculator
from stratum.kernels import native
from stratum.kernels.governor import ThreadGovernor
from stratum.models.loader import Checkpoint

log = logging.getLogger("stratum.engine")

# A step with this many tokens is prefill-heavy: its large matmuls are compute-bound and gain from
# every core, while small decode steps lose more to thread synchronisation than they gain.
PREFILL_STEP_TOKENS = 128


class EngineKilled(BaseException):
    """STRATUM_FAULT_INJECT=engine_death:N: the engine loop dies outright after N steps (tests).

    A BaseException, like the failures it stands for, so no handler meant for request errors keeps
    the loop alive."""


def parse_faults(spec: str | None) -> tuple[str | None, int | None]:
    """STRATUM_FAULT_INJECT: "scheduler" | "cache" (orchestration faults, degrade to basic mode) or
    "engine_death:N" (the loop dies after N steps). Returns (orchestration fault, death step)."""
    if not spec:
        return None, None
    if spec.startswith("engine_death"):
        _, _, n = spec.partition(":")
        return None, int(n or 0)
    return spec, None


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: Detokenizer
    stop_ids: set[int]


def attention_path(model, native_decode: bool) -> str:
    """How attention runs for `model` (for `kernel_choices` and `stratum info`); `native_decode`: the
    native decode kernel is built (a runner on the CPU with the native kernels loaded)."""
    if model.packed is not None:
        return "native paged, every row"
    if model.config.has_masked_attention:  # layers.attention: sliding windows and soft-caps on PyTorch
        return "pytorch paged gather, masked (sliding window / soft-cap), no cascade"
    return ("native paged decode" if native_decode else "paged gather") + " + cascade, torch sdpa prefill"


class LLMEngine:
    """Owns the model, the KV pool, the scheduler and the tokenizer of one process.

    Args:
        config: engine settings, resolved once here (`builder.resolve`).
        checkpoint: an already-loaded checkpoint (tests build tiny ones); else config.model is loaded.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        settings, spec = config, SpecConfig.of(config)
        checkpoint = checkpoint or builder.load(config)
        settings = config
        resolved = builder.resolve(config, checkpoint, defer=config.defer_kernels)
        self.upgrade: KernelUpgrade | None = None  # a cold start's kernels, being compiled (`switch_kernels`)
        if resolved is None:
            resolved = builder.provisional(config, checkpoint)
            # the prepared step keeps this pool's size: a default pool is sized by the memory free now
            self.upgrade = KernelUpgrade(replace(config, num_kv_blocks=resolved.num_kv_blocks))
        self.config = config = resolved
        torch.set_num_threads(config.num_threads)
        self._threads = config.num_threads
        self.governor = ThreadGovernor(max(config.num_threads, config.prefill_threads))
        torch.manual_seed(config.seed)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.grammars = GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size)
        self._chat_template_source = checkpoint.chat_template
        self.device = torch.device(config.device)
        self.kernel_plan = config.kernel_plan
        self.dtype = config.torch_dtype
        self.max_model_len = config.max_model_len
        self.model, self.packed_bytes = builder.build_model(config, checkpoint)
        self._fault, self._death_after = parse_faults(os.environ.get("STRATUM_FAULT_INJECT"))
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_cache, fault=self._fault)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, fault=self._fault)
        self.runner = ModelRunner(self.model, config.num_kv_blocks, config.block_size, self.device, config.torch_kv_dtype,
                                  use_native=self.upgrade is None)
        self.runner.grammars = self.grammars
        draft = None
        if spec.uses_draft:
            from stratum.engine.spec_decode.draft import DraftModel

            draft = DraftModel(spec.draft_model, checkpoint.tokenizer, settings, config.num_threads,
                               provisional=self.upgrade is not None)
            draft.attach(config.num_kv_blocks, config.block_size)
        self.speculator = Speculator(spec, lambda: self.config.numerics, self.model, self.kernel_plan, draft)
        self.requests: dict[str, _Request] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        self.num_steps = 0
        self.mode = "normal"
        self.degraded_reason: str | None = None
        self.tool_reserve_tokens = 128
        self.kv_bytes_per_block = self._kv_cache_bytes() // config.num_kv_blocks
        self._started: list[str] = []
        # the disk tier under the prefix cache (its figures for the pool tier too, when the disk is off)
        self.tier = DiskTier(open_store(settings.kv_disk_gb, settings.kv_disk_dir) if config.enable_prefix_cache else None)
        self._attach_tier()

    def _attach_tier(self) -> None:
        self.tier.attach(self.block_manager, self.scheduler, self.runner.kv_caches,
                         kv_binding(self.config, self.model))

    @functools.cached_property
    def chat_template(self):
        """The model's ChatTemplate, compiled on first use: an engine process never renders one (its
        server does), and importing Jinja alone took 0.13 s of its start."""
        from stratum.models.chat_template import ChatTemplate

        return ChatTemplate(self._chat_template_source, self.tokenizer)

    @property
    def kernel_choices(self) -> dict:
        plan, numerics = self.kernel_plan, self.config.numerics
        return {"numerics": numerics.key(), "dtype": numerics.dtype, "kv_dtype": numerics.kv_dtype,
                "activations": numerics.activations,
                "packed_mb": round(self.packed_bytes / 2**20, 1),
                "low_latency_lm_head": "int8" if self.model.lm_head_int8 is not None else None,
                "threads": plan.threads, "native_kernels": ("being prepared" if self.upgrade is not None else native.status())
                if self.device.type == "cpu" else "cpu only",
                "step": "native, packed blocks" if self.model.packed is not None else "pytorch",
                "native_step_refused": self.model.packed_refusal,
                "step_simd": native.simd_path() if self.model.packed is not None else None,
                "attention": attention_path(self.model, self.runner.native),
                "speculative": self.speculator.describe(),
                "source": plan.source}

    def _kv_cache_bytes(self) -> int:
        """The KV pool's memory: the target's, and the draft model's over the same blocks."""
        draft = self.speculator.draft
        return self.runner.kv_cache_bytes + (draft.kv_cache_bytes if draft is not None else 0)

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Raises InvalidRequestError when the request can never run (too long, bad params)."""
        self.config.check_request(num_prompt_tokens, sampling)

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
        fork_of: str | None = None,
    ) -> Sequence:
        """Validate and queue one request.

        Raises:
            InvalidRequestError: out-of-range parameters or too long for the context.
        """
        self.check_request(len(prompt_token_ids), sampling)
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):  # else the step fails for the whole batch
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        cache_policy = cache_policy or CachePolicy()
        if sampling.prompt_logprobs is not None:  # every prompt position is scored, so none is read from the cache
            cache_policy = CachePolicy(read=False, write=cache_policy.write)
        seq = Sequence(
            request_id, list(prompt_token_ids), sampling, self.config.block_size,
            priority=priority, cache_salt=cache_salt, cache_policy=cache_policy,
            tool_marker=tool_marker, pin_prefixes=list(pin_prefixes or []),
            is_low_latency=low_latency and self.model.lm_head_int8 is not None,  # only where a lossier head exists
        )
        if sampling.seed is not None:
            seq.generator = torch.Generator().manual_seed(sampling.seed)
        if sampling.grammar is not None:
            seq.matcher = self.grammars.matcher(sampling.grammar)
        parent = self.requests.get(fork_of) if fork_of else None
        if parent is not None and parent.seq.prompt_token_ids == seq.prompt_token_ids and sampling.prompt_logprobs is None:
            seq.fork_of = parent.seq  # a sample of n: it starts from the parent's computed prompt
        self.scheduler.add(seq)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids)
        detok = Detokenizer(self.tokenizer, list(sampling.stop), sampling.skip_special_tokens)
        self.requests[request_id] = _Request(seq, detok, stop_ids)
        return seq

    def expected_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens the prefix cache would serve seq now: what it will read when it is scheduled,
        unless blocks are evicted or computed meanwhile."""
        match = self.block_manager.match_prefix(seq)
        if match is None:
            return 0
        on_disk = self.tier.expected_blocks(seq, match)
        bs = self.config.block_size
        return (match.num_blocks + on_disk) * bs if on_disk else match.num_tokens(bs)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state and return every block it held."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def take_started(self) -> list[str]:
        """Requests scheduled for the first time since the last call: they have left the queue."""
        started, self._started = self._started, []
        return started

    # ---- what its loop reads (`stratum.engine.loop`) ----------------------------------------------
    def snapshot(self, rss_mb: float = 0.0, kv_blocks: KVBlocks | None = None) -> EngineSnapshot:
        """The engine's state now, as its loop publishes it after a step.

        Args:
            rss_mb: the process's resident memory, as the caller last measured it.
            kv_blocks: a recent count of the KV pool to report again; None: counted now (counting
                cached and in-use blocks walks the pool: milliseconds for a large GPU pool).
        """
        sched, bm = self.scheduler, self.block_manager
        if kv_blocks is None:
            kv_blocks = KVBlocks(bm.num_blocks, bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks)
        steps = list(islice(reversed(self.step_stats), 64))  # the latest, not a copy of all 1,024 (every step)
        total = sum(s.step_s for s in steps)
        gpu = round(torch.cuda.memory_allocated(self.device) / 2**20, 1) if self.device.type == "cuda" else None
        return EngineSnapshot(
            alive=True, mode=self.mode, degraded_reason=self.degraded_reason,
            num_running=len(sched.running), num_waiting=len(sched.waiting), kv_blocks=kv_blocks,
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            overhead_ratio=(total - sum(s.forward_s for s in steps)) / total if total > 0 else 0.0,
            mean_step_s=total / len(steps) if steps else 0.0, threads=torch.get_num_threads(), rss_mb=rss_mb,
            gpu_memory_allocated_mb=gpu, step="native" if self.model.packed is not None else "pytorch",
            preparing=self.upgrade.stage if self.upgrade is not None else None, kv_tiers=self.tier.report(),
        )

    def request_ids(self) -> list[str]:
        """Every request the engine holds, queued or running."""
        return list(self.requests)

    def recent_cache_keys(self, max_keys: int) -> list[bytes]:
        """The prefix cache's block keys, most recently used first (none without a prefix cache)."""
        bm = self.block_manager
        return bm.cache.recent_keys(max_keys) if bm.enable_prefix_cache else []

    @property
    def is_preparing(self) -> bool:
        """A cold start's kernels are being prepared: `switch_kernels` adopts them once ready."""
        return self.upgrade is not None

    @property
    def works_in_background(self) -> bool:
        """Work whose progress an idle loop should look in on: kernels being prepared, or the disk tier
        still writing (its figures on /metrics would go stale until the next request)."""
        return self.is_preparing or not self.tier.is_settled

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> commit -> postprocess.

        Raises:
            OrchestrationError: scheduling or prefix-cache logic failed (the caller may degrade).
            StepError: the model step failed; it names the requests that were in it.
        """
        if self._death_after is not None and self.num_steps >= self._death_after:
            raise EngineKilled(f"injected engine death after {self.num_steps} steps (STRATUM_FAULT_INJECT)")
        t0 = time.perf_counter()
        try:
            self.speculator.propose(self.scheduler.running, self.config.scheduler.max_num_batched_tokens,
                                    allowed=self.mode == "normal")
            sched = self.scheduler.schedule()
        except Exception as e:
            raise OrchestrationError(f"scheduler: {type(e).__name__}: {e}") from e
        self._started += [item.seq.request_id for item in sched.scheduled if item.seq.first_scheduled_time >= t0]
        if sched.is_empty and not sched.copies:  # (every request waits: on reads from the disk tier, or for blocks)
            if self.tier.num_loading:
                self.tier.wait(0.05)  # nothing can run before a read lands: no busy loop
            return []
        self._set_threads(sched.num_batched_tokens)
        try:
            draft_s = self.speculator.draft_proposals(sched.scheduled)
            result = self.runner.execute(sched)
        except Exception as e:
            raise StepError([s.seq.request_id for s in sched.scheduled], e) from e
        try:
            self.scheduler.commit(sched)
            stats = StepStats(len(sched.scheduled), sched.num_decodes, sched.num_batched_tokens, 0.0, result.forward_s,
                              result.mask_s, draft_s=draft_s)
            outputs = self._postprocess(sched, result, stats)
        except Exception as e:
            raise OrchestrationError(f"postprocess: {type(e).__name__}: {e}") from e
        stats.step_s = step_s = time.perf_counter() - t0
        if not sched.is_empty:
            self.num_steps += 1
            self.step_stats.append(stats)
            self.speculator.observe_step(sched.scheduled, step_s - draft_s)
        return outputs

    def _set_threads(self, num_tokens: int) -> None:
        """Compute-bound prefill steps use every core; decode-bound steps leave the configured ones free.
        The native step, whose bits no thread count changes, uses no more than the cores other processes
        leave free (`ThreadGovernor`): its barriers would otherwise wait on descheduled threads."""
        threads = self.config.prefill_threads if num_tokens >= PREFILL_STEP_TOKENS else self.config.num_threads
        if self.model.packed is not None:
            threads = min(threads, self.governor.threads())
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def _postprocess(self, sched: SchedulerOutput, result, stats: StepStats) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for item in sched.scheduled:
            seq = item.seq
            if item.start < seq.num_prompt_tokens:
                seq.num_prefill_chunks += 1
                seq.state = f"prefill_chunk_{seq.num_prefill_chunks}"
            if seq.prefill_done_time is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.prefill_done_time = now
            req = self.requests[seq.request_id]
            kept = result.accepted.get(seq.request_id)
            if kept is not None:  # a verify step: the accepted proposals and the target's next token
                tokens, logprobs = kept
                stats.num_verify_seqs += 1
                stats.num_spec_proposed_tokens += item.num_spec_tokens
                stats.num_spec_accepted_tokens += self.speculator.settle(item, tokens)
            elif seq.request_id in result.sampled:
                tokens, logprobs = [result.sampled[seq.request_id]], [result.logprobs.get(seq.request_id)]
            else:
                if seq.num_computed_tokens >= seq.num_tokens and seq.sampling.max_tokens == 0:
                    seq.state = "prefill_complete"
                    seq.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block
                    outputs.append(self._finish(req, "length", running=True))
                continue
            outputs.append(self._take_tokens(req, tokens, logprobs, now))
            if item.num_spec_tokens and not seq.is_finished:
                self.scheduler.end_speculation(item)
        return outputs

    def _take_tokens(self, req: _Request, tokens: list[int], logprobs: list, now: float) -> RequestOutput:
        """Append a step's tokens to the request one at a time, each through the stop conditions, the
        grammar and the state machine as a decode's token; tokens after a stop are dropped. Each
        accepted proposal after the first makes the KV its verify row wrote the request's own."""
        seq = req.seq
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if i:
                self.scheduler.advance(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.state = "prefill_complete"
                seq.kv_bytes_at_first_token = len(seq.block_table) * self.kv_bytes_per_block
            else:
                seq.state = f"decode_step_{seq.num_output_tokens}"
            seq.token_ids.append(token)
            seq.token_times.append(now)
            if lp is not None:
                seq.logprobs.append(lp)
            reason = None
            if token in req.stop_ids:
                reason, seq.stop_reason = "stop", token
            else:
                req.detok.add(token)
                if req.detok.stop_hit is not None:
                    reason, seq.stop_reason = "stop", req.detok.stop_hit
                elif seq.matcher is not None and self._grammar_done(seq, token):
                    reason = "stop"
            if reason is None and seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if reason is None and seq.tool_marker is not None and not seq.is_tool_prepared and seq.tool_marker in req.detok.text:
                self._prepare_tool_use(seq)
            if reason is not None:
                return self._finish(req, reason, running=True, new_ids=tokens[: i + 1])
        return self._output(req, tokens, finished=False)

    @staticmethod
    def _grammar_done(seq: Sequence, token: int) -> bool:
        """Advance the request's grammar by its new token: True once the grammar is complete (the
        sampler only offered accepted tokens, so a rejection means a bug, and also ends it)."""
        if not seq.matcher.consume_token(token):
            log.error("%s: grammar rejected a sampled token: %s", seq.request_id, seq.matcher.get_error())
            return True
        return seq.matcher.is_stopped()

    def _prepare_tool_use(self, seq: Sequence) -> None:
        """The model began a tool call: reserve KV room for its arguments now, so they decode without stalls."""
        seq.state = "tool_use_prepared"
        seq.is_tool_prepared = True
        budget = seq.sampling.max_tokens - seq.num_output_tokens
        reserve = min(budget, self.tool_reserve_tokens)
        if reserve > 0 and self.scheduler.reserve(seq, 1 + reserve):
            seq.num_tool_reserved_tokens = reserve

    def _finish(self, req: _Request, reason: str, running: bool = False, new_ids: list[int] | None = None) -> RequestOutput:
        seq = req.seq
        efficiency = seq.kv_cache_efficiency(self.config.block_size)
        if running:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        req.detok.flush()
        out = self._output(req, new_ids or [], finished=True, efficiency=efficiency)
        seq.state = "finished"
        return out

    def _output(self, req: _Request, new_ids: list[int], finished: bool, efficiency: float | None = None) -> RequestOutput:
        seq = req.seq
        delta_logprobs = None
        if seq.sampling.logprobs is not None:
            delta_logprobs = seq.logprobs[len(seq.logprobs) - len(new_ids):] if new_ids else []
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=req.detok.take_delta(finished),
            delta_token_ids=new_ids,
            delta_logprobs=delta_logprobs,
            logprobs=list(seq.logprobs) if finished and delta_logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(seq) if finished or len(new_ids) == seq.num_output_tokens else None,
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

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list | None:
        """Per prompt token its (logprob, top) given the tokens before it; None for the first token."""
        if seq.sampling.prompt_logprobs is None:
            return None
        return [seq.prompt_logprobs.get(p) for p in range(seq.num_prompt_tokens)]

    def request_stats(self, seq: Sequence) -> RequestStats:
        return RequestStats(
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(0, seq.num_cached_tokens),
            num_prompt_tokens_computed=seq.num_prompt_tokens_computed,
            num_cache_written_tokens=seq.num_cache_written_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_disk_cached_tokens=seq.num_disk_cached_tokens,
            disk_read_s=seq.disk_read_s,
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
            num_spec_proposed_tokens=seq.spec.num_proposed if seq.spec is not None else 0,
            num_spec_accepted_tokens=seq.spec.num_accepted if seq.spec is not None else 0,
            num_spec_steps=seq.spec.num_steps if seq.spec is not None else 0,
        )

    # ---- degraded basic mode ---------------------------------------------------------------------
    def enter_basic_mode(self, reason: str) -> None:
        """Scheduler or cache logic failed: keep serving FIFO, one sequence at a time, without the prefix cache.

        Every unfinished request is kept and recomputed from its tokens under a fresh block manager.
        """
        log.error("entering basic mode: %s", reason)
        self.mode = "basic"
        self.degraded_reason = reason
        self._renew_pool()

    def _renew_pool(self) -> None:
        """A fresh block manager and scheduler over the runner's KV pool, for the current mode; every
        unfinished request is kept and recomputed from its tokens (nothing in the old pool is read)."""
        pending = sorted(self.scheduler.waiting + self.scheduler.running, key=lambda s: s.arrival_order)
        num_preemptions = self.scheduler.num_preemptions
        config = self.config
        if self.mode == "basic":
            self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_cache=False)
            basic = SchedulerConfig(max_num_batched_tokens=config.scheduler.max_num_batched_tokens, max_num_seqs=1,
                                    max_waiting=config.scheduler.max_waiting, watermark_blocks=0)
            self.scheduler = Scheduler(basic, self.block_manager, fifo=True)
        else:
            self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_cache,
                                              fault=self._fault)
            self.scheduler = Scheduler(config.scheduler, self.block_manager, fault=self._fault)
        self.scheduler.num_preemptions = num_preemptions
        self.scheduler.adopt(pending)
        self._attach_tier()

    # ---- the kernel switch: a cold start's PyTorch step, then the prepared kernels -----------------
    def switch_kernels(self) -> bool:
        """Adopt the model `self.upgrade` prepared, once it is ready; called between steps.

        The prepared step may keep its KV pool in another dtype and layout (the native step stores
        keys transposed per block), so nothing computed on the old pool carries over: the prefix
        cache starts empty, and every unfinished request is recomputed from its tokens on the new
        step, as after a preemption (and counted as one). The tokens it has already produced stay;
        the following ones are the new step's continuation of them.

        Returns:
            Whether it switched (False: nothing is ready, or preparing failed and the step stays).
        """
        upgrade = self.upgrade
        if upgrade is None or not upgrade.is_done:
            return False
        self.upgrade = None
        if upgrade.prepared is None:
            return False
        prepared = upgrade.prepared
        recomputed = [seq for seq in self.scheduler.running if seq.num_computed_tokens > 0]
        for seq in recomputed:
            seq.num_preemptions += 1
        self.config, self.model, self.packed_bytes, self.runner = prepared.config, prepared.model, prepared.packed_bytes, prepared.runner
        self.kernel_plan, self.dtype = self.config.kernel_plan, self.config.torch_dtype  # numerics: config.numerics
        self.runner.grammars = self.grammars
        if self.speculator.draft is not None:
            self.speculator.draft.follow(provisional=False)
            self.speculator.draft.attach(self.config.num_kv_blocks, self.config.block_size)
        self.speculator.set_target(self.model, self.kernel_plan)
        self.kv_bytes_per_block = self._kv_cache_bytes() // self.config.num_kv_blocks
        self._threads = self.config.num_threads
        torch.set_num_threads(self._threads)
        self.governor = ThreadGovernor(max(self.config.num_threads, self.config.prefill_threads))
        self._renew_pool()
        self.scheduler.num_preemptions += len(recomputed)
        log.warning("switched to the prepared kernels: %s, numerics %s", self.kernel_choices["step"],
                    self.config.numerics.key())
        return True
