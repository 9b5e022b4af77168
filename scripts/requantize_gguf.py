"""Requantize a GGUF file to a Q4_K_M mix with the tests' quantizer (tests/kquants.py), for benchmarks.

Each matrix is dequantized by gguf-py and quantized again; the type of each follows llama.cpp's
Q4_K_M choice (src/llama-quant.cpp, llama_tensor_get_type): Q4_K, with Q6_K for the output projection
(or the tied embedding that serves as one) and for attn_v and ffn_down in the layers `use_more_bits`
picks; a K-quant tensor whose rows are not a multiple of 256 falls back as llama.cpp's does (Q4_K ->
Q5_0, Q6_K -> Q8_0). Metadata and 1-D tensors are copied. The quantizer is plain min/max rounding
per sub-block, not llama.cpp's searched scales: the file has llama.cpp's types and sizes, not its
accuracy; starting from an already quantized file adds that file's error too.

Usage: python scripts/requantize_gguf.py IN.gguf OUT.gguf
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kquants import use_more_bits  # noqa: E402

FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # rows not a multiple of 256


def q4_k_m_type(name: str, num_layers: int, has_output: bool, cols: int) -> str:
    qtype = "Q4_K"
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        qtype = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), num_layers):
        qtype = "Q6_K"
    return FALLBACK[qtype] if cols % 256 else qtype


def main(src: str, dst: str) -> None:
    import gguf
    from gguf.quants import dequantize

    from tests.kquants import quantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    names = {t.name for t in reader.tensors}
    num_layers = int(reader.fields[f"{arch}.block_count"].contents())
    counts: Counter = Counter()
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # logical, outermost first
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if len(shape) == 1:
            writer.add_tensor(t.name, values)
            counts["F32"] += 1
            continue
        qtype = q4_k_m_type(t.name, num_layers, "output.weight" in names, shape[-1])
        writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        counts[qtype] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(dict(counts))


if __name__ == "__main__":
    main(*sys.argv[1:3])
