"""Checkpoint loaders: a GGUF file, or a Hugging Face folder (config.json + *.safetensors + tokenizer.json).

Both produce a `Checkpoint` whose weights carry Hugging Face Llama tensor names, so the model has
one loading path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from stratum.models.config import ModelConfig
from stratum.models.tokenizer import TextTokenizer, tokenizer_from_file, tokenizer_from_gguf

log = logging.getLogger("stratum.models")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# GGUF tensor name (per block) -> Hugging Face name, from llama.cpp's gguf-py tensor map.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept in its packed form, for kernels that run on it directly."""

    qtype: str  # gguf GGMLQuantizationType name, e.g. "Q4_1"
    data: np.ndarray  # the raw blocks, [rows, bytes_per_row] uint8
    shape: tuple[int, int]  # logical [out_features, in_features]


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    chat_template: str | None
    path: Path
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    cache_dir: Path | None = None  # where derived forms of this checkpoint may be kept (GGUF only)


class ModelLoadError(ValueError):
    """The path is not a model this runtime can load; the message says why."""


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face folder.

    Raises:
        ModelLoadError: missing files, unsupported architecture or tokenizer.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path)
    raise ModelLoadError(f"{path}: expected a .gguf file or a folder with config.json, *.safetensors and tokenizer.json")


def _field_value(field_):
    from gguf import GGUFValueType

    if not field_.types:
        return None
    if field_.types[0] == GGUFValueType.ARRAY:
        return field_.contents()
    return field_.contents()


def read_gguf_metadata(reader) -> dict:
    return {key: _field_value(f) for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (interleaved -> rotate-half RoPE)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Parsing a GGUF's metadata in Python (49k vocabulary strings) and dequantizing it take seconds; the
# first load converts the file into this cache, later loads map safetensors instead.
# the output projection (or the tied embedding that serves as one), kept raw when it is Q8_0
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")
CACHE_VERSION = 2  # 2: Q8_0 output projections are kept raw too


def load_gguf(path: Path) -> Checkpoint:
    """A GGUF file, through the converted-checkpoint cache under $STRATUM_HOME/cache when it is current."""
    cache_dir = _cache_dir(path)
    if cache_dir is not None and (cache_dir / "meta.json").exists():
        try:
            return _load_cached(cache_dir, path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable checkpoint cache %s: %s", cache_dir, e)
    checkpoint = _read_gguf(path)
    if cache_dir is not None:
        try:
            _save_cached(cache_dir, checkpoint)
            checkpoint.cache_dir = cache_dir
        except OSError as e:  # a read-only or full disk only costs speed
            log.warning("could not write checkpoint cache %s: %s", cache_dir, e)
    return checkpoint


def _cache_dir(path: Path) -> Path | None:
    from stratum.models.registry import stratum_home

    try:
        st = path.stat()
    except OSError:
        return None
    key = json.dumps([CACHE_VERSION, str(path.resolve()), st.st_size, st.st_mtime_ns])
    return stratum_home() / "cache" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save_cached(cache_dir: Path, ck: Checkpoint) -> None:
    from dataclasses import asdict

    from safetensors.torch import save_file

    tmp = cache_dir.with_name(cache_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ck.weights.items()}, str(tmp / "weights.safetensors"))
    save_file({k: torch.from_numpy(np.ascontiguousarray(q.data)) for k, q in ck.quantized.items()}, str(tmp / "quantized.safetensors"))
    tok = ck.tokenizer
    meta = {
        "config": asdict(ck.config),
        "chat_template": ck.chat_template,
        "quantized": {k: {"qtype": q.qtype, "shape": list(q.shape)} for k, q in ck.quantized.items()},
        "tokenizer": {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
                      "eos_token_ids": list(tok.eos_token_ids)},
    }
    (tmp / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp / "meta.json").write_text(json.dumps(meta))
    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    os.replace(tmp, cache_dir)


def _load_cached(cache_dir: Path, path: Path) -> Checkpoint:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    meta = json.loads((cache_dir / "meta.json").read_text())
    cfg = meta["config"]
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    t = meta["tokenizer"]
    tokenizer = TextTokenizer(Tokenizer.from_str((cache_dir / "tokenizer.json").read_text()), t["bos_token"],
                              t["eos_token"], t["bos_token_id"], tuple(t["eos_token_ids"]))
    raw = load_file(str(cache_dir / "quantized.safetensors"))
    quantized = {k: QuantizedTensor(q["qtype"], raw[k].numpy(), tuple(q["shape"])) for k, q in meta["quantized"].items()}
    weights = load_file(str(cache_dir / "weights.safetensors"))
    return Checkpoint(ModelConfig(**cfg), weights, tokenizer, meta["chat_template"], path, quantized, cache_dir)


def _read_gguf(path: Path) -> Checkpoint:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:  # bad magic, truncated tensor data, unreadable file
        raise ModelLoadError(f"{path.name}: not a readable GGUF file (corrupt or truncated?): {e}") from e
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = m("attention.head_count")
    hidden = m("embedding_length")
    head_dim = m("attention.key_length") or hidden // num_heads
    rope_scaling = None
    if m("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": m("rope.scaling.factor")}
    try:
        tokenizer = tokenizer_from_gguf(meta)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    vocab_size = m("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=m("feed_forward_length"),
        num_layers=m("block_count"),
        num_heads=num_heads,
        num_kv_heads=m("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=m("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=meta.get("general.name") or path.stem,
    )
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            # Llama 3.1 files store the scaled-frequency divisors instead of rope_scaling metadata.
            factors = torch.from_numpy(np.array(t.data, dtype=np.float32))
            config = _with_rope_factors(config, factors)
            continue
        name = _hf_name(t.name)
        qtype = GGMLQuantizationType(t.tensor_type)
        logical = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            array = np.array(dequantize(t.data, qtype) if qtype == GGMLQuantizationType.BF16 else t.data, dtype=np.float32)
        else:
            array = dequantize(t.data, qtype)
            if name.endswith("proj.weight") or (qtype == GGMLQuantizationType.Q8_0 and name in _HEAD_NAMES):
                quantized[name] = QuantizedTensor(qtype.name, np.array(t.data), logical)
        tensor = torch.from_numpy(np.ascontiguousarray(array.reshape(logical)))
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute(tensor, config.num_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute(tensor, config.num_kv_heads)
        weights[name] = tensor
    if arch == "llama":  # permuted rows: the packed blocks no longer match the logical weight
        for key in [k for k in quantized if k.endswith(("q_proj.weight", "k_proj.weight"))]:
            heads = config.num_heads if "q_proj" in key else config.num_kv_heads
            quantized[key] = _unpermute_rows(quantized[key], heads)
    return Checkpoint(config, weights, tokenizer, meta.get("tokenizer.chat_template"), path, quantized)


def _unpermute_rows(qt: QuantizedTensor, num_heads: int) -> QuantizedTensor:
    rows = torch.from_numpy(qt.data)
    return QuantizedTensor(qt.qtype, _unpermute(rows, num_heads).numpy(), qt.shape)


def _with_rope_factors(config: ModelConfig, factors: torch.Tensor) -> ModelConfig:
    from dataclasses import replace

    return replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors.tolist()})


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or parts[2] not in _GGUF_BLOCK_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"


def load_hf_folder(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    try:
        cfg = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON: {e}") from e
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
    gen_cfg = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}

    def token_str(value):
        return value.get("content") if isinstance(value, dict) else value

    eos = token_str(tok_cfg.get("eos_token"))
    tokenizer = tokenizer_from_file(str(path / "tokenizer.json"), [eos] if eos else [], token_str(tok_cfg.get("bos_token")))
    try:
        config = ModelConfig.from_hf_config(cfg, name=path.name)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'}: missing required field {e}") from e
    eos_ids = set(config.eos_token_ids) | set(tokenizer.eos_token_ids)
    gen_eos = gen_cfg.get("eos_token_id")
    eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if "lm_head.weight" not in weights:
        from dataclasses import replace

        config = replace(config, tie_word_embeddings=True)
    from dataclasses import replace

    config = replace(config, eos_token_ids=tuple(sorted(eos_ids)))
    tokenizer.eos_token_ids = config.eos_token_ids
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return Checkpoint(config, weights, tokenizer, template, path)
