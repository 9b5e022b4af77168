"""The engine's speculation: before each step it proposes tokens for the decoding requests, and after
it settles what was kept.

Proposals are verified only where the numerics say the step is batch-invariant (a verify row then
computes what a decode row would, bit for bit), read at each step: elsewhere speculation is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from stratum.engine.spec_decode.ngram import NgramIndex
from stratum.engine.spec_decode.policy import DRAFT_BUCKET, Acceptance, StepCost, bucket_of, choose
from stratum.engine.spec_decode.verify import verify

MODES = ("auto", "off", "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """How the engine speculates.

    mode: "auto" proposes by prompt lookup (by the draft model when one is given) where the measured
        step cost and the acceptance so far say it pays, per request and step; "ngram" and "draft"
        propose with that proposer whenever it has a proposal; "off" never.
    num_tokens: the most tokens proposed per request and step.
    lookup_min, lookup_max: the n-gram lengths prompt lookup matches.
    draft_model: a GGUF file or folder with the target's tokenizer.
    """

    mode: str = "auto"
    num_tokens: int = 16
    lookup_min: int = 2
    lookup_max: int = 5
    draft_model: str | None = None

    @classmethod
    def of(cls, config) -> "SpecConfig":
        """From an EngineConfig. Raises ValueError for settings that cannot work together."""
        spec = cls(config.speculative, config.num_speculative_tokens, config.prompt_lookup_min,
                   config.prompt_lookup_max, config.draft_model)
        if spec.mode not in MODES:
            raise ValueError(f"speculative: {spec.mode!r} is not one of {', '.join(MODES)}")
        if spec.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {spec.num_tokens}")
        if not 1 <= spec.lookup_min <= spec.lookup_max:
            raise ValueError(f"prompt lookup n-grams need 1 <= min <= max, got {spec.lookup_min}..{spec.lookup_max}")
        if spec.mode == "draft" and not spec.draft_model:
            raise ValueError("speculative draft needs --draft-model")
        return spec

    @property
    def uses_draft(self) -> bool:
        return self.draft_model is not None and self.mode in ("auto", "draft")


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its n-gram index, what it proposed and kept, and (with a draft
    model) up to where the draft pool holds its KV."""

    index: NgramIndex | None = None
    bucket: int = 0  # the pending proposal's kind (policy.bucket_of, or DRAFT_BUCKET)
    num_proposed: int = 0
    num_accepted: int = 0
    num_rejected: int = 0  # verify steps that rejected a proposal
    num_steps: int = 0  # verify steps
    draft_computed: int = 0
    draft_preemptions: int = 0  # the request's preemptions when draft_computed was last true


def verify_refusal(numerics, model) -> str | None:
    """Why the target's step cannot verify proposals exactly (None where it can). Greedy answers stay
    those of plain decoding only where a token's logits do not depend on the rows beside it
    (`Numerics.is_batch_invariant`, kernels/numerics.py), the output projection's included."""
    if not numerics.is_batch_invariant:
        return (f"the {numerics.step} step ({numerics.dtype}) is not batch-invariant: which kernel runs a matmul "
                "depends on its rows, so a verify row need not compute what a decode row would")
    if model.packed_head is None:
        return "the output projection is not on the native kernel, so its rows depend on the batch"
    return None


class Speculator:
    """Args:
        config: what the user set.
        numerics: the target's numerics now (the engine's `config.numerics`, which a kernel switch
            changes): read whenever the speculator decides whether it may verify.
        model, plan: the target model and its kernel plan (`set_target` on a kernel switch).
        draft: the draft model, when one is given.
    """

    def __init__(self, config: SpecConfig, numerics: Callable, model, plan, draft=None):
        self.config = config
        self.numerics = numerics
        self.draft = draft
        self.acceptance = Acceptance()
        self.states: dict[str, SpecState] = {}  # by request id, from its first proposal to `forget`
        self.set_target(model, plan)

    @classmethod
    def build(cls, spec: SpecConfig, settings, resolved, tokenizer, model, numerics: Callable,
              provisional: bool) -> "Speculator":
        """The engine's speculator, with its draft model (and the draft's KV pool) where spec names one.

        Args:
            settings, resolved: the engine's EngineConfig and ResolvedConfig.
            provisional: the engine starts on a cold start's provisional step (so does the draft).
        """
        draft = None
        if spec.uses_draft:
            from stratum.engine.spec_decode.draft import DraftModel

            draft = DraftModel(spec.draft_model, tokenizer, settings, resolved.num_threads, provisional=provisional)
            draft.attach(resolved.num_kv_blocks, resolved.block_size)
        return cls(spec, numerics, model, resolved.kernel_plan, draft)

    def set_target(self, model, plan) -> None:
        self.model = model
        # a plan measured while other processes held the cores kept its figures only to show why
        self.cost = StepCost(plan.timings_us if plan.quiet else {}, model.config.num_layers, plan.threads)

    @property
    def refusal(self) -> str | None:
        """Why nothing is verified now (None: proposals are)."""
        if self.config.mode == "off":
            return "--speculative off"
        numerics = self.numerics()
        why = verify_refusal(numerics, self.model)
        if why is None and self.draft is not None:
            why = self.draft.disagreement(numerics)
        return why

    @property
    def is_active(self) -> bool:
        return self.refusal is None

    def describe(self) -> dict:
        """For `kernel_choices` (and `stratum info`)."""
        why = self.refusal
        if why is not None:
            return {"mode": "off", "why": why}
        proposer = f"draft model {self.draft.name} ({self.draft.numerics.step} step)" if self.draft is not None else (
            f"prompt lookup, {self.config.lookup_min}- to {self.config.lookup_max}-grams")
        return {"mode": self.config.mode, "proposer": proposer, "max_tokens_per_step": self.config.num_tokens}

    def propose(self, running: list, budget: int, allowed: bool = True) -> None:
        """Before the step is scheduled: each decoding request's proposals (seq.spec_token_ids; a
        draft model's are placeholders, filled once the step is scheduled: `draft_proposals`).
        allowed: False in the engine's basic mode (every proposal is cleared)."""
        for seq in running:
            seq.spec_token_ids.clear()
        if not self.is_active or not allowed:
            return
        decodes = [s for s in running if s.is_decoding]  # (a forced token is written alone, unproposed)
        chosen = []  # (seq, proposal, acceptance rate)
        for seq in decodes:
            most = min(self.config.num_tokens, seq.sampling.max_tokens - seq.num_output_tokens - 1)
            if most <= 0 or seq.sampler.forced_token_ids:
                continue
            state = self.states.get(seq.request_id)
            if state is None:
                cfg = self.config
                state = self.states[seq.request_id] = SpecState(
                    None if self.draft is not None else NgramIndex(cfg.lookup_min, cfg.lookup_max))
            if self.draft is not None:
                proposal, state.bucket = [-1] * most, DRAFT_BUCKET
            else:
                proposal, match = state.index.propose(seq.token_ids, most)
                if not proposal:
                    continue
                state.bucket = bucket_of(match)
            chosen.append((seq, proposal, self.acceptance.rate(state.bucket, state.num_accepted, state.num_rejected)))
        if not chosen:
            return
        if self.config.mode == "auto":
            prefill = sum(s.num_tokens - s.num_computed_tokens for s in running if not s.is_decoding)
            rows = len(decodes) + min(prefill, max(0, budget - len(decodes)))
            level_s = self.draft.level_s if self.draft is not None else 0.0
            ks = choose(self.cost, [(rate, len(p)) for _, p, rate in chosen], len(decodes), rows, level_s)
        else:
            ks = [len(p) for _, p, _ in chosen]
        for (seq, proposal, _), k in zip(chosen, ks):
            seq.spec_token_ids[:] = proposal[:k]

    def draft_proposals(self, scheduled: list) -> float:
        """Once the step is scheduled: the draft model fills the proposals it was given room for.
        Returns the seconds the draft model took."""
        items = [item for item in scheduled if item.num_spec_tokens] if self.draft is not None else []
        return self.draft.propose(items, self.states) if items else 0.0

    def verify(self, item, rows, grammars) -> tuple[list[int], list, int]:
        """After a verify step: the tokens item's request keeps from its rows' logits (`verify`), with
        what it proposed and kept counted.

        Returns:
            (the accepted proposals and the target's next token, their log-probabilities, how many
            proposals were accepted).
        """
        seq, k = item.seq, item.num_spec_tokens
        kept, logprobs = verify(rows, seq, seq.spec_token_ids[:k], grammars)
        proposals = seq.spec_token_ids
        accepted = 0
        while accepted < min(k, len(kept)) and kept[accepted] == proposals[accepted]:
            accepted += 1
        state = self.states[seq.request_id]
        state.num_proposed += k
        state.num_accepted += accepted
        state.num_rejected += accepted < k
        state.num_steps += 1
        self.acceptance.record(state.bucket, accepted, k)
        if self.draft is not None:
            self.draft.settle(state, item.start, k, len(kept))
        return kept, logprobs, accepted

    def counts(self, request_id: str) -> tuple[int, int, int]:
        """A request's proposed and accepted tokens, and its verify steps."""
        state = self.states.get(request_id)
        return (state.num_proposed, state.num_accepted, state.num_steps) if state is not None else (0, 0, 0)

    def forget(self, request_id: str) -> None:
        """The request ended."""
        self.states.pop(request_id, None)

    def observe_step(self, scheduled: list, step_s: float) -> None:
        """A step ran: a decode-only step's time calibrates the cost model (`StepCost.observe`)."""
        if not scheduled or not self.is_active or any(not item.is_decode for item in scheduled):
            return
        rows = sum(item.num_new_tokens for item in scheduled)
        self.cost.observe(rows, rows, step_s)
