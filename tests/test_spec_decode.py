"""Speculative decoding: prompt lookup, the cost policy, the scheduler's lookahead and its rollback, and
exactness through the engine: greedy outputs and logits bit-identical to plain decoding, seeded
sampling identical, the sampled distribution unchanged, grammars and stops applied to kept tokens."""

from __future__ import annotations

import pytest
import torch

from stratum.engine.config import SchedulerConfig
from stratum.engine.sampling_params import SamplingParams
from stratum.engine.scheduler import Scheduler
from stratum.engine.spec_decode import SpecConfig, verify
from stratum.engine.spec_decode.ngram import NgramIndex
from stratum.engine.spec_decode.policy import Acceptance, StepCost, bucket_of, choose
from stratum.kernels import native
from tests.factories import make_block_manager, make_seq, make_tiny_gguf

# ---- prompt lookup -------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_suffix():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3]
    assert index.propose(tokens, 3) == ([4, 5, 6], 2)
    assert index.propose(tokens, 10) == ([4, 5, 6, 7, 9, 2, 3], 2)  # up to the end of what is known
    assert NgramIndex(2, 4).propose([1, 2, 3, 4], 3) == ([], 0)  # nothing recurs
    assert NgramIndex(3, 4).propose(tokens, 3) == ([], 0)  # "2 3" is shorter than min_n


def test_prompt_lookup_follows_the_longest_match_not_the_latest():
    """A line that recurs ("7 8") is followed elsewhere too; the occurrence whose match runs longest
    (the copy being made) wins over the most recent one."""
    copy = [1, 2, 3, 7, 8, 40, 41]
    tokens = copy + [5, 6, 7, 8, 50, 51] + [1, 2, 3, 7, 8]
    assert NgramIndex(2, 2).propose(tokens, 2) == ([40, 41], 5)


def test_prompt_lookup_index_grows_with_the_request():
    index = NgramIndex(2, 3)
    tokens = [10, 11, 12, 13]
    assert index.propose(tokens, 2) == ([], 0)
    tokens += [10, 11]
    assert index.propose(tokens, 2) == ([12, 13], 2)
    assert index.num_indexed == len(tokens)
    tokens += [12, 99, 10, 11, 12]  # "10 11 12" was followed by 13, then by 99: equal matches, the latest wins
    assert index.propose(tokens, 1) == ([99], 3)


# ---- the cost policy -----------------------------------------------------------------------------------

# the kernel plan's shape of timings (µs per decoder layer at each row count, output projection by rows)
FLAT = {"packed": {1: 100.0, 2: 101.0, 4: 102.0, 8: 104.0, 16: 108.0, 32: 116.0}, "head_packed": {1: 50.0, 16: 51.0}}
LINEAR = {"packed": {m: 100.0 * m for m in (1, 2, 4, 8, 16, 32)},
          "head_packed": {m: 50.0 * m for m in (1, 2, 4, 8, 16)}}


def test_rows_pay_while_the_step_is_memory_bound():
    cost = StepCost(FLAT, num_layers=4)
    assert choose(cost, [(0.9, 16)], num_decodes=1, rows=1) == [16]
    assert choose(cost, [(0.9, 5), (0.5, 16)], num_decodes=2, rows=2)[0] == 5


def test_no_rows_when_the_step_is_compute_bound():
    """Each row costs what a decode row costs: a proposal must be surely accepted to pay, and none is."""
    cost = StepCost(LINEAR, num_layers=4)
    assert choose(cost, [(0.99, 16)] * 8, num_decodes=8, rows=8) == [0] * 8


def test_low_acceptance_proposes_less():
    cost = StepCost({"packed": {1: 100.0, 2: 150.0, 4: 250.0, 8: 450.0, 16: 850.0}}, num_layers=4)
    high, low = choose(cost, [(0.95, 16)], 1, 1)[0], choose(cost, [(0.3, 16)], 1, 1)[0]
    assert high > low == 0


def test_the_measured_residual_makes_rows_relatively_cheaper():
    cost = StepCost({"packed": {1: 100.0, 2: 180.0, 4: 340.0}}, num_layers=1)
    before = choose(cost, [(0.7, 16)], 1, 1)[0]
    for _ in range(5):
        cost.observe(1, 1, 0.010)  # the real step takes 10 ms where the plan's kernels take 0.1
    assert cost.time(1, 1) == pytest.approx(0.010)
    assert choose(cost, [(0.7, 16)], 1, 1)[0] > before


def test_the_cost_fit_finds_the_steps_scale_and_base_despite_outliers():
    """Steps of 1 to 4 rows take 2 ms + 3x what the plan's kernels take; a few were slowed 10x by
    other processes. The fit recovers both figures."""
    cost = StepCost({"packed": {1: 100.0, 2: 180.0, 4: 340.0}}, num_layers=10)
    for i in range(64):
        rows = 1 + i % 4
        t = 0.002 + 3 * cost.plan_s(rows, 0)
        cost.observe(rows, 0, t * (10 if i % 16 == 5 else 1))
    assert cost.scale == pytest.approx(3.0, rel=0.01) and cost.base == pytest.approx(0.002, rel=0.05)


def test_without_a_believable_plan_the_fit_finds_a_rows_cost():
    """A plan whose one-row step timed slower than sixteen rows (other processes held the cores) gives
    no shape: rows are free until measured, then cost what the steps say (2 ms + 1.5 ms a row here)."""
    cost = StepCost({"native_2_threads": {1: 11976.0, 16: 524.8}}, num_layers=30, threads=2)
    assert not cost.is_shaped and choose(cost, [(0.6, 16)], 1, 1) == [16]
    for i in range(64):
        rows = 1 + i % 8
        cost.observe(rows, rows, (0.002 + 0.0015 * rows) * (10 if i % 16 == 5 else 1))
    assert cost.scale == pytest.approx(0.0015, rel=0.01) and cost.base == pytest.approx(0.002, rel=0.05)
    # the first proposal (kept 60% of the time) pays, the second (36%) not
    assert choose(cost, [(0.6, 16)], 1, 1) == [1]
    assert choose(cost, [(0.99, 16)], 1, 1)[0] > 8


def test_acceptance_moves_from_the_prior_to_what_is_measured():
    acc = Acceptance()
    b = bucket_of(9)
    assert acc.rate(b) == 0.5
    for _ in range(50):
        acc.record(b, 8, 8)
    assert acc.rate(b) > 0.95
    assert acc.rate(b, num_accepted=0, num_rejected=20) < 0.2  # a request's own record weighs more


def test_bad_settings_are_refused():
    from stratum.engine.config import EngineConfig

    with pytest.raises(ValueError, match="one of"):
        SpecConfig.of(EngineConfig(speculative="sometimes"))
    with pytest.raises(ValueError, match="draft-model"):
        SpecConfig.of(EngineConfig(speculative="draft"))
    with pytest.raises(ValueError, match="min <= max"):
        SpecConfig.of(EngineConfig(prompt_lookup_min=4, prompt_lookup_max=2))


# ---- the scheduler's lookahead and rollback ------------------------------------------------------------


def _decoding(bm, tokens, max_tokens=32):
    seq = make_seq("a", tokens, max_tokens=max_tokens)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, watermark_blocks=1), bm)
    sched.add(seq)
    out = sched.schedule()
    sched.commit(out)
    seq.token_ids.append(100)  # its first token: now a decode
    return sched, seq


def test_proposals_get_blocks_and_rejected_ones_give_them_back():
    bm = make_block_manager(num_blocks=8, block_size=4)
    sched, seq = _decoding(bm, [1, 2, 3, 4, 5, 6])
    assert seq.block_table == [0, 1] and seq.is_decoding
    seq.spec_token_ids = [7, 8, 9, 10, 11, 12]
    out = sched.schedule()
    item = out.scheduled[0]
    assert (item.num_new_tokens, item.num_spec_tokens, item.start) == (7, 6, 6)
    assert seq.block_table == [0, 1, 2, 3]  # positions 6..12
    sched.commit(out)
    assert seq.num_computed_tokens == 7  # only the decode's own row counts until a proposal is kept
    seq.token_ids.append(7)  # the first proposal was kept, then the target's own token
    sched.advance(seq)
    seq.token_ids.append(55)
    sched.end_speculation(item)
    assert seq.num_computed_tokens == 8 and seq.block_table == [0, 1, 2]  # block 3 held rejected positions only
    assert list(bm.free_blocks)[-1] == 3
    bm.check_integrity()


def test_proposals_never_take_the_watermark_or_evict():
    bm = make_block_manager(num_blocks=4, block_size=4)
    sched, seq = _decoding(bm, [1, 2, 3, 4, 5, 6])
    seq.spec_token_ids = list(range(20, 36))
    out = sched.schedule()
    # blocks 0, 1 held, 2 free beyond the watermark of 1: positions 6..11 at most
    assert out.scheduled[0].num_spec_tokens == 5 and bm.num_free_blocks == 1
    assert seq.spec_token_ids == list(range(20, 25))


def test_only_kept_tokens_reach_the_prefix_cache():
    bm = make_block_manager(num_blocks=16, block_size=4)
    sched, seq = _decoding(bm, [1, 2, 3, 4, 5, 6])
    seq.spec_token_ids = [7, 8, 9, 10, 11, 12]
    out = sched.schedule()
    sched.commit(out)
    seq.token_ids.append(70)  # the first proposal rejected: the target's token instead
    sched.end_speculation(out.scheduled[0])
    assert bm.cache.num_cached_blocks == 1  # [1 2 3 4]; positions 4..7 hold 5 6 100 and a rejected row
    assert seq.token_ids[:8] == [1, 2, 3, 4, 5, 6, 100, 70]


# ---- verification on its own: the distribution it draws from ------------------------------------------


def test_verification_keeps_the_sampled_distribution():
    """Rows p0, p1, p2 and proposals d1, d2: the first token is drawn from p0, the second (after d1 was
    kept) from p1, and so on, as plain decoding would draw them. 20,000 seeded verifications; the
    tolerance is 4 standard deviations of the most uncertain frequency."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25]])
    rows = probs.log()
    seq = make_seq("v", [1, 2, 3], max_tokens=8)
    seq.sampling = SamplingParams(temperature=1.0, max_tokens=8)
    seq.sampler.generator = torch.Generator().manual_seed(0)
    n = 20_000
    first, second, third = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        kept, _ = verify(rows, seq, [0, 2], None)
        first[kept[0]] += 1
        if len(kept) > 1:
            second[kept[1]] += 1
        if len(kept) > 2:
            third[kept[2]] += 1
        assert kept[:-1] == [0, 2][: len(kept) - 1]  # every token but the last is a kept proposal
    tol = 4 * (0.25 / n) ** 0.5
    assert first[3] == 0
    assert torch.allclose(first / n, probs[0], atol=tol)
    m = int(first[0])  # d1 = 0 was kept this often: the second token followed row 1
    assert torch.allclose(second / m, probs[1], atol=4 * (0.25 / m) ** 0.5)
    m2 = int(second[2])
    assert torch.allclose(third / m2, probs[2], atol=4 * (0.25 / m2) ** 0.5)


def test_greedy_verification_is_the_argmax_of_each_row():
    rows = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    seq = make_seq("g", [1], max_tokens=8)
    assert verify(rows, seq, [1, 0], None)[0] == [1, 0, 2]  # both kept, then the last row's token
    assert verify(rows, seq, [1, 2], None)[0] == [1, 0]  # the second rejected: the target's token instead
    assert verify(rows, seq, [2, 0], None)[0] == [1]


# ---- through the engine: exactness ---------------------------------------------------------------------

pytestmark_native = pytest.mark.skipif(not native.available(), reason="native kernels not built")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("spec-gguf") / "tiny.gguf")


def _engine(path, speculative: str, **kw):
    from stratum.engine import LLM

    defaults = dict(num_kv_blocks=256, block_size=4, dtype="float32", int4_max_tokens=0, native_step=True,
                    num_threads=1, speculative=speculative)
    return LLM(str(path), **{**defaults, **kw}).engine


# prompts that repeat themselves, so prompt lookup has matches, and one that does not
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
           "The capital of Japan is Tokyo. The capital of",
           "numbers 0123456789 and numbers 0123", "Once upon a time there was a small model"]


def _run(engine, prompts, params_list):
    seqs = [engine.add_request(engine.tokenizer.encode(p), sp, request_id=f"r{i}")
            for i, (p, sp) in enumerate(zip(prompts, params_list))]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0  # nothing leaked
    return seqs, [finals[s.request_id] for s in seqs]


def _greedy(max_tokens=48, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytestmark_native
def test_greedy_outputs_and_logits_are_identical_with_speculation(tiny_gguf):
    plain_seqs, plain = _run(_engine(tiny_gguf, "off"), PROMPTS, [_greedy(return_logits=True)] * 4)
    spec_engine = _engine(tiny_gguf, "ngram")
    spec_seqs, spec = _run(spec_engine, PROMPTS, [_greedy(return_logits=True)] * 4)
    assert sum(o.stats.num_spec_accepted_tokens for o in spec) > 0  # proposals were verified and kept
    for a, b, sa, sb in zip(plain, spec, plain_seqs, spec_seqs):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert sorted(sa.readouts.logits) == sorted(sb.readouts.logits)
        assert all(torch.equal(sa.readouts.logits[p], sb.readouts.logits[p]) for p in sa.readouts.logits)  # bit for bit
    steps = list(spec_engine.step_stats)
    assert any(s.num_spec_proposed_tokens for s in steps)
    assert sum(s.num_spec_accepted_tokens for s in steps) == sum(o.stats.num_spec_accepted_tokens for o in spec)


@pytestmark_native
def test_stops_and_max_tokens_apply_to_kept_tokens_as_without_speculation(tiny_gguf):
    plain_engine, spec_engine = _engine(tiny_gguf, "off"), _engine(tiny_gguf, "ngram")
    first = _run(plain_engine, PROMPTS[:1], [_greedy(40)])[1][0]
    stop_text = first.text[len(first.text) // 2 :][:3]  # a piece of the answer's second half
    stop_id = first.token_ids[len(first.token_ids) // 2]
    params = [_greedy(40, stop=[stop_text]), _greedy(40, stop_token_ids=[stop_id]), _greedy(7), _greedy(1)]
    prompts = PROMPTS[:1] * 4
    for a, b in zip(_run(plain_engine, prompts, params)[1], _run(spec_engine, prompts, params)[1]):
        assert ((a.token_ids, a.text, a.finish_reason, a.stop_reason)
                == (b.token_ids, b.text, b.finish_reason, b.stop_reason))


@pytestmark_native
def test_seeded_sampling_and_logprobs_are_identical_with_speculation(tiny_gguf):
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=s, ignore_eos=True, logprobs=3) for s in range(4)]
    _, plain = _run(_engine(tiny_gguf, "off"), PROMPTS, params)
    _, spec = _run(_engine(tiny_gguf, "ngram"), PROMPTS, params)
    assert sum(o.stats.num_spec_steps for o in spec) > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytestmark_native
def test_grammars_constrain_kept_tokens_as_without_speculation(tiny_gguf):
    import llguidance

    schema = {"type": "object",
              "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a", "b"], "additionalProperties": False}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    params = [_greedy(60, grammar=grammar)] * 2 + [
        SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=grammar)]
    prompts = ['{"a": "x", "b": [1, 2]} {"a": "x", "b": [1,', *PROMPTS[:2]]
    _, plain = _run(_engine(tiny_gguf, "off"), prompts, params)
    _, spec = _run(_engine(tiny_gguf, "ngram"), prompts, params)
    for a, b in zip(plain, spec):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)


@pytestmark_native
def test_a_prefix_cache_hit_after_speculation_reads_only_verified_kv(tiny_gguf):
    """A second turn re-reads the first turn's answer from the cache: its logits are those of an
    engine that never speculated, so every cached block held KV of kept tokens."""
    plain_engine, spec_engine = (_engine(tiny_gguf, "off", enable_prefix_cache=True),
                                 _engine(tiny_gguf, "ngram", enable_prefix_cache=True))
    results = []
    for engine in (plain_engine, spec_engine):
        _, (first,) = _run(engine, PROMPTS[:1], [_greedy(40)])
        ids = engine.tokenizer.encode(PROMPTS[0]) + first.token_ids + engine.tokenizer.encode(" again")
        seq = engine.add_request(ids, _greedy(8, return_logits=True), request_id="second")
        while engine.has_unfinished():
            engine.step()
        assert seq.num_cached_tokens >= 32
        results.append(seq)
    assert results[0].output_token_ids == results[1].output_token_ids
    assert all(torch.equal(results[0].readouts.logits[p], results[1].readouts.logits[p])
               for p in results[0].readouts.logits)


@pytestmark_native
def test_speculation_under_continuous_batching_and_preemption(tiny_gguf):
    """Requests arrive while others verify, the pool is small enough to preempt: the outputs are
    plain decoding's and no block leaks."""
    params = [_greedy(60)] * 6
    prompts = PROMPTS + PROMPTS[:2]
    small = dict(num_kv_blocks=40, scheduler=SchedulerConfig(max_num_batched_tokens=32, watermark_blocks=1))
    _, plain = _run(_engine(tiny_gguf, "off", **small), prompts, params)
    engine = _engine(tiny_gguf, "ngram", **small)
    _, spec = _run(engine, prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    assert engine.scheduler.num_preemptions > 0


@pytestmark_native
def test_aborts_between_verify_steps_leak_no_block(tiny_gguf):
    """Requests aborted after verify steps (some with rejected rows) give every block back; the others
    finish as plain decoding would."""
    params = [_greedy(60)] * 4
    _, plain = _run(_engine(tiny_gguf, "off"), PROMPTS, params)
    engine = _engine(tiny_gguf, "ngram")
    seqs = [engine.add_request(engine.tokenizer.encode(p), sp, request_id=f"r{i}")
            for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    def verified(seq, rejected):
        state = engine.speculator.states.get(seq.request_id)
        return state is not None and (state.num_rejected if rejected else state.num_steps) > 0

    while engine.has_unfinished() and not (verified(seqs[0], True) and verified(seqs[2], False)):
        engine.step()
    assert not seqs[0].is_finished and not seqs[2].is_finished
    for rid in ("r0", "r2"):
        engine.abort(rid)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert [finals[r].token_ids for r in ("r1", "r3")] == [plain[1].token_ids, plain[3].token_ids]


def test_the_pytorch_step_does_not_speculate(tiny_model_dir):
    from stratum.engine import LLM

    engine = LLM(str(tiny_model_dir), num_kv_blocks=64, dtype="float32", speculative="ngram").engine
    assert engine.kernel_choices["step"] == "pytorch"
    assert engine.kernel_choices["speculative"]["mode"] == "off"
    assert "batch-invariant" in engine.kernel_choices["speculative"]["why"]


# ---- a draft model --------------------------------------------------------------------------------------


@pytestmark_native
def test_a_draft_model_proposes_and_the_output_is_the_targets(tiny_gguf, tmp_path):
    other = make_tiny_gguf(tmp_path / "other.gguf", seed=1)  # the same tokenizer, other weights
    _, plain = _run(_engine(tiny_gguf, "off"), PROMPTS, [_greedy(30)] * 4)
    same = _engine(tiny_gguf, "draft", draft_model=str(tiny_gguf))
    _, by_itself = _run(same, PROMPTS, [_greedy(30)] * 4)
    assert [o.token_ids for o in by_itself] == [o.token_ids for o in plain]
    # the target drafting for itself: every proposal is what the target computes
    assert all(o.stats.num_spec_accepted_tokens == o.stats.num_spec_proposed_tokens > 0 for o in by_itself)
    _, by_other = _run(_engine(tiny_gguf, "draft", draft_model=str(other)), PROMPTS, [_greedy(30)] * 4)
    assert [o.token_ids for o in by_other] == [o.token_ids for o in plain]
    assert same.kernel_choices["speculative"]["proposer"] == f"draft model {tiny_gguf} (native step)"


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from stratum.engine import LLM
    from tests.factories import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, dtype="float32", draft_model=str(other))


# ---- the real model ------------------------------------------------------------------------------------

EDIT_PROMPT = '''```python
import json
import os


def load_config(path):
    """Read the JSON configuration at path."""
    with open(path) as f:
        return json.load(f)


def get_setting(config, key, default=None):
    """One setting, or default when it is missing."""
    return config.get(key, default)


def set_setting(config, key, value):
    """Set one setting and return the configuration."""
    config[key] = value
    return config
```

Rename the function `get_setting` to `read_setting`.'''


def _edit_ids(tokenizer_engine):
    return tokenizer_engine.chat_template.encode([
        {"role": "system", "content": "You edit code. Reply with the complete edited file in one code block."},
        {"role": "user", "content": EDIT_PROMPT}])


@pytestmark_native
def test_real_model_greedy_is_bit_identical_with_speculation(real_model_path):
    """The default model on the native step: an edit answer (mostly copied from the prompt, so most
    proposals are kept) and three other prompts batched with it, with prompt lookup and without."""
    from stratum.engine import LLM

    def engine(mode):
        return LLM(str(real_model_path), num_kv_blocks=256, native_step=True, speculative=mode).engine

    plain, spec = engine("off"), engine("ngram")
    prompts = [_edit_ids(plain)] + [plain.tokenizer.encode_prompt(p) for p in PROMPTS[1:]]
    params = SamplingParams(max_tokens=96, temperature=0.0, return_logits=True)
    results, finals = [], {}
    for e in (plain, spec):
        seqs = [e.add_request(list(p), params, request_id=f"q{i}") for i, p in enumerate(prompts)]
        while e.has_unfinished():
            finals.update((out.request_id, out) for out in e.step() if out.finished)
        assert e.block_manager.num_used_blocks == 0
        results.append(seqs)
    assert finals["q0"].stats.num_spec_accepted_tokens > 30  # the copy was proposed, and kept
    for a, b in zip(*results):
        assert a.output_token_ids == b.output_token_ids
        assert sorted(a.readouts.logits) == sorted(b.readouts.logits)
        assert all(torch.equal(a.readouts.logits[p], b.readouts.logits[p]) for p in a.readouts.logits)


@pytestmark_native
def test_served_answers_report_speculation_in_trace_and_metrics(real_model_path):
    """Through `stratum serve` (speculation on its default): the answer is plain decoding's, the trace
    counts what was proposed and kept, and /metrics sums it."""
    import openai

    from stratum.client.cost import parse_stratum_cost
    from stratum.engine import LLM
    from stratum.telemetry.trace import decode_trace
    from tests.conftest import ServerProcess

    plain = LLM(str(real_model_path), num_kv_blocks=256, speculative="off")
    ids = _edit_ids(plain.engine)
    expected = plain.generate([ids], SamplingParams(max_tokens=80, temperature=0.0))[0]
    server = ServerProcess(str(real_model_path), "--served-model-name", "m").wait_ready(timeout=300)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        raw = client.completions.with_raw_response.create(model="m", prompt=ids, max_tokens=80, temperature=0,
                                                          extra_headers={"x-stratum-debug": "true"})
        assert raw.parse().choices[0].text == expected.text
        spec = decode_trace(raw.headers["x-stratum-trace"])["steps"][2]["speculative"]
        assert 0 < spec["accepted_tokens"] <= spec["proposed_tokens"] and spec["verify_steps"] > 0
        assert spec["tokens_per_verify_step"] == round(
            (spec["accepted_tokens"] + spec["verify_steps"]) / spec["verify_steps"], 3)
        cost = parse_stratum_cost(raw.headers["x-stratum-cost"])
        assert ((cost.spec_proposed_tokens, cost.spec_accepted_tokens)
                == (spec["proposed_tokens"], spec["accepted_tokens"]))
        metrics = httpx_get(server.url + "/metrics")
        assert f"stratum_spec_accepted_tokens_total {float(spec['accepted_tokens'])}" in metrics
        assert f"stratum_spec_verify_steps_total {float(spec['verify_steps'])}" in metrics
    finally:
        server.stop()


def httpx_get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=10).text
