"""Write a random-weight GGUF with a real model's shapes and llama.cpp's Q4_K_M tensor mix, for
measuring what loading and serving a 1-3 B model costs (memory, start-up, decode) without a model hub.

The weights are random (normal, std 0.02; norms 1, biases 0), quantized by tests/kquants.py. The
tokenizer, chat template and special tokens are copied from a donor GGUF (the pulled SmolLM2 by
default), so the embedding has the donor's vocabulary size rather than the real model's.

Q4_K_M mix, as llama.cpp's llama-quant.cpp (llama_tensor_get_type) assigns it: Q4_K everywhere,
except Q6_K for the output projection (the token embedding when tied), and for attn_v and ffn_down
in the layers where `use_more_bits` holds: the first and last eighth, and every third layer between.

Usage: python scripts/synthetic_gguf.py OUT.gguf [--shape qwen2.5-1.5b] [--donor FILE.gguf] [--layers N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kquants import quantize, use_more_bits  # noqa: E402

# Hugging Face config.json figures of each model (vocabulary aside: the donor's is used)
SHAPES = {
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, bias=True,
                         rope_theta=1000000.0, eps=1e-6, context=32768),
    "qwen2.5-3b": dict(arch="qwen2", hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, bias=True,
                       rope_theta=1000000.0, eps=1e-6, context=32768),
    "llama-3.2-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, bias=False,
                         rope_theta=500000.0, eps=1e-5, context=131072),
    "llama-3.2-3b": dict(arch="llama", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, bias=False,
                         rope_theta=500000.0, eps=1e-5, context=131072),
    # no real model: a tiny one whose context holds an agent's 12k-token prompt (`stratum bench disktier`)
    "tiny-16k": dict(arch="llama", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, bias=False,
                     rope_theta=500000.0, eps=1e-5, context=16384),
}


def main() -> None:
    from stratum.models.registry import model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--donor", default=None, help="GGUF whose tokenizer is copied (default: the pulled SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (a quick check)")
    args = parser.parse_args()
    s = {**SHAPES[args.shape], **({"layers": args.layers} if args.layers else {})}
    donor = gguf.GGUFReader(args.donor or str(model_path("smollm2-135m")))
    vocab = len(donor.fields["tokenizer.ggml.tokens"].data)
    head_dim = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(args.out, s["arch"])
    w.add_name(f"synthetic-{args.shape}-Q4_K_M")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for field in donor.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)

    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()

    def matrix(name: str, rows: int, cols: int, qtype: str) -> None:
        raw = quantize((rng.standard_normal((rows, cols), dtype=np.float32) * 0.02), qtype)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])

    def vector(name: str, n: int, value: float) -> None:
        w.add_tensor(name, np.full(n, value, np.float32))

    q, kv, h = s["heads"] * head_dim, s["kv_heads"] * head_dim, s["hidden"]
    matrix("token_embd.weight", vocab, h, "Q6_K")  # tied: the output projection's type
    vector("output_norm.weight", h, 1.0)
    for i in range(s["layers"]):
        more = "Q6_K" if use_more_bits(i, s["layers"]) else "Q4_K"
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h, 1.0)
        vector(p + "ffn_norm.weight", h, 1.0)
        matrix(p + "attn_q.weight", q, h, "Q4_K")
        matrix(p + "attn_k.weight", kv, h, "Q4_K")
        matrix(p + "attn_v.weight", kv, h, more)
        if s["bias"]:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                vector(p + name + ".bias", n, 0.0)
        matrix(p + "attn_output.weight", h, q, "Q4_K")
        matrix(p + "ffn_gate.weight", s["intermediate"], h, "Q4_K")
        matrix(p + "ffn_up.weight", s["intermediate"], h, "Q4_K")
        matrix(p + "ffn_down.weight", h, s["intermediate"], more)
        print(f"layer {i + 1}/{s['layers']} quantized ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
