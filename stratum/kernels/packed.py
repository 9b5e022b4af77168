"""GGUF tensors repacked for the native step (csrc/packed_step.cpp): tiles of 16 output rows.

Every block format the step runs is first decoded into one affine form per block of 32 inputs,
weight = q·d + m with integer q (kept as stored: no value is rounded), and written in one of six
formats (FORMATS; the same numbers in packed_step.cpp's `Format`):

    Q4    4-bit q, fp16 d and m        Q4_0 (m = −8d, exact), Q4_1
    Q8    int8 q, fp16 d               Q8_0, Q5_0 (q − 16)
    Q4K   4-bit q, fp32 d and m        Q4_K (d = d·sc, m = −dmin·min of each sub-block of 32)
    Q8K   int8 q, fp32 d_lo, d_hi, m   Q5_K, Q5_1 (d_lo = d_hi), Q6_K (q − 32; a scale per 16 inputs, m = 0)
    F16, BF16  the 16-bit floats as stored

(block layouts: llama.cpp ggml-common.h, block_q4_0 ... block_q6_K; K-quant sub-blocks unpacked by
kernels/kquant.py). A K-quant scale is an fp16 times a 6- or 8-bit integer: exact in fp32, not in fp16.

The kernel computes 16 outputs at once, one per int32 lane, each lane taking a pair of inputs per
instruction (int16 activations); so per tile of 16 rows and per block of 32 inputs:

    8-bit, 512 bytes: [pair p][row i][e < 2] = q[i, 2p + e]  (int8, sign-extended in the kernel)
    4-bit, 256 bytes: [group g of 8 inputs][row quad L][h < 2][row k < 4][e < 2]
                      = q[4L + k, 8g + 2h + e] | q[4L + k, 8g + 4 + 2h + e] << 4
    16-bit float, 1024 bytes: [input j][row i]

(the 4-bit order is what the kernel's byte unpacking within 128-bit lanes turns into one pair
of inputs per output lane), and the scales of a tile-block are 16 values of each of the format's
scales in turn. Rows are padded to a multiple of 16 with zero weights.

A projection whose parts (q, k, v; gate, up) differ in format is run as segments, one per format,
their outputs side by side: llama.cpp's Q4_K_M keeps some attn_v and ffn_down tensors in Q6_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stratum.kernels import kquant
from stratum.kernels.quant import GROUP_SIZE, Q8_0_BYTES

TILE = 16
Q4, Q8, Q4K, Q8K, F16, BF16 = range(6)  # FORMATS, as packed_step.cpp numbers them
FORMATS = {"Q4_0": Q4, "Q4_1": Q4, "Q8_0": Q8, "Q5_0": Q8, "Q4_K": Q4K, "Q5_K": Q8K, "Q6_K": Q8K, "Q5_1": Q8K,
           "F16": F16, "BF16": BF16}
PACKED_QTYPES = tuple(FORMATS)
_FP32_SCALES = (Q4K, Q8K)
LAYOUT_VERSION = 2  # of the tiles below and csrc/packed_step.cpp's reading of them; names the cached copy


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0]


def _tiles(values: np.ndarray) -> np.ndarray:
    """[N, ...] -> [ceil(N / 16), 16, ...], padded with zeros."""
    pad = -values.shape[0] % TILE
    if pad:
        values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
    return values.reshape(-1, TILE, *values.shape[1:])


def _q5_bits(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0 / Q5_1 blocks -> q [N, b, 32] in 0..31: nibble j (j < 16 low, j + 16 high) and bit j of qh."""
    qh = blocks[..., qh_at : qh_at + 4].copy().view("<u4")  # [N, b, 1]
    qs = blocks[..., qh_at + 4 :]
    low = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return low | (high << 4)


def decode(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[int, np.ndarray, list[np.ndarray]]:
    """Raw GGUF rows of `shape` [N, K] -> (format, q [N, K], scales [N, K / 32] each, in the format's order).

    q is uint8 nibbles for the 4-bit formats, int8 for the 8-bit ones, the 16-bit floats' bits (uint16)
    for F16 / BF16. Nothing is rounded: q·d + m is the GGUF's own value of every weight.
    """
    n, k = shape
    fmt = FORMATS[qtype]
    if fmt in (F16, BF16):
        return fmt, np.ascontiguousarray(raw).view(np.uint16).reshape(n, k), []
    if qtype in kquant.BLOCK_BYTES:
        u = kquant.unpack(qtype, raw, shape)
        q, scale = u.q.numpy(), u.scale.numpy()
        if qtype == "Q4_K":
            return fmt, q, [scale, u.offset.numpy()]
        if qtype == "Q5_K":
            return fmt, q.astype(np.int8), [scale, scale, u.offset.numpy()]
        return fmt, q, [scale[:, 0::2], scale[:, 1::2], np.zeros_like(scale[:, 0::2])]  # Q6_K: d per 16
    nb = k // GROUP_SIZE
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, nb, -1)
    d = _fp16(blocks, 0)
    if qtype == "Q8_0":
        assert blocks.shape[-1] == Q8_0_BYTES
        return fmt, blocks[..., 2:].copy().view(np.int8).reshape(n, k), [d]
    if qtype == "Q5_0":
        return fmt, (_q5_bits(blocks, 2).astype(np.int8) - 16).reshape(n, k), [d]
    if qtype == "Q5_1":
        d32 = d.astype(np.float32)
        return fmt, _q5_bits(blocks, 4).astype(np.int8).reshape(n, k), [d32, d32, _fp16(blocks, 2).astype(np.float32)]
    if qtype == "Q4_1":
        m, qs = _fp16(blocks, 2), blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]  # exact: a power of two
    return fmt, np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k), [d, m]


def _data(fmt: int, q: np.ndarray) -> np.ndarray:
    """q [N, K] -> [tiles, K / 32, bytes] uint8 in the kernel's order (module docstring)."""
    n, k = q.shape
    nb = k // GROUP_SIZE
    if fmt in (F16, BF16):
        t = _tiles(q.reshape(n, nb, GROUP_SIZE)).transpose(0, 2, 3, 1)  # [T, b, j, i]
        return np.ascontiguousarray(t).view(np.uint8).reshape(-1, nb, GROUP_SIZE * TILE * 2)
    if fmt in (Q8, Q8K):
        t = _tiles(np.ascontiguousarray(q).view(np.uint8).reshape(n, nb, 16, 2))  # [T, i, b, p, e], int8 bits as uint8
        return t.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 16 * TILE * 2)
    t = _tiles(q.reshape(n, nb, 4, 2, 2, 2))  # [T, i, b, g, c, h, e]: input 8g + 4c + 2h + e
    t = t.reshape(t.shape[0], 4, 4, nb, 4, 2, 2, 2)  # [T, L, k, b, g, c, h, e]
    t = t.transpose(0, 3, 4, 1, 6, 2, 7, 5)  # [T, b, g, L, h, k, e, c]
    return (t[..., 0] | (t[..., 1] << 4)).reshape(-1, nb, 4 * TILE * 4)


@dataclass
class PackedWeight:
    """One segment of a projection in the native kernel's layout; `matmul` runs it on its own."""

    data: torch.Tensor  # [tiles, blocks, 256 | 512 | 1024] uint8
    scales: torch.Tensor  # [tiles, blocks, 16 per scale] fp16 (Q4, Q8, F16, BF16: none) or fp32 (Q4K, Q8K)
    out_features: int
    in_features: int
    format: int  # FORMATS

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] fp32, the activations quantized to int16 per block of 32 as the kernel does
        (fp32 as they are for F16 / BF16 weights)."""
        return torch.ops.stratum.packed_linear(x.float(), self.data, self.scales, self.format, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()

    def saved(self) -> tuple:
        """The fields as a tuple of tensors and ints (torch.save with weights_only reads it back)."""
        return self.data, self.scales, self.out_features, self.in_features, self.format


def _packed(fmt: int, q: np.ndarray, scales: list[np.ndarray]) -> PackedWeight:
    n, k = q.shape
    dtype = np.float32 if fmt in _FP32_SCALES else np.float16
    tiles = [_tiles(s.astype(dtype)).transpose(0, 2, 1) for s in scales]  # [T, b, i] each
    scale = np.concatenate(tiles, axis=-1) if tiles else np.zeros((-(-n // TILE), k // GROUP_SIZE, 0), dtype)
    return PackedWeight(torch.from_numpy(np.ascontiguousarray(_data(fmt, q))), torch.from_numpy(np.ascontiguousarray(scale)),
                        n, k, fmt)


def pack(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF rows [N, bytes] of a tensor of logical `shape` in one of PACKED_QTYPES -> PackedWeight."""
    if qtype not in FORMATS:
        raise ValueError(f"{qtype}: not a packed format ({', '.join(PACKED_QTYPES)})")
    return _packed(*decode(qtype, raw, shape))


def reference_matmul(qtype: str, raw: np.ndarray, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """What the native kernel computes, in float64 PyTorch: x quantized to int16 per block of 32
    (scale max|x| / 32767, round half to even), exact integer block sums (half-block sums for Q8K),
    each scaled once; F16 / BF16 weights times x as it is. For tests of the kernel; the model's own
    reference is the dequantized fp32 path."""
    n, k = shape
    nb = k // GROUP_SIZE
    fmt, q, scales = decode(qtype, raw, shape)
    if fmt in (F16, BF16):
        bits = torch.from_numpy(q.astype(np.int32))
        w = bits.to(torch.int16).view(torch.float16) if fmt == F16 else (bits << 16).view(torch.float32)
        return x.double() @ w.double().T
    xb = x.double().view(x.shape[0], nb, GROUP_SIZE)
    amax = xb.abs().amax(-1, keepdim=True)
    dx = (amax.float() / 32767).double()[..., 0]  # [M, b]
    xq = torch.where(amax > 0, torch.round(xb.float() * torch.where(amax > 0, 32767 / amax.float(), 0)).double(), 0.0)
    qd = torch.from_numpy(q.astype(np.float64)).view(n, nb, GROUP_SIZE)
    s = [torch.from_numpy(v.astype(np.float64)) for v in scales]  # [N, b] each
    if fmt == Q8K:
        lo = torch.einsum("mbj,nbj->mnb", xq[..., :16], qd[..., :16])
        hi = torch.einsum("mbj,nbj->mnb", xq[..., 16:], qd[..., 16:])
        out = (lo * s[0][None] + hi * s[1][None]) * dx[:, None, :] + s[2][None] * (dx * xq.sum(-1))[:, None, :]
        return out.sum(-1)
    out = torch.einsum("mbj,nbj->mnb", xq, qd) * s[0][None] * dx[:, None, :]
    if len(s) > 1:  # the offset term: m · dx · sum(xq)
        out = out + s[1][None] * (dx * xq.sum(-1))[:, None, :]
    return out.sum(-1)


# Each fused projection of a decoder layer (its module path) and the HF checkpoint tensors that make
# it up, in the native step's order: the PyTorch path's int4 copies are built from the same parts.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


# What packed_step.cpp computes: Llama-shaped decoders (RMSNorm before attention and MLP, SwiGLU,
# unscaled embeddings, causal attention at 1/sqrt(head_dim)) with Qwen2's q/k/v bias and Qwen3's q/k
# norms; Phi-3 once the loader has split its fused projections. Each family is checked against the
# PyTorch model in tests/test_gguf_formats.py.
NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def native_step_refusal(config, quantized: dict) -> str | None:
    """Why the native step cannot run this checkpoint (config: a ModelConfig), or None where it can."""
    if config.architecture not in NATIVE_ARCHITECTURES:
        return (f"architecture {config.architecture} is not Llama-shaped "
                f"(the native step computes {', '.join(NATIVE_ARCHITECTURES)})")
    if any(config.sliding_layers):
        return "sliding-window attention, which the native attention kernel does not mask"
    if config.attn_logit_softcap is not None:
        return "soft-capped attention scores, which the native attention kernel does not compute"
    kinds = {getattr(quantized.get(f"model.layers.{i}.{p}.weight"), "qtype", "dense")
             for i in range(config.num_layers) for parts in FUSED.values() for p in parts}
    if not kinds <= set(PACKED_QTYPES):
        return (f"projections stored as {', '.join(sorted(kinds - set(PACKED_QTYPES)))} (the native step runs "
                f"{', '.join(PACKED_QTYPES)})")
    if any(k % GROUP_SIZE for k in {q.shape[1] for q in quantized.values()}):
        return f"an input width that is not a multiple of {GROUP_SIZE}"
    return None


def pack_fused(quantized: dict, prefix: str, parts: tuple[str, ...]) -> list[PackedWeight] | None:
    """The parts of one fused projection, their rows concatenated: one segment per run of parts in
    the same format. None when a part is missing or not in a packed format."""
    tensors = [quantized.get(f"{prefix}{p}.weight") for p in parts]
    if any(t is None or t.qtype not in FORMATS for t in tensors):
        return None
    decoded = [decode(t.qtype, t.data, t.shape) for t in tensors]
    segments: list[list] = []
    for fmt, q, scales in decoded:
        if segments and segments[-1][0] == fmt:
            segments[-1][1].append(q)
            segments[-1][2].append(scales)
        else:
            segments.append([fmt, [q], [scales]])
    return [_packed(fmt, np.concatenate(qs), [np.concatenate(parts) for parts in zip(*ss)]) for fmt, qs, ss in segments]


class PackedStack:
    """Every decoder layer on packed weights, run by one native call per step (csrc/packed_step.cpp).

    Holds each layer's projections as their segments (a format per layer and projection, as the
    file stores them); the norms (and Qwen's biases and q/k norms) are fp32 copies of the model's
    own. The KV pool it writes keeps keys transposed per block (`keys` reads them back as [slot, KVH, D]).
    """

    def __init__(self, model, layers: list[list[list[PackedWeight]]]):
        """layers: per decoder layer, per projection in FUSED order, its segments (see `pack_layers`)."""
        cfg = model.config
        self.config = cfg
        attn = [layer.self_attn for layer in model.layers]
        empty = torch.empty(0)
        bias = torch.stack([a.qkv_proj.bias.float() for a in attn]) if cfg.attention_bias else empty
        q_norm = torch.stack([a.q_norm.weight.float() for a in attn]) if cfg.qk_norm else empty
        k_norm = torch.stack([a.k_norm.weight.float() for a in attn]) if cfg.qk_norm else empty
        self.weights = [
            torch.stack([layer.input_layernorm.weight.float() for layer in model.layers]),
            torch.stack([layer.post_attention_layernorm.weight.float() for layer in model.layers]),
            model.norm.weight.float().contiguous(),
            bias, q_norm, k_norm,
        ]
        self.layout: list[int] = []  # per layer and projection: segments, then (format, rows) of each
        for projections in layers:
            for segments in projections:
                self.layout.append(len(segments))
                for w in segments:
                    self.layout += [w.format, w.out_features]
                    self.weights += [w.data, w.scales]
        self.nbytes = sum(w.nbytes for projections in layers for segments in projections for w in segments)

    @staticmethod
    def pack_layers(quantized: dict, num_layers: int) -> list[list[list[PackedWeight]]] | None:
        """The checkpoint's raw GGUF tensors as the segments the step reads, per layer and projection;
        None unless every projection of every layer is in packed formats."""
        layers = [[pack_fused(quantized, f"model.layers.{i}.", parts) for parts in FUSED.values()] for i in range(num_layers)]
        return None if any(p is None for projections in layers for p in projections) else layers

    @staticmethod
    def keys(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
        """The keys at `slots`, [n, KVH, D], from a pool the native step wrote: its blocks hold keys
        transposed, [KVH, D, block_size] each (csrc/packed_step.cpp)."""
        num_slots, kv_heads, head_dim = k_cache.shape
        blocks = k_cache.view(num_slots // block_size, kv_heads, head_dim, block_size)
        return blocks[slots // block_size, :, :, slots % block_size]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] fp32 embedded tokens -> (final-normed hidden [T, hidden], probed queries)."""
        cfg = self.config
        probe = meta.probe
        layers = sorted(probe.layers) if probe is not None else []
        rows = torch.tensor(probe.rows if probe is not None else [], dtype=torch.long)
        return torch.ops.stratum.packed_forward(
            x, positions, cos, sin, meta.slot_mapping, meta.row_tables, meta.row_seq,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], self.weights, self.layout,
            cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, meta.block_size, layers, rows)
