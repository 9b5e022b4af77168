"""The native CPU kernels against the PyTorch paths they replace, on random pools and weights."""

import pytest
import torch

from stratum.kernels import native
from stratum.layers.attention import AttentionMetadata, paged_attention
from stratum.kernels.quant import Q8Weight, unpack_q8_0

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64


def _pool(num_blocks: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * BLOCK, KV_HEADS, DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _decode_meta(own: list[list[int]], lens: list[int], shared: list[int], use_native: bool) -> AttentionMetadata:
    """One decode token per sequence, context = shared blocks + its own blocks; the new K/V go to its last slot."""
    prefix = len(shared) * BLOCK
    tables = [shared + t for t in own]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=len(own), block_size=BLOCK)
    width = max(len(t) for t in own)
    table = torch.tensor([t + [0] * (width - len(t)) for t in own])
    suffix = torch.tensor(lens) - prefix
    if shared:
        meta.shared_slots = (torch.tensor(shared)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    if use_native:
        meta.decode_table, meta.decode_lens = table, suffix
    else:
        meta.decode_slots = (table[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)
        meta.decode_mask = (torch.arange(meta.decode_slots.shape[1])[None, :] < suffix[:, None]).view(
            len(own), 1, 1, -1)
    return meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cascade", [False, True])
def test_native_decode_attention_matches_the_gather_path(dtype, cascade):
    g = torch.Generator().manual_seed(1)
    shared = [7, 3, 11] if cascade else []
    own = [[20, 5], [9], [30, 31, 2, 4], [14]]
    lens = [(len(shared) + len(t)) * BLOCK - cut for t, cut in zip(own, [3, 0, 15, 9])]
    q = torch.randn(len(own), HEADS, DIM, generator=g).to(dtype)
    k, v = (torch.randn(len(own), KV_HEADS, DIM, generator=g).to(dtype),
            torch.randn(len(own), KV_HEADS, DIM, generator=g).to(dtype))
    outs = []
    for use_native in (False, True):
        k_cache, v_cache = _pool(40, dtype)
        meta = _decode_meta(own, lens, shared, use_native)
        outs.append(paged_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5).float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # the gather path multiplies in bf16
    torch.testing.assert_close(outs[1], outs[0], atol=tolerance, rtol=tolerance)


def test_native_decode_attention_matches_a_dense_softmax_reference():
    k_cache, v_cache = _pool(12, torch.float32, seed=2)
    table = torch.tensor([[4, 9, 1], [0, 11, 0]])
    lens = torch.tensor([41, 17])
    q = torch.randn(2, HEADS, DIM)
    out, lse = torch.ops.stratum.decode_attention(q, k_cache, v_cache, table, lens, BLOCK, 0.125)
    for b in range(2):
        slots = (table[b][:, None] * BLOCK + torch.arange(BLOCK)).flatten()[: lens[b]]
        k = k_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[b], k) * 0.125
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1))
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("table, lens, message", [
    ([[4, 99]], [20], "outside the pool"),
    ([[4, -1]], [20], "outside the pool"),
    ([[4]], [17], "longer than its block table"),
])
def test_native_decode_attention_rejects_tables_outside_the_pool(table, lens, message):
    k_cache, v_cache = _pool(12, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.stratum.decode_attention(torch.randn(1, HEADS, DIM), k_cache, v_cache, torch.tensor(table),
                                           torch.tensor(lens), BLOCK, 0.125)


def test_q8_0_table_rows_are_exact_against_the_dequantized_weight():
    """The embedding's Q8_0 table as stored: unpacked to the file's int8 values and fp16 scales, and a
    row looked up is the dequantized row exactly."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    n, k = 300, 96
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    raw = np.concatenate([d.numpy().view(np.uint8).reshape(n, k // 32, 2),
                          q.numpy().view(np.uint8).reshape(n, k // 32, 32)], axis=-1)
    q2, scales = unpack_q8_0(raw.reshape(n, -1), (n, k))
    assert torch.equal(q2, q) and torch.equal(scales, d.float())
    weight = (q.float().view(n, k // 32, 32) * d.float()[..., None]).view(n, k)
    ids = torch.tensor([0, 299, 7, 7])
    assert torch.equal(Q8Weight(q2, scales).rows(ids), weight[ids])


@pytest.mark.integration
def test_unpack_q8_0_matches_gguf_dequantize(real_model_path):
    from gguf import GGUFReader, dequantize

    tensor = next(t for t in GGUFReader(real_model_path).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    shape = tuple(int(x) for x in reversed(tensor.shape))
    q, scales = unpack_q8_0(tensor.data, shape)
    rows = slice(0, 512)
    ours = (q[rows].float().view(512, -1, 32) * scales[rows, :, None]).view(512, -1)
    ref = torch.from_numpy(dequantize(tensor.data[rows], tensor.tensor_type).reshape(512, -1))
    assert torch.equal(ours, ref)


def test_engine_without_native_kernels_generates_the_same_tokens(tiny_model_dir, monkeypatch):
    """A machine without a compiler keeps the PyTorch paths; they compute the same thing."""
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of Japan is", "One two three four five six seven eight nine ten eleven twelve thirteen"]

    def run():
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
        return llm.engine, [o.token_ids for o in llm.generate(prompts, params)]

    engine, with_native = run()
    assert engine.runner.native and engine.kernel_choices["attention"].startswith("native")
    monkeypatch.setattr(native, "_state", {"ok": False, "status": "disabled (test)"})
    engine, without = run()
    assert not engine.runner.native and engine.kernel_choices["native_kernels"] == "disabled (test)"
    assert without == with_native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cache_matches_rotary_then_pool_write(dtype):
    from stratum.layers.rotary import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(4)
    tokens = 5
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(DIM, 64, 10000.0, None).tables(torch.tensor([0, 3, 17, 40, 63]))
    slots = torch.tensor([5, 0, 31, 6, 12])
    ours, ref = _pool(2, dtype), _pool(2, dtype)
    qk = torch.ops.stratum.rotary_cache(qkv, cos, sin, ours[0], ours[1], slots, HEADS)
    expected = apply_rotary(qkv[:, : (HEADS + KV_HEADS) * DIM].view(tokens, HEADS + KV_HEADS, DIM), cos, sin)
    ref[0][slots] = expected[:, HEADS:]
    ref[1][slots] = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # fused multiply-adds round differently, by an ulp
    torch.testing.assert_close(qk, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(ours[0], ref[0], atol=tolerance, rtol=tolerance)
    assert torch.equal(ours[1], ref[1])
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.stratum.rotary_cache(qkv, cos, sin, ours[0], ours[1], torch.tensor([5, 0, 32, 6, 12]), HEADS)
