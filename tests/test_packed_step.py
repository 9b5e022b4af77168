"""The native step (kernels/csrc/packed_step.cpp): its kernel against an independent reference, the
whole forward against the PyTorch model, and batch invariance: a row's result never depends on the
rows around it, on the threads, or on whether its prefix came from the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stratum.kernels import native
from stratum.kernels.packed import PACKED_QTYPES, pack, reference_matmul
from tests.factories import make_tiny_gguf
from tests.kquants import quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def _raw(qtype: str, rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random GGUF rows of `qtype` through gguf-py's own quantizer (the K-quants through tests/kquants.py)."""
    values = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 0.5, (n, 1)).astype(np.float32)
    return quantize(values, qtype)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_packed_linear_matches_the_reference_arithmetic_and_the_dequantized_weights(qtype, bits):
    """Each format against (1) its own arithmetic in float64 (reference_matmul) and (2) gguf-py's
    dequantized weights times the fp32 activations, within the error the int16 (or int8) activations
    allow: each input is off by at most half its block's step dx = max|x| / 32767 (127), so an output by
    at most sum_j |w_j| dx_j / 2; both bounds add 1e-6 of sum_j |w_j x_j| for the fp32 rounding. At
    int8 this runs the CPU's int8 kernels where it has them (vpmaddubsw on AVX2), from one row up."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    n, k = 50, 512  # 50 rows: the last tile is padded; 512 inputs: two K-quant super-blocks
    raw = _raw(qtype, rng, n, k)
    w = pack(qtype, raw, (n, k))
    w.activation_bits = bits
    x = torch.from_numpy(rng.standard_normal((7, k)).astype(np.float32))
    x[2] = 0.0  # an all-zero row: zero activation scales
    y = w.matmul(x).double()
    assert y.shape == (7, n)
    dense = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float64).reshape(n, k))
    rounding = 1e-6 * (x.double().abs() @ dense.abs().T)
    assert ((y - reference_matmul(qtype, raw, (n, k), x, bits)).abs() <= rounding).all()
    # dx per row and block
    step = x.double().view(7, -1, 32).abs().amax(-1).float().double() / (32767 if bits == 16 else 127)
    quantization = 0.0 if qtype in ("F16", "BF16") else (step.repeat_interleave(32, -1) / 2) @ dense.abs().T
    assert ((y - x.double() @ dense.T).abs() <= quantization + rounding).all()


# bits per weight the tiles hold against the GGUF block's own: Q4_0's m = -8d is stored (one fp16 more
# per block), a K-quant's 6-bit sub-scales take a byte each
TILE_BITS = {"Q4_0": (5.0, 4.5), "Q4_1": (5.0, 5.0), "Q8_0": (8.5, 8.5), "Q5_0": (5.5, 5.5), "Q5_1": (6.0, 6.0),
             "Q4_K": (4.625, 4.5), "Q5_K": (5.625, 5.5), "Q6_K": (6.5625, 6.5625), "F16": (16.0, 16.0),
             "BF16": (16.0, 16.0)}


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_packed_tiles_are_about_as_small_as_the_file(qtype):
    """A decode step reads every weight once, so the tiles' bytes are its cost: the 5- and 6-bit
    formats keep their bits (not int8), the K-quants their integer sub-scales (not fp32)."""
    rng = np.random.default_rng(2)
    n, k = 32, 512
    raw = _raw(qtype, rng, n, k)
    tiles, file = TILE_BITS[qtype]
    assert raw.nbytes * 8 / (n * k) == file
    assert pack(qtype, raw, (n, k)).nbytes * 8 / (n * k) == tiles


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])  # 4-bit, 5-bit, integer sub-scales, 6-bit
def test_packed_linear_rows_do_not_depend_on_the_batch_or_the_threads(qtype, bits):
    rng = np.random.default_rng(1)
    n, k = 64, 256
    w = pack(qtype, _raw(qtype, rng, n, k), (n, k))
    w.activation_bits = bits
    x = torch.from_numpy(rng.standard_normal((64, k)).astype(np.float32))
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(64)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (2, 3, 5, 16, 64):
                assert torch.equal(w.matmul(x[:m]), alone[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [16, 8])
def test_a_projection_in_segments_gives_each_segments_own_outputs_side_by_side(bits):
    """PackedSegments (the output projection's cached row ranges, formats mixed, a segment ending
    mid-tile) in one call: each segment's own matmul, concatenated, bit for bit."""
    from stratum.kernels.packed import PackedSegments

    rng = np.random.default_rng(2)
    k = 256
    parts = [pack(q, _raw(q, rng, n, k), (n, k)) for q, n in (("Q6_K", 48), ("Q4_K", 37), ("Q8_0", 16))]
    for w in parts:
        w.activation_bits = bits
    head = PackedSegments(parts)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    assert torch.equal(head.matmul(x), torch.cat([w.matmul(x) for w in parts], dim=-1))
    assert head.nbytes == sum(w.nbytes for w in parts)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def _engine(path, native_step: bool, **kw):
    from stratum.engine import LLM

    defaults = dict(num_kv_blocks=128, block_size=4, enable_prefix_cache=False, dtype="float32", int4_max_tokens=0)
    return LLM(str(path), native_step=native_step, **{**defaults, **kw}).engine


def _run(engine, prompts, max_tokens=8, **params):
    from stratum.engine.sampling_params import SamplingParams

    seqs = [engine.add_request(engine.tokenizer.encode(p),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params),
                               request_id=f"r{i}-{p}")
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return seqs


PROMPTS = ["The capital of Japan is Tokyo.", "def add(a, b):", "Once upon a time there was", "Hello world!",
           "numbers 0123456789 and cities", "The capital of Germany is Berlin. Hello", "for i in range(10):",
           "a small model that answered questions"]


@pytest.fixture(scope="module")
def tiny_gguf_d64(tmp_path_factory):
    """Head size 64 and two query heads per KV head: the attention's register-blocked kernels."""
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf-d64") / "tiny.gguf", hidden=256)


@pytest.mark.parametrize("model", ["tiny_gguf", "tiny_gguf_d64"])
def test_the_native_step_computes_what_the_pytorch_model_computes(model, request):
    path = request.getfixturevalue(model)
    torch_engine, native_engine = _engine(path, False), _engine(path, True)
    assert torch_engine.kernel_choices["step"] == "pytorch"
    assert native_engine.kernel_choices["step"] == "native, packed blocks"
    a = _run(torch_engine, PROMPTS[:3], max_tokens=17, return_logits=True)
    b = _run(native_engine, PROMPTS[:3], max_tokens=17, return_logits=True)
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids
        # kv_sparsity's samples (tokens 0, 8, 16): the native step measures them in its attention
        assert x.readouts.coverage_count == y.readouts.coverage_count == 3
        assert y.readouts.coverage_sum == pytest.approx(x.readouts.coverage_sum, abs=1e-6)
        for p in x.readouts.logits:
            # int16 activations: each block rounded at 1.5e-5 of its largest value, through every layer
            torch.testing.assert_close(y.readouts.logits[p], x.readouts.logits[p], rtol=1e-3,
                                       atol=1e-3 * float(x.readouts.logits[p].abs().max()))
    assert native_engine.block_manager.num_used_blocks == 0  # nothing leaked


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_greedy_outputs_are_identical_solo_batched_and_after_a_cache_hit(tiny_gguf, activations):
    solo = [_run(_engine(tiny_gguf, True, activations=activations), [p], return_logits=True)[0] for p in PROMPTS]
    batched = _run(_engine(tiny_gguf, True, activations=activations), PROMPTS, return_logits=True)
    cached_engine = _engine(tiny_gguf, True, enable_prefix_cache=True, activations=activations)
    _run(cached_engine, PROMPTS)
    again = _run(cached_engine, PROMPTS, return_logits=True)
    # a one-block prompt keeps its last token
    assert all(s.num_cached_tokens > 0 for s in again if s.num_prompt_tokens > 4)
    for s, b, c in zip(solo, batched, again):
        assert s.output_token_ids == b.output_token_ids == c.output_token_ids
        last = max(s.readouts.logits)
        assert (torch.equal(s.readouts.logits[last], b.readouts.logits[last])
                and torch.equal(s.readouts.logits[last], c.readouts.logits[last]))


def test_prefill_writes_the_kv_a_decode_would(tiny_gguf):
    """A conversation's next turn re-reads the previous answer: computed by prefill (no cache) it gives
    the same logits, bit for bit, as the decode steps that produced it."""
    engine = _engine(tiny_gguf, True)
    first = _run(engine, [PROMPTS[0]], max_tokens=6, return_logits=True)[0]
    from stratum.engine.sampling_params import SamplingParams

    ids = first.token_ids[:-1]  # the prompt and every sampled token but the last
    replay = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, return_logits=True),
                                request_id="replay")
    while engine.has_unfinished():
        engine.step()
    last = len(ids) - 1
    assert torch.equal(replay.readouts.logits[last], first.readouts.logits[last])


def test_the_native_step_refuses_reads_outside_the_pool(tiny_gguf):
    engine = _engine(tiny_gguf, True)
    model = engine.model
    k, v = engine.runner.kv_caches[0]
    x = torch.zeros(1, model.config.hidden_size)
    pos = torch.zeros(1, dtype=torch.long)
    caches = [k for k, _ in engine.runner.kv_caches], [v for _, v in engine.runner.kv_caches]
    args = (x, pos, model.rotary.cos, model.rotary.sin)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.stratum.packed_forward(*args, torch.tensor([k.shape[0]]), torch.zeros(1, 1, dtype=torch.long),
                                         pos, *caches, model.packed.weights, model.packed.layout, 4, 2, 1e-5, 4, [],
                                         torch.empty(0, dtype=torch.long))
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.stratum.packed_forward(*args, pos, torch.full((1, 1), 10**6, dtype=torch.long),
                                         pos, *caches, model.packed.weights, model.packed.layout, 4, 2, 1e-5, 4, [],
                                         torch.empty(0, dtype=torch.long))


@pytest.mark.integration
def test_real_model_greedy_outputs_identical_solo_batched_and_cache_hit(real_model_path):
    """The same greedy outputs solo, batched and after a cache hit, for 16 of 16 fixed prompts: the default
    model, on the native step (the rule's for its Q4_1)."""
    from tests.test_kernels import QUALITY_CORPUS

    prompts = (QUALITY_CORPUS + PROMPTS)[:16]

    def engine(**kw):
        from stratum.engine import LLM

        return LLM(str(real_model_path), num_kv_blocks=512, native_step=True, **kw).engine

    solo = [_run(engine(enable_prefix_cache=False), [p], max_tokens=24)[0].output_token_ids for p in prompts]
    batched = [s.output_token_ids for s in _run(engine(enable_prefix_cache=False), prompts, max_tokens=24)]
    cached = engine(enable_prefix_cache=True)
    _run(cached, prompts, max_tokens=24)
    again = [s.output_token_ids for s in _run(cached, prompts, max_tokens=24)]
    same = sum(a == b == c for a, b, c in zip(solo, batched, again))
    assert same == 16, f"{same} of 16 identical"
