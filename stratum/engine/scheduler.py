"""The scheduler: decides what runs each step, and owns the accounting. It never touches tensors.

It is the only writer of `num_computed_tokens` and the only code that allocates, caches or pins KV
blocks: the engine runs the step and hands the scheduler the step back (`commit`).

Order of a step: running decodes first (one token each), then running prefills continue with a
chunk, then waiting requests are admitted by priority class and arrival, each with a chunk that
fits the remaining token budget. While any request decodes, the step also keeps a time budget
(`SchedulerConfig.max_itl_ms`): its prefill chunks are sized by the measured cost of a step
(`step_cost.StepCost`), in the same order, so that no decoding request waits longer than the budget
for its next token. When blocks run out, the lowest-priority, latest-arriving running
request is preempted by recompute: its blocks are freed (its computed prefix stays in the cache)
and it returns to the waiting queue at num_computed_tokens = 0.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from stratum.engine.block_manager import BlockManager
from stratum.engine.config import SchedulerConfig
from stratum.engine.request import Sequence, SequenceStatus
from stratum.engine.step_cost import StepCost, chunk_pairs, step_features

# The smallest prefill chunk a step beside decodes gives the first prefill it schedules, even where the
# decodes alone fill the time budget: a long prompt keeps moving. Small, because at long context a row's
# attention is most of its cost (SmolLM2-135M at 11k tokens of context: about 25 ms a row on two cores),
# and there a small chunk loses little to the step's fixed cost.
MIN_PREFILL_CHUNK = 8
# A step is planned to this share of the budget: the rest is for the loop's own work between steps
# (outputs, events) and for the fit's error, so that the gaps clients see stay inside it.
PLANNED_SHARE = 0.8


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: 1 for a decode, the chunk for a prefill
    start: int  # seq.num_computed_tokens when it was scheduled: the chunk's first position
    is_decode: bool  # Sequence.is_decoding when scheduled
    num_spec_tokens: int = 0  # of num_new_tokens, proposed tokens verified after a decode's last one
    num_blocks_kept: int = 0  # with proposals: the blocks seq held before they took more (`end_speculation`)


@dataclass
class SchedulerOutput:
    """What runs this step: decodes first, then prefill chunks."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # scheduled for the first time: they left the queue
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks, before the step
    # the step's cost as planned under the time budget (seconds; None: no request decoded, no budget)
    planned_s: float | None = None

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.scheduled.append(ScheduledSeq(seq, num_new_tokens, seq.num_computed_tokens, seq.is_decoding))

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def cost_features(self) -> tuple[float, ...]:
        """What the step computes, as `StepCost` weighs it: rows and attention pairs."""
        pairs = sum(chunk_pairs(s.start, s.num_new_tokens) for s in self.scheduled)
        return step_features(self.num_batched_tokens, pairs)


@dataclass(slots=True)
class TimeBudget:
    """The seconds left in a step that runs decodes (`SchedulerConfig.max_itl_ms`), spent in the
    scheduler's order: decodes, running prefills, then admitted ones.

    The first prefill chunk gets at least MIN_PREFILL_CHUNK tokens; a later one is scheduled only where
    that many fit. A running prefill leaves half of what is left while a short prompt waits, so the
    short prompt starts this step."""

    cost: StepCost
    seconds_left: float
    num_prefills: int = 0

    def spend(self, start: int, num_tokens: int) -> None:
        self.seconds_left -= self.cost.added_s(start, num_tokens)

    def rows_for(self, start: int) -> int:
        """Rows after start computed positions that fit what is left (verified proposals)."""
        return self.cost.chunk_for(self.seconds_left, start)

    def chunk(self, start: int, num_tokens: int, share: float = 1.0) -> int:
        """The prefill chunk, of at most num_tokens, that fits (0: none this step); spent at once."""
        fit = self.cost.chunk_for(self.seconds_left * share, start)
        if self.num_prefills == 0:
            fit = max(fit, MIN_PREFILL_CHUNK)
        elif fit < MIN_PREFILL_CHUNK:
            return 0
        n = min(num_tokens, fit)
        self.num_prefills += 1
        self.spend(start, n)
        return n


class Scheduler:
    """Args:
        config: step limits.
        block_manager: the KV pool.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, fifo: bool = False,
                 fault: str | None = None, cost: StepCost | None = None):
        self.config = config
        self.cost = cost  # the measured step cost (`EngineCore` feeds it); None: no time budget
        self.sort_key = (lambda s: s.arrival_order) if fifo else Sequence.sort_key  # basic mode ignores priority
        self.fault = fault
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a request (admission is decided before it reaches the engine: `stratum.server`)."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.sort_key)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request from any state, returning every block it held."""
        for queue in (self.waiting, self.running):
            for i, seq in enumerate(queue):
                if seq.request_id == request_id:
                    del queue[i]
                    self.bm.free(seq)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Called by the engine when seq is done: cache its computed blocks and free the rest."""
        self.running.remove(seq)
        self.bm.cache_computed_blocks(seq, seq.cache_policy.pin_ttl_s if seq.cache_policy.pin_output else 0.0)
        self.bm.free(seq)

    def commit(self, out: SchedulerOutput) -> None:
        """The step ran: each scheduled request has computed its chunk. Advance the accounting, offer
        the newly full blocks to the prefix cache, and pin the prefixes requests asked for."""
        for item in out.scheduled:
            seq = item.seq
            prompt_left = max(0, seq.num_prompt_tokens - item.start)
            seq.cache_stats.num_prompt_tokens_computed += min(item.num_new_tokens, prompt_left)
            # a verify step's proposals count once accepted (`advance`)
            seq.num_computed_tokens = item.start + item.num_new_tokens - item.num_spec_tokens
            policy = seq.cache_policy
            in_prompt = seq.num_computed_tokens <= seq.num_prompt_tokens
            self.bm.cache_computed_blocks(seq, policy.pin_ttl_s if in_prompt or policy.pin_output else 0.0)
            if seq.pin_prefixes:
                self._pin_prefixes(seq)

    def advance(self, seq: Sequence) -> None:
        """One more of seq's proposed tokens was accepted: the KV its verify row wrote holds a token of
        seq now, so that position is computed (and a block it fills is offered to the prefix cache)."""
        assert seq.num_computed_tokens < seq.num_tokens
        seq.num_computed_tokens += 1
        policy = seq.cache_policy
        self.bm.cache_computed_blocks(seq, policy.pin_ttl_s if policy.pin_output else 0.0)

    def end_speculation(self, item: ScheduledSeq) -> None:
        """After a verify step: give back the blocks that only held rejected proposals, keeping those
        seq held before and those its next decode writes. They were never full of computed tokens, so
        the prefix cache never saw them."""
        seq = item.seq
        needed = self.bm.num_blocks_needed_for(seq.num_computed_tokens + 1 + seq.num_reserved_tokens)  # (`reserve`)
        self.bm.truncate(seq, max(item.num_blocks_kept, needed))

    def _speculate(self, item: ScheduledSeq, budget: int) -> int:
        """Rows for a decode's proposed tokens after its own: as many as the step's token budget and
        the free blocks above the watermark allow. Speculation never preempts and never evicts the
        prefix cache. Returns the rows added (seq.spec_token_ids is cut to them)."""
        seq, bs = item.seq, self.bm.block_size
        free = max(0, self.bm.num_free_blocks - self.config.watermark_blocks)
        room = (len(seq.block_table) + free) * bs - seq.num_computed_tokens - 1
        k = min(len(seq.spec_token_ids), budget, room)
        item.num_blocks_kept = len(seq.block_table)
        if k <= 0 or not self.bm.allocate(seq, 1 + k):
            seq.spec_token_ids.clear()
            return 0
        del seq.spec_token_ids[k:]
        item.num_new_tokens += k
        item.num_spec_tokens = k
        return k

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Hold blocks from now on for num_tokens positions past seq's next one, which it will decode
        (a tool call's arguments), so they decode without stalls; a verify step keeps them
        (`end_speculation`). False, changing nothing, when the pool cannot spare them."""
        if not self.bm.allocate(seq, 1 + num_tokens):
            return False
        seq.num_reserved_tokens = num_tokens
        return True

    def adopt(self, seqs: list[Sequence]) -> None:
        """Take over requests from another scheduler whose KV pool is gone (basic mode): each is
        recomputed from its tokens."""
        for seq in seqs:
            seq.block_table, seq.num_computed_tokens, seq.num_inserted_blocks = [], 0, 0
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=self.sort_key)

    def _pin_prefixes(self, seq: Sequence) -> None:
        """Pin the prompt prefixes a request asked for (cache_control) once they are computed and cached."""
        keep = []
        for num_tokens, ttl in seq.pin_prefixes:
            if num_tokens <= seq.num_computed_tokens:
                self.bm.cache.pin(seq.full_block_hashes()[: num_tokens // self.bm.block_size], ttl)
            else:
                keep.append((num_tokens, ttl))
        seq.pin_prefixes = keep

    def schedule(self) -> SchedulerOutput:
        if self.fault == "scheduler":
            raise RuntimeError("injected scheduler fault (STRATUM_FAULT_INJECT=scheduler)")
        out = SchedulerOutput()
        self.bm.poll_tiers()
        self.running.sort(key=self.sort_key)
        # A prefill that is already running takes at most half the step's budget while a short prompt
        # waits, so that prompt starts now instead of after all of a long document's chunks.
        half = self.config.max_num_batched_tokens // 2
        has_short_waiting = len(self.running) < self.config.max_num_seqs and any(
            s.num_tokens <= half for s in self.waiting[:8])
        time_budget = self._time_budget()
        budget = self._schedule_running(out, half if has_short_waiting else self.config.max_num_batched_tokens,
                                        time_budget, 0.5 if has_short_waiting else 1.0)
        if not out.preempted:  # under KV pressure admit nobody new this step
            self._admit(out, budget, time_budget)
        if time_budget is not None:
            out.planned_s = self.cost.predict(out.cost_features())
        return out

    def _time_budget(self) -> TimeBudget | None:
        """The step's time budget: while any running request decodes, with a cost model and a budget set."""
        max_itl_ms = self.config.max_itl_ms
        if self.cost is None or max_itl_ms <= 0 or all(s.is_prefilling for s in self.running):
            return None
        return TimeBudget(self.cost, PLANNED_SHARE * max_itl_ms / 1e3 - self.cost.coefficients[0])

    def _schedule_running(self, out: SchedulerOutput, prefill_cap: int, time_budget: TimeBudget | None,
                          share: float) -> int:
        """Running decodes (and their proposals), then running prefills' chunks. Returns the token
        budget left."""
        budget = self.config.max_num_batched_tokens
        decodes = [s for s in self.running if not s.is_prefilling]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.is_prefilling:
                n = min(n, max(1, prefill_cap))
                if time_budget is not None:
                    n = time_budget.chunk(seq.num_computed_tokens, n, share=share)
                    if n == 0:
                        continue
            if not self._allocate_or_preempt(seq, n, out):
                continue
            out.add(seq, n)
            budget -= n
            if time_budget is not None and not seq.is_prefilling:
                time_budget.spend(seq.num_computed_tokens, n)
            if seq.spec_token_ids and seq.is_decoding:
                item = out.scheduled[-1]
                rows = budget if time_budget is None else min(budget, time_budget.rows_for(item.start + 1))
                k = self._speculate(item, rows)
                budget -= k
                if time_budget is not None and k:
                    time_budget.spend(item.start + 1, k)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, time_budget: TimeBudget | None) -> None:
        """Waiting requests by priority and arrival, each with the chunk that fits what is left."""
        in_flight = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq.fork_of is not None:
                forked = self._fork(seq, out)
                if forked is None:
                    i += 1  # its parent has not finished the prompt yet
                    continue
                if forked:
                    del self.waiting[i]
                    budget -= 1
                    if time_budget is not None:
                        time_budget.spend(seq.num_computed_tokens, 1)
                    continue
                if seq.fork_of is not None:
                    break  # no block for it now
            match = self.bm.match_prefix(seq)
            # the watermark keeps room for running requests to grow; with none running it would only
            # stall a request that fits the pool forever
            watermark = self.config.watermark_blocks if self.running else 0
            if self.bm.is_loading(seq, match, watermark):
                i += 1  # its next blocks are being read from disk: hit them once they are in the pool
                continue
            hit = match.num_tokens(self.bm.block_size) if match is not None else 0
            if in_flight is None:
                in_flight = self._in_flight_keys()
            if self._waits_for_in_flight(seq, hit, in_flight):
                i += 1  # its next blocks are being computed by another request: hit them next step
                continue
            n = min(seq.num_tokens - hit, budget)
            if time_budget is not None:
                n = time_budget.chunk(hit, n)
                if n == 0:
                    break
            need = -(-(hit + n) // self.bm.block_size) - hit // self.bm.block_size
            if not self.bm.can_allocate(need + watermark) or not self.bm.allocate(seq, n, match):
                break
            copy = self.bm.partial_copy(seq, match)
            if copy is not None:
                out.copies.append(copy)
            seq.num_computed_tokens = hit
            first = seq.num_cached_tokens < 0
            if first:  # the first admission's hit is what the cache served
                seq.num_cached_tokens = hit
            self.bm.admitted(seq, match, first)
            del self.waiting[i]
            self._start(seq, n, out)
            budget -= n
            in_flight.update(self._pending_keys(seq))

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
            out.started.append(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.add(seq, n)

    def _fork(self, seq: Sequence, out: SchedulerOutput) -> bool | None:
        """Start a sample of n from its parent's computed prompt: the full blocks shared, the last one
        copied (copy-on-write), so only the last prompt token is computed again, for its own logits.

        Returns:
            True when forked; None while the parent's prompt is still being computed; False when the
            fork cannot be made now (no free block), or ever (seq.fork_of is cleared: it is prefilled as
            any request, with the prefix cache).
        """
        parent = seq.fork_of
        if (seq.num_output_tokens or parent.is_finished
                or parent.token_ids[: seq.num_prompt_tokens] != seq.prompt_token_ids):
            seq.fork_of = None
            return False
        if parent.status is not SequenceStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens:
            return None
        watermark = self.config.watermark_blocks if self.running else 0
        if not self.bm.can_allocate(1 + watermark):
            return False
        copy = self.bm.fork(parent, seq)
        if copy is not None:
            out.copies.append(copy)
        seq.fork_of = None
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        if seq.num_cached_tokens < 0:  # served by its parent's computation, as a cache hit would be
            seq.num_cached_tokens = seq.num_computed_tokens
        self._start(seq, 1, out)
        return True

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        while not self.bm.allocate(seq, n):
            victim = max((s for s in self.running if s.status is SequenceStatus.RUNNING
                          and not any(x.seq is s for x in out.scheduled)), key=self.sort_key, default=None)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.cache_computed_blocks(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.sort_key)
        out.preempted.append(seq)

    def _pending_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of seq's full prompt blocks that are scheduled or still to be computed."""
        if not (self.bm.enable_prefix_cache and seq.cache_policy.write):
            return []
        keys = seq.full_block_hashes()[: seq.num_prompt_tokens // self.bm.block_size]
        return keys[seq.num_computed_tokens // self.bm.block_size:]

    def _in_flight_keys(self) -> set[bytes]:
        keys: set[bytes] = set()
        for s in self.running:
            if s.is_prefilling:
                keys.update(self._pending_keys(s))
        return keys

    def _waits_for_in_flight(self, seq: Sequence, hit: int, in_flight: set[bytes]) -> bool:
        if not in_flight or not (self.bm.enable_prefix_cache and seq.cache_policy.read):
            return False
        keys = seq.full_block_hashes()
        nxt = hit // self.bm.block_size
        return nxt < (seq.num_tokens - 1) // self.bm.block_size and keys[nxt] in in_flight
