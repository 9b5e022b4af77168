"""Checkpoint loaders: a GGUF file, or a Hugging Face folder (config.json + *.safetensors + tokenizer.json,
or a SentencePiece tokenizer.model).

Both produce a `Checkpoint` whose weights carry Hugging Face Llama tensor names, so the model has
one loading path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from stratum.models.config import GEMMA, HF_FAMILIES, ModelConfig, UnsupportedModelError
from stratum.models.tokenizer import (
    TextTokenizer, tokenizer_from_file, tokenizer_from_gguf, tokenizer_from_sentencepiece,
)

log = logging.getLogger("stratum.models")

# general.architecture values read (Mistral GGUFs are "llama": llama.cpp's converter writes them so)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# Tensor types loaded: the K-quants dequantized by kernels.kquant, the rest by gguf-py; what the native
# step runs as stored is kernels.packed.PACKED_QTYPES.
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (per block) -> Hugging Face name, from llama.cpp's gguf-py tensor map. Gemma's
# norms around attention and MLP have names of their own; elsewhere ffn_norm is Llama's pre-MLP norm.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept in its packed form (a view of the mapped file), for kernels that run on it
    directly; `dense` and `rows` dequantize it, or some of its rows, on demand. Llama's Q/K rows,
    which llama.cpp stores permuted, are put back in order on the first read of `data` (a copy),
    so a start that never reads them (the native step's repacked cache is current) never copies them."""

    qtype: str  # gguf GGMLQuantizationType name, e.g. "Q4_1"
    # the raw blocks as the file holds them, [rows, bytes_per_row] uint8 (F16: [rows, in_features] float16)
    stored: np.ndarray
    shape: tuple[int, int]  # logical [out_features, in_features]
    permuted_heads: int = 0  # llama.cpp's Q/K row permutation over this many heads, undone by `data` (0: none)

    @functools.cached_property
    def data(self) -> np.ndarray:
        """The raw blocks, rows in the model's order."""
        if not self.permuted_heads:
            return self.stored
        from stratum.kernels.kquant import mapped_tensor

        return _unpermute(mapped_tensor(self.stored), self.permuted_heads).numpy()

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """`data` as uint8 [rows, bytes per row] over the same memory, for the native lookup: made once
        (the tensor over a read-only mapping took ~55 us a step, made at every lookup)."""
        from stratum.kernels.kquant import mapped_tensor

        return mapped_tensor(np.asarray(self.data).view(np.uint8))

    def release(self) -> None:
        """Done with the blocks for now: the file's pages leave this process's resident set (`release_pages`)
        and an unpermuted copy is dropped; a later read maps (or copies) them again."""
        release_pages(self.stored)
        self.__dict__.pop("data", None)
        self.__dict__.pop("table", None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as fp32 [len(ids), in_features]: an embedding lookup from the table as stored, by
        the native library where it is loaded (kernels.packed `dequantize_rows`), else by gguf-py's NumPy
        dequantization (for a few rows ~3x faster than kernels.kquant's PyTorch form, whose per-operation
        cost dominates there); the same values either way (tests/test_gguf_formats.py)."""
        from stratum.kernels.packed import dequantize_rows, native_lookup

        if native_lookup(self.qtype):
            return dequantize_rows(self.qtype, self.table, self.shape[1], ids)
        return _dequantize(self.qtype, np.asarray(self.data)[ids.numpy()], (ids.shape[0], self.shape[1]), by_gguf=True)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor in `dtype`, dequantized a slice of rows at a time: no fp32 copy of all of it."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype)
        step = max(1, (1 << 22) // k)  # rows per slice: 16 MB of fp32
        for r in range(0, n, step):
            rows = min(step, n - r)
            out[r : r + rows] = _dequantize(self.qtype, self.data[r : r + rows], (rows, k))
        return out


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    chat_template: str | None
    path: Path
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    cache_dir: Path | None = None  # where derived forms of this checkpoint may be kept (GGUF only)

    @functools.cached_property
    def identity(self) -> str:
        """Which file this is (`file_identity`), for the numerics record."""
        return file_identity(self.path)


def file_identity(path: Path) -> str:
    """A digest of the checkpoint's files by resolved path, size and modification time: the same
    file at every start, another after it is rewritten or replaced. (Hashing the content would cost a
    read of the whole file at every start.)"""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    try:
        key = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    except OSError:
        key = [str(path)]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


class ModelLoadError(ValueError):
    """The path is not a model this runtime can load; the message says why."""


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face folder (a BERT one as `bert.EncoderCheckpoint`).

    Raises:
        ModelLoadError: missing files, unsupported architecture or tokenizer.
    """
    from stratum.models import bert

    path = Path(path)
    if bert.is_encoder(path):
        return bert.load_encoder(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_folder(path)
    raise ModelLoadError(f"{path}: expected a .gguf file or a folder with config.json, *.safetensors "
                         "and tokenizer.json")


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


# the output projection (or the tied embedding that serves as one), kept raw for the kernels that read it as stored
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")
# Parsing a GGUF's metadata in Python (the vocabulary's strings) takes seconds; the first load keeps
# what it found in a small cache under $STRATUM_HOME/cache (configuration, tokenizer, and where each
# tensor lies in the file), and later loads map the file's tensors straight from those offsets. No
# tensor is ever copied into the cache: every weight is a view of the mapped GGUF, as stored.
# Versions: 2, Q8_0 output projections kept raw too; 3, more families, K-quants kept raw; 4, no tensor
# data, only each tensor's place in the mapped file; 5, F16 / BF16 projections held as stored too; 6, the
# tokenizer's add_bos
CACHE_VERSION = 6
DENSE_TYPES = ("F32", "F16", "BF16")  # stored unquantized: taken as mapped views


@dataclass(frozen=True)
class _Entry:
    """One GGUF tensor's place in the file."""

    name: str
    qtype: str
    shape: tuple[int, ...]  # logical, outermost first
    offset: int  # bytes from the start of the file
    nbytes: int


def load_gguf(path: Path) -> Checkpoint:
    """A GGUF file, its metadata through the checkpoint cache under $STRATUM_HOME/cache when it is current."""
    cache_dir = _cache_dir(path)
    if cache_dir is not None and (cache_dir / "meta.json").exists():
        try:
            return _load_cached(cache_dir, path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable checkpoint cache %s: %s", cache_dir, e)
    checkpoint, entries = _read_gguf(path)
    if cache_dir is not None:
        try:
            _save_cached(cache_dir, checkpoint, entries)
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


def _save_cached(cache_dir: Path, ck: Checkpoint, entries: list[_Entry]) -> None:
    # a directory of this writer's own, renamed into place whole: two processes converting the same
    # file at once (the test suite's SIMD-path runs, two servers) never write into each other's files
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache_dir.name + ".", suffix=".tmp", dir=cache_dir.parent))
    try:
        _write_cache(tmp, ck, entries)
        if (cache_dir / "meta.json").exists():  # another process finished the same conversion first
            return
        if cache_dir.exists():  # an unreadable leftover
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            os.replace(tmp, cache_dir)
        except OSError:
            if not (cache_dir / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_cache(tmp: Path, ck: Checkpoint, entries: list[_Entry]) -> None:
    from dataclasses import asdict

    tok = ck.tokenizer
    meta = {
        "config": asdict(ck.config),
        "chat_template": ck.chat_template,
        "tensors": [asdict(e) for e in entries],
        "tokenizer": {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
                      "eos_token_ids": list(tok.eos_token_ids), "add_bos": tok.add_bos},
    }
    (tmp / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp / "meta.json").write_text(json.dumps(meta))


def _load_cached(cache_dir: Path, path: Path) -> Checkpoint:
    from tokenizers import Tokenizer

    meta = json.loads((cache_dir / "meta.json").read_text())
    cfg = meta["config"]
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    cfg["sliding_layers"] = tuple(cfg["sliding_layers"])
    config = ModelConfig(**cfg)
    t = meta["tokenizer"]
    tokenizer = TextTokenizer(Tokenizer.from_str((cache_dir / "tokenizer.json").read_text()), t["bos_token"],
                              t["eos_token"], t["bos_token_id"], tuple(t["eos_token_ids"]), t["add_bos"])
    entries = [_Entry(e["name"], e["qtype"], tuple(e["shape"]), e["offset"], e["nbytes"]) for e in meta["tensors"]]
    weights, quantized = _tensors(path, np.memmap(path, dtype=np.uint8, mode="r"), entries, config)
    return Checkpoint(config, weights, tokenizer, meta["chat_template"], path, quantized, cache_dir)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type (GGUF types, or safetensors dtypes) the checkpoint at `path` stores."""
    from collections import Counter

    if path.is_dir():
        from safetensors import safe_open

        counts: Counter = Counter()
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                counts.update(st.get_slice(k).get_dtype() for k in st.keys())
        return dict(counts)
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def _read_gguf(path: Path) -> tuple[Checkpoint, list[_Entry]]:
    try:
        reader = _reader(path)
    except (ValueError, OSError) as e:  # bad magic, truncated tensor data, unreadable file
        raise ModelLoadError(f"{path.name}: not a readable GGUF file (corrupt or truncated?): {e}") from e
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path.name}: architecture {arch!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    try:
        tokenizer = tokenizer_from_gguf(meta)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    try:
        config = _gguf_config(meta, arch, {t.name: t for t in reader.tensors}, tokenizer, path.stem)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    entries = [_Entry(t.name, t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)), int(t.data_offset),
                      int(t.n_bytes)) for t in reader.tensors]
    weights, quantized = _tensors(path, reader.data, entries, config)
    checkpoint = Checkpoint(config, weights, tokenizer, meta.get("tokenizer.chat_template"), path, quantized)
    return checkpoint, entries


def _tensors(path: Path, mapped: np.ndarray, entries: list[_Entry], config: ModelConfig
             ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedTensor]]:
    """The GGUF's tensors under Hugging Face names, each a view of `mapped` (the whole file, memory-
    mapped): unquantized ones as tensors, quantized projections, embedding and output projection
    as QuantizedTensor (dequantized only where the model builder decides to). Only Llama's permuted
    Q/K rows are copies, made when first read."""
    arch = config.architecture
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    for e in entries:
        if e.name == "rope_freqs.weight":  # read by _gguf_config
            continue
        name = _hf_name(e.name, arch)
        if e.qtype not in GGUF_TENSOR_TYPES:
            raise ModelLoadError(f"{path.name}: tensor {e.name} is {e.qtype}, a type this runtime does not load "
                                 f"(supported: {', '.join(GGUF_TENSOR_TYPES)})")
        raw = mapped[e.offset : e.offset + e.nbytes]
        projection = len(e.shape) == 2 and (name.endswith("proj.weight") or name in _HEAD_NAMES)
        if e.qtype == "F32" or (e.qtype in DENSE_TYPES and not projection):
            weights[name] = _mapped_dense(raw, e.qtype, e.shape)
            continue
        # quantized, or an F16 / BF16 projection, which the native step also takes as stored
        rows = int(np.prod(e.shape[:-1]))  # (gguf-py's block sizes unread: importing it costs a warm start 0.19 s)
        qt = QuantizedTensor(e.qtype, raw.reshape(rows, e.nbytes // rows), (rows, e.shape[-1]))
        if projection:
            quantized[name] = qt
        else:  # a quantized vector or an unexpected tensor: small, dequantized
            weights[name] = qt.dense().reshape(e.shape)
    if arch == "llama":  # llama.cpp stores Q/K rows permuted for its interleaved RoPE
        for key, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for name in [n for n in weights if f".{key}." in n]:
                weights[name] = _unpermute(weights[name], heads)
            for name in [n for n in quantized if f".{key}." in n]:
                quantized[name] = _unpermute_rows(quantized[name], heads)
    if arch == "phi3":  # fused q/k/v and gate/up, split into the common names
        _split_phi3(weights, quantized, config)
    return weights, quantized


def _reader(path: Path):
    """gguf-py's reader over a plain ndarray view of the mapped file: with numpy's memmap subclass,
    every one of the ~1.2 M slices it takes of a 49k-token vocabulary (and of each tensor when
    dequantizing) pays the subclass's bookkeeping, 2.3 s of a 3.6 s parse of SmolLM2-135M."""
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._data = mapped.view(np.ndarray)  # still the mapping's memory, which it keeps open

    return PlainReader(str(path))


def _mapped_dense(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An unquantized GGUF tensor as a tensor over the mapped file's bytes, uncopied (only ever read)."""
    from stratum.kernels import kquant

    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    return kquant.mapped_tensor(raw).view(dtype).reshape(shape)


def _dequantize(qtype: str, raw: np.ndarray, shape: tuple[int, int], by_gguf: bool = False) -> torch.Tensor:
    """Quantized GGUF rows as fp32 [shape]: K-quants by kernels.kquant (unless by_gguf), the other block
    formats by gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from stratum.kernels import kquant

    if qtype in kquant.BLOCK_BYTES and not by_gguf:
        return kquant.dequantize(qtype, raw, shape)
    return torch.from_numpy(np.asarray(dequantize(np.asarray(raw), GGMLQuantizationType[qtype]),
                                       dtype=np.float32).reshape(shape))


def _gguf_config(meta: dict, arch: str, tensors: dict, tokenizer, stem: str) -> ModelConfig:
    """ModelConfig from a GGUF's `{arch}.*` keys and tensor list, with llama.cpp's defaults where
    the converter writes no key (llama-model.cpp, llm_load_hparams)."""

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = m("attention.head_count")
    hidden = m("embedding_length")
    num_layers = m("block_count")
    head_dim = m("attention.key_length") or hidden // num_heads
    rope_scaling = None
    if m("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": m("rope.scaling.type"), "factor": m("rope.scaling.factor")}
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: the scaled-frequency divisors, instead of rope_scaling keys
        rope_scaling = {"rope_type": "freq_factors",
                        "factors": np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).tolist()}
    if "rope_factors_long.weight" in tensors:
        raise UnsupportedModelError(f"{arch}: long-context RoPE factors (rope_factors_long, LongRoPE) "
                                    "are not supported")
    window = m("attention.sliding_window") or None
    sliding: tuple[bool, ...] = ()
    if window:  # llama.cpp's swa patterns: every n-th layer (the last of each group) attends globally
        pattern = m("attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}.get(arch, 1))
        if isinstance(pattern, list):
            sliding = tuple(bool(x) for x in pattern)
        else:
            sliding = tuple(pattern == 1 or i % pattern < pattern - 1 for i in range(num_layers))
    gemma = arch in GEMMA
    # Gemma's attention scale is 1/sqrt(query_pre_attn_scalar): head_dim, except the 27B models'
    # hidden / heads (llama.cpp picks it by model size: 46 layers for Gemma 2, 62 for Gemma 3)
    scalar = hidden / num_heads if (arch, num_layers) in (("gemma2", 46), ("gemma3", 62)) else head_dim
    return ModelConfig(
        architecture=arch,
        vocab_size=m("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=m("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=m("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=m("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=meta.get("general.name") or stem,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        embedding_scale=hidden**0.5 if gemma else 1.0,
        sandwich_norms=gemma,
        query_pre_attn_scalar=scalar if gemma else None,
        attn_logit_softcap=m("attn_logit_softcapping") if arch == "gemma2" else None,
        final_logit_softcap=m("final_logit_softcapping") if gemma else None,
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=float(m("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    ).check()


def _split_phi3(weights: dict, quantized: dict, config: ModelConfig) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj (rows [q; k; v] and [gate; up]) as separate tensors.
    Splitting rows is exact for dense and block-quantized tensors alike."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    splits = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
              "mlp.gate_up_proj": (("mlp.gate_proj", inter), ("mlp.up_proj", inter))}
    for i in range(config.num_layers):
        for fused, parts in splits.items():
            name = f"model.layers.{i}.{fused}.weight"
            dense, packed, row = weights.pop(name, None), quantized.pop(name, None), 0
            for part, rows in parts:
                target = f"model.layers.{i}.{part}.weight"
                if dense is not None:
                    weights[target] = dense[row : row + rows]
                if packed is not None:
                    data = np.asarray(packed.data).reshape(packed.shape[0], -1)[row : row + rows]
                    quantized[target] = QuantizedTensor(packed.qtype, data, (rows, packed.shape[1]))
                row += rows


def _unpermute_rows(qt: QuantizedTensor, num_heads: int) -> QuantizedTensor:
    return QuantizedTensor(qt.qtype, qt.stored, qt.shape, num_heads)  # undone when first read


def release_pages(array: np.ndarray) -> None:
    """Drop the pages of a view of a read-only file mapping from this process's resident set, once
    it is done with them (madvise MADV_DONTNEED): they stay in the page cache, and a later read maps
    them again. Anything not a view of a file mapping is left alone (there, the same call would zero
    memory)."""
    import ctypes
    import mmap

    base = array
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None or not array.size or not array.flags.c_contiguous or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.__array_interface__["data"][0]
    end = start + array.nbytes
    start -= start % page
    ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def _hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    names = {**_GGUF_BLOCK_NAMES, **_GGUF_GEMMA_NAMES} if arch in GEMMA else _GGUF_BLOCK_NAMES
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in names:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r} for architecture {arch!r}")
    if arch == "phi3" and parts[2] == "ffn_up":  # Phi-3's ffn_up holds gate and up
        return f"model.layers.{parts[1]}.mlp.gate_up_proj.{parts[3]}"
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def load_hf_folder(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    try:
        cfg = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON: {e}") from e
    model_type = cfg.get("model_type")
    if model_type not in HF_FAMILIES:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(HF_FAMILIES)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
        raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer.model")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    tok_cfg = (json.loads((path / "tokenizer_config.json").read_text())
               if (path / "tokenizer_config.json").exists() else {})
    gen_cfg = (json.loads((path / "generation_config.json").read_text())
               if (path / "generation_config.json").exists() else {})

    def token_str(value):
        return value.get("content") if isinstance(value, dict) else value

    eos = token_str(tok_cfg.get("eos_token"))
    eos_tokens, bos = [eos] if eos else [], token_str(tok_cfg.get("bos_token"))
    add_bos = tok_cfg.get("add_bos_token")  # left out: as the tokenizer.json's post-processor does, or
    if (path / "tokenizer.json").exists():
        tokenizer = tokenizer_from_file(str(path / "tokenizer.json"), eos_tokens, bos, add_bos)
    else:
        try:  # transformers' LlamaTokenizer default for a SentencePiece model
            tokenizer = tokenizer_from_sentencepiece(str(path / "tokenizer.model"), eos_tokens, bos,
                                                     True if add_bos is None else add_bos)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    try:
        config = ModelConfig.from_hf_config(cfg, name=path.name)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'}: missing required field {e}") from e
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if config.architecture in GEMMA:  # Gemma's RMSNorm scales by (1 + w): stored here as the multiplier
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name] + 1
    if config.architecture == "phi3":
        _split_phi3(weights, {}, config)
    eos_ids = set(config.eos_token_ids) | set(tokenizer.eos_token_ids)
    gen_eos = gen_cfg.get("eos_token_id")
    eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    config = replace(config, eos_token_ids=tuple(sorted(eos_ids)),
                     tie_word_embeddings=config.tie_word_embeddings or "lm_head.weight" not in weights)
    tokenizer.eos_token_ids = config.eos_token_ids
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return Checkpoint(config, weights, tokenizer, template, path)
