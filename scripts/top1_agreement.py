"""Top-1 agreement of the native step's activation blocks with the fp32 model, position by position.

Prefills a text in chunks and compares, at every position, the argmax of the logits against the
reference: the same file dequantized to fp32 on the PyTorch step (llama.cpp's dequantization, fp32
activations). Prints one JSON object: positions, and per `--activations` setting the positions whose
top-1 token matches, the share, and the numerics key (the same key on every SIMD family and restart
means the same bits).

Usage: python scripts/top1_agreement.py MODEL.gguf [--text FILE] [--positions 400] [--chunk 100]
       [--activations int16 int8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def top1(model: str, chunks: list[list[int]], **config) -> tuple[list[int], str]:
    """Every position's argmax over the chunks, and the start's numerics key."""
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    blocks = sum(len(c) for c in chunks) // 16 + 16 * len(chunks) + 16
    llm = LLM(model, num_kv_blocks=blocks, enable_prefix_cache=False, kv_disk_gb=0, **config)
    seqs = [llm.engine.add_request(c, params, request_id=f"t{i}") for i, c in enumerate(chunks)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    tokens = [int(s.readouts.logits[p].argmax()) for s in seqs for p in sorted(s.readouts.logits)]
    return tokens, llm.engine.kernel_choices["numerics"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"),
                   help="the text whose positions are compared (default: the README)")
    p.add_argument("--positions", type=int, default=400)
    p.add_argument("--chunk", type=int, default=100, help="tokens per prompt")
    p.add_argument("--activations", nargs="+", default=["int16", "int8"])
    args = p.parse_args()

    from stratum.engine import LLM

    tokenizer = LLM(args.model, num_kv_blocks=16, enable_prefix_cache=False, kv_disk_gb=0).engine.tokenizer
    ids = tokenizer.encode(Path(args.text).read_text())[: args.positions]
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    reference, _ = top1(args.model, chunks, dtype="float32", int4_max_tokens=0, native_step=False)
    result: dict = {"model": args.model, "text": args.text, "positions": len(reference)}
    for activations in args.activations:
        tokens, key = top1(args.model, chunks, activations=activations)
        agree = sum(a == b for a, b in zip(reference, tokens))
        result[activations] = {"agree": agree, "share": round(agree / len(reference), 4), "numerics": key}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
