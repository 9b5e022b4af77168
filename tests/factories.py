"""Test factories: a tiny random-weight Llama written as a Hugging Face folder, sequences, block managers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stratum.engine.block_manager import BlockManager
from stratum.engine.sampling_params import SamplingParams
from stratum.engine.request import CachePolicy, Sequence

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The capital of Japan is Tokyo. The capital of Germany is Berlin. Hello world!",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "Once upon a time there was a small model that answered questions about cities and numbers 0123456789.",
    "日本の首都は東京です。 Emoji: 🙂🚀 — naïve café, Straße, 中文, ελληνικά.",
] * 20


def make_tiny_model_dir(path: Path, num_layers: int = 2, hidden: int = 64, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json for a tiny Llama.

    The tokenizer is a byte-level BPE trained here on a small corpus; the weights are random but
    fixed by `seed`. Returns the folder.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    inter = hidden * 2
    config = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
    }))
    w = random_llama_weights(torch.Generator().manual_seed(seed), num_layers, vocab, hidden, heads, kv_heads, head_dim, inter)
    save_file(w, str(path / "model.safetensors"))
    return path


def random_llama_weights(g: torch.Generator, num_layers: int, vocab: int, hidden: int, heads: int, kv_heads: int,
                         head_dim: int, inter: int) -> dict[str, torch.Tensor]:
    """Random Llama tensors under Hugging Face names: embeddings, final norm, and each layer's
    attention, MLP and norms (norm weights near 1). Architecture extras are added by the caller."""

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0), "model.norm.weight": 1 + rand(hidden, scale=0.05)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        w[p + "input_layernorm.weight"] = 1 + rand(hidden, scale=0.05)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(hidden, scale=0.05)
    return w


def make_seq(request_id: str, token_ids: list[int], block_size: int = 4, max_tokens: int = 8, priority: int = 0,
             salt: str | None = None, policy: CachePolicy | None = None) -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens, temperature=0.0), block_size,
                    priority=priority, cache_salt=salt, cache_policy=policy or CachePolicy())


def make_block_manager(num_blocks: int = 16, block_size: int = 4, enable_prefix_cache: bool = True, clock=None) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_cache, clock=clock)


def rereads(n: int, output_tokens: int, block_size: int = 16) -> int:
    """Prompt tokens a repeat of an n-token prompt reads from the prefix cache after one run that
    generated output_tokens: its full prompt blocks, and all but the last token when that run's own
    tokens filled the block holding the prompt's tail (the block is then cached, its slots copied)."""
    computed = n + max(0, output_tokens - 1)  # the last output token is never fed back; a warm-up computes n
    return n - 1 if computed >= ((n - 1) // block_size + 1) * block_size else (n - 1) // block_size * block_size


def make_tiny_gguf(path: Path, qtype: str = "Q4_1", head_qtype: str = "Q8_0", num_layers: int = 2, hidden: int = 64,
                   seed: int = 0) -> Path:
    """The tiny model of `make_tiny_model_dir` as a GGUF file (architecture "llama", so Q and K rows are
    permuted the way llama.cpp's converter stores them), its projections quantized to `qtype` and its
    tied embedding to `head_qtype` by gguf-py. Returns the file."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    path = Path(path)
    folder = make_tiny_model_dir(path.with_suffix(".hf"), num_layers=num_layers, hidden=hidden, seed=seed)
    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    for added in tokenizer["added_tokens"]:
        vocab.append((added["content"], added["id"]))
    tokens = [t for t, _ in sorted(dict(vocab).items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHATML)

    def permute(w: torch.Tensor, n: int) -> torch.Tensor:  # convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def put(name: str, tensor: torch.Tensor, kind: str | None) -> None:
        array = tensor.float().numpy()
        if kind is None:
            writer.add_tensor(name, array)
        else:
            t = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, quantize(array, t), raw_dtype=t)

    put("token_embd.weight", weights["model.embed_tokens.weight"], head_qtype)
    put("output_norm.weight", weights["model.norm.weight"], None)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(num_layers):
        for hf, short in names.items():
            w = weights[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                w = permute(w, heads)
            elif short == "attn_k":
                w = permute(w, kv_heads)
            put(f"blk.{i}.{short}.weight", w, None if short.endswith("norm") else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del np
    return path
