"""The model runner: owns the KV pool, turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

import itertools
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from stratum.kernels import native
from stratum.layers.attention import AttentionMetadata, CoverageProbe, PrefillSpan
from stratum.models.llama import LlamaForCausalLM
from stratum.engine import grammar
from stratum.engine.sampler import Logprobs, sample
from stratum.engine.scheduler import SchedulerOutput

# Decodes share their common leading blocks through the cascade path only when it saves work.
_MIN_SHARED_BLOCKS = 2
# kv_sparsity is sampled, to keep its cost small: at a request's first sampled token (the end of its
# prefill) and at every COVERAGE_EVERY-th output token after, on the first, middle and last layer.
COVERAGE_EVERY = 8


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request_id -> new token, for sequences that sampled
    # request_id -> the logits of its rows, [proposals + 1, V], for sequences that verify proposed tokens
    # (`Speculator.verify` keeps what the target accepts)
    verify_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # request_id -> its token's logprobs, where asked for
    forward_s: float = 0.0  # wall time inside the model forward and logits
    mask_s: float = 0.0  # grammar masks


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU, over anonymous memory the OS zero-fills a page at a time when first
    touched, so the KV pool costs neither start-up time (torch.zeros wrote a 256 MB pool in 0.44 s of
    a 2.8 s warm start) nor resident memory until its blocks are used.

    The memory is advised for transparent huge pages where the kernel offers them: each step's
    attention reads every block of every context, and on 4 KB pages each block costs TLB misses
    (a 1 B decode step, two engines in one process stepping in turn: 1.7-2.1% faster on 2 MB pages at
    200-500 tokens of context, 0.8% at 1,000-1,300). A page is then zero-filled 2 MB at a time, when
    a block in it is first used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}
    memory = mmap.mmap(-1, max(nbytes, 1), **private)  # private: a forked child copies on write, never shares
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: 4 KB pages
            pass
    return torch.frombuffer(memory, dtype=dtype, count=math.prod(shape)).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, use_native: bool = True):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        num_slots = num_blocks * block_size
        # kv_caches[layer] = (k, v), each [num_slots, num_kv_heads, head_dim]; the native step keeps
        # each block of k transposed, [num_kv_heads, head_dim, block_size]
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_layers)]
        self._offsets = torch.arange(block_size, device=device)
        n = cfg.num_layers
        self.coverage_layers = frozenset({0, n // 2, n - 1})
        # decode attention reads the pool in place through the native kernel where it is built (CPU)
        # (use_native False: a cold start's PyTorch step, which must not wait for them to compile)
        self.native = use_native and device.type == "cpu" and native.available()
        # sliding windows and soft-capped scores are computed on PyTorch (layers.attention): every decode's
        # context gathered, no native decode kernel and no shared-prefix cascade
        self.masked_attention = cfg.has_masked_attention
        self.grammars: grammar.GrammarCompiler | None = None  # the engine's, for constrained requests

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step. Sequences whose computed tokens reach num_tokens sample their next token;
        those verifying proposed tokens get their rows' logits (`RunnerOutput.verify_rows`)."""
        for src, dst in sched.copies:  # a forked sample's last prompt block, a partial prefix match's slots
            a, b = src * self.block_size, dst * self.block_size
            for k, v in self.kv_caches:
                k[b : b + self.block_size] = k[a : a + self.block_size]
                v[b : b + self.block_size] = v[a : a + self.block_size]
        input_ids, positions, meta, logit_rows, samplers, recorders, verifiers = self._prepare(sched)
        fast_rows = [j for seq, j in samplers if seq.sampler.is_low_latency]
        t0 = time.perf_counter()
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if any(item.seq.readouts.pooling for item in sched.scheduled):
            self._read_hidden(sched, hidden)
        if meta.probe is not None:
            for seq, values in zip(meta.probe.seqs, meta.probe.results):
                seq.readouts.coverage_sum += sum(values) / len(values)
                seq.readouts.coverage_count += 1
        logits = self._logits(hidden, logit_rows, fast_rows) if logit_rows else None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = RunnerOutput(forward_s=t1 - t0)
        if logits is None:
            return out
        logits = logits.cpu()
        for seq, index, pos in recorders:
            if seq.sampling.return_logits:
                for j, p in zip(index, pos):
                    seq.readouts.logits.setdefault(p, logits[j].clone())
            if seq.sampling.prompt_logprobs is not None:
                self._score_prompt(seq, logits, index, pos)
        if samplers:
            self._sample(logits, samplers, out, t1)
        for seq, first, k in verifiers:
            out.verify_rows[seq.request_id] = logits[first : first + k + 1]
        return out

    @staticmethod
    def _read_hidden(sched: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Embedding requests' final hidden states out of the step's rows (`Readouts.hidden`)."""
        row = 0
        for item in sched.scheduled:
            seq, n, start = item.seq, item.num_new_tokens, item.start
            out = seq.readouts
            if out.pooling == "mean":
                if out.hidden is None:
                    out.hidden = torch.empty(seq.num_prompt_tokens, hidden.shape[1])
                out.hidden[start : start + n] = hidden[row : row + n].float().cpu()
            elif out.pooling == "last" and start + n == seq.num_tokens:
                out.hidden = hidden[row + n - 1].float().cpu()
            row += n

    @staticmethod
    def pooled(seq) -> list[float]:
        """An embedding request's vector once its prefill is done: its rows' mean (over every prompt
        position at once, so how its prefill was chunked does not change it) or its last row, at unit
        length (as llama-server's embeddings are by default)."""
        out = seq.readouts
        vector = out.hidden.mean(0) if out.pooling == "mean" else out.hidden
        return torch.nn.functional.normalize(vector, dim=0).tolist()

    @staticmethod
    def read_verified(seq, start: int, rows: torch.Tensor, num_kept: int) -> None:
        """After a verify step kept num_kept tokens: with return_logits, the rows whose input was kept
        (their positions, from start, are computed) join the request's logits."""
        if seq.sampling.return_logits:
            for i in range(num_kept):
                seq.readouts.logits.setdefault(start + i, rows[i].clone())

    def _sample(self, logits: torch.Tensor, samplers: list, out: RunnerOutput, t1: float) -> None:
        idx = [j for _, j in samplers]
        seqs = [s for s, _ in samplers]
        allowed = None
        constrained = [i for i, s in enumerate(seqs) if s.sampler.matcher is not None]
        if constrained:
            masks = grammar.allowed_tokens([seqs[i].sampler.matcher for i in constrained], logits.shape[-1])
            allowed = {}
            for i, mask in zip(constrained, masks):
                seq = seqs[i]
                if (seq.sampling.max_tokens - seq.num_output_tokens <= grammar.WIND_DOWN_TOKENS
                        and not seq.sampler.matcher.is_accepting()):
                    mask = grammar.wind_down(mask, self.grammars.closers)
                allowed[i] = mask
            out.mask_s = time.perf_counter() - t1
        for i, seq in enumerate(seqs):
            if seq.sampler.forced_token_ids:  # the engine writes this token (a thought's end at its budget)
                allowed = allowed if allowed is not None else {}
                allowed[i] = torch.zeros(logits.shape[-1], dtype=torch.bool)
                allowed[i][seq.sampler.forced_token_ids[0]] = True
        # usually every row samples: no copy, unless grammar masks will write into the rows (the
        # logits are an inference-mode tensor, not writable here)
        rows = logits if allowed is None and idx == list(range(len(logits))) else logits[idx]
        result = sample(rows, [s.sampling for s in seqs], [s.sampler.generator for s in seqs], allowed)
        out.sampled = {s.request_id: t for s, t in zip(seqs, result.tokens)}
        out.logprobs = {s.request_id: lp for s, lp in zip(seqs, result.logprobs) if lp is not None}

    def last_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """The logits of each scheduled item's last row, [items, V], for a draft model's proposals:
        nothing is sampled, recorded or probed."""
        input_ids, positions, meta, *_ = self._prepare(sched, probe=False)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        ends = list(itertools.accumulate(item.num_new_tokens for item in sched.scheduled))
        return self.model.compute_logits(hidden[torch.tensor(ends, device=self.device) - 1]).cpu()

    @staticmethod
    def _score_prompt(seq, logits: torch.Tensor, index: range, pos: range) -> None:
        """Each prompt token's log-probability given the tokens before it, from the row one position back
        (the raw model distribution), with the top alternatives there."""
        scored = seq.readouts.prompt_logprobs
        pairs = [(j, p + 1) for j, p in zip(index, pos) if p + 1 < seq.num_prompt_tokens and p + 1 not in scored]
        if not pairs:
            return
        rows = torch.log_softmax(logits[[j for j, _ in pairs]], dim=-1)
        targets = torch.tensor([seq.token_ids[p] for _, p in pairs])
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        top = seq.sampling.prompt_logprobs
        values, ids = rows.topk(top, dim=-1) if top else (None, None)
        for k, (_, p) in enumerate(pairs):
            alternatives = list(zip(ids[k].tolist(), values[k].tolist())) if top else []
            scored[p] = (chosen[k], alternatives)

    def _logits(self, hidden: torch.Tensor, logit_rows: list[int], fast_rows: list[int]) -> torch.Tensor:
        """Logits of the selected rows; rows of low-latency requests use the fast output projection."""
        if not fast_rows or self.model.lm_head_int8 is None:
            first = logit_rows[0]
            if logit_rows == list(range(first, first + len(logit_rows))):  # a decode's, a verify's: a view, no gather
                return self.model.compute_logits(hidden[first : first + len(logit_rows)])
            return self.model.compute_logits(hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)])
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        fast = torch.tensor(fast_rows, dtype=torch.long, device=self.device)  # indices into logit_rows
        is_fast = torch.zeros(len(logit_rows), dtype=torch.bool, device=self.device)
        is_fast[fast] = True
        logits = torch.empty(len(logit_rows), self.model.config.vocab_size, device=self.device)
        logits[is_fast] = self.model.compute_logits(hidden[rows[is_fast]], fast=True)
        if not bool(is_fast.all()):
            logits[~is_fast] = self.model.compute_logits(hidden[rows[~is_fast]])
        return logits

    def _prepare(self, sched: SchedulerOutput, probe: bool = True):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        samplers = []  # (seq, row in logits)
        recorders = []  # (seq, logits rows, positions) for return_logits and prompt logprobs
        verifiers = []  # (seq, its first logits row, proposed tokens): every row of a verify step has logits
        decode_seqs = []
        prefills: list[PrefillSpan] = []
        probe = CoverageProbe(self.coverage_layers) if probe else None
        packed = self.model.packed is not None
        tables: list[list[int]] = []  # the native step's: one block table per sequence, and each row's
        row_seq: list[int] = []
        for item in sched.scheduled:
            seq, n, start = item.seq, item.num_new_tokens, item.start
            row0 = len(ids)
            tokens = seq.token_ids[start : start + n]
            if len(tokens) < n:  # proposed tokens, after the last one (a verify step, or a draft model's)
                first = max(0, start - seq.num_tokens)
                tokens = tokens + seq.spec_token_ids[first : first + n - len(tokens)]
            ids += tokens
            pos += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            will_sample = start + n == seq.num_tokens and seq.num_output_tokens < seq.sampling.max_tokens
            scores_prompt = seq.sampling.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1
            if item.num_spec_tokens:
                verifiers.append((seq, len(logit_rows), item.num_spec_tokens))
                logit_rows += range(row0, row0 + n)
            elif seq.sampling.return_logits or scores_prompt:
                first = len(logit_rows)
                logit_rows += range(row0, row0 + n)
                recorders.append((seq, range(first, first + n), range(start, start + n)))
                if will_sample:
                    samplers.append((seq, first + n - 1))
            elif will_sample:
                samplers.append((seq, len(logit_rows)))
                logit_rows.append(row0 + n - 1)
            # a verify step's first row is its decode row; it samples when its tokens pass a multiple
            if probe is not None and (will_sample and seq.num_output_tokens % COVERAGE_EVERY == 0 or (
                    item.num_spec_tokens and -seq.num_output_tokens % COVERAGE_EVERY < n)):
                row = row0 if item.num_spec_tokens else row0 + n - 1
                probe.rows.append(row)
                if not packed:  # the native step reads the context through the row's block table
                    probe.slots.append(self._slots_of(table, start + row - row0 + 1))
                probe.results.append([])
                probe.seqs.append(seq)
            if packed:  # every row attends through its sequence's block table
                row_seq += [len(tables)] * n
                tables.append(table[: -(-(start + n) // bs)])
            elif item.is_decode and n == 1 and not prefills:
                # the batch's leading decodes (a late one-token chunk stays a prefill)
                decode_seqs.append(seq)
            elif start == 0:
                prefills.append(PrefillSpan(row0, row0 + n))
            else:
                ctx = start + n
                mask = torch.ones(n, ctx, dtype=torch.bool, device=self.device).tril(diagonal=start)
                prefills.append(PrefillSpan(row0, row0 + n, self._slots_of(table, ctx), mask))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                                 native=self.native, block_size=bs)
        if packed:
            width = max(len(t) for t in tables)
            meta.row_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            meta.row_seq = torch.tensor(row_seq, dtype=torch.long)
        if decode_seqs:
            self._prepare_decode(decode_seqs, meta)
        meta.prefills = prefills
        meta.probe = probe if probe is not None and probe.rows else None
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
                meta, logit_rows, samplers, recorders, verifiers)

    def _slots_of(self, table: list[int], ctx: int) -> torch.Tensor:
        blocks = torch.tensor(table[: -(-ctx // self.block_size)], dtype=torch.long, device=self.device)
        return (blocks[:, None] * self.block_size + self._offsets).flatten()[:ctx]

    def _prepare_decode(self, seqs, meta: AttentionMetadata) -> None:
        bs = self.block_size
        ctx_lens = [s.num_computed_tokens + 1 for s in seqs]
        shared = 0
        if len(seqs) > 1 and not self.masked_attention:
            first = seqs[0].block_table
            limit = min((c - 1) // bs for c in ctx_lens)  # the block being written is never shared
            while shared < limit and all(s.block_table[shared] == first[shared] for s in seqs):
                shared += 1
            if shared < _MIN_SHARED_BLOCKS:
                shared = 0
        num_blocks = max(-(-c // bs) for c in ctx_lens) - shared
        table = torch.zeros(len(seqs), num_blocks, dtype=torch.long)
        for i, s in enumerate(seqs):
            row = s.block_table[shared : -(-ctx_lens[i] // bs)]
            table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        table = table.to(self.device)
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=self.device) - shared * bs
        meta.num_decode_tokens = len(seqs)
        meta.decode_lens = lens
        if self.native and not self.masked_attention:
            meta.decode_table, meta.block_size = table, bs
        else:
            meta.decode_slots = (table[:, :, None] * bs + self._offsets).flatten(1)  # [B, L]
            span = torch.arange(meta.decode_slots.shape[1], device=self.device)
            meta.decode_mask = (span[None, :] < lens[:, None]).view(len(seqs), 1, 1, -1)
        if shared:
            meta.shared_slots = self._slots_of(seqs[0].block_table, shared * bs)
