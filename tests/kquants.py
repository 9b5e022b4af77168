"""Test helper: a small reference quantizer for the GGUF K-quants gguf-py cannot write (Q4_K, Q5_K, Q6_K).

Plain min/max rounding per sub-block (not llama.cpp's searched scales, so its error is somewhat
larger than a real Q4_K_M file's), packed byte for byte as ggml's block_q4_K / block_q5_K / block_q6_K
(ggml-common.h). Other types go to gguf-py's own quantizer. Used to write test GGUFs only.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 [..., K] (K a multiple of 256 for K-quants) -> raw GGUF rows [..., bytes] uint8."""
    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):
        import gguf

        return gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])
    rows = array.reshape(-1, QK_K).astype(np.float32)  # one super-block per row
    packed = _q6_k(rows) if qtype == "Q6_K" else _q45_k(rows, bits=4 if qtype == "Q4_K" else 5)
    return packed.reshape(*array.shape[:-1], -1)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[:, None].view(np.uint8)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    n = x.shape[0]
    levels = (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # the offset is subtracted: mins are stored as -lo >= 0
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin[:, None] > 0, np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0).clip(0, 63).astype(
        np.uint8)
    step = d[:, None] * sc  # [n, 8]
    q = np.where(step[..., None] > 0,
                 np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    q = q.clip(0, levels).astype(np.uint8)  # [n, 8, 32]
    scales = np.empty((n, 12), np.uint8)  # inverse of ggml's get_scale_min_k4
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)  # sub-blocks 2j (low nibble), 2j + 1 (high)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: bit j of byte l
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.where(step[..., None] > 0, np.round(sub / np.where(step > 0, step, 1)[..., None]), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, k, l]: weight 128·half + 32·k + l
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                         (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in a _M mix
    (src/llama-quant.cpp, use_more_bits): the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
