"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) unpacked into affine sub-blocks, vectorized in PyTorch.

Each format is a super-block of 256 weights (QK_K) split into sub-blocks that share a scale
(llama.cpp ggml-common.h, block_q4_K / block_q5_K / block_q6_K; dequantize_row_q*_K in ggml-quants.c):

    Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
                     128 bytes of nibbles; weight = d·sc·q − dmin·m, q in 0..15
    Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits (qh) before the nibbles; q in 0..31
    Q6_K, 210 bytes: 128 bytes of low nibbles (ql), 64 bytes of high 2-bit pairs (qh), 16 int8 scales
                     for sub-blocks of 16, fp16 d; weight = d·sc·(q − 32), q in 0..63

`parts` reads the integers as stored (q, the sub-block scales and mins) and the super-block's fp16 d and
dmin: what the native step's tiles keep (kernels/packed.py). `unpack` turns them into the one form
q·scale + offset per sub-block — the form Q4_0 / Q4_1 / Q8_0 already have — with fp32 scales, exact
(an fp16 times a 6- or 8-bit integer), for the PyTorch path.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


class Unpacked(NamedTuple):
    """weight[n, k] = q[n, k] · scale[n, k // group] (+ offset[n, k // group])."""

    q: torch.Tensor  # [N, K] uint8 (Q4_K, Q5_K) or int8 (Q6_K, already centred: q − 32)
    scale: torch.Tensor  # [N, K / group] fp32
    offset: torch.Tensor | None  # [N, K / group] fp32, or None (Q6_K)
    group: int  # weights per sub-block: 32, or 16 for Q6_K


def mapped_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a (read-only, memory-mapped) array, without a copy; only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(array))


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml-quants.c get_scale_min_k4):
    sub-blocks 0-3 keep the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take a
    nibble of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, mins


class Parts(NamedTuple):
    """A K-quant tensor's integers as stored, the super-block scales as their fp16 values:
    weight[n, k] = d[n, k // 256] · sc[n, k // group] · (q[n, k] − centre) − dmin[n, k // 256] · mins[n, k // 32]."""

    q: torch.Tensor  # [N, K] uint8: 0..15 (Q4_K), 0..31 (Q5_K), 0..63 (Q6_K, centre 32; else 0)
    sc: torch.Tensor  # [N, K / group] uint8 6-bit (Q4_K, Q5_K) or int8 (Q6_K)
    mins: torch.Tensor | None  # [N, K / 32] uint8 6-bit, or None (Q6_K)
    d: torch.Tensor  # [N, K / 256] fp16
    dmin: torch.Tensor | None  # [N, K / 256] fp16, or None (Q6_K)
    group: int  # weights per sub-block: 32, or 16 for Q6_K


def parts(qtype: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Parts:
    """Raw GGUF rows of a K-quant tensor of logical `shape` [N, K] (K a multiple of 256) -> Parts.

    Raises:
        ValueError: not a K-quant format handled here, or the bytes do not match the shape.
    """
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{qtype}: not a K-quant format ({', '.join(BLOCK_BYTES)})")
    n, k = shape
    data = raw if isinstance(raw, torch.Tensor) else mapped_tensor(raw)
    if k % QK_K or data.numel() != n * k // QK_K * BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype}: {data.numel()} bytes do not hold a [{n}, {k}] tensor")
    b = data.reshape(n, k // QK_K, BLOCK_BYTES[qtype])
    if qtype == "Q6_K":
        ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208].contiguous().view(torch.int8)
        # per half of 128 weights: ql [64], qh [32]; output 32·j + l takes ql nibble j // 2 of byte
        # l + 32·(j % 2) and the 2-bit field j of qh byte l
        ql = ql.reshape(n, -1, 2, 2, 32)  # [N, S, half, byte group, l]
        low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=-2)
        qh = qh.reshape(n, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        q = low | ((qh & 0x03) << 4)  # [N, S, half, 4, 32]
        return Parts(q.reshape(n, k), sc.reshape(n, -1), None, _fp16(b, 208), None, 16)
    sc, mins = _scale_min_k4(b[..., 4:16])
    qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # sub-blocks 2j, 2j + 1 share 32 bytes: low, high nibble
    q = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F  # [N, S, 4, 2, 32]
    q = q.reshape(n, -1, 8, 32)
    if qtype == "Q5_K":  # bit j of qh byte l is the fifth bit of weight l of sub-block j
        qh = b[..., 16:48].reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
        q = q | ((qh & 0x01) << 4)
    return Parts(q.reshape(n, k), sc.reshape(n, -1), mins.reshape(n, -1), _fp16(b, 0), _fp16(b, 2), 32)


def unpack(qtype: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Unpacked:
    """Raw GGUF rows of a K-quant tensor of logical `shape` [N, K] (K a multiple of 256) -> Unpacked.

    Raises:
        ValueError: not a K-quant format handled here, or the bytes do not match the shape.
    """
    p = parts(qtype, raw, shape)
    per_super = QK_K // p.group
    scale = p.d.float().repeat_interleave(per_super, -1) * p.sc.float()  # an fp16 times a small integer: exact
    if p.mins is None:
        return Unpacked(p.q.to(torch.int8) - 32, scale, None, p.group)
    offset = -(p.dmin.float().repeat_interleave(per_super, -1) * p.mins.float())
    return Unpacked(p.q, scale, offset, p.group)


def dequantize(qtype: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 weights [N, K], computed as ggml's dequantize_row_q*_K rounds them."""
    q, scale, offset, group = unpack(qtype, raw, shape)
    n, k = shape
    w = q.view(n, -1, group).float() * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.view(n, k)
