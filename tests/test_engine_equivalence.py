"""Every scheduling path computes the same function: the logits at each position and the greedy text
do not depend on batching, prefix-cache hits, chunked prefill or recompute preemption.

The reference for each prompt set is one unchunked batch with the prefix cache bypassed. Each other
path must give identical greedy tokens and texts, fp32 logits within TOL at every position it
computed, and must compute every position except those its prefix-cache hit served.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from stratum.engine.config import SchedulerConfig
from stratum.engine import LLM, RequestStats
from stratum.models.loader import load_checkpoint
from stratum.engine.sampling_params import SamplingParams
from stratum.engine.request import CachePolicy, Sequence

TOL = 1e-3
BS = 16
_ids = itertools.count()


@dataclasses.dataclass
class Run:
    seqs: list[Sequence]
    texts: list[str]
    stats: list[RequestStats]


def greedy(max_tokens: int) -> SamplingParams:
    # ignore_eos keeps every path at exactly max_tokens, so all positions line up
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, policy: CachePolicy | None = None) -> Run:
    """Submit every prompt at once and step the engine until all are done."""
    engine = llm.engine
    seqs = [engine.add_request(p, greedy(max_tokens), request_id=f"eq-{next(_ids)}", cache_policy=policy)
            for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    outs = [finals[s.request_id] for s in seqs]
    assert all(o.finish_reason == "length" for o in outs)
    return Run(seqs, [o.text for o in outs], [o.stats for o in outs])


def run_alone(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Run:
    runs = [run(llm, [p], max_tokens, CachePolicy.bypass()) for p in prompts]
    return Run([r.seqs[0] for r in runs], [r.texts[0] for r in runs], [r.stats[0] for r in runs])


def assert_equivalent(ref: Run, other: Run) -> float:
    """Identical tokens and texts; logits within TOL wherever `other` computed them. Returns the max diff."""
    worst = 0.0
    for i, (r, o) in enumerate(zip(ref.seqs, other.seqs, strict=True)):
        assert o.token_ids == r.token_ids, f"prompt {i}: greedy tokens differ"
        assert other.texts[i] == ref.texts[i]
        assert sorted(r.readouts.logits) == list(range(r.num_tokens - 1))
        # every position is computed except those served by the prefix cache
        assert sorted(o.readouts.logits) == list(range(other.stats[i].num_cached_tokens, o.num_tokens - 1)), (
            f"prompt {i}")
        positions = sorted(o.readouts.logits)
        diff = (torch.stack([o.readouts.logits[p] for p in positions])
                - torch.stack([r.readouts.logits[p] for p in positions])).abs()
        worst = max(worst, float(diff.max()))
        assert worst <= TOL, f"prompt {i}: logits differ by {float(diff.max()):.2e}"
    return worst


# ---- the tiny random model: every path, cheaply -----------------------------------------------------


def tiny_prompts(num: int = 32, seed: int = 0) -> list[list[int]]:
    """A shared 40-token preamble (two full blocks) and distinct suffixes of 2..20 tokens."""
    rng = random.Random(seed)
    preamble = [rng.randrange(3, 460) for _ in range(40)]
    return [preamble + [rng.randrange(3, 460) for _ in range(rng.randrange(2, 21))] for _ in range(num)]


def tiny_llm(path, num_kv_blocks=256, budget=4096, enable_prefix_cache=True, watermark=4, max_num_seqs=64) -> LLM:
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, watermark_blocks=watermark)
    # one thread: the tiny model gains nothing from a second, which stalls on a busy machine
    return LLM(str(path), num_kv_blocks=num_kv_blocks, block_size=BS, dtype="float32", device="cpu",
               num_threads=1, enable_prefix_cache=enable_prefix_cache, scheduler=sched)


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir) -> Run:
    return run(tiny_llm(tiny_model_dir), tiny_prompts(), 16, CachePolicy.bypass())


def test_tiny_alone_equals_batched(tiny_model_dir, tiny_ref):
    alone = run_alone(tiny_llm(tiny_model_dir), tiny_prompts(), 16)
    assert_equivalent(tiny_ref, alone)


def test_tiny_prefix_hits_equal_no_hits(tiny_model_dir, tiny_ref):
    llm = tiny_llm(tiny_model_dir)
    cold = run(llm, tiny_prompts(), 16)
    # the first request computes the preamble; the rest wait one step for it, then hit its two full
    # blocks and copy the preamble's last 8 slots from its third
    assert [s.num_cached_tokens for s in cold.stats] == [0] + [40] * 31
    assert_equivalent(tiny_ref, cold)
    warm = run(llm, tiny_prompts(), 16)  # each prompt's own blocks, its tail's block filled by its output
    assert [s.num_cached_tokens for s in warm.stats] == [len(p) - 1 for p in tiny_prompts()]
    assert_equivalent(tiny_ref, warm)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_tiny_chunked_prefill_equals_unchunked(tiny_model_dir, tiny_ref, budget):
    llm = tiny_llm(tiny_model_dir, budget=budget, enable_prefix_cache=False)
    chunked = run(llm, tiny_prompts(), 16)
    assert all(s.num_cached_tokens == 0 for s in chunked.stats)
    assert max(st.num_batched_tokens for st in llm.engine.step_stats) <= budget
    assert_equivalent(tiny_ref, chunked)


@pytest.mark.parametrize("enable_prefix_cache", [False, True])
def test_tiny_recompute_preemption_equals_no_preemption(tiny_model_dir, tiny_ref, enable_prefix_cache):
    llm = tiny_llm(tiny_model_dir, num_kv_blocks=12, watermark=0, enable_prefix_cache=enable_prefix_cache)
    preempted = run(llm, tiny_prompts(), 16, None if enable_prefix_cache else CachePolicy.bypass())
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for s in preempted.stats) == llm.engine.scheduler.num_preemptions
    assert_equivalent(tiny_ref, preempted)


def test_tiny_one_token_chunk_behind_a_prefill(tiny_model_dir):
    """A prefix hit that leaves one token to compute, scheduled after another request's prefill chunk,
    is still a prefill (regression: the runner took it for a decode and the step failed)."""
    llm = tiny_llm(tiny_model_dir)
    engine = llm.engine
    rng = random.Random(1)
    x = [rng.randrange(3, 460) for _ in range(17)]
    alone = run_alone(tiny_llm(tiny_model_dir), [x], 4)
    run(llm, [x], 1)  # caches x's first block
    d = engine.add_request([5, 6, 7, 8], greedy(12), request_id="decoder")
    engine.step()
    engine.add_request([rng.randrange(3, 460) for _ in range(40)], greedy(2), request_id="long")
    y = engine.add_request(x, greedy(4), request_id="y")
    plans = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        plans.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = spy
    while engine.has_unfinished():
        engine.step()
    assert plans[0] == [("decoder", 1), ("long", 40), ("y", 1)]
    assert y.num_cached_tokens == 16
    assert y.token_ids == alone.seqs[0].token_ids
    for p in range(16, y.num_tokens - 1):
        assert torch.allclose(y.readouts.logits[p], alone.seqs[0].readouts.logits[p], atol=TOL, rtol=0)
    assert d.num_output_tokens == 12


# ---- the real model (SmolLM2-135M), fp32 --------------------------------------------------------------

PREAMBLE = ("You are a careful assistant who answers every question in one short sentence, using plain words, "
            "no lists and no greetings. If you are unsure, say so. Question: ")
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How many legs does a spider have?",
    "What does a compiler do?", "Who wrote Hamlet?", "What is photosynthesis?", "How far away is the Moon?",
    "What is the boiling point of water?", "Why do cats purr?", "What is a prime number?",
    "How do airplanes stay in the air?", "What is the largest ocean?", "Who painted the Mona Lisa?",
    "What causes rain?", "What is gravity?", "How many days are in a leap year?", "What is an atom?",
    "Why do leaves change color?", "What is the speed of light?", "What language is spoken in Brazil?",
    "How does a battery work?", "What is democracy?", "Why is the ocean salty?", "What is a black hole?",
    "How do bees make honey?", "What is the tallest mountain?", "What does DNA stand for?",
    "Why do we have seasons?", "What is a volcano?", "How do vaccines work?", "What is inflation?",
    "Who invented the telephone?",
]
REAL_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def real_checkpoint(real_model_path):
    return load_checkpoint(real_model_path)


def real_llm(path, checkpoint, num_kv_blocks=512, budget=4096, enable_prefix_cache=True, watermark=4) -> LLM:
    # the engine empties the checkpoint's dicts once the model holds them: give each engine its own
    ck = dataclasses.replace(checkpoint, weights=dict(checkpoint.weights), quantized=dict(checkpoint.quantized))
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, watermark_blocks=watermark)
    # one thread: on a shared 2-core machine a second OpenMP thread mostly waits, and makes steps 10x slower
    return LLM(str(path), checkpoint=ck, num_kv_blocks=num_kv_blocks, block_size=BS, dtype="float32",
               device="cpu", num_threads=1, enable_prefix_cache=enable_prefix_cache, scheduler=sched)


@pytest.fixture(scope="module")
def real_prompts(real_checkpoint) -> list[list[int]]:
    tok = real_checkpoint.tokenizer
    prompts = [tok.encode(PREAMBLE + q) for q in QUESTIONS]
    assert len(tok.encode(PREAMBLE)) >= 2 * BS  # two full shared blocks: prefix hits and cascade decode
    return prompts


@pytest.fixture(scope="module")
def real_base(real_model_path, real_checkpoint) -> LLM:
    return real_llm(real_model_path, real_checkpoint)


@pytest.fixture(scope="module")
def real_ref(real_base, real_prompts) -> Run:
    ref = run(real_base, real_prompts, REAL_MAX_TOKENS, CachePolicy.bypass())
    assert len(set(ref.texts)) > 16  # real, varied answers, not one degenerate string
    return ref


@pytest.mark.integration
def test_real_alone_equals_batched_with_31_others(real_base, real_prompts, real_ref):
    alone = run_alone(real_base, real_prompts, REAL_MAX_TOKENS)
    assert_equivalent(real_ref, alone)


@pytest.mark.integration
def test_real_prefix_hits_equal_no_hits(real_base, real_prompts, real_ref):
    real_base.engine.block_manager.reset_prefix_cache()
    cold = run(real_base, real_prompts, REAL_MAX_TOKENS)
    assert [s.num_cached_tokens for s in cold.stats] == [0] + [32] * 31
    assert_equivalent(real_ref, cold)
    warm = run(real_base, real_prompts, REAL_MAX_TOKENS)  # each prompt's own blocks, its tail's filled by its output
    assert [s.num_cached_tokens for s in warm.stats] == [len(p) - 1 for p in real_prompts]
    assert_equivalent(real_ref, warm)


@pytest.mark.integration
def test_real_chunked_prefill_equals_unchunked(real_model_path, real_checkpoint, real_prompts, real_ref):
    llm = real_llm(real_model_path, real_checkpoint, budget=24, enable_prefix_cache=False)
    chunked = run(llm, real_prompts, REAL_MAX_TOKENS)
    assert max(st.num_batched_tokens for st in llm.engine.step_stats) <= 24
    assert_equivalent(real_ref, chunked)


@pytest.mark.integration
def test_real_recompute_preemption_equals_no_preemption(real_model_path, real_checkpoint, real_prompts, real_ref):
    llm = real_llm(real_model_path, real_checkpoint, num_kv_blocks=16, watermark=0, enable_prefix_cache=False)
    preempted = run(llm, real_prompts, REAL_MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_equivalent(real_ref, preempted)
