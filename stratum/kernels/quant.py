"""Keeping GGUF 4-bit weights packed: Q4_0 / Q4_1 / Q4_K blocks as PyTorch's int4 group-wise layout.

A Q4_1 block of 32 weights stores fp16 `d`, fp16 `m` and 16 bytes of nibbles (llama.cpp ggml-common.h,
block_q4_1): weight j is (qs[j] & 0xF) and weight j+16 is (qs[j] >> 4), value = q·d + m. PyTorch's
int4 CPU kernel computes (q − 8)·scale + zero, so scale = d and zero = m + 8d reproduce the block
exactly (Q4_0 has no m: value = (q − 8)·d, zero = 0). Q4_K's sub-blocks of 32 have the same affine
form once unpacked (kernels.kquant: value = q·scale + offset, so zero = offset + 8·scale). Only the
fp32 -> activation-dtype rounding of scale and zero differs from the dequantized reference.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

GROUP_SIZE = 32  # QK4_0 == QK4_1 == 32
INNER_K_TILES = 2
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def unpack_q4(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw GGUF rows [N, bytes] -> (q int32 [N, K] in 0..15, scale [N, K/32], zero [N, K/32]) in fp32."""
    n, k = shape
    if qtype == "Q4_K":
        from stratum.kernels import kquant

        q, scale, offset, _ = kquant.unpack(qtype, raw, shape)
        return q.int(), scale, offset + 8 * scale
    blocks = raw.reshape(n, k // GROUP_SIZE, _BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zero = m + 8 * d
    else:
        qs = blocks[..., 2:]
        zero = np.zeros_like(d)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k).astype(np.int32)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


Q8_0_BYTES = 34  # block_q8_0: fp16 d, then 32 int8 values; value = q * d


def unpack_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q8_0 rows -> (q int8 [N, K], scales fp32 [N, K/32]); q * scale is the exact weight."""
    n, k = shape
    blocks = raw.reshape(n, k // GROUP_SIZE, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy(d)


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The int4 layout's own value of every weight: (q − 8)·scale + zero, [N, K] fp32."""
    n, k = q.shape
    groups = (q.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8) * scale[..., None] + zero[..., None]
    return groups.view(n, k)


class Int4Weight:
    """A weight packed for `aten._weight_int4pack_mm_for_cpu` (activations in bf16)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
        # scale_and_zeros: [K / group, N, 2]
        self.scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.dtype = dtype

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                    in_features: int) -> "Int4Weight":
        w = cls.__new__(cls)
        w.out_features, w.in_features = out_features, in_features
        w.packed, w.scale_zeros, w.dtype = packed, scale_zeros, scale_zeros.dtype
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N] in self.dtype
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.dtype), self.packed, GROUP_SIZE, self.scale_zeros)

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scale_zeros.numel() * self.scale_zeros.element_size())


class Q8Weight:
    """A GGUF Q8_0 table as stored (int8 values, one fp32 scale per 32): the embedding, looked up row
    by row from the checkpoint's own values with no dense copy."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        self.q, self.scales = q.contiguous(), scales.float().contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized to fp32, exactly: an int8 times an fp16 scale fits fp32's mantissa.
        An embedding lookup from the table as stored."""
        m = ids.shape[0]
        return (self.q[ids].float().view(m, -1, GROUP_SIZE) * self.scales[ids].unsqueeze(-1)).view(m, -1)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4


class RecentRows:
    """An embedding dequantized at lookup (a quantized table's `rows`), with the rows of small lookups
    kept for the next ones, up to `max_bytes`, least recently used out first: a decode step embeds one
    token per sequence, and dequantizing a K-quant row costs ~0.1-0.2 ms of Python however few rows it
    is (1 B Q6_K table: ~1% of a one-stream step; measured). The same fp32 values either way."""

    SMALL = 64  # rows of a lookup that go through the kept ones; a prompt's are dequantized at once

    def __init__(self, table, max_bytes: int = 16 << 20):
        self.table = table
        self.capacity = max(1, max_bytes // (table.shape[1] * 4))
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] > self.SMALL:
            return self.table.rows(ids)
        keys = ids.tolist()
        missing = [i for i in dict.fromkeys(keys) if i not in self._kept]
        if missing:
            for i, row in zip(missing, self.table.rows(torch.tensor(missing))):
                self._kept[i] = row.clone()  # not a view holding the whole lookup's tensor
        for i in keys:
            self._kept.move_to_end(i)
        out = torch.stack([self._kept[i] for i in keys])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        return out


class Int8Weight:
    """Per-output-channel int8 weight-only copy for `aten._weight_int8pack_mm` (activations in bf16).

    Lossy (one scale per row, round to nearest): used only where a request asked for latency over
    accuracy (the "Prioritize low-latency over accuracy" hint), never by default.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(dtype)
        self.dtype = dtype

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N] in self.dtype
        return torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.q, self.scales)


class DenseWeight:
    """A dense weight [N, K] behind the same `matmul` as the packed forms: one part of a `Parts`."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Parts:
    """A fused projection whose row blocks are held in different forms (a Q4_K_M file's Q4_K q and k
    beside its Q6_K v): each runs on its own kernel and the outputs are concatenated."""

    def __init__(self, parts: list):
        self.parts = parts

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x).float() for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
