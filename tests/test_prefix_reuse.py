"""Twenty requests that share a long system prompt, submitted together, compute that prompt once.

With block size 16 a 600-token shared prompt is 37 full blocks (592 tokens) and 8 tokens in a block
that each request completes with its own suffix, so:

    request 0:      computes 600 + suffix_0                  (cached 0)
    requests 1-19:  compute  8 + suffix_i                    (cached 592: shared blocks 0..36)
    total:          600 + sum(suffixes) + 19 * 8

The first request's 600+ tokens do not fit one step's budget (512); the others wait for its chunks
(in-flight prefix dedup) instead of computing the same blocks alongside it.
"""

from __future__ import annotations

import random

import pytest

from stratum.engine.config import SchedulerConfig
from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams

BS = 16
SHARED = 600
NUM_REQUESTS = 20


def tiny_llm(path, budget: int = 512) -> LLM:
    return LLM(str(path), num_kv_blocks=256, block_size=BS, dtype="float32", device="cpu", num_threads=1,
               scheduler=SchedulerConfig(max_num_batched_tokens=budget))


def shared_prompt_requests(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 460) for _ in range(SHARED)]
    suffixes = [[rng.randrange(3, 460) for _ in range(5 + i)] for i in range(NUM_REQUESTS)]  # 5..24 tokens
    return system, suffixes


def test_twenty_requests_compute_a_shared_600_token_prompt_once(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    system, suffixes = shared_prompt_requests()
    outs = llm.generate([system + s for s in suffixes], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    shared_cached = SHARED // BS * BS
    assert shared_cached == 592

    cached = [o.stats.num_cached_tokens for o in outs]
    computed = [o.stats.num_prompt_tokens_computed for o in outs]
    assert cached == [0] + [592] * (NUM_REQUESTS - 1)
    assert computed == [SHARED + len(suffixes[0])] + [SHARED - 592 + len(s) for s in suffixes[1:]]
    assert sum(computed) == SHARED + sum(len(s) for s in suffixes) + (NUM_REQUESTS - 1) * 8 == 1042
    for o, s in zip(outs, suffixes):
        assert o.stats.num_prompt_tokens == SHARED + len(s)
        assert o.stats.num_cached_tokens + o.stats.num_prompt_tokens_computed == o.stats.num_prompt_tokens
        assert o.stats.num_preemptions == 0 and len(o.token_ids) == 4

    engine = llm.engine
    # every forward token is accounted for: the prompt tokens above plus 3 computed decodes per request
    assert sum(st.num_batched_tokens for st in engine.step_stats) == sum(computed) + NUM_REQUESTS * 3
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_integrity()


def test_the_shared_prompt_is_computed_once_even_when_it_fits_one_step(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, budget=4096)
    system, suffixes = shared_prompt_requests(seed=1)
    outs = llm.generate([system + s for s in suffixes], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert [o.stats.num_cached_tokens for o in outs] == [0] + [592] * (NUM_REQUESTS - 1)
    assert sum(o.stats.num_prompt_tokens_computed for o in outs) == 600 + sum(map(len, suffixes)) + 19 * 8


def test_a_second_wave_reuses_the_first_waves_prompt_blocks(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    system, suffixes = shared_prompt_requests(seed=2)
    llm.generate([system + suffixes[0]], SamplingParams(max_tokens=1, temperature=0.0))
    outs = llm.generate([system + s for s in suffixes[1:]], SamplingParams(max_tokens=1, temperature=0.0))
    assert [o.stats.num_cached_tokens for o in outs] == [592] * (NUM_REQUESTS - 1)
    assert [o.stats.num_prompt_tokens_computed for o in outs] == [8 + len(s) for s in suffixes[1:]]


def test_tenants_with_different_salts_each_compute_the_prompt(tiny_model_dir):
    engine = tiny_llm(tiny_model_dir).engine
    system, suffixes = shared_prompt_requests(seed=3)
    seqs = [engine.add_request(system + s, SamplingParams(max_tokens=1, temperature=0.0),
                               request_id=f"r{i}", cache_salt=f"tenant-{i % 2}")
            for i, s in enumerate(suffixes)]
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out.stats) for out in engine.step() if out.finished)
    stats = [finals[s.request_id] for s in seqs]
    # one full computation per tenant (requests 0 and 1), every other request hits its own tenant's copy
    assert [s.num_cached_tokens for s in stats] == [0, 0] + [592] * (NUM_REQUESTS - 2)
    assert sum(s.num_prompt_tokens_computed for s in stats) == 2 * 600 + sum(map(len, suffixes)) + 18 * 8


def test_a_partly_matching_block_is_copied_not_recomputed(tiny_model_dir):
    """The shared prompt's last 8 tokens sit in block 37 with the first request's own suffix: a later
    request copies those 8 slots from it instead of computing them, and answers exactly as it would
    have with no cache at all."""
    system, suffixes = shared_prompt_requests(seed=4)
    first, later = system + [7] * 20, [system + s for s in suffixes[1:6]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = tiny_llm(tiny_model_dir)
    llm.generate([first], greedy)  # blocks 0..37 cached, 37 holding 8 shared tokens and 8 of its own
    outs = llm.generate(later, greedy)
    assert [o.stats.num_cached_tokens for o in outs] == [SHARED] * 5
    assert [o.stats.num_prompt_tokens_computed for o in outs] == [len(s) for s in suffixes[1:6]]
    reference = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=BS, dtype="float32", device="cpu",
                    num_threads=1, enable_prefix_cache=False).generate(later, greedy)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.engine.block_manager.check_integrity()


def test_a_prompt_ending_inside_a_cached_block_reads_all_but_its_last_token(tiny_model_dir):
    system, _ = shared_prompt_requests(seed=5)
    llm = tiny_llm(tiny_model_dir)
    llm.generate([system + [7] * 20], SamplingParams(max_tokens=1, temperature=0.0))
    out = llm.generate([system], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.stats.num_cached_tokens == SHARED - 1 and out.stats.num_prompt_tokens_computed == 1


def test_partial_matches_stay_within_a_tenant(tiny_model_dir):
    engine = tiny_llm(tiny_model_dir).engine
    system, _ = shared_prompt_requests(seed=6)

    def run(prompt, salt):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"r{run.i}",
                                 cache_salt=salt)
        run.i += 1
        while engine.has_unfinished():
            engine.step()
        return seq.num_cached_tokens
    run.i = 0

    assert run(system + [7] * 20, "a") == 0
    assert run(system[:40] + [9] * 30, "b") == 0  # another tenant reads neither blocks nor slots
    assert run(system[:40] + [9] * 30, "a") == 40  # two full blocks and 8 slots of the third
    assert run(system[:10] + [8] * 30, "a") == 0  # a partial match follows a full one: never at the root,
    #                                               whose children are every tenant's first blocks


@pytest.mark.integration
def test_real_chat_requests_share_a_long_system_prompt(real_model_path):
    llm = LLM(str(real_model_path), num_kv_blocks=512, block_size=BS, dtype="float32", device="cpu", num_threads=1)
    sentence = "Every answer must be short, correct and polite, and it must cite the section of the manual it uses. "
    system_text = sentence * 30
    questions = [f"Question number {i}: how do I reset the device to its factory settings, step {i}?"
                 for i in range(NUM_REQUESTS)]
    prompts = [llm.engine.chat_template.encode([{"role": "system", "content": system_text},
                                               {"role": "user", "content": q}]) for q in questions]
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    assert 550 <= common <= 700, common  # a ~600-token shared system prompt
    shared_cached = common // BS * BS

    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.stats.num_cached_tokens for o in outs] == [0] + [shared_cached] * (NUM_REQUESTS - 1)
    computed = [o.stats.num_prompt_tokens_computed for o in outs]
    assert computed == [len(prompts[0])] + [len(p) - shared_cached for p in prompts[1:]]
    assert sum(computed) == sum(map(len, prompts)) - (NUM_REQUESTS - 1) * shared_cached


# ---- n samples: one prefill, forked copy-on-write ------------------------------------------------------
def test_forked_samples_compute_the_prompt_once(tiny_model_dir):
    """Samples 1..n-1 start from sample 0's computed prompt: the full blocks shared, the last one copied,
    so each computes only the last prompt token again. Their outputs equal independent runs with the
    same seeds, and every block comes back."""
    from stratum.engine import LLM
    from stratum.engine.config import SchedulerConfig
    from stratum.engine.sampling_params import SamplingParams

    def engine():
        return LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=16, dtype="float32", device="cpu", num_threads=1,
                   enable_prefix_cache=False, scheduler=SchedulerConfig(max_num_batched_tokens=64)).engine

    prompt = list(range(40, 40 + 45))  # 2 full blocks and a partial one: the copy path
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    for size in (45, 49):  # 49: the last prompt token opens a block of its own (nothing to copy)
        prompt = list(range(40, 40 + size))
        eng = engine()
        seqs = [eng.add_request(prompt, params[0], request_id="s0")]
        seqs += [eng.add_request(prompt, p, request_id=f"s{i}", fork_of="s0") for i, p in enumerate(params[1:], 1)]
        finals = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out
            eng.block_manager.check_integrity()
        assert eng.block_manager.num_used_blocks == 0
        computed = [s.cache_stats.num_prompt_tokens_computed for s in seqs]
        assert computed == [size, 1, 1]
        for i, p in enumerate(params):  # the same samples as each run alone
            alone = engine()
            alone.add_request(prompt, p, request_id="x")
            while alone.has_unfinished():
                for out in alone.step():
                    if out.finished:
                        assert out.token_ids == finals[f"s{i}"].token_ids, (size, i)
