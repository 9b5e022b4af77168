"""Attention over the paged KV pool, for a flattened batch of decode tokens and prefill chunks.

The pool of one layer is a flat array of slots, [num_blocks * block_size, num_kv_heads, head_dim];
slot = block_id * block_size + offset. A step's tokens are laid out decodes first, then prefill
chunks, each chunk contiguous:

    tokens:  | d0 | d1 | ... | d(B-1) | chunk of seq P0 ......... | chunk of seq P1 ... |
    attends: own context via gathered slots                 | prefix slots + chunk (causal)

Decodes whose block tables start with the same blocks (a shared system prompt) attend to that
common prefix once, as one matrix product for the whole batch, and merge it with the per-sequence
remainder by log-sum-exp (the cascade idea of FlashInfer, Ye et al. 2024), so the shared prefix is
not gathered once per sequence.

A layer with a sliding window (attend to the last `window` positions, itself included) or soft-capped
scores (cap * tanh(s / cap), Gemma 2) runs on PyTorch here: the runner then gathers every decode's
whole context (no native decode kernel, no cascade), and prefill is masked explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk: token rows [start, end) of the step.

    ctx_slots is None when the chunk starts at position 0: it then attends to itself only.
    Otherwise ctx_slots [ctx_len] lists every slot of its context (cached prefix + the chunk) and
    mask [chunk_len, ctx_len] is the causal mask shifted by the prefix length.
    """

    start: int
    end: int
    ctx_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class CoverageProbe:
    """Query rows whose attention coverage is measured this step, at the given layers.

    rows[i] is a token row of the step and slots[i] the KV slots of its whole context (the PyTorch
    step's; the native step reads it through the row's block table); results[i] collects one coverage
    value per measured layer.
    """

    layers: frozenset[int]
    rows: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    results: list[list[float]] = field(default_factory=list)
    seqs: list = field(default_factory=list)  # the owner of each row, for the caller


COVERAGE_MASS = 0.9  # the share of a head's attention whose positions kv_sparsity counts


def attention_coverage(q: torch.Tensor, k: torch.Tensor, scale: float, mass: float = COVERAGE_MASS) -> float:
    """Share of context positions needed to hold `mass` of one query's attention, averaged over heads.

    Args:
        q: [H, D] one token's queries; k: [C, KVH, D] its whole context's keys.
    Returns:
        In (0, 1]: low when a few positions carry the attention (most of the context is unused).
    The native step measures the same in its attention (csrc/step/attention.h `coverage`).
    """
    num_heads, num_kv_heads = q.shape[0], k.shape[1]
    qg = q.float().view(num_kv_heads, num_heads // num_kv_heads, -1)  # [KVH, G, D]
    scores = torch.matmul(qg, k.float().permute(1, 2, 0)).view(num_heads, -1)  # [H, C]
    probs = torch.softmax(scores * scale, dim=-1)
    # sorted by NumPy (the negated values ascending: the same values as torch.sort's, which took ~0.4 ms
    # for [32, 300] here, NumPy's ~0.05 ms), three probed layers every 8th token of every stream
    descending = torch.from_numpy(-np.sort(-probs.cpu().numpy(), axis=-1))
    cumulative = descending.cumsum(-1)
    needed = (cumulative < mass).sum(-1) + 1  # positions until the mass is reached, per head
    return float((needed.float() / k.shape[0]).clamp(max=1.0).mean())


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a layer needs to write and read the pool for one step; built once per step."""

    slot_mapping: torch.Tensor  # [T]: where each token's new K/V is written
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None  # [B, L]: per-decode context slots after the shared prefix
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool, True = attend
    # the native kernel's form of the same: block tables [B, N] and context lengths [B], after the shared prefix
    decode_table: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None  # also set with decode_slots: each decode's context length
    block_size: int = 16
    native: bool = False  # the native CPU kernels are loaded: decode_table/decode_lens, fused rotary + pool write
    shared_slots: torch.Tensor | None = None  # [P]: the slots all decodes share, or None
    prefills: list[PrefillSpan] = field(default_factory=list)
    probe: CoverageProbe | None = None
    # the native step's form: every row attends to positions 0..its own through its sequence's table
    row_tables: torch.Tensor | None = None  # [S, N] int64, one block table per scheduled sequence
    row_seq: torch.Tensor | None = None  # [T] int64: the sequence of each row


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    written: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the pool (unless already `written`), then attend.

    Args:
        q: [T, H, D]; k, v: [T, KVH, D]; k_cache, v_cache: [num_slots, KVH, D].
        window: attend only to the last `window` positions; softcap: cap the scores (None: neither).
            Either needs decodes prepared as gathered slots without a shared prefix.
    Returns:
        [T, H, D] attention output.
    """
    dtype = q.dtype
    q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)  # attention runs in the KV dtype
    if not written:
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    masked = window is not None or softcap is not None
    if num_decode and masked:
        assert meta.decode_slots is not None and meta.shared_slots is None, "masked attention needs gathered decodes"
        out[:num_decode] = _decode(q[:num_decode], k_cache, v_cache, meta, scale, window, softcap)
    elif num_decode:
        if meta.shared_slots is None:
            out[:num_decode] = _decode(q[:num_decode], k_cache, v_cache, meta, scale)
        else:
            out[:num_decode] = _decode_cascade(q[:num_decode], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        rows = slice(span.start, span.end)
        if masked:
            out[rows] = _prefill_masked(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale, window, softcap)
            continue
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
        if span.ctx_slots is None:
            kp, vp = k[rows], v[rows]
            o = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=scale, enable_gqa=True,
            )
        else:
            kp, vp = k_cache[span.ctx_slots], v_cache[span.ctx_slots]  # [C, KVH, D]
            o = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask, scale=scale, enable_gqa=True,
            )
        out[rows] = o[0].transpose(0, 1)
    return out.to(dtype)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [N, KVH, D], slots [B, L] -> [B, KVH, L, D] contiguous.

    index_select on the flattened pool is several times faster than advanced indexing, and a
    contiguous [L, D] per (sequence, head) keeps the batched matmuls below on their fast path.
    """
    num_seqs, length = slots.shape
    num_kv_heads, head_dim = cache.shape[1:]
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, slots.flatten())
    return rows.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2).contiguous()


def _native_suffix(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Each decode query against its own blocks, read in place (csrc/paged_attention.cpp).

    Returns out [B, H, D] and lse [B, H], fp32.
    """
    return torch.ops.stratum.decode_attention(q, k_cache, v_cache, meta.decode_table, meta.decode_lens,
                                              meta.block_size, scale)


def _suffix_scores(q, k_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
                   softcap: float | None = None):
    """Masked scores of each decode query against its own gathered slots: [B, KVH, G, L] fp32.
    With a window, slot column j is position j (no shared prefix), and the query is at decode_lens - 1."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    kd = _gather(k_cache, meta.decode_slots)  # [B, KVH, L, D]
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KVH, G, D]
    scores = _softcap(torch.matmul(qg, kd.transpose(-1, -2)).float() * scale, softcap)
    mask = meta.decode_mask.view(num_seqs, -1)
    if window is not None:
        span = torch.arange(mask.shape[1], device=mask.device)
        mask = mask & (span[None, :] > meta.decode_lens[:, None] - 1 - window)
    return scores.masked_fill(~mask.view(num_seqs, 1, 1, -1), float("-inf"))


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _prefill_masked(q, k, v, k_cache, v_cache, span: PrefillSpan, scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """One prefill chunk attended with explicit scores: q [S, H, D] -> [S, H, D].

    Query i of the chunk is at position C - S + i of its context of C positions (cached prefix + chunk);
    it sees positions up to its own, and with a window only those after its position - window.
    """
    if span.ctx_slots is None:
        kp, vp = k, v
    else:
        kp, vp = k_cache[span.ctx_slots], v_cache[span.ctx_slots]  # [C, KVH, D]
    num_q, num_heads, head_dim = q.shape
    ctx, num_kv_heads = kp.shape[0], kp.shape[1]
    qpos = torch.arange(ctx - num_q, ctx, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    qg = q.view(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [KVH, G, S, D]
    scores = _softcap(torch.matmul(qg, kp.permute(1, 2, 0).unsqueeze(1)).float() * scale, softcap)  # [KVH, G, S, C]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    o = torch.matmul(probs, vp.transpose(0, 1).unsqueeze(1))  # [KVH, G, S, D]
    return o.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    # q: [B, H, D]; one query per sequence, so plain batched matmuls beat the flash kernel here
    if meta.decode_table is not None:
        return _native_suffix(q, k_cache, v_cache, meta, scale)[0].to(q.dtype)
    num_seqs, num_heads, head_dim = q.shape
    scores = _suffix_scores(q, k_cache, meta, scale, window, softcap)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [B, KVH, G, L]
    out = torch.matmul(probs, _gather(v_cache, meta.decode_slots))  # [B, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_cascade(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Shared prefix once for the whole batch, each sequence's own suffix, merged by log-sum-exp."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    # shared part: q grouped by KV head, [KVH, B*G, D] against the prefix [KVH, P, D]
    qs = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    ks = k_cache.index_select(0, meta.shared_slots).transpose(0, 1)  # [KVH, P, D]
    vs = v_cache.index_select(0, meta.shared_slots).transpose(0, 1)
    s1 = torch.matmul(qs, ks.transpose(-1, -2)).float() * scale  # [KVH, B*G, P]
    m1 = s1.amax(-1, keepdim=True)
    p1 = torch.exp(s1 - m1)
    l1 = p1.sum(-1, keepdim=True)
    o1 = torch.matmul(p1.to(q.dtype), vs).float()  # [KVH, B*G, D]

    def per_seq(x):  # [KVH, B*G, X] -> [B, KVH, G, X]
        return x.view(num_kv_heads, num_seqs, group, -1).transpose(0, 1)

    o1, m1, l1 = per_seq(o1), per_seq(m1), per_seq(l1)
    if meta.decode_table is not None:
        o2, lse2 = _native_suffix(q, k_cache, v_cache, meta, scale)  # normalised, with its log-sum-exp
        lse1 = m1 + torch.log(l1)
        lse2 = lse2.view(num_seqs, num_kv_heads, group, 1)
        m = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        out = (o1 / l1 * w1 + o2.view(num_seqs, num_kv_heads, group, head_dim) * w2) / (w1 + w2)
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    s2 = _suffix_scores(q, k_cache, meta, scale)  # [B, KVH, G, L]
    m2 = s2.amax(-1, keepdim=True)
    p2 = torch.exp(s2 - m2)
    l2 = p2.sum(-1, keepdim=True)
    o2 = torch.matmul(p2.to(q.dtype), _gather(v_cache, meta.decode_slots)).float()  # [B, KVH, G, D]
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * w1 + o2 * w2) / (l1 * w1 + l2 * w2)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
