"""GGUF tensors repacked for the native step (csrc/packed_step.cpp): tiles of 16 output rows.

Every block format the step runs is first decoded into one affine form per block of 32 inputs,
weight = q·d + m with integer q (kept as stored: no value is rounded), and written in one of the
formats (FORMATS; the same numbers in csrc/step/formats.h's `Format`), each as close to the file's own
bits per weight as the tiles allow:

    Q4    4-bit q, fp16 d and m                                Q4_0 (m = −8d, exact), Q4_1
    Q8    int8 q, fp16 d                                       Q8_0
    Q5    5-bit q, fp16 d (m = −16d, computed)                 Q5_0
    Q5M   5-bit q, fp16 d and m                                Q5_1
    Q4K   4-bit q; per block the 6-bit sub-scale sc and min;   Q4_K (d = D·sc, m = −Dmin·min)
          per super-block of 256 inputs fp16 D and Dmin
    Q5K   5-bit q, scales as Q4K                               Q5_K
    Q6K   6-bit q (centred: q − 32); per block two int8        Q6_K (d_lo = D·sc_lo, d_hi = D·sc_hi)
          sub-scales (inputs 0-15, 16-31); fp16 D per 256
    F16, BF16  the 16-bit floats as stored

(block layouts: llama.cpp ggml-common.h, block_q4_0 ... block_q6_K; K-quant sub-blocks unpacked by
kernels/kquant.py). A K-quant scale is an fp16 times a 6- or 8-bit integer: exact in fp32, so the
kernel multiplies the two at run time and gets the scale ggml's dequantizer computes, bit for bit.

The kernel computes 16 outputs at once, one per int32 lane, each lane taking a pair of inputs per
instruction (int16 activations); so per tile of 16 rows and per block of 32 inputs:

    8-bit, 512 bytes: [pair p][row i][e < 2] = q[i, 2p + e]  (int8, sign-extended in the kernel)
    4-bit, 256 bytes: [group g of 8 inputs][row quad L][h < 2][row k < 4][e < 2]
                      = q[4L + k, 8g + 2h + e] | q[4L + k, 8g + 4 + 2h + e] << 4
    5-bit, 320 bytes: the 4-bit plane of q & 15, then per group 16 bytes of fifth bits: bit L of
                      byte r is bit 4 of the low nibble's q in byte 16L + r of the group's 64,
                      bit 4 + L that of its high nibble
    6-bit, 384 bytes: the 4-bit plane, then per group 32 bytes of q >> 4: bits 2L, 2L + 1 of byte r
                      (r < 16) for the low nibble's q in byte 16L + r, of byte 16 + r for the high one
    16-bit float, 1024 bytes: [input j][row i]

(the 4-bit order is what the kernel's byte unpacking within 128-bit lanes turns into one pair of
inputs per output lane; the high planes are read with one shift per 128-bit lane L). The scales of a
tile-block are 16 values of each of the format's scales in turn; for Q4K, Q5K and Q6K, whose scales are
integers under a super-block's fp16, a tile's eight blocks of a super-block store their integer
scales (16 bytes each, 32 a block) and then the super-block's fp16 values (16 each), in one uint8
row of 320 (Q4K, Q5K) or 288 (Q6K) bytes. Rows are padded to a multiple of 16 with zero weights.

A projection whose parts (q, k, v; gate, up) differ in format is run as segments, one per format,
their outputs side by side: llama.cpp's Q4_K_M keeps some attn_v and ffn_down tensors in Q6_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stratum.kernels import kquant
from stratum.kernels.quant import GROUP_SIZE, Q8_0_BYTES
from stratum.layers.attention import COVERAGE_MASS

TILE = 16
# FORMATS, as csrc/step/formats.h numbers them; 3 (kQ8K: int8 q with fp32 scales, Q5_K's form before Q5K) is retired
Q4, Q8, Q4K, _, F16, BF16, Q5, Q5M, Q6K, Q5K = range(10)
FORMAT_NAMES = ("q4", "q8", "q4k", "q8k", "f16", "bf16", "q5", "q5m", "q6k", "q5k")  # what `stratum info` calls them
FORMATS = {"Q4_0": Q4, "Q4_1": Q4, "Q8_0": Q8, "Q5_0": Q5, "Q5_1": Q5M, "Q4_K": Q4K, "Q5_K": Q5K, "Q6_K": Q6K,
           "F16": F16, "BF16": BF16}
PACKED_QTYPES = tuple(FORMATS)
_SUPER = {Q4K: 2, Q5K: 2, Q6K: 1}  # formats with fp16 scales per super-block of 256 inputs: how many
_SUPER_BLOCKS = kquant.QK_K // GROUP_SIZE  # blocks of 32 in a super-block
LAYOUT_VERSION = 3  # of the tiles below and csrc/step/formats.h's (which writes and reads them); names the cached copy


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
    """Raw GGUF rows of `shape` [N, K] -> (format, q [N, K], scales, in the format's order).

    q is uint8 for the 4-, 5- and 6-bit formats (Q6K's not yet centred), int8 for the 8-bit ones, the
    16-bit floats' bits (uint16) for F16 / BF16. Scales are [N, K / 32] each; for Q4K, Q5K and Q6K,
    first the integer sub-scales [N, K / 32] (sc, min; Q6K: sc_lo, sc_hi), then the fp16 super-block
    values [N, K / 256] (D, Dmin; Q6K: D). Nothing is rounded: q·d + m is the GGUF's own value
    of every weight.
    """
    n, k = shape
    fmt = FORMATS[qtype]
    if fmt in (F16, BF16):
        return fmt, np.ascontiguousarray(raw).view(np.uint16).reshape(n, k), []
    if qtype in kquant.BLOCK_BYTES:
        p = kquant.parts(qtype, raw, shape)
        if qtype != "Q6_K":
            return fmt, p.q.numpy(), [p.sc.numpy(), p.mins.numpy(), p.d.numpy(), p.dmin.numpy()]
        sc = p.sc.numpy()  # Q6_K: a scale per 16 inputs
        return fmt, p.q.numpy(), [sc[:, 0::2], sc[:, 1::2], p.d.numpy()]
    nb = k // GROUP_SIZE
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, nb, -1)
    d = _fp16(blocks, 0)
    if qtype == "Q8_0":
        assert blocks.shape[-1] == Q8_0_BYTES
        return fmt, blocks[..., 2:].copy().view(np.int8).reshape(n, k), [d]
    if qtype == "Q5_0":
        return fmt, _q5_bits(blocks, 2).reshape(n, k), [d]
    if qtype == "Q5_1":
        return fmt, _q5_bits(blocks, 4).reshape(n, k), [d, _fp16(blocks, 2)]
    if qtype == "Q4_1":
        m, qs = _fp16(blocks, 2), blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]  # exact: a power of two
    return fmt, np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k), [d, m]


def native_form(qtype: str) -> str:
    """How the native step holds a tensor of this GGUF type, as `stratum info` names it."""
    return f"native step, as stored in {FORMAT_NAMES[FORMATS[qtype]]} tiles"


def block_scales(fmt: int, scales: list[np.ndarray]) -> list[np.ndarray]:
    """decode's scales -> the fp64 values the kernel scales each block's integer sums by, [N, K / 32]
    each: d, m (Q4, Q5, Q5M, Q4K, Q5K), d (Q8), d_lo, d_hi (Q6K)."""
    s = [v.astype(np.float64) for v in scales]
    if fmt == Q5:
        return [s[0], -16 * s[0]]
    if fmt in _SUPER:
        ints, sup = s[: len(s) - _SUPER[fmt]], [np.repeat(v, _SUPER_BLOCKS, -1) for v in s[len(s) - _SUPER[fmt] :]]
        return [sup[0] * ints[0], sup[0] * ints[1]] if fmt == Q6K else [sup[0] * ints[0], -sup[1] * ints[1]]
    return s


def _nibble_order(q: np.ndarray) -> np.ndarray:
    """q [N, K] -> [tiles, K / 32, g, L, h, k, e, c]: the 4-bit layout's order, c the low / high nibble."""
    n, k = q.shape
    t = _tiles(q.reshape(n, k // GROUP_SIZE, 4, 2, 2, 2))  # [T, i, b, g, c, h, e]: input 8g + 4c + 2h + e
    t = t.reshape(t.shape[0], 4, 4, k // GROUP_SIZE, 4, 2, 2, 2)  # [T, L, k, b, g, c, h, e]
    return t.transpose(0, 3, 4, 1, 6, 2, 7, 5)  # [T, b, g, L, h, k, e, c]


def _data(fmt: int, q: np.ndarray) -> np.ndarray:
    """q [N, K] -> [tiles, K / 32, bytes] uint8 in the kernel's order (module docstring)."""
    n, k = q.shape
    nb = k // GROUP_SIZE
    if fmt in (F16, BF16):
        t = _tiles(q.reshape(n, nb, GROUP_SIZE)).transpose(0, 2, 3, 1)  # [T, b, j, i]
        return np.ascontiguousarray(t).view(np.uint8).reshape(-1, nb, GROUP_SIZE * TILE * 2)
    if fmt == Q8:
        t = _tiles(np.ascontiguousarray(q).view(np.uint8).reshape(n, nb, 16, 2))  # [T, i, b, p, e], int8 bits as uint8
        return t.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 16 * TILE * 2)
    t = _nibble_order(q)
    low = t & 0xF
    planes = [(low[..., 0] | (low[..., 1] << 4)).reshape(-1, nb, 4 * TILE * 4)]
    if fmt in (Q5, Q5M, Q5K, Q6K):
        high = (t >> 4).reshape(*t.shape[:4], 16, 2).astype(np.uint16)  # [T, b, g, L, r, c]
        lane = np.arange(4, dtype=np.uint16).reshape(4, 1)  # L
        if fmt == Q6K:  # 2 bits, at 2L: the low nibbles' bytes, then the high ones'
            plane = np.concatenate([np.bitwise_or.reduce(high[..., c] << (2 * lane), axis=3) for c in (0, 1)], -1)
        else:  # 1 bit, at L for the low nibble, 4 + L for the high one
            plane = np.bitwise_or.reduce((high[..., 0] << lane) | (high[..., 1] << (4 + lane)), axis=3)
        planes.append(plane.astype(np.uint8).reshape(-1, nb, plane.shape[-1] * 4))
    return np.concatenate(planes, axis=-1)


@dataclass
class PackedWeight:
    """One segment of a projection in the native kernel's layout; `matmul` runs it on its own."""

    data: torch.Tensor  # [tiles, blocks, 256 | 320 | 384 | 512 | 1024] uint8
    # [tiles, blocks, 16 per scale] fp16 (Q4, Q8, Q5, Q5M; F16, BF16: none);
    # Q4K, Q5K, Q6K: [tiles, blocks / 8, 320 | 288] uint8 (module docstring)
    scales: torch.Tensor
    out_features: int
    in_features: int
    format: int  # FORMATS
    activation_bits: int = 16  # the numerics' activation blocks: int16, or int8 where the user asked (not saved)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] fp32, the activations quantized per block of 32 as the native step does
        (to `activation_bits`; fp32 as they are for F16 / BF16 weights)."""
        return torch.ops.stratum.packed_linear(x.float(), [self.data, self.scales], [self.format, self.out_features],
                                               self.activation_bits)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * self.scales.element_size()

    def saved(self) -> tuple:
        """The fields as a tuple of tensors and ints (torch.save with weights_only reads it back)."""
        return self.data, self.scales, self.out_features, self.in_features, self.format


class PackedSegments:
    """A projection held as segments of rows (a large vocabulary's output projection, packed and cached a
    range of rows at a time) run by one native call: x quantized once, every segment's tiles shared out
    among the threads together, the outputs written side by side. The same values as each segment's own
    `matmul`, concatenated."""

    def __init__(self, parts: list[PackedWeight]):
        self.parts = parts
        self.activation_bits = parts[0].activation_bits
        self._weights = [t for w in parts for t in (w.data, w.scales)]
        self._layout = [v for w in parts for v in (w.format, w.out_features)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, the segments' rows] fp32 (PackedWeight.matmul)."""
        return torch.ops.stratum.packed_linear(x.float(), self._weights, self._layout, self.activation_bits)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.parts)


def _packed(fmt: int, q: np.ndarray, scales: list[np.ndarray]) -> PackedWeight:
    n, k = q.shape
    if fmt in _SUPER:  # per super-block: its 8 blocks' integer scales, then its fp16 values (module docstring)
        ints, sup = scales[: len(scales) - _SUPER[fmt]], scales[len(scales) - _SUPER[fmt] :]
        ints = np.concatenate([_tiles(s.view(np.uint8)).transpose(0, 2, 1) for s in ints], axis=-1)  # [T, b, 32]
        sup = [_tiles(s.astype(np.float16)).transpose(0, 2, 1).copy().view(np.uint8) for s in sup]  # [T, b / 8, 32]
        scale = np.concatenate([ints.reshape(ints.shape[0], -1, _SUPER_BLOCKS * ints.shape[-1]), *sup], axis=-1)
    else:
        tiles = [_tiles(s.astype(np.float16)).transpose(0, 2, 1) for s in scales]  # [T, b, i] each
        scale = np.concatenate(tiles, axis=-1) if tiles else np.zeros((-(-n // TILE), k // GROUP_SIZE, 0), np.float16)
    return PackedWeight(torch.from_numpy(np.ascontiguousarray(_data(fmt, q))),
                        torch.from_numpy(np.ascontiguousarray(scale)),
                        n, k, fmt)


# the GGUF types as csrc/repack.cpp numbers them
REPACK_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "F16": 8,
                "BF16": 9}


def pack(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF rows [N, bytes] of a tensor of logical `shape` in one of PACKED_QTYPES -> PackedWeight:
    by the native repack (csrc/repack.cpp) where its library is loaded, else by `pack_reference`;
    the same bytes either way."""
    if qtype not in FORMATS:
        raise ValueError(f"{qtype}: not a packed format ({', '.join(PACKED_QTYPES)})")
    op = _native_op("packed_repack")
    if op is None:
        return pack_reference(qtype, raw, shape)
    n, k = shape
    flat = kquant.mapped_tensor(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    data, scales = op(flat, REPACK_TYPES[qtype], n, k)
    return PackedWeight(data, scales, n, k, FORMATS[qtype])


def pack_reference(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """`pack` in NumPy: the layouts of the module docstring, spelled out; what the native repack is
    tested against, and what runs where the native kernels are not built."""
    return _packed(*decode(qtype, raw, shape))


def _native_op(name: str):
    """torch.ops.stratum.<name> where the native step's library is loaded (never built here), else None."""
    try:
        return getattr(torch.ops.stratum, name)
    except (AttributeError, RuntimeError):
        return None


def native_lookup(qtype: str) -> bool:
    """Whether `dequantize_rows` reads rows of `qtype` here (the native library is loaded)."""
    return qtype in REPACK_TYPES and _native_op("dequantize_rows") is not None


def dequantize_rows(qtype: str, table: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a GGUF table as stored (uint8 [N, bytes per row], a view of the file's rows) as
    fp32 [len(ids), k], by the native library where `native_lookup(qtype)`: csrc/repack.cpp, the values
    gguf-py's dequantization gives. A decode step's lookup, measured inside the step: ~60 us with the call
    and the page fault of a new token's row, against gguf-py's ~0.4 ms."""
    return torch.ops.stratum.dequantize_rows(table, REPACK_TYPES[qtype], k, ids.long())


def reference_matmul(qtype: str, raw: np.ndarray, shape: tuple[int, int], x: torch.Tensor,
                     activation_bits: int = 16) -> torch.Tensor:
    """What the native kernel computes, in float64 PyTorch: x quantized to int16 (or int8) per block of
    32 (scale max|x| / 32767 or 127, round half to even), exact integer block sums (half-block sums for Q6K),
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
    top = 32767 if activation_bits == 16 else 127
    dx = (amax.float() / top).double()[..., 0]  # [M, b]
    xq = torch.where(amax > 0, torch.round(xb.float() * torch.where(amax > 0, top / amax.float(), 0)).double(), 0.0)
    qd = torch.from_numpy(q.astype(np.float64) - (32 if fmt == Q6K else 0)).view(n, nb, GROUP_SIZE)
    s = [torch.from_numpy(v) for v in block_scales(fmt, scales)]  # [N, b] each
    if fmt == Q6K:
        lo = torch.einsum("mbj,nbj->mnb", xq[..., :16], qd[..., :16])
        hi = torch.einsum("mbj,nbj->mnb", xq[..., 16:], qd[..., 16:])
        return ((lo * s[0][None] + hi * s[1][None]) * dx[:, None, :]).sum(-1)
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


# What the native step computes (csrc/step/forward.h): Llama-shaped decoders (RMSNorm before attention and MLP, SwiGLU,
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
    runs: list[list] = []
    for t in tensors:
        if runs and FORMATS[runs[-1][0].qtype] == FORMATS[t.qtype]:
            runs[-1].append(t)
        else:
            runs.append([t])
    return [_pack_run(run) for run in runs]


def _pack_run(run: list) -> PackedWeight:
    """Tensors of one format as one segment: their raw rows as one tensor where they share a GGUF
    type (Q4_0 and Q4_1, both Q4 tiles, are decoded apart)."""
    n, k = sum(t.shape[0] for t in run), run[0].shape[1]
    if len({t.qtype for t in run}) == 1:
        raw = (run[0].data if len(run) == 1
               else np.concatenate([np.asarray(t.data).reshape(t.shape[0], -1) for t in run]))
        return pack(run[0].qtype, raw, (n, k))
    decoded = [decode(t.qtype, t.data, t.shape) for t in run]
    return _packed(decoded[0][0], np.concatenate([q for _, q, _ in decoded]),
                   [np.concatenate(s) for s in zip(*(scales for _, _, scales in decoded))])


class PackedStack:
    """Every decoder layer on packed weights, run by one native call per step (csrc/packed_step.cpp).

    Holds each layer's projections as their segments (a format per layer and projection, as the
    file stores them); the norms (and Qwen's biases and q/k norms) are fp32 copies of the model's
    own. The KV pool it writes keeps keys transposed per block, [KVH, D, block_size] each.
    """

    def __init__(self, model, layers: list[list[list[PackedWeight]]]):
        """layers: per decoder layer, per projection in FUSED order, its segments (`pack_fused`)."""
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
        self.activation_bits = 16  # the numerics' activation blocks (16 or 8 bits; engine builder)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] fp32 embedded tokens -> (final-normed hidden [T, hidden], the attention coverage
        of the probe's rows at its layers [layers (sorted), rows])."""
        cfg = self.config
        probe = meta.probe
        layers = sorted(probe.layers) if probe is not None else []
        rows = torch.tensor(probe.rows if probe is not None else [], dtype=torch.long)
        return torch.ops.stratum.packed_forward(
            x, positions, cos, sin, meta.slot_mapping, meta.row_tables, meta.row_seq,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], self.weights, self.layout,
            cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, meta.block_size, layers, rows, COVERAGE_MASS,
            self.activation_bits)
