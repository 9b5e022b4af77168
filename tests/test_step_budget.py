"""The step-time budget: the cost model learnt from measured steps, the scheduler's prefill chunks sized
by it while requests decode (`--max-itl-ms`), and an engine keeping it beside a long prompt."""

from __future__ import annotations

import random

import pytest

from stratum.engine.config import EngineConfig, SchedulerConfig
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.engine.scheduler import MIN_PREFILL_CHUNK, PLANNED_SHARE, Scheduler
from stratum.engine.step_cost import CostPrior, StepCost, chunk_pairs, step_features
from tests.factories import make_block_manager, make_seq
from tests.test_scheduler import FakeRunner, plan


def fixed_cost(fixed_s=0.02, row_s=0.004, pair_s=0.0) -> StepCost:
    """A cost model that has measured nothing: its prior is the cost."""
    return StepCost(CostPrior(fixed_s, row_s, pair_s))


def make_budgeted(cost: StepCost, max_itl_ms=200.0 / PLANNED_SHARE, budget=512, num_blocks=2048, block_size=16):
    bm = make_block_manager(num_blocks=num_blocks, block_size=block_size)
    config = SchedulerConfig(max_num_batched_tokens=budget, watermark_blocks=0, max_itl_ms=max_itl_ms)
    scheduler = Scheduler(config, bm, cost=cost)
    return scheduler, FakeRunner(scheduler)


def start_decoding(sched, runner, request_id="d", max_tokens=200, block_size=16):
    d = make_seq(request_id, range(8), block_size=block_size, max_tokens=max_tokens)
    sched.add(d)
    runner.step()  # its prompt, with nothing decoding: no budget
    assert d.is_decoding
    return d


# ---- the cost model --------------------------------------------------------------------------------------


def test_the_fit_recovers_a_linear_step_cost_from_measured_steps():
    truth = (0.012, 0.0031, 0.0002)
    cost = fixed_cost(0.05, 0.01, 0.001)  # a prior far from the truth
    rng = random.Random(0)
    for _ in range(200):
        rows, start = rng.randint(1, 512), rng.randint(0, 8000)
        x = step_features(rows, chunk_pairs(start, rows))
        cost.observe(x, sum(c * v for c, v in zip(truth, x)))
    assert cost.coefficients[1:] == pytest.approx(truth[1:], rel=0.02)
    assert cost.coefficients[0] == pytest.approx(truth[0], rel=0.02)
    assert cost.num_observed == 200
    for rows, start in ((1, 100), (64, 4000), (512, 0)):
        x = step_features(rows, chunk_pairs(start, rows))
        assert cost.predict(x) == pytest.approx(sum(c * v for c, v in zip(truth, x)), rel=0.02)


def test_the_chunk_fits_the_budget_and_one_more_token_would_not():
    cost = fixed_cost(0.0, 0.004, 0.0005)
    c = cost.coefficients
    for start in (0, 1000, 12000):
        n = cost.chunk_for(0.15, start)

        def added(k):
            return c[1] * k + c[2] * chunk_pairs(start, k) * 1e-3

        assert n > 0 and added(n) == pytest.approx(cost.added_s(start, n))
        assert added(n) <= 0.15 + 1e-12 < added(n + 1)
    assert cost.chunk_for(0.15, 12000) < cost.chunk_for(0.15, 0)  # attention grows with context
    assert cost.chunk_for(-0.01, 0) == 0


def test_bad_measurements_are_ignored():
    cost = fixed_cost()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cost.observe(step_features(1, 1.0), bad)
    assert cost.num_observed == 0 and cost.coefficients == [0.02, 0.004, 0.0]


# ---- the scheduler under the budget -----------------------------------------------------------------------


def test_without_a_decoding_request_a_prefill_takes_the_whole_token_budget():
    sched, runner = make_budgeted(fixed_cost())
    sched.add(make_seq("long", range(2000), block_size=16, max_tokens=1))
    out = runner.step()
    assert plan(out) == [("long", 512)] and out.planned_s is None


def test_beside_a_decode_the_chunk_is_what_the_budget_leaves():
    sched, runner = make_budgeted(fixed_cost(fixed_s=0.02, row_s=0.004))  # 200 ms: 20 fixed, 4 the decode
    d = start_decoding(sched, runner)
    sched.add(make_seq("long", range(100, 2100), block_size=16, max_tokens=1))
    chunks = []
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        out = runner.step()
        assert out.scheduled[0].seq is d and out.scheduled[0].num_new_tokens == 1  # a token every step
        assert out.planned_s <= 0.2 + 1e-9
        chunks.append(dict(plan(out))["long"])
    assert chunks[:-1] == [44] * (len(chunks) - 1)  # (200 - 20 - 4) / 4 tokens
    assert sum(chunks) == 2000


def test_attention_makes_later_chunks_of_a_long_prompt_smaller():
    sched, runner = make_budgeted(fixed_cost(fixed_s=0.01, row_s=0.002, pair_s=0.00002))
    start_decoding(sched, runner)
    sched.add(make_seq("long", range(100, 6100), block_size=16, max_tokens=1))
    chunks = []
    for _ in range(40):
        out = runner.step()
        assert out.planned_s <= 0.2 + 1e-9
        chunks.append(dict(plan(out))["long"])
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]


def test_the_floor_keeps_a_prompt_moving_when_decodes_fill_the_budget():
    sched, runner = make_budgeted(fixed_cost(fixed_s=0.02, row_s=0.06))  # four decodes: 260 ms alone
    for i in range(4):
        start_decoding(sched, runner, f"d{i}")
    sched.add(make_seq("long", range(100, 300), block_size=16, max_tokens=1))
    sched.add(make_seq("next", range(400, 500), block_size=16, max_tokens=1))
    out = runner.step()
    assert plan(out)[-1] == ("long", MIN_PREFILL_CHUNK)  # and no second prefill: nothing was left
    assert out.planned_s > 0.2


def test_prefills_share_the_budget_by_priority_then_arrival():
    sched, runner = make_budgeted(fixed_cost(fixed_s=0.0, row_s=0.001), budget=2048)
    start_decoding(sched, runner)
    sched.add(make_seq("late", range(1000, 1300), block_size=16, max_tokens=1, priority=1))
    sched.add(make_seq("urgent", range(2000, 2150), block_size=16, max_tokens=1, priority=0))
    out = runner.step()
    # 199 ms after the decode: urgent's whole prompt first, then what is left to the later class
    assert plan(out) == [("d", 1), ("urgent", 150), ("late", 49)]
    assert out.planned_s == pytest.approx(0.2)


def test_a_running_prefill_leaves_half_the_budget_to_a_short_prompt_waiting():
    sched, runner = make_budgeted(fixed_cost(fixed_s=0.0, row_s=0.001), budget=2048)
    start_decoding(sched, runner)
    sched.add(make_seq("long", range(1000, 5000), block_size=16, max_tokens=1))
    runner.step()
    sched.add(make_seq("short", range(6000, 6040), block_size=16, max_tokens=1))
    out = runner.step()
    assert plan(out) == [("d", 1), ("long", 99), ("short", 40)]


def test_a_zero_budget_is_off():
    sched, runner = make_budgeted(fixed_cost(), max_itl_ms=0)
    start_decoding(sched, runner)
    sched.add(make_seq("long", range(100, 2100), block_size=16, max_tokens=1))
    out = runner.step()
    assert plan(out) == [("d", 1), ("long", 511)] and out.planned_s is None


# ---- the engine ---------------------------------------------------------------------------------------------


def test_the_engine_learns_its_step_cost_and_keeps_a_decode_moving_beside_a_long_prompt(tiny_model_dir):
    from stratum.engine import EngineCore
    from stratum.models.loader import load_checkpoint

    max_itl_ms = 3.0  # below what a 512-token chunk of the tiny model costs, so the budget decides
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=256, kv_disk_gb=0,
                          scheduler=SchedulerConfig(max_itl_ms=max_itl_ms))
    engine = EngineCore(config, checkpoint=load_checkpoint(tiny_model_dir))
    sampling = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    d = engine.add_request(list(range(3, 40)), sampling, request_id="d", cache_policy=CachePolicy.bypass())
    while not d.is_decoding:
        engine.step()
    for _ in range(10):  # decode-only steps: the cost model meets the step
        engine.step()
    long = engine.add_request([3 + (i * 7) % 460 for i in range(1500)], SamplingParams(max_tokens=1),
                              request_id="long", cache_policy=CachePolicy.bypass())
    chunks, gaps_in_steps, last = [], [], d.num_output_tokens
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = long.num_computed_tokens
        engine.step()
        stats = engine.step_stats[-1]
        assert stats.planned_s is not None  # d decodes: every step is planned under the budget
        chunk = long.num_computed_tokens - before
        assert chunk >= MIN_PREFILL_CHUNK or long.num_computed_tokens == long.num_prompt_tokens
        if chunk > MIN_PREFILL_CHUNK:  # above the floor only where the plan fits the budget
            assert stats.planned_s <= PLANNED_SHARE * max_itl_ms / 1e3 + 1e-9
        chunks.append(chunk)
        gaps_in_steps.append(d.num_output_tokens - last)
        last = d.num_output_tokens
    assert set(gaps_in_steps) == {1}  # the decode got its token at every step of the prefill
    assert len(chunks) > 1500 // 512 + 1 and max(chunks) < 512  # the long prompt was cut finer than the token budget
    assert engine.step_cost.num_observed == engine.num_steps
    prior = engine.step_cost.prior
    assert engine.step_cost.coefficients != [prior.fixed_s, prior.row_s, prior.pair_s]
    engine.abort("d")
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_speculation_keeps_its_answers_under_a_budget_that_binds(tmp_path):
    from stratum.kernels import native
    from tests.factories import make_tiny_gguf
    from tests.test_spec_decode import PROMPTS, _engine, _greedy, _run

    if not native.available():
        pytest.skip("native kernels not built")
    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    _, plain = _run(_engine(path, "off"), PROMPTS, [_greedy()] * 4)
    engine = _engine(path, "ngram", scheduler=SchedulerConfig(max_itl_ms=2.0))
    long_prompt = engine.tokenizer.encode("numbers 0123456789 " * 40)
    engine.add_request(long_prompt, SamplingParams(max_tokens=1), request_id="long")  # prefills beside them
    _, spec = _run(engine, PROMPTS, [_greedy()] * 4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.stats.num_spec_accepted_tokens for o in spec) > 0
    assert any(s.planned_s is not None and s.num_spec_proposed_tokens for s in engine.step_stats)
