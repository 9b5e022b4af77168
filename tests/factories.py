"""Test factories: a tiny random-weight Llama written as a Hugging Face folder, sequences, block managers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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
# Mistral v3's control tokens (mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json, ids 3-9 there)
MISTRAL_CONTROLS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]"]
_CORPUS = [
    "The capital of Japan is Tokyo. The capital of Germany is Berlin. Hello world!",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)\n",
    "Once upon a time there was a small model that answered questions about cities and numbers 0123456789.",
    "日本の首都は東京です。 Emoji: 🙂🚀 — naïve café, Straße, 中文, ελληνικά.",
] * 20


def make_tiny_model_dir(path: Path, num_layers: int = 2, hidden: int = 64, seed: int = 0, vocab_size: int = 512,
                        context: int = 2048, eos_logit: float | None = None, corpus: list[str] = ()) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json for a tiny Llama.

    The tokenizer is a byte-level BPE trained here on a small corpus (and `corpus`, so that texts like
    it take about as many tokens as a real model's tokenizer makes of them); the weights are random but
    fixed by `seed`; `context` is its max_position_embeddings. With `eos_logit`, the model ends its
    answers after a few tokens, as a chat model does (a random one rarely does, and agent clients wait
    for the end): hidden dimension 0 is a constant 1 that no layer writes to, and an untied output
    head reads it into the EOS logit only, at `eos_logit` / the final hidden state's RMS. Returns the
    folder.
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
    tok.train_from_iterator([*_CORPUS, *corpus], trainer)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    inter = hidden * 2
    config = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": context,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
    }))
    w = random_llama_weights(torch.Generator().manual_seed(seed), num_layers, vocab, hidden, heads, kv_heads, head_dim,
                             inter)
    if eos_logit is not None:
        _end_answers(w, num_layers, eos=2, logit=eos_logit)
        config["tie_word_embeddings"] = False
        (path / "config.json").write_text(json.dumps(config))
    save_file(w, str(path / "model.safetensors"))
    return path


def _end_answers(w: dict[str, torch.Tensor], num_layers: int, eos: int, logit: float) -> None:
    """`make_tiny_model_dir`'s eos_logit: a constant hidden dimension read into the EOS logit only."""
    w["model.embed_tokens.weight"][:, 0] = 1.0
    for i in range(num_layers):  # no layer writes to dimension 0: it reaches the final norm as the constant 1
        w[f"model.layers.{i}.self_attn.o_proj.weight"][0] = 0.0
        w[f"model.layers.{i}.mlp.down_proj.weight"][0] = 0.0
    head = w["model.embed_tokens.weight"].clone()
    head[:, 0] = 0.0
    head[eos] = 0.0
    head[eos, 0] = logit
    w["lm_head.weight"] = head.contiguous()


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


def make_block_manager(num_blocks: int = 16, block_size: int = 4, enable_prefix_cache: bool = True,
                       clock=None) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_cache, clock=clock)


def rereads(n: int, output_tokens: int, block_size: int = 16) -> int:
    """Prompt tokens a repeat of an n-token prompt reads from the prefix cache after one run that
    generated output_tokens: its full prompt blocks, and all but the last token when that run's own
    tokens filled the block holding the prompt's tail (the block is then cached, its slots copied)."""
    computed = n + max(0, output_tokens - 1)  # the last output token is never fed back; a warm-up computes n
    return n - 1 if computed >= ((n - 1) // block_size + 1) * block_size else (n - 1) // block_size * block_size


def add_tiny_tokenizer(writer, tok: dict, chat_template: str = CHATML) -> None:
    """The tiny byte-level BPE tokenizer (its tokenizer.json as `tok`) and a chat template (ChatML unless
    given), written into a GGUF the way llama.cpp's converter writes a "gpt2" vocabulary."""
    import gguf

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    tokens = [t for t, _ in vocab]
    types = [gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens]
    for added in sorted(tok.get("added_tokens", []), key=lambda a: a["id"]):  # beyond the BPE vocabulary
        if added["id"] >= len(vocab):  # as the converter writes them: text ones user-defined, others control
            assert added["id"] == len(tokens)
            tokens.append(added["content"])
            types.append(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(chat_template)


def make_sentencepiece_model(vocab_size: int = 400) -> bytes:
    """A tiny SentencePiece BPE model trained here, set up as Llama 2's is: byte fallback, digits split,
    no normalization, spaces kept as written, a dummy prefix; <unk> <s> </s> are ids 0-2, and the
    ChatML markers and Mistral v3's are control pieces. Returns the serialized model (a tokenizer.model
    file's bytes)."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for text in _CORPUS for line in text.splitlines() if line.strip()]),
        model_writer=out, model_type="bpe", vocab_size=vocab_size, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        allow_whitespace_only_pieces=True, character_coverage=0.99, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=SPECIAL[1:] + MISTRAL_CONTROLS, minloglevel=2)
    return out.getvalue()


def add_sentencepiece_vocab(writer, model: bytes, vocab_size: int, chat_template: str = CHATML,
                            add_space_prefix: bool = True) -> None:
    """A SentencePiece model's vocabulary written into a GGUF as llama.cpp's convert_hf_to_gguf writes it
    (TextModel._set_vocab_sentencepiece): model "llama", every piece with its score and type, rows past
    the model's pieces as [PADn] unused tokens, bos/eos/unk ids, add_bos_token, add_space_prefix."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                     else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                     else gguf.TokenType.NORMAL)
    for i in range(1, vocab_size - len(tokens) + 1):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(chat_template)


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


# ---- tiny random models of every supported family, as HF folders and as GGUF files ------------------

# transformers config class and the family's own options, at tiny dims. Each exercises what its family
# adds: Llama 3 RoPE scaling and tied embeddings; Qwen2 q/k/v bias; Qwen3 q/k norms and a head_dim
# that is not hidden / heads; Mistral an explicit head_dim; Gemma 2 soft-capped scores and logits and
# alternating sliding-window layers; Gemma 3 q/k norms, 5 local layers to 1 global, each with its own
# RoPE base, the global one linearly scaled; Phi-3 fused projections and a sliding window. Windows and
# caps are small so a prompt of a few dozen tokens crosses them.
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, head_dim=24, sliding_window=None,
                                      tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        final_logit_softcapping=None, attn_logit_softcapping=None)),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False, pad_token_id=0)),
}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3", "phi3": "phi3"}


def make_family_dir(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight model of `family` written by transformers (config -> seeded random init ->
    save_pretrained safetensors), with the tiny BPE tokenizer of `make_tiny_model_dir`; `overrides` replace
    FAMILY_CONFIGS options. Returns the folder.

    Weights are drawn here rather than left at transformers' init (std 0.02, norms at their neutral
    value), so every norm, bias and cap changes the logits."""
    import transformers

    path = Path(path)
    make_tiny_model_dir(path, num_layers=1, seed=seed)  # the tokenizer files; config and weights replaced below
    (path / "model.safetensors").unlink()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    cls, extra = FAMILY_CONFIGS[family]
    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, cls)(vocab_size=vocab, **{**dims, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:  # Gemma stores w of (1 + w); the others the multiplier itself
                p.copy_(noise * 0.1 + (0.0 if gemma else 1.0))
            elif name.endswith("bias"):
                p.copy_(noise * 0.5)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5 * 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_family_gguf(folder: Path, out: Path, qtype: str | None = None, head_qtype: str | None = None,
                      qtypes: dict[str, str] | None = None, sentencepiece: bytes | None = None,
                      chat_template: str = CHATML) -> Path:
    """Convert a `make_family_dir` folder to GGUF the way llama.cpp's convert_hf_to_gguf.py writes it:
    tensor names from gguf-py's TensorNameMap, Llama/Mistral Q and K rows permuted for interleaved RoPE,
    Gemma norms stored as (1 + w), Llama 3 RoPE scaling as a rope_freqs tensor, and each family's keys.

    Matrices are F32 unless qtype names a gguf type (F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1 by gguf-py;
    Q4_K, Q5_K, Q6_K by tests/kquants.py); head_qtype is the output projection's (or the tied embedding's);
    qtypes maps a GGUF tensor-name fragment ("ffn_down") to a type of its own, as llama.cpp's Q4_K_M mixes do.
    sentencepiece, a SentencePiece model (`make_sentencepiece_model`), is written as the vocabulary
    instead of the folder's byte-level one; chat_template is the file's tokenizer.chat_template.
    """
    import math

    import gguf
    from safetensors.torch import load_file

    from tests.kquants import quantize as quantize_tensor

    cfg = json.loads((folder / "config.json").read_text())
    family = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    arch = GGUF_ARCH[family]
    num_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{family}")
    w.add_block_count(num_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if family.startswith("gemma") and cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family in ("gemma2", "gemma3") or (family == "phi3" and cfg.get("sliding_window")):
        w.add_sliding_window(cfg["sliding_window"])
    if family == "phi3":
        w.add_rope_dimension_count(head_dim)
    if sentencepiece is not None:
        add_sentencepiece_vocab(w, sentencepiece, cfg["vocab_size"], chat_template)
    else:
        add_tiny_tokenizer(w, json.loads((folder / "tokenizer.json").read_text()), chat_template)

    if scaling and scaling["rope_type"] == "llama3":  # convert_hf_to_gguf LlamaModel.generate_extra_tensors
        base = float(cfg.get("rope_theta") or rope["rope_theta"])
        freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    tied = "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if family.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch == "llama" and ".attn_q." in gname:
            tensor = _llamacpp_permute(tensor, heads)
        elif arch == "llama" and ".attn_k." in gname:
            tensor = _llamacpp_permute(tensor, kv_heads)
        array = tensor.float().numpy()
        kind = None
        if array.ndim == 2:
            is_head = gname == "output.weight" or (gname == "token_embd.weight" and tied)
            kind = head_qtype if is_head else qtype
            for fragment, special in (qtypes or {}).items():
                if fragment in gname:
                    kind = special
        if kind is None:
            w.add_tensor(gname, array)
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, quantize_tensor(array, kind), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# Files in every format the native step takes, each in a mix (`write_family_gguf` arguments): a
# projection of two formats (run as segments), layers of different formats, the output projection in
# another. Inputs must be multiples of 256 for the K-quants.
PACKED_MIXES = {
    "Q4_K_M": dict(qtype="Q4_K", head_qtype="Q6_K", qtypes={"blk.0.ffn_down": "Q6_K", "blk.0.attn_v": "Q6_K"}),
    "Q5_K_M": dict(qtype="Q5_K", head_qtype="Q6_K", qtypes={"blk.1.ffn_down": "Q6_K", "attn_output": "Q8_0"}),
    "Q5_0/Q5_1": dict(qtype="Q5_0", head_qtype="Q8_0", qtypes={"ffn_up": "Q5_1", "blk.0.attn_k": "Q4_1"}),
    "F16": dict(qtype="F16", head_qtype="F16"),
    "BF16": dict(qtype="BF16", head_qtype="BF16", qtypes={"blk.1.attn_q": "Q8_0"}),
}


def _llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
