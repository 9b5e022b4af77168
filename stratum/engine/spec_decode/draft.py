"""A draft model: a smaller model of the same tokenizer proposes each request's next tokens, its most
likely one at a time, and the target verifies them in one step.

The draft keeps a KV pool of its own tensors over the target's block ids: a request's block table
addresses both, so the scheduler's accounting (allocation, preemption, the rollback of rejected
positions) holds for the draft as it is. What the draft pool holds for a request is tracked per
request (`SpecState.draft_computed`), not per block, and caught up before it proposes: a block another
request computed may hold target KV the draft never wrote, and rewriting a shared block with the
draft's KV of the same tokens writes what is there already.
"""

from __future__ import annotations

import time
import torch

from stratum.engine.config import EngineConfig
from stratum.engine.model_runner import ModelRunner
from stratum.engine.sampler import argmax_rows
from stratum.engine.scheduler import ScheduledSeq, SchedulerOutput


def check_same_tokenizer(target, draft, draft_name: str) -> None:
    """Proposals are token ids: the draft's must mean what the target's do.

    Raises:
        ValueError: the vocabularies or the special tokens differ (the message names the first difference).
    """
    a, b = target.backend.get_vocab(with_added_tokens=True), draft.backend.get_vocab(with_added_tokens=True)
    if a != b:
        token = next((t for t in sorted(a.keys() | b.keys()) if a.get(t) != b.get(t)), None)
        raise ValueError(f"draft model {draft_name}: its tokenizer differs from the target's ({len(b)} tokens against "
                         f"{len(a)}; token {token!r} is id {b.get(token)} there, {a.get(token)} in the target)")
    for name in ("bos_token_id", "eos_token_ids"):
        if getattr(target, name) != getattr(draft, name):
            raise ValueError(f"draft model {draft_name}: {name} {getattr(draft, name)} differs from the target's "
                             f"{getattr(target, name)}")


class DraftModel:
    """The draft model and its KV pool (`attach`).

    Its numerics come from the rule (kernels/numerics.py) applied to the draft's file with the target's
    settings, on the kernels the target has: a cold start's draft runs on the provisional step as its
    target does, and follows it to the native kernels at the switch (`follow`).

    Args:
        path: the draft's GGUF file or folder (or registered name).
        tokenizer: the target's tokenizer, which the draft's must equal.
        settings: the target's EngineConfig: the draft runs on the device, dtype and step it asks for.
        threads: the engine's threads.
        provisional: the target serves on a cold start's provisional step (its kernels being prepared).
    Raises:
        ValueError: the draft cannot be loaded, or its tokenizer is not the target's.
    """

    def __init__(self, path: str, tokenizer, settings: EngineConfig, threads: int, provisional: bool = False):
        from stratum.engine import builder

        self.name = path
        self.settings = EngineConfig(model=path, device=settings.device, dtype=settings.dtype, num_threads=threads,
                                     int4_max_tokens=settings.int4_max_tokens, native_step=settings.native_step,
                                     activations=settings.activations,
                                     num_kv_blocks=16)
        checkpoint = builder.load(self.settings)
        check_same_tokenizer(tokenizer, checkpoint.tokenizer, path)
        self.config = checkpoint.config
        self.runner: ModelRunner | None = None
        self.level_s = 0.0  # the latest draft forward of one token per request, measured
        self._build(checkpoint, provisional)

    def _build(self, checkpoint, provisional: bool) -> None:
        from stratum.engine import builder

        resolved = (builder.provisional(self.settings, checkpoint) if provisional
                    else builder.resolve(self.settings, checkpoint, measure=False))
        self.numerics = resolved.numerics
        self.provisional = provisional
        self.device, self.kv_dtype = torch.device(resolved.device), resolved.torch_kv_dtype
        self.model, _ = builder.build_model(resolved, checkpoint)

    def follow(self, provisional: bool) -> None:
        """The target switched kernels: rebuild the draft on the kernels the target now has (its KV
        pool follows at `attach`)."""
        if provisional != self.provisional:
            from stratum.engine import builder

            self._build(builder.load(self.settings), provisional)

    def disagreement(self, target) -> str | None:
        """Why the draft cannot propose for a target with numerics `target` (None: it can): the two
        share block ids, so they sit on one device. Which step the draft runs on never changes an
        answer (the target verifies every proposal); it only changes what a proposal costs."""
        if self.numerics.device != target.device:
            return f"the draft model runs on {self.numerics.device}, the target on {target.device}"
        return None

    def attach(self, num_blocks: int, block_size: int) -> None:
        """A KV pool over the target's block ids (a new one on a kernel switch: its requests were
        preempted, so none holds draft KV)."""
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, self.kv_dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes if self.runner is not None else 0

    def propose(self, items: list[ScheduledSeq], states: dict) -> float:
        """Fill each item's proposals (item.num_spec_tokens of them) with the draft's greedy tokens.

        The first forward catches the draft's KV up to the request's last token and proposes after
        it; each further forward takes the previous proposal. Every request's state says up to where
        the draft pool holds its KV (`SpecState.draft_computed`, in `states` by request id). Returns
        the seconds it took."""
        t_start = time.perf_counter()
        for item in items:
            item.seq.spec_token_ids.clear()
        level = 0
        while True:
            batch = [item for item in items if item.num_spec_tokens > level]
            if not batch:
                return time.perf_counter() - t_start
            sched = SchedulerOutput()
            for item in batch:
                seq, state = item.seq, states[item.seq.request_id]
                if state.draft_preemptions != seq.num_preemptions:  # its blocks were given up since
                    state.draft_computed, state.draft_preemptions = 0, seq.num_preemptions
                first = min(state.draft_computed, item.start) if level == 0 else item.start + level
                sched.scheduled.append(ScheduledSeq(seq, item.start + level + 1 - first, first, False))
            t0 = time.perf_counter()
            tokens = argmax_rows(self.runner.last_logits(sched))
            if level:
                self.level_s = time.perf_counter() - t0
            for item, token in zip(batch, tokens):
                item.seq.spec_token_ids.append(token)
            level += 1

    @staticmethod
    def settle(state, start: int, num_proposed: int, num_kept: int) -> None:
        """After a verify step that kept num_kept tokens: the draft pool holds the request's KV at the
        positions whose input was kept (it wrote start .. start + num_proposed - 1)."""
        state.draft_computed = start + min(num_kept, num_proposed)
