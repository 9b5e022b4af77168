"""Scheduler lifecycle with a fake model runner: chunk budgets, ordering, preemption, abort, caps.

The fake runner does what the engine's postprocess does, without a model: it advances
num_computed_tokens by each chunk, caches the computed blocks, and when a sequence has computed
all its tokens it "samples" token 1000 + position, so recomputed outputs are reproducible.
"""

from __future__ import annotations

import pytest

from stratum.engine.config import SchedulerConfig
from stratum.engine.scheduler import Scheduler, SchedulerOutput
from stratum.engine.request import CachePolicy, SequenceStatus
from tests.factories import make_block_manager, make_seq


class FakeRunner:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.bm = scheduler.bm
        self.finished = []

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.bm.check_integrity()
        assert out.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if seq.num_output_tokens < seq.sampling.max_tokens:
                seq.token_ids.append(1000 + seq.num_tokens)
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                self.scheduler.finish(seq)
                seq.status = SequenceStatus.FINISHED
                self.finished.append(seq)
        self.bm.check_integrity()
        return out

    def run(self, max_steps: int = 1000) -> list[list[tuple[str, int]]]:
        """Step until nothing is left; returns each step's [(request_id, num_new_tokens)]."""
        steps = []
        while self.scheduler.num_unfinished:
            out = self.step()
            steps.append(plan(out))
            assert len(steps) < max_steps, "no progress"
        return steps


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def make_scheduler(num_blocks=64, block_size=4, budget=512, max_num_seqs=64, watermark=0,
                   enable_prefix_cache=True) -> tuple[Scheduler, FakeRunner]:
    bm = make_block_manager(num_blocks=num_blocks, block_size=block_size, enable_prefix_cache=enable_prefix_cache)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, watermark_blocks=watermark)
    scheduler = Scheduler(config, bm)
    return scheduler, FakeRunner(scheduler)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return list(prompt) + [1000 + len(prompt) + i for i in range(max_tokens)]


# ---- chunked prefill ----------------------------------------------------------------------------------


def test_a_40_token_prompt_with_budget_16_runs_in_chunks_16_16_8():
    sched, runner = make_scheduler(block_size=4, budget=16)
    seq = make_seq("a", range(40), max_tokens=3)
    sched.add(seq)
    steps = runner.run()
    assert steps == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert seq.token_ids == expected_tokens(range(40), 3)
    assert sched.bm.num_used_blocks == 0


def test_chunks_track_num_computed_tokens_and_blocks():
    sched, runner = make_scheduler(block_size=16, budget=16)
    seq = make_seq("a", range(40), block_size=16, max_tokens=1)
    sched.add(seq)
    seen = []
    while sched.num_unfinished:
        runner.step()
        seen.append((seq.num_computed_tokens, list(seq.block_table)))
    assert seen == [(16, [0]), (32, [0, 1]), (40, [])]  # finished after the last chunk: blocks freed
    assert sorted(sched.bm.cache.block_node) == [0, 1]


def test_running_decodes_come_first_and_are_never_stalled_by_a_long_prompt():
    sched, runner = make_scheduler(block_size=4, budget=16)
    d = make_seq("d", range(4), max_tokens=20, priority=5)  # a low-priority decode...
    sched.add(d)
    assert plan(runner.step()) == [("d", 4)]
    long = make_seq("long", range(100, 200), max_tokens=1, priority=0)  # ...and a high-priority long prompt
    sched.add(long)
    steps = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        steps.append(plan(runner.step()))
    assert steps == [[("d", 1), ("long", 15)]] * 6 + [[("d", 1), ("long", 10)]]
    assert d.num_output_tokens == 8  # one token per step, every step


def test_a_prompt_longer_than_the_budget_is_chunked_among_decodes():
    sched, runner = make_scheduler(block_size=4, budget=8)
    for i in range(3):
        sched.add(make_seq(f"d{i}", [10 * i, 10 * i + 1], max_tokens=12))
    assert plan(runner.step()) == [("d0", 2), ("d1", 2), ("d2", 2)]
    sched.add(make_seq("p", range(100, 120), max_tokens=1))
    steps = [plan(runner.step()) for _ in range(5)]
    decodes = [("d0", 1), ("d1", 1), ("d2", 1)]
    assert steps == [decodes + [("p", 5)]] * 4 + [decodes]


# ---- order -------------------------------------------------------------------------------------------


def test_priority_classes_then_arrival_order():
    sched, runner = make_scheduler(budget=512)
    for rid, prio in (("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", 1)):
        sched.add(make_seq(rid, [ord(rid)] * 3, priority=prio, max_tokens=1))
    assert [s.request_id for s in sched.waiting] == ["b", "d", "a", "e", "c"]
    assert plan(runner.step()) == [("b", 3), ("d", 3), ("a", 3), ("e", 3), ("c", 3)]


def test_admission_follows_priority_when_only_one_fits_per_step():
    sched, runner = make_scheduler(budget=512, max_num_seqs=1)
    for rid, prio in (("a", 1), ("b", 0), ("c", 1), ("d", 0)):
        sched.add(make_seq(rid, [ord(rid)] * 3, priority=prio, max_tokens=1))
    steps = runner.run()
    assert steps == [[("b", 3)], [("d", 3)], [("a", 3)], [("c", 3)]]


def test_a_later_high_priority_request_jumps_the_waiting_queue():
    sched, runner = make_scheduler(budget=512, max_num_seqs=1)
    sched.add(make_seq("first", [1, 2, 3], max_tokens=2))
    sched.add(make_seq("low", [4, 5, 6], max_tokens=1, priority=1))
    assert plan(runner.step()) == [("first", 3)]
    sched.add(make_seq("urgent", [7, 8, 9], max_tokens=1, priority=-1))
    assert runner.run() == [[("first", 1)], [("urgent", 3)], [("low", 3)]]


# ---- preemption ----------------------------------------------------------------------------------------


def test_preemption_takes_lowest_priority_then_latest_arrival():
    sched, runner = make_scheduler(num_blocks=5, block_size=4, enable_prefix_cache=False)
    seqs = {rid: make_seq(rid, [i] * 4, max_tokens=4, priority=prio)
            for i, (rid, prio) in enumerate((("a", 0), ("b", 1), ("c", 1), ("d", 0)))}
    for seq in seqs.values():
        sched.add(seq)
    assert plan(runner.step()) == [("a", 4), ("d", 4), ("b", 4), ("c", 4)]
    assert [seqs[r].block_table for r in "adbc"] == [[0], [1], [2], [3]]

    out = runner.step()  # every decode needs a second block; one is free
    assert plan(out) == [("a", 1), ("d", 1)]
    assert [s.request_id for s in out.preempted] == ["c", "b"]  # c (prio 1, latest) first, then b
    assert seqs["a"].block_table == [0, 4] and seqs["d"].block_table == [1, 3]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    for rid in "bc":
        s = seqs[rid]
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 and s.block_table == []
        assert s.num_preemptions == 1 and s.num_tokens == 5  # its sampled token is kept and recomputed
    assert sched.num_preemptions == 2

    steps = runner.run()
    assert [("b", 5), ("c", 5)] in steps  # both recompute prompt + sampled token together
    assert sched.num_preemptions == 2
    for rid, seq in seqs.items():
        assert seq.token_ids == expected_tokens(seq.prompt_token_ids, 4), rid
    assert sched.bm.num_used_blocks == 0 and sched.bm.num_free_blocks == 5


def test_preemption_among_equal_priorities_takes_the_latest_arrival():
    sched, runner = make_scheduler(num_blocks=4, block_size=4, enable_prefix_cache=False)
    seqs = [make_seq(f"s{i}", [i] * 4, max_tokens=2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    runner.step()
    out = runner.step()
    # s0 needs a block: s3 goes; s1 needs one: s2 goes; s2 and s3 are then preempted, not run
    assert plan(out) == [("s0", 1), ("s1", 1)]
    assert [s.request_id for s in out.preempted] == ["s3", "s2"]
    runner.run()
    assert all(s.token_ids == expected_tokens(s.prompt_token_ids, 2) for s in seqs)


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_lowest():
    sched, runner = make_scheduler(num_blocks=3, block_size=4, enable_prefix_cache=False)
    hi = make_seq("hi", [1] * 4, max_tokens=5, priority=0)
    lo = make_seq("lo", [2] * 4, max_tokens=5, priority=1)
    sched.add(hi)
    sched.add(lo)
    runner.step()
    out = runner.step()  # hi takes the free block; lo finds only itself to preempt
    assert plan(out) == [("hi", 1)]
    assert [s.request_id for s in out.preempted] == ["lo"]
    runner.run()
    assert hi.token_ids == expected_tokens(hi.prompt_token_ids, 5)
    assert lo.token_ids == expected_tokens(lo.prompt_token_ids, 5)


def test_a_preempted_request_rehits_its_own_cached_prefix():
    sched, runner = make_scheduler(num_blocks=5, block_size=4, budget=32)
    a = make_seq("a", range(8), max_tokens=3, priority=0)
    v = make_seq("v", range(100, 109), max_tokens=3, priority=1)
    sched.add(a)
    sched.add(v)
    assert plan(runner.step()) == [("a", 8), ("v", 9)]
    assert (a.block_table, v.block_table) == ([0, 1], [2, 3, 4])
    out = runner.step()  # a needs block 2 of its table: v goes, its two full blocks stay cached
    assert plan(out) == [("a", 1)] and out.preempted == [v]
    assert a.block_table == [0, 1, 4]
    assert sorted(sched.bm.cache.block_node) == [0, 1, 2, 3]
    out = runner.step()  # v's hit is locked, but its last block cannot come from anywhere yet
    assert plan(out) == [("a", 1)] and a.is_finished
    out = runner.step()
    assert plan(out) == [("v", 2)]  # 8 of its 10 tokens come from the cache
    assert v.block_table == [2, 3, 4] and v.num_computed_tokens == 10
    runner.run()
    assert v.token_ids == expected_tokens(range(100, 109), 3)


# ---- abort, caps --------------------------------------------------------------------------------------


def test_abort_from_waiting_and_running_frees_every_block():
    sched, runner = make_scheduler(num_blocks=16, block_size=4, budget=8)
    a = make_seq("a", range(20), max_tokens=4)
    b = make_seq("b", range(100, 120), max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert plan(runner.step()) == [("a", 8)]
    assert sched.bm.num_used_blocks == 2 and b.status is SequenceStatus.WAITING

    assert sched.abort("b") is b
    sched.bm.check_integrity()
    assert sched.waiting == [] and b.block_table == []
    assert sched.abort("a") is a
    sched.bm.check_integrity()
    assert sched.running == [] and a.block_table == []
    assert sched.bm.num_used_blocks == 0
    assert sched.bm.num_free_blocks + sched.bm.num_cached_blocks == 16
    assert sched.abort("a") is None and sched.abort("nobody") is None
    assert runner.step().is_empty


def test_abort_of_a_decoding_request_with_a_shared_prefix():
    sched, runner = make_scheduler(num_blocks=16, block_size=4)
    a = make_seq("a", range(12), max_tokens=10)
    sched.add(a)
    runner.step()
    b = make_seq("b", list(range(12)) + [50], max_tokens=10)  # hits a's three blocks
    sched.add(b)
    runner.step()
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert sched.bm.ref_counts[a.block_table[0]] == 2
    sched.abort("a")
    sched.bm.check_integrity()
    assert sched.bm.ref_counts[b.block_table[0]] == 1
    sched.abort("b")
    sched.bm.check_integrity()
    assert sched.bm.num_used_blocks == 0


def test_max_num_seqs_caps_the_running_batch():
    sched, runner = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(make_seq(f"s{i}", [i] * 3, max_tokens=3))
    steps = []
    while sched.num_unfinished:
        steps.append(plan(runner.step()))
        assert len(sched.running) <= 2
    assert steps == [
        [("s0", 3), ("s1", 3)], [("s0", 1), ("s1", 1)], [("s0", 1), ("s1", 1)],
        [("s2", 3), ("s3", 3)], [("s2", 1), ("s3", 1)], [("s2", 1), ("s3", 1)],
    ]


def test_watermark_holds_blocks_back_from_new_requests():
    sched, runner = make_scheduler(num_blocks=8, block_size=4, watermark=2)
    sched.add(make_seq("a", range(12), max_tokens=8))  # 3 blocks + 2 watermark: fits
    sched.add(make_seq("b", range(100, 114), max_tokens=8))  # 4 more + 2 > 5 left: waits
    assert plan(runner.step()) == [("a", 12)]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_a_request_that_fits_the_pool_is_admitted_when_nothing_runs():
    """The watermark protects running requests; with none running it must not block forever."""
    sched, runner = make_scheduler(num_blocks=8, block_size=4, watermark=4)
    seq = make_seq("big", range(24), max_tokens=4)  # 6 prompt blocks + 4 watermark > 8
    sched.add(seq)
    steps = runner.run(max_steps=20)
    assert steps[0] == [("big", 24)]
    assert seq.token_ids == expected_tokens(range(24), 4)


def test_max_tokens_zero_prefills_only():
    sched, runner = make_scheduler(block_size=4)
    seq = make_seq("p", range(10), max_tokens=0)
    sched.add(seq)
    assert runner.run() == [[("p", 10)]]
    assert seq.num_output_tokens == 0
    assert sorted(sched.bm.cache.block_node) == [0, 1]


# ---- in-flight prefix dedup ----------------------------------------------------------------------------


def test_a_request_waits_one_step_for_a_prefix_being_computed():
    sched, runner = make_scheduler(block_size=4, budget=64)
    shared = list(range(12))
    a = make_seq("a", shared + [50, 51, 52], max_tokens=2)
    b = make_seq("b", shared + [60, 61, 62], max_tokens=2)
    c = make_seq("c", range(200, 215), max_tokens=2)  # unrelated: not held back
    for s in (a, b, c):
        sched.add(s)
    assert plan(runner.step()) == [("a", 15), ("c", 15)]
    a_table = list(a.block_table)
    assert plan(runner.step()) == [("a", 1), ("c", 1), ("b", 3)]
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a_table[:3]


def test_a_short_prompt_is_not_held_behind_a_long_prefill():
    sched, runner = make_scheduler(num_blocks=64, block_size=4, budget=16)
    sched.add(make_seq("long", list(range(100, 140)), max_tokens=1))
    assert plan(runner.step()) == [("long", 16)]
    sched.add(make_seq("short", [1, 2, 3, 4, 5], max_tokens=1))
    # the running prefill keeps half the budget; the short prompt starts in the same step
    assert plan(runner.step()) == [("long", 8), ("short", 5)]
    assert plan(runner.step()) == [("long", 16)]  # nobody short waits: the whole budget again


def test_a_long_prompt_waiting_does_not_slow_a_running_prefill():
    sched, runner = make_scheduler(num_blocks=64, block_size=4, budget=16)
    sched.add(make_seq("a", list(range(100, 140)), max_tokens=1))
    sched.add(make_seq("b", list(range(200, 240)), max_tokens=1))
    assert plan(runner.step()) == [("a", 16)]
    assert plan(runner.step()) == [("a", 16)]


def test_in_flight_dedup_waits_through_a_chunked_prefix():
    sched, runner = make_scheduler(block_size=4, budget=8)
    shared = list(range(16))
    a = make_seq("a", shared + [50], max_tokens=1)
    b = make_seq("b", shared + [60], max_tokens=1)
    sched.add(a)
    sched.add(b)
    steps = runner.run()
    assert steps == [[("a", 8)], [("a", 8)], [("a", 1), ("b", 1)]]
    assert b.num_cached_tokens == 16


def test_no_dedup_wait_for_a_request_that_does_not_read_the_cache():
    sched, runner = make_scheduler(block_size=4, budget=64)
    shared = list(range(12))
    a = make_seq("a", shared + [50], max_tokens=1)
    b = make_seq("b", shared + [60], max_tokens=1, policy=CachePolicy(read=False))
    sched.add(a)
    sched.add(b)
    assert plan(runner.step()) == [("a", 13), ("b", 13)]


# ---- through the engine --------------------------------------------------------------------------------


def test_engine_abort_in_every_state_frees_every_block(tiny_model_dir):
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir), num_kv_blocks=32, block_size=4, dtype="float32", device="cpu", num_threads=1,
              scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2))
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6, 7, 8], params, request_id="decoding")
    engine.add_request(list(range(10, 50)), params, request_id="prefilling")
    engine.add_request([9, 9, 9], params, request_id="waiting")
    engine.step()
    engine.step()
    seqs = {s.request_id: s for s in engine.scheduler.running + engine.scheduler.waiting}
    assert seqs["decoding"].num_output_tokens == 2
    assert seqs["prefilling"].num_computed_tokens == 27 and seqs["prefilling"].is_prefilling
    assert seqs["waiting"].status is SequenceStatus.WAITING
    assert engine.block_manager.num_used_blocks == 2 + 7

    for rid in ("prefilling", "waiting", "decoding"):
        out = engine.abort(rid)
        engine.block_manager.check_integrity()
        assert out.finished and out.finish_reason == "abort"
    assert out.token_ids == seqs["decoding"].output_token_ids and len(out.token_ids) == 2
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks + engine.block_manager.num_cached_blocks == 32
    assert not engine.has_unfinished() and engine.requests == {}
    assert engine.abort("decoding") is None
    assert engine.step() == []

    (again,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert again.token_ids[:2] == seqs["decoding"].output_token_ids  # the pool is usable as before


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_every_invariant(seed):
    """Random arrivals, priorities, shared prefixes, salts, aborts and a pool small enough to preempt."""
    import random

    rng = random.Random(seed)
    sched, runner = make_scheduler(num_blocks=12, block_size=4, budget=rng.choice([5, 8, 16, 64]),
                                   max_num_seqs=rng.choice([3, 8]), watermark=rng.choice([0, 2]))
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    live, aborted, done = {}, set(), []
    for step in range(3000):
        if step < 300 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 12))]
            seq = make_seq(f"r{step}", prompt, max_tokens=rng.randrange(0, 16), priority=rng.randrange(3),
                           salt=rng.choice([None, "t1"]))
            sched.add(seq)
            live[seq.request_id] = seq
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            assert sched.abort(rid) is live[rid]
            sched.bm.check_integrity()
            aborted.add(rid)
            assert live.pop(rid).block_table == []
        runner.step()
        for seq in runner.finished:
            done.append(live.pop(seq.request_id))
        runner.finished.clear()
        if step >= 300 and not sched.num_unfinished:
            break
    assert not sched.num_unfinished and not live
    assert sched.num_preemptions > 0  # the pool is small enough that every seed preempts
    assert sched.bm.num_used_blocks == 0
    for seq in done:
        assert seq.token_ids == expected_tokens(seq.prompt_token_ids, seq.sampling.max_tokens), seq.request_id
