"""Sampling: greedy, seeds, top-k/top-p, and the request limits (max_tokens, stop ids, EOS, validation).

Engine tests run the tiny random model; its logits are arbitrary but fixed, which is all these need.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stratum.engine.config import SchedulerConfig
from stratum.engine import LLM
from stratum.models.loader import load_checkpoint
from stratum.engine.sampler import NUCLEUS_CANDIDATES, sample
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams

BS = 16
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    list(range(20, 60)),
    [300, 200, 100],
    list(range(100, 121)),
]


def tiny_llm(path, checkpoint=None, **config) -> LLM:
    config = {"num_kv_blocks": 128, "block_size": BS, "dtype": "float32", "device": "cpu", "num_threads": 1,
              "scheduler": SchedulerConfig(max_num_batched_tokens=256), **config}
    return LLM(str(path), checkpoint=checkpoint, **config)


@pytest.fixture
def llm(tiny_model_dir) -> LLM:
    return tiny_llm(tiny_model_dir)


def run(llm: LLM, prompts, params):
    """Submit all at once; returns (sequences, final outputs) in submission order."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.num_used_blocks == 0
    return seqs, [finals[s.request_id] for s in seqs]


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---- the sampler on its own ----------------------------------------------------------------------------


def test_sampler_greedy_rows_are_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    greedy_row, top1_row = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)
    params = [greedy_row, top1_row, greedy_row, top1_row, greedy_row]
    assert sample(logits, params, [None] * 5).tokens == logits.argmax(-1).tolist()


def test_sampler_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    drawn = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        drawn.update(sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)], [g]).tokens)
    assert drawn == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)], [g]).tokens == [0]


def test_sampled_tokens_follow_the_distribution():
    """Each token is drawn as often as its probability says (20,000 seeded draws: the tolerance is 4
    standard deviations of the most uncertain frequency), and a token of probability 0 never."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros(len(probs))
    for _ in range(n):
        counts[sample(probs.log().unsqueeze(0), [SamplingParams(temperature=1.0)], [g]).tokens[0]] += 1
    assert counts[1] == counts[5] == 0
    assert torch.allclose(counts / n, probs, atol=4 * (0.25 / n) ** 0.5)


def test_sampler_top_p_beyond_the_first_candidates_sorts_the_whole_vocabulary():
    """A flat distribution whose nucleus holds more tokens than `NUCLEUS_CANDIDATES`: every one of
    them can be drawn, not just the candidates looked at first."""
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = torch.zeros(1, vocab)
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [g]).tokens[0] for _ in range(5000)}
    assert NUCLEUS_CANDIDATES < len(drawn) <= vocab // 2 + 1  # the set reaching 0.5, and the token at its edge


def test_sampler_top_k_draws_only_from_the_k_best():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    drawn = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        drawn.update(sample(logits, [SamplingParams(temperature=2.0, top_k=2)], [g]).tokens)
    assert drawn == {1, 2}


def test_sampler_seeded_row_ignores_its_batch_companions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[2:3], [seeded], [torch.Generator().manual_seed(7)]).tokens[0] for _ in range(3)]
    torch.manual_seed(123)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), seeded, SamplingParams(temperature=0.0)]
    batch = sample(logits, params,
                   [None, torch.Generator().manual_seed(99), torch.Generator().manual_seed(7), None]).tokens
    assert alone == [batch[2]] * 3


# ---- through the engine --------------------------------------------------------------------------------


def test_greedy_tokens_are_the_argmax_of_their_logits(llm):
    seqs, outs = run(llm, PROMPTS, greedy(10, return_logits=True))
    for seq, out in zip(seqs, outs):
        p = seq.num_prompt_tokens
        assert out.token_ids == seq.output_token_ids and len(out.token_ids) == 10
        for j, token in enumerate(out.token_ids):
            assert token == int(seq.readouts.logits[p + j - 1].argmax())


def test_seeded_sampling_is_reproducible_and_independent_of_batch_companions(tiny_model_dir):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = PROMPTS[1]
    _, (alone,) = run(tiny_llm(tiny_model_dir), [prompt], seeded)
    _, (again,) = run(tiny_llm(tiny_model_dir), [prompt], seeded)
    assert alone.token_ids == again.token_ids

    torch.manual_seed(999)  # unseeded companions draw from the global generator
    companions = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
                  SamplingParams(max_tokens=9, temperature=0.7, seed=5, ignore_eos=True),
                  greedy(16)]
    for position in range(4):
        params = companions[:position] + [seeded] + companions[position:]
        prompts = PROMPTS[:position] + [prompt] + PROMPTS[position:]
        _, outs = run(tiny_llm(tiny_model_dir), prompts, params)
        assert outs[position].token_ids == alone.token_ids, position

    other_seed = dataclasses.replace(seeded, seed=4321)
    _, (different,) = run(tiny_llm(tiny_model_dir), [prompt], other_seed)
    assert different.token_ids != alone.token_ids


def test_seeded_sampling_survives_chunked_prefill(tiny_model_dir):
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=77, ignore_eos=True)
    _, (whole,) = run(tiny_llm(tiny_model_dir), [PROMPTS[1]], seeded)
    chunked = tiny_llm(tiny_model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=7))
    _, outs = run(chunked, [PROMPTS[0], PROMPTS[1]], [greedy(12), seeded])
    assert outs[1].token_ids == whole.token_ids


def test_top_k_1_and_a_tiny_top_p_equal_greedy(llm):
    _, ref = run(llm, PROMPTS, greedy(10))
    for params in (SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True),
                   SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True),
                   SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)):
        _, outs = run(llm, PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_exact(llm, max_tokens):
    _, outs = run(llm, PROMPTS, greedy(max_tokens))
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in outs)
    assert all(o.stats.num_output_tokens == max_tokens for o in outs)


def test_stop_token_ids_end_the_request_at_the_first_occurrence(llm):
    _, (ref,) = run(llm, [PROMPTS[1]], greedy(16))
    i = next(i for i in range(2, 16) if ref.token_ids[i] not in ref.token_ids[:i])
    stop_id = ref.token_ids[i]
    _, (out,) = run(llm, [PROMPTS[1]], greedy(16, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == ref.token_ids[: i + 1]  # the stop token is returned, its text is not
    assert out.text == llm.engine.tokenizer.decode(ref.token_ids[:i])


def test_eos_ends_the_request_unless_ignore_eos(tiny_model_dir):
    _, (ref,) = run(tiny_llm(tiny_model_dir), [PROMPTS[0]], greedy(16))
    i = next(i for i in range(2, 16) if ref.token_ids[i] not in ref.token_ids[:i])
    eos = ref.token_ids[i]
    ck = load_checkpoint(tiny_model_dir)
    ck.config = dataclasses.replace(ck.config, eos_token_ids=(eos,))  # make a token the model emits the EOS
    llm = tiny_llm(tiny_model_dir, checkpoint=ck)

    _, (stopped,) = run(llm, [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos
    assert stopped.token_ids == ref.token_ids[: i + 1]
    _, (ignored,) = run(llm, [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.token_ids == ref.token_ids


def test_max_tokens_zero_prefills_only_and_caches_the_prompt(llm):
    prompt = list(range(200, 240))  # 40 tokens: two full blocks and a partial one
    seqs, (out,) = run(llm, [prompt], SamplingParams(max_tokens=0))
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert out.stats.num_prompt_tokens_computed == 40 and out.stats.num_output_tokens == 0
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    bm.check_integrity()

    _, (follow,) = run(llm, [prompt + [1, 2, 3]], greedy(2))
    assert follow.stats.num_cached_tokens == 32
    assert follow.stats.num_prompt_tokens_computed == 11


def test_max_tokens_zero_with_a_chunked_prompt(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=16))
    _, (out,) = run(llm, [list(range(200, 240))], SamplingParams(max_tokens=0))
    assert out.token_ids == [] and out.finish_reason == "length"
    assert llm.engine.num_steps == 3 and llm.engine.block_manager.num_cached_blocks == 2


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([1, 2, 3], SamplingParams(temperature=2.5), "temperature"),
    ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(top_k=-1), "top_k"),
    ([1, 2, 3], SamplingParams(max_tokens=-1), "max_tokens"),
    ([1, 2, 3], SamplingParams(stop=[""]), "stop"),
    ([], SamplingParams(), "empty"),
    ([1] * 2040, SamplingParams(max_tokens=16), "context length"),
    ([1] * 2000, SamplingParams(max_tokens=48), "KV pool"),
    ([1, 2, 10**6], SamplingParams(), "token ids"),
    ([1, -1, 3], SamplingParams(), "token ids"),
])
def test_invalid_requests_are_rejected_at_admission(tiny_model_dir, prompt, params, message):
    llm = tiny_llm(tiny_model_dir, num_kv_blocks=125)
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request(prompt, params)
    assert not llm.engine.has_unfinished() and llm.engine.requests == {}


# ---- log-probabilities and grammars --------------------------------------------------------------------


@pytest.mark.parametrize("params", [greedy(8, logprobs=5),
                                    SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True,
                                                   logprobs=5)])
def test_logprobs_match_a_recomputation_from_the_logits(llm, params):
    params = dataclasses.replace(params, return_logits=True)
    seqs, outs = run(llm, PROMPTS, params)
    for seq, out in zip(seqs, outs):
        assert len(out.logprobs) == len(out.token_ids) == 8
        p = seq.num_prompt_tokens
        for j, (token, (logprob, top)) in enumerate(zip(out.token_ids, out.logprobs)):
            temperature = 1.0 if params.is_greedy else params.temperature
            expected = torch.log_softmax(seq.readouts.logits[p + j - 1] / temperature, dim=-1)
            assert logprob == pytest.approx(float(expected[token]), abs=1e-4)
            values = [v for _, v in top]
            assert len(top) == 5 and values == sorted(values, reverse=True)
            assert [t for t, _ in top] == expected.topk(5).indices.tolist()


def test_grammar_restricts_every_token_and_ends_the_request(tiny_model_dir):
    import json

    import jsonschema
    import llguidance

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "s": {"enum": ["yes", "no"]}}, "required": ["n", "s"],
              "additionalProperties": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    llm = tiny_llm(tiny_model_dir)
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, grammar=grammar) for s in range(6)]
    _, outs = run(llm, PROMPTS + PROMPTS[:2], params)
    for out in outs:
        assert out.finish_reason == "stop" and out.stop_reason is None  # the grammar completed, not max_tokens
        jsonschema.validate(json.loads(out.text), schema)
    plain = run(llm, PROMPTS[:1], greedy(8))[1][0]
    assert not plain.text.startswith("{")  # unconstrained rows of the same engine stay free


def test_an_invalid_grammar_is_rejected_at_admission(llm):
    with pytest.raises(InvalidRequestError, match="grammar"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(grammar="start: undefined_rule"))


def test_prompt_logprobs_score_every_prompt_token(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, scheduler=SchedulerConfig(max_num_batched_tokens=16))  # chunked prompts
    run(llm, PROMPTS[1:2], greedy(1))  # cache the prompt: scoring must recompute it anyway
    seqs, outs = run(llm, PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=3, return_logits=True))
    for seq, out in zip(seqs, outs):
        assert len(out.prompt_logprobs) == seq.num_prompt_tokens and out.prompt_logprobs[0] is None
        for p in range(1, seq.num_prompt_tokens):
            logprob, top = out.prompt_logprobs[p]
            expected = torch.log_softmax(seq.readouts.logits[p - 1], dim=-1)
            assert logprob == pytest.approx(float(expected[seq.prompt_token_ids[p]]), abs=1e-4)
            assert [t for t, _ in top] == expected.topk(3).indices.tolist()


def test_greedy_rows_take_the_first_most_likely_token_as_torch_argmax_does():
    """argmax_rows (NumPy on CPU) against torch.argmax: ties, a row masked but for its last token,
    an all-masked row and a NaN."""
    from stratum.engine.sampler import argmax_rows

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 10] = x[1, 20] = x[1].max() + 1  # a tie: the first
    x[2, :-1] = float("-inf")
    x[3] = float("-inf")
    x[4, 7] = float("nan")
    assert argmax_rows(x) == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 10, 999, 0, 7]
