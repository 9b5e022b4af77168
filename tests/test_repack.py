"""The native repack (csrc/repack.cpp) against the NumPy one (kernels/packed.py `pack_reference`): the
same tile bytes for every GGUF type the native step takes, rows padded to a tile or not; and its row
lookup (`dequantize_rows`) against gguf-py's dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stratum.kernels import native
from stratum.kernels.packed import PACKED_QTYPES, pack, pack_reference
from tests.kquants import quantize


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native.available():
        pytest.skip(f"native kernels: {native.status()}")


def _raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        return torch.from_numpy(w).bfloat16().view(torch.uint8).numpy()
    return quantize(w, qtype)  # K-quants by tests/kquants.py, the rest by gguf-py


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
@pytest.mark.parametrize("n", [16, 37])
def test_native_repack_writes_the_reference_bytes(qtype, n):
    rng = np.random.default_rng(hash(qtype) % 2**32 + n)
    k = 512
    raw = _raw(qtype, n, k, rng)
    got, want = pack(qtype, raw, (n, k)), pack_reference(qtype, raw, (n, k))
    assert (got.format, got.out_features, got.in_features) == (want.format, want.out_features, want.in_features)
    assert got.data.dtype == want.data.dtype and torch.equal(got.data, want.data), qtype
    assert same_bits(got.scales, want.scales), qtype


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and (not a.numel() or torch.equal(a.view(torch.uint8), b.view(torch.uint8))))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0"])
def test_native_repack_of_random_bytes(qtype):
    """Blocks of random bytes (every scale field's bits, with the fp16 values kept finite): the two
    decoders agree on every bit pattern, not only on what a quantizer writes."""
    from stratum.kernels.plan import _FP16_FIELDS
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n, k = 48, 1024
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (n, k // block, nbytes), generator=g, dtype=torch.uint8)
    for at in _FP16_FIELDS[qtype]:
        raw[..., at : at + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    raw = raw.numpy().reshape(n, -1)
    got, want = pack(qtype, raw, (n, k)), pack_reference(qtype, raw, (n, k))
    assert torch.equal(got.data, want.data) and same_bits(got.scales, want.scales)


@pytest.mark.parametrize("qtype", PACKED_QTYPES)
def test_native_row_lookup_gives_gguf_pys_values(qtype):
    """An embedding lookup by the native library (kernels.packed `dequantize_rows`) gives the fp32 bits
    of gguf-py's dequantization: on a quantizer's rows and, for the block formats, on random bytes
    (every scale and quant field's bit patterns, the fp16 values random but finite); a row out of
    the table is refused."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from stratum.kernels.packed import dequantize_rows
    from stratum.kernels.plan import _FP16_FIELDS

    n, k = 48, 1024
    rng = np.random.default_rng(7)
    tables = [_raw(qtype, n, k, rng)]
    if qtype in _FP16_FIELDS:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        g = torch.Generator().manual_seed(2)
        raw = torch.randint(0, 256, (n, k // block, nbytes), generator=g, dtype=torch.uint8)
        for at in _FP16_FIELDS[qtype]:
            raw[..., at : at + 2] = (torch.randn(n, k // block, 1, generator=g) * 0.1).half().view(torch.uint8)
        tables.append(raw.numpy().reshape(n, -1))
    ids = torch.tensor([0, 47, 5, 5, 31])
    for raw in tables:
        want = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[qtype]),
                                           dtype=np.float32).reshape(n, k))
        got = dequantize_rows(qtype, torch.from_numpy(raw.view(np.uint8)), k, ids)
        assert got.dtype == torch.float32 and got.shape == (5, k)
        assert torch.equal(got.view(torch.int32), want[ids].view(torch.int32)), qtype
    with pytest.raises(RuntimeError, match="row 48 of 48"):
        dequantize_rows(qtype, torch.from_numpy(tables[0].view(np.uint8)), k, torch.tensor([48]))
