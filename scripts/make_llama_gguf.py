"""Make a Llama-3.2-shaped Q4_K_M GGUF the way users' files are made: a Hugging Face folder (random
weights, the donor GGUF's tokenizer), llama.cpp's convert_hf_to_gguf.py, then `llama-quantize Q4_K_M`.

The weights are seeded normal(0, 0.02) (the initializer_range Llama configs declare), norms 1, so a
file is the same on every run; tensors are written one layer per safetensors shard, so no two dense
copies of a 3 B model are ever in memory. The vocabulary and tokenizer are the donor's (SmolLM2-135M's
49,152 tokens by default): config shapes and rope_scaling are Llama 3.2's (meta-llama/Llama-3.2-{1B,3B}
config.json), max_position_embeddings 131072.

Usage: python scripts/make_llama_gguf.py OUT.gguf --shape llama-3.2-1b --llama /work/llama.cpp
       [--donor FILE.gguf] [--work DIR] [--seed 0] [--keep]
(--llama is scripts/build_llama_cpp.sh's DEST: convert/ and native/bin/llama-quantize are used.)
Convert and quantize run under `flock $CPU_LOCK` (default /tmp/stratum-cpu.lock; CPU_LOCK= for none).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

# meta-llama/Llama-3.2-{1B,3B} config.json, vocabulary aside (the donor's is used)
LLAMA_3_2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
                 hidden_act="silu", initializer_range=0.02, max_position_embeddings=131072, mlp_bias=False,
                 pretraining_tp=1, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                 rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                 torch_dtype="bfloat16", use_cache=True)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192),
}
# Transformers' GGUF loader rebuilds a byte-level BPE without the pre-tokenizer the GGUF names;
# llama.cpp's llama-vocab.cpp gives each name's split rules (smollm: single digits, then GPT-2's regex).
PRE_TOKENIZERS = {"smollm": {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}}


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents() if key in reader.fields else None


def write_tokenizer(donor: Path, out: Path) -> dict:
    """The donor GGUF's tokenizer as Hugging Face files. Returns the config ids (bos, eos, vocab size)."""
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(donor))
    pre = field(reader, "tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise SystemExit(f"donor pre-tokenizer {pre!r} has no Hugging Face form here (known: {list(PRE_TOKENIZERS)})")
    tokenizer = AutoTokenizer.from_pretrained(donor.parent, gguf_file=donor.name)
    tokenizer.save_pretrained(out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = PRE_TOKENIZERS[pre]
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("backend", "is_local", "local_files_only"):  # transformers 5's bookkeeping, not the model's
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4 (convert's pin) knows too
    config["model_max_length"] = LLAMA_3_2["max_position_embeddings"]
    config["add_bos_token"] = bool(field(reader, "tokenizer.ggml.add_bos_token"))
    config["add_eos_token"] = bool(field(reader, "tokenizer.ggml.add_eos_token"))
    if not (out / "chat_template.jinja").exists() and "tokenizer.chat_template" in reader.fields:
        (out / "chat_template.jinja").write_text(field(reader, "tokenizer.chat_template"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
            "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data)}


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """normal(0, 0.02) in bf16, seeded by the tensor's name: the same whatever order tensors are made in."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= 0.02
    return torch.from_numpy(values).to(torch.bfloat16)


def layer_tensors(i: int, c: dict, seed: int) -> dict[str, torch.Tensor]:
    h, ffn, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h), "mlp.down_proj": (h, ffn)}
    tensors = {f"{p}{k}.weight": random_tensor(f"{p}{k}", s, seed) for k, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{p}{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return tensors


def write_weights(out: Path, c: dict, seed: int) -> None:
    """One safetensors shard per layer (plus one for the embedding and final norm), with HF's index."""
    n = c["num_hidden_layers"] + 1
    weight_map, total = {}, 0
    for k in range(n):
        if k == 0:
            embed = random_tensor("model.embed_tokens", (c["vocab_size"], c["hidden_size"]), seed)
            tensors = {"model.embed_tokens.weight": embed,
                       "model.norm.weight": torch.ones(c["hidden_size"], dtype=torch.bfloat16)}
        else:
            tensors = layer_tensors(k - 1, c, seed)
        shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_hf_folder(out: Path, shape: str, donor: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(donor, out)
    config = {**LLAMA_3_2, **SHAPES[shape], **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"], "do_sample": False}, indent=2))
    write_weights(out, config, seed)


def summary(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    arch = field(reader, "general.architecture")
    return {"file": str(path), "bytes": path.stat().st_size, "tensor_types": dict(sorted(types.items())),
            "context_length": int(field(reader, f"{arch}.context_length")),
            "rope_freq_base": float(field(reader, f"{arch}.rope.freq_base")),
            "file_type": int(field(reader, "general.file_type")), "tokenizer_pre": field(reader, "tokenizer.ggml.pre")}


def run(cmd: list[str]) -> float:
    """Run a heavy step under the CPU lock (flock(2), as flock(1) takes it); returns the step's own
    seconds, not the wait for the lock."""
    path = os.environ.get("CPU_LOCK", "/tmp/stratum-cpu.lock")
    with open(path, "a") if path else contextlib.nullcontext() as lock:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        print("+", " ".join(cmd), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        return round(time.perf_counter() - start, 1)


def main() -> None:
    from stratum.models.registry import model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--llama", type=Path, required=True, help="scripts/build_llama_cpp.sh's DEST")
    parser.add_argument("--donor", type=Path, default=None, help="tokenizer donor GGUF (default: the pulled SmolLM2)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the HF folder and bf16 GGUF go (default: OUT's folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the HF folder and the bf16 GGUF")
    args = parser.parse_args()
    donor = (args.donor or Path(model_path("smollm2-135m"))).resolve()
    work = (args.work or args.out.parent).resolve()
    hf, bf16 = work / f"{args.shape}-random-hf", work / f"{args.shape}-random-bf16.gguf"
    times = {}
    start = time.perf_counter()
    write_hf_folder(hf, args.shape, donor, args.seed)
    times["hf_folder_s"] = round(time.perf_counter() - start, 1)
    times["convert_s"] = run([sys.executable, str(args.llama / "convert" / "convert_hf_to_gguf.py"), str(hf),
                              "--outtype", "bf16", "--outfile", str(bf16)])
    quantize = args.llama / "native" / "bin" / "llama-quantize"
    times["quantize_s"] = run([str(quantize), str(bf16), str(args.out), "Q4_K_M"])
    if not args.keep:
        shutil.rmtree(hf)
        bf16.unlink()
    print(json.dumps({**summary(args.out), "shape": args.shape, "seed": args.seed, **times}, indent=1))


if __name__ == "__main__":
    main()
