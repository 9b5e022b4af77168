"""GGUF blocks repacked for the native step (csrc/packed_step.cpp): tiles of 16 output rows.

A Q4_0 / Q4_1 block of 32 weights is fp16 `d`, (Q4_1) fp16 `m`, then 16 bytes of nibbles: weight j
is qs[j] & 0xF and weight j + 16 is qs[j] >> 4, value q·d + m; Q4_0's value (q − 8)·d is the same
form with m = −8d (llama.cpp ggml-common.h, block_q4_0 / block_q4_1). A Q8_0 block is fp16 `d` and
32 int8 values, value q·d.

The native kernel computes 16 outputs at once, one per int32 lane, each lane taking a pair of
inputs per instruction (int16 activations); so per tile of 16 rows and per block of 32 inputs:

    8-bit, 512 bytes: [pair p][row i][e < 2] = q[i, 2p + e]  (int8, sign-extended in the kernel)
    4-bit, 256 bytes: [group g of 8 inputs][row quad L][h < 2][row k < 4][e < 2]
                      = q[4L + k, 8g + 2h + e] | q[4L + k, 8g + 4 + 2h + e] << 4

(the 4-bit order is what the kernel's byte unpacking within 128-bit lanes turns into one pair
of inputs per output lane).

and the scales of a tile-block are 16 fp16 `d` (then 16 fp16 `m` for 4-bit). Rows are padded to a
multiple of 16 with zero weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stratum.kernels.quant import GROUP_SIZE, Q8_0_BYTES

TILE = 16
PACKED_QTYPES = ("Q4_0", "Q4_1", "Q8_0")
LAYOUT_VERSION = 1  # of the tiles below and csrc/packed_step.cpp's reading of them; names the cached copy


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0]


def _tiles(values: np.ndarray) -> np.ndarray:
    """[N, ...] -> [ceil(N / 16), 16, ...], padded with zeros."""
    pad = -values.shape[0] % TILE
    if pad:
        values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
    return values.reshape(-1, TILE, *values.shape[1:])


@dataclass
class PackedWeight:
    """One projection in the native kernel's layout; `matmul` runs it on its own."""

    data: torch.Tensor  # [tiles, blocks, 256 | 512] uint8
    scales: torch.Tensor  # [tiles, blocks, 32 | 16] fp16
    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] fp32, the activations quantized to int16 per block of 32 as the kernel does."""
        return torch.ops.stratum.packed_linear(x.float(), self.data, self.scales, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() * 2


def pack(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF rows [N, bytes] of a Q4_0, Q4_1 or Q8_0 tensor of logical `shape` -> PackedWeight."""
    n, k = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // GROUP_SIZE, -1)
    nb = k // GROUP_SIZE
    if qtype == "Q8_0":
        assert blocks.shape[-1] == Q8_0_BYTES
        q = _tiles(blocks[..., 2:].reshape(n, nb, 16, 2))  # [T, i, b, p, e], int8 bits as uint8
        data = q.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 16 * TILE * 2)
        scales = _tiles(_fp16(blocks, 0)).transpose(0, 2, 1)  # [T, b, i]
    elif qtype in ("Q4_0", "Q4_1"):
        d = _fp16(blocks, 0)
        if qtype == "Q4_1":
            m, qs = _fp16(blocks, 2), blocks[..., 4:]
        else:
            m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]  # exact: a power of two
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [N, b, 32] in input order: 8g + 4c + 2h + e
        q = _tiles(q.reshape(n, nb, 4, 2, 2, 2))  # [T, i, b, g, c, h, e]
        q = q.reshape(q.shape[0], 4, 4, nb, 4, 2, 2, 2)  # [T, L, k, b, g, c, h, e]
        q = q.transpose(0, 3, 4, 1, 6, 2, 7, 5)  # [T, b, g, L, h, k, e, c]
        data = (q[..., 0] | (q[..., 1] << 4)).reshape(-1, nb, 4 * TILE * 4)
        scales = np.concatenate([_tiles(d).transpose(0, 2, 1), _tiles(m).transpose(0, 2, 1)], axis=-1)
    else:
        raise ValueError(f"{qtype}: not a packed format ({', '.join(PACKED_QTYPES)})")
    return PackedWeight(torch.from_numpy(np.ascontiguousarray(data)),
                        torch.from_numpy(np.ascontiguousarray(scales)), n, k)


def reference_matmul(qtype: str, raw: np.ndarray, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """What the native kernel computes, in float64 PyTorch: x quantized to int16 per block of 32
    (scale max|x| / 32767, round half to even), exact integer block sums, each scaled once.
    For tests of the kernel; the model's own reference is the dequantized fp32 path."""
    n, k = shape
    nb = k // GROUP_SIZE
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, nb, -1)
    xb = x.double().view(x.shape[0], nb, GROUP_SIZE)
    amax = xb.abs().amax(-1, keepdim=True)
    dx = (amax.float() / 32767).double()
    xq = torch.where(amax > 0, torch.round(xb.float() * torch.where(amax > 0, 32767 / amax.float(), 0)).double(), 0.0)
    d = torch.from_numpy(_fp16(blocks, 0).astype(np.float64))
    if qtype == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.float64))  # [N, b, 32]
        sums = torch.einsum("mbj,nbj->mnb", xq, q)
        return (sums * d[None] * dx[..., 0][:, None, :]).sum(-1)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = torch.from_numpy(np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64))
    m = torch.from_numpy(_fp16(blocks, 2).astype(np.float64)) if qtype == "Q4_1" else -8 * d
    sums = torch.einsum("mbj,nbj->mnb", xq, q)
    sx = dx[..., 0] * xq.sum(-1)  # [M, b]
    return (sums * d[None] * dx[..., 0][:, None, :] + m[None] * sx[:, None, :]).sum(-1)


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
    for parts in FUSED.values():
        kinds = {getattr(quantized.get(f"model.layers.{i}.{p}.weight"), "qtype", "dense")
                 for i in range(config.num_layers) for p in parts}
        if len(kinds) != 1 or not kinds <= set(PACKED_QTYPES):
            return (f"projections stored as {', '.join(sorted(kinds))} (the native step runs "
                    f"{', '.join(PACKED_QTYPES)}, one format per projection kind)")
    return None


def pack_fused(quantized: dict, prefix: str, parts: tuple[str, ...]) -> PackedWeight | None:
    """The parts of one fused projection (their rows concatenated), or None when a part is missing
    or not in a packed format, or the parts differ in format."""
    tensors = [quantized.get(f"{prefix}{p}.weight") for p in parts]
    if any(t is None or t.qtype not in PACKED_QTYPES for t in tensors) or len({t.qtype for t in tensors}) != 1:
        return None
    k = tensors[0].shape[1]
    raw = np.concatenate([np.asarray(t.data).reshape(t.shape[0], -1) for t in tensors])
    return pack(tensors[0].qtype, raw, (sum(t.shape[0] for t in tensors), k))


class PackedStack:
    """Every decoder layer on packed weights, run by one native call per step (csrc/packed_step.cpp).

    Holds the weights stacked per kind across layers; the norms (and Qwen's biases and q/k norms)
    are fp32 copies of the model's own. The KV pool it writes keeps keys transposed per block
    (`keys` reads them back as [slot, KVH, D]).
    """

    def __init__(self, model, stacked: list[torch.Tensor]):
        """stacked: (data, scales) of each kind in FUSED order, each [layers, ...] (see `pack_layers`)."""
        cfg = model.config
        self.config = cfg
        layers = model.layers
        empty = torch.empty(0)
        attn = [layer.self_attn for layer in layers]
        bias = torch.stack([a.qkv_proj.bias.float() for a in attn]) if cfg.attention_bias else empty
        q_norm = torch.stack([a.q_norm.weight.float() for a in attn]) if cfg.qk_norm else empty
        k_norm = torch.stack([a.k_norm.weight.float() for a in attn]) if cfg.qk_norm else empty
        self.weights = [
            torch.stack([layer.input_layernorm.weight.float() for layer in layers]),
            torch.stack([layer.post_attention_layernorm.weight.float() for layer in layers]),
            model.norm.weight.float().contiguous(),
            *stacked,
            bias, q_norm, k_norm,
        ]
        self.nbytes = sum(t.numel() * t.element_size() for t in stacked)

    @staticmethod
    def pack_layers(quantized: dict, num_layers: int) -> list[torch.Tensor] | None:
        """The checkpoint's raw GGUF tensors as the stacked (data, scales) pairs the step reads; None
        unless every projection of every layer is in one packed format per kind."""
        stacked = []
        for parts in FUSED.values():
            ws = [pack_fused(quantized, f"model.layers.{i}.", parts) for i in range(num_layers)]
            if any(w is None for w in ws) or len({(w.data.shape, w.scales.shape) for w in ws}) != 1:
                return None
            stacked += [torch.stack([w.data for w in ws]), torch.stack([w.scales for w in ws])]
        return stacked

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
            [k for k, _ in kv_caches], [v for _, v in kv_caches], self.weights,
            cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, meta.block_size, layers, rows)
