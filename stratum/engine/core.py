"""The engine core: one step is schedule -> run -> commit.

`EngineCore` owns the model on its kernels (`builder.Built`), the scheduler over the KV pool, the
speculator and the disk tier of one process, and hands each step's kept tokens to its output
processor (`output_processor.OutputProcessor`), which turns them into what clients see; each step's
measured time goes to the step cost (`step_cost.StepCost`) the scheduler sizes prefill chunks by
while requests decode. It also owns the degraded basic mode and the switch from a cold start's
provisional kernels to the prepared ones.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
import weakref
from collections import deque
from dataclasses import replace
from itertools import islice

import torch

from stratum.engine import builder
from stratum.engine.block_manager import BlockManager
from stratum.engine.config import EngineConfig, ResolvedConfig
from stratum.engine.disk_store import open_store
from stratum.engine.disk_tier import DiskTier
from stratum.engine.faults import Faults
from stratum.engine.grammar import GrammarCompiler
from stratum.engine.kv_view import kv_binding
from stratum.engine.model_runner import ModelRunner
from stratum.engine.output_processor import OutputProcessor
from stratum.engine.outputs import OrchestrationError, RequestOutput, StepError, StepStats
from stratum.engine.prepare import KernelUpgrade
from stratum.engine.protocol import EngineInfo, EngineSnapshot, KVBlocks
from stratum.engine.reasoning import Reasoning
from stratum.engine.request import CachePolicy, SamplerState, Sequence, SequenceStatus
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.engine.scheduler import Scheduler, SchedulerOutput
from stratum.engine.spec_decode import SpecConfig, Speculator
from stratum.engine.step_cost import CostPrior, StepCost
from stratum.kernels.governor import StepThreads
from stratum.models.facts import model_facts
from stratum.models.loader import Checkpoint

log = logging.getLogger("stratum.engine")


class EngineCore:
    """Owns the model, the KV pool, the scheduler and the tokenizer of one process.

    Args:
        config: engine settings, resolved once here (`builder.resolve`).
        checkpoint: an already-loaded checkpoint (tests build tiny ones); else config.model is loaded.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        spec = SpecConfig.of(config)
        checkpoint = checkpoint or builder.load(config)
        resolved = builder.resolve(config, checkpoint, defer=config.defer_kernels)
        self.upgrade: KernelUpgrade | None = None  # a cold start's kernels, being compiled (`switch_kernels`)
        if resolved is None:
            resolved = builder.provisional(config, checkpoint)
            # the prepared step keeps this pool's size: a default pool is sized by the memory free now
            self.upgrade = KernelUpgrade(replace(config, num_kv_blocks=resolved.num_kv_blocks))
        torch.manual_seed(resolved.seed)
        self.model_config = checkpoint.config
        self.pooling = config.pooling  # embeddings by "mean" or "last" pooling of the final hidden states, or none
        self.model_facts = model_facts(checkpoint)
        self.tokenizer = checkpoint.tokenizer
        self.grammars = GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size)
        self._chat_template_source = checkpoint.chat_template
        self.built = builder.build(resolved, checkpoint, use_native=self.upgrade is None)
        self.faults = Faults.from_env()
        self.speculator = Speculator.build(spec, config, resolved, checkpoint.tokenizer, self.model,
                                           lambda: self.config.numerics, provisional=self.upgrade is not None)
        self.outputs = OutputProcessor(self.tokenizer, checkpoint.config.eos_token_ids, resolved.block_size,
                                       lambda: self.kv_bytes_per_block, lambda: self.mode, self.speculator.counts)
        self.requests: dict[str, Sequence] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        self.num_steps = 0
        self.mode = "normal"
        self.degraded_reason: str | None = None
        self._started: list[str] = []
        # the disk tier under the prefix cache (its figures for the pool tier too, when the disk is off);
        # a clean exit writes what it has queued (a killed process loses only that: the tier stays consistent)
        self.tier = DiskTier(open_store(config.kv_disk_gb, config.kv_disk_dir)
                             if resolved.enable_prefix_cache else None)
        weakref.finalize(self, self.tier.close, 5.0)
        self._adopt_kernels()
        self._renew_pool([], num_preemptions=0)

    @property
    def config(self) -> ResolvedConfig:
        return self.built.config

    @property
    def model(self):
        return self.built.model

    @property
    def runner(self) -> ModelRunner:
        return self.built.runner

    @functools.cached_property
    def chat_template(self):
        """The model's ChatTemplate, compiled on first use: an engine process never renders one (its
        server does), and importing Jinja alone took 0.13 s of its start."""
        from stratum.models.chat_template import ChatTemplate

        return ChatTemplate(self._chat_template_source, self.tokenizer)

    @property
    def kernel_choices(self) -> dict:
        return self.built.kernel_choices(self.speculator.describe(), preparing=self.upgrade is not None)

    def info(self) -> EngineInfo:
        """The engine's configuration and kernel choices, as its start-up and a kernel switch report them."""
        pooling = self.pooling
        return EngineInfo(self.config, self.model_config.name, self.model_config.vocab_size, self.kernel_choices,
                          self.model_facts, tasks=("generate", "embed") if pooling else ("generate",), pooling=pooling,
                          embedding_size=self.model_config.hidden_size if pooling else 0)

    # ---- requests ------------------------------------------------------------------------------
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
        reasoning: Reasoning | None = None,
        task: str = "generate",
    ) -> Sequence:
        """Validate and queue one request; task "embed": prefill only (max_tokens 0), its finished output
        carries the pooled vector (`--pooling`).

        Raises:
            InvalidRequestError: out-of-range parameters, too long for the context, or a task not served.
        """
        if task != "generate" and (task != "embed" or self.pooling is None):
            raise InvalidRequestError(f"this model serves {', '.join(self.info().tasks)}, not {task}")
        if task == "embed":
            sampling = replace(sampling, max_tokens=0, logprobs=None, prompt_logprobs=None, return_logits=False)
        self.config.check_request(len(prompt_token_ids), sampling)
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):  # else the step fails for the whole batch
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        cache_policy = cache_policy or CachePolicy()
        if sampling.prompt_logprobs is not None or task == "embed":  # every prompt position is read, none cached
            cache_policy = CachePolicy(read=False, write=cache_policy.write)
        sampler = SamplerState(
            generator=torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None,
            matcher=self.grammars.matcher(sampling.grammar) if sampling.grammar is not None else None,
            is_low_latency=low_latency and self.model.lm_head_int8 is not None,  # only where a lossier head exists
        )
        seq = Sequence(request_id, list(prompt_token_ids), sampling, self.config.block_size, priority=priority,
                       cache_salt=cache_salt, cache_policy=cache_policy, pin_prefixes=list(pin_prefixes or []),
                       sampler=sampler)
        seq.readouts.pooling = self.pooling if task == "embed" else None
        parent = self.requests.get(fork_of) if fork_of else None
        if parent is not None and parent.prompt_token_ids == seq.prompt_token_ids and sampling.prompt_logprobs is None:
            seq.fork_of = parent  # a sample of n: it starts from the parent's computed prompt
        self.scheduler.add(seq)
        self.outputs.add(seq, tool_marker, reasoning)
        self.requests[request_id] = seq
        return seq

    def expected_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens the prefix cache would serve seq now: what it will read when it is scheduled,
        unless blocks are evicted or computed meanwhile."""
        return self.block_manager.expected_cached_tokens(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state and return every block it held."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish(seq, "abort", running=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def take_started(self) -> list[str]:
        """Requests scheduled for the first time since the last call: they have left the queue."""
        started, self._started = self._started, []
        return started

    def request_ids(self) -> list[str]:
        """Every request the engine holds, queued or running."""
        return list(self.requests)

    def recent_cache_keys(self, max_keys: int) -> list[bytes]:
        """The prefix cache's block keys, most recently used first (none without a prefix cache)."""
        bm = self.block_manager
        return bm.cache.recent_keys(max_keys) if bm.enable_prefix_cache else []

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> commit; the kept tokens go through the output processor.

        Raises:
            OrchestrationError: scheduling or prefix-cache logic failed (the caller may degrade).
            StepError: the model step failed; it names the requests that were in it.
        """
        self.faults.check_death(self.num_steps)
        t0 = time.perf_counter()
        try:
            self.speculator.propose(self.scheduler.running, self.config.scheduler.max_num_batched_tokens,
                                    allowed=self.mode == "normal")
            sched = self.scheduler.schedule()
        except Exception as e:
            raise OrchestrationError(f"scheduler: {type(e).__name__}: {e}") from e
        self._started += [seq.request_id for seq in sched.started]
        if sched.num_decodes:
            self.tier.decoding()
        if sched.is_empty and not sched.copies:  # (every request waits: on reads from the disk tier, or for blocks)
            if self.tier.num_loading:
                self.tier.wait(0.05)  # nothing can run before a read lands: no busy loop
            return []
        self.threads.set_for(sched.num_batched_tokens)
        try:
            draft_s = self.speculator.draft_proposals(sched.scheduled)
            result = self.runner.execute(sched)
            verified = {}  # request id -> (kept tokens, their logprobs, proposals accepted)
            for item in sched.scheduled:
                rows = result.verify_rows.get(item.seq.request_id)
                if rows is not None:
                    verified[item.seq.request_id] = kept = self.speculator.verify(item, rows, self.grammars)
                    ModelRunner.read_verified(item.seq, item.start, rows, len(kept[0]))
        except Exception as e:
            raise StepError([s.seq.request_id for s in sched.scheduled], e) from e
        try:
            self.scheduler.commit(sched)
            stats = StepStats(len(sched.scheduled), sched.num_decodes, sched.num_batched_tokens, 0.0, result.forward_s,
                              result.mask_s, draft_s=draft_s)
            outputs = self._update(sched, result.sampled, result.logprobs, verified, stats)
        except Exception as e:
            raise OrchestrationError(f"postprocess: {type(e).__name__}: {e}") from e
        stats.step_s = step_s = time.perf_counter() - t0
        if not sched.is_empty:
            self.num_steps += 1
            self.step_stats.append(stats)
            self.step_cost.observe(sched.cost_features(), step_s)
            stats.planned_s = sched.planned_s
            self.speculator.observe_step(sched.scheduled, step_s - draft_s)
        return outputs

    def _update(self, sched: SchedulerOutput, sampled: dict, logprobs: dict, verified: dict,
                stats: StepStats) -> list[RequestOutput]:
        """The step's tokens through the output processor, and what it says applied to the scheduler:
        each accepted proposal after the first makes the KV its verify row wrote the request's own."""
        now = time.perf_counter()
        outputs = []
        for item in sched.scheduled:
            seq, rid = item.seq, item.seq.request_id
            self.outputs.scheduled(item, now)
            if rid in verified:
                tokens, token_logprobs, num_accepted = verified[rid]
                stats.num_verify_seqs += 1
                stats.num_spec_proposed_tokens += item.num_spec_tokens
                stats.num_spec_accepted_tokens += num_accepted
            elif rid in sampled:
                tokens, token_logprobs = [sampled[rid]], [logprobs.get(rid)]
            else:
                if seq.num_computed_tokens >= seq.num_tokens and seq.sampling.max_tokens == 0:
                    self.outputs.prefilled(seq)
                    outputs.append(out := self._finish(seq, "length"))
                    if seq.readouts.pooling:
                        out.embedding = ModelRunner.pooled(seq)
                continue
            taken = self.outputs.take(seq, tokens, token_logprobs, now)
            kept = tokens[: taken.num_kept]
            for _ in range(taken.num_kept - 1):
                self.scheduler.advance(seq)
            if taken.finish_reason is not None:
                outputs.append(self._finish(seq, taken.finish_reason, kept))
                continue
            if taken.num_reserve_tokens:  # a tool call began: room for its arguments, so they decode without stalls
                self.scheduler.reserve(seq, taken.num_reserve_tokens)
            outputs.append(self.outputs.output(seq, kept))
            if item.num_spec_tokens:
                self.scheduler.end_speculation(item)
        return outputs

    def _finish(self, seq: Sequence, reason: str, new_ids: list[int] | None = None,
                running: bool = True) -> RequestOutput:
        efficiency = seq.kv_cache_efficiency(self.config.block_size)
        if running:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        out = self.outputs.finish(seq, reason, new_ids or [], efficiency)
        self.speculator.forget(seq.request_id)
        return out

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
        gpu = (round(torch.cuda.memory_allocated(self.runner.device) / 2**20, 1)
               if self.config.device == "cuda" else None)
        return EngineSnapshot(
            alive=True, mode=self.mode, degraded_reason=self.degraded_reason,
            num_running=len(sched.running), num_waiting=len(sched.waiting), kv_blocks=kv_blocks,
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            overhead_ratio=(total - sum(s.forward_s for s in steps)) / total if total > 0 else 0.0,
            mean_step_s=total / len(steps) if steps else 0.0, threads=torch.get_num_threads(), rss_mb=rss_mb,
            gpu_memory_allocated_mb=gpu, step="native" if self.model.packed is not None else "pytorch",
            preparing=self.upgrade.stage if self.upgrade is not None else None, kv_tiers=self.tier.report(),
        )

    @property
    def is_preparing(self) -> bool:
        """A cold start's kernels are being prepared: `switch_kernels` adopts them once ready."""
        return self.upgrade is not None

    @property
    def works_in_background(self) -> bool:
        """Work whose progress an idle loop should look in on: kernels being prepared, or the disk tier
        still writing (its figures on /metrics would go stale until the next request)."""
        return self.is_preparing or not self.tier.is_settled

    # ---- degraded basic mode ---------------------------------------------------------------------
    def enter_basic_mode(self, reason: str) -> None:
        """Scheduler or cache logic failed: keep serving FIFO, one sequence at a time, without the prefix cache.

        Every unfinished request is kept and recomputed from its tokens under a fresh block manager.
        """
        log.error("entering basic mode: %s", reason)
        self.mode = "basic"
        self.degraded_reason = reason
        self._renew_pool(self._unfinished(), self.scheduler.num_preemptions)

    def _unfinished(self) -> list[Sequence]:
        return sorted(self.scheduler.waiting + self.scheduler.running, key=lambda s: s.arrival_order)

    def _renew_pool(self, pending: list[Sequence], num_preemptions: int) -> None:
        """A fresh block manager and scheduler over the runner's KV pool, for the current mode; the
        pending requests are kept and recomputed from their tokens (nothing in the old pool is read)."""
        config = self.config
        if self.mode == "basic":
            self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_cache=False)
            basic = replace(config.scheduler, max_num_seqs=1, watermark_blocks=0)
            self.scheduler = Scheduler(basic, self.block_manager, fifo=True, cost=self.step_cost)
        else:
            fault = self.faults.orchestration
            self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_cache,
                                              fault=fault)
            self.scheduler = Scheduler(config.scheduler, self.block_manager, fault=fault, cost=self.step_cost)
        self.scheduler.num_preemptions = num_preemptions
        self.scheduler.adopt(pending)
        self.tier.attach(self.block_manager, self.runner.kv_caches, kv_binding(config, self.model))

    # ---- the kernel switch: a cold start's PyTorch step, then the prepared kernels -----------------
    def _adopt_kernels(self) -> None:
        """What follows the model's kernels: the threads, the runner's grammars, the KV block size in bytes."""
        config = self.config
        # each step's cost, learnt from the steps these kernels run (a kernel switch starts over)
        shape = self.model_config
        self.step_cost = StepCost(CostPrior.guess(self.model_facts["num_parameters"], shape.hidden_size,
                                                  shape.num_layers, config.device))
        self.threads = StepThreads(config.num_threads, config.prefill_threads, governed=self.model.packed is not None)
        self.runner.grammars = self.grammars
        draft = self.speculator.draft
        kv_bytes = self.runner.kv_cache_bytes + (draft.kv_cache_bytes if draft is not None else 0)
        self.kv_bytes_per_block = kv_bytes // config.num_kv_blocks

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
        recomputed = [seq for seq in self.scheduler.running if seq.num_computed_tokens > 0]
        for seq in recomputed:
            seq.num_preemptions += 1
        self.built = upgrade.prepared
        draft = self.speculator.draft
        if draft is not None:
            draft.follow(provisional=False)
            draft.attach(self.config.num_kv_blocks, self.config.block_size)
        self.speculator.set_target(self.model, self.config.kernel_plan)
        self._adopt_kernels()
        self._renew_pool(self._unfinished(), self.scheduler.num_preemptions + len(recomputed))
        log.warning("switched to the prepared kernels: %s, numerics %s", self.kernel_choices["step"],
                    self.config.numerics.key())
        return True
