"""The encoder family: BERT (`BertEncoder`) read from a Hugging Face folder (safetensors, tokenizer.json
and sentence-transformers' module configs) or a GGUF from llama.cpp's converter (`load_encoder`), with
what its output is for (`Pooling`: mean, CLS or last-token embeddings, or a cross-encoder's score).

Every sequence of a batch runs as its own rows: no padding between sequences, attention one sequence at
a time, and every matmul over a row count padded to `ROW_MULTIPLE`, so a sequence's vector is the same
alone or in any batch (`BertEncoder.forward`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from stratum.models.config import ContextLengthError
from stratum.models.loader import ModelLoadError
from stratum.models.tokenizer import TextTokenizer

# PyTorch's CPU GEMM (MKL / oneDNN) picks another kernel for a handful of rows, which rounds a row
# differently; measured on this runtime's x86 machines at 1 and 2 threads, every row count that is a
# multiple of 16 gives each row the same bits whatever the other rows (and below 12 rows it does not).
ROW_MULTIPLE = 16
ACTIVATIONS = {"gelu": functools.partial(F.gelu, approximate="none"),
               "gelu_new": functools.partial(F.gelu, approximate="tanh"),
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
# llama.cpp's pooling types (LLAMA_POOLING_TYPE_*: 1 mean, 2 cls, 3 last, 4 rank)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "score"}


class EncoderLoadError(ModelLoadError):
    """The folder or file is not an encoder this runtime reads; the message says why."""


@dataclass(frozen=True)
class Pooling:
    """What an encoder's output is: `kind` "mean" | "cls" | "last" (an embedding, normalized to unit
    length where `normalize`), or "score" (a cross-encoder's one logit through a sigmoid, as
    sentence-transformers' CrossEncoder scores one label)."""

    kind: str
    normalize: bool = True

    @property
    def task(self) -> str:
        return "score" if self.kind == "score" else "embed"


@dataclass(frozen=True)
class BertConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    max_model_len: int  # the longest input served: sentence-transformers' max_seq_length, else the positions
    pooling: Pooling
    sep_token_id: int | None = None  # where a pair's first segment ends (token types 0 up to it, then 1)
    architecture: str = "bert"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def with_context(self, max_model_len: int | None, scaling: str | None = None, *_args) -> "BertConfig":
        """At most the positions the model has (`stratum serve --max-model-len`); no RoPE to scale.

        Raises:
            ContextLengthError: a longer context, or a scaling asked of absolute positions.
        """
        if scaling not in (None, "none"):
            raise ContextLengthError(f"--rope-scaling {scaling!r}: {self.name} has learned absolute positions")
        if max_model_len is None:
            return self
        if max_model_len > self.max_position_embeddings:
            raise ContextLengthError(f"--max-model-len {max_model_len} is beyond {self.name}'s "
                                     f"{self.max_position_embeddings} positions")
        return replace(self, max_model_len=max_model_len)


@dataclass
class EncoderCheckpoint:
    """An encoder's config, weights (Hugging Face BERT names, without the `bert.` prefix) and tokenizer."""

    config: BertConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    path: Path
    chat_template: str | None = None  # an encoder has none
    quantized: dict = field(default_factory=dict)


def is_encoder(path: Path) -> bool:
    """A BERT folder (config.json's model_type "bert") or GGUF (general.architecture "bert")."""
    try:
        if path.is_dir():
            return json.loads((path / "config.json").read_text()).get("model_type") == "bert"
        if path.suffix == ".gguf":
            from gguf import GGUFReader

            field_ = GGUFReader(str(path)).fields.get("general.architecture")
            return field_ is not None and field_.contents() == "bert"
    except (OSError, ValueError):
        return False
    return False


# ---- a Hugging Face folder -----------------------------------------------------------------------------
def load_encoder(path: str | Path) -> EncoderCheckpoint:
    """A BERT folder (config.json with model_type "bert") or a GGUF whose architecture is "bert".

    Raises:
        EncoderLoadError: missing files, or an architecture or pooling this runtime does not run.
    """
    path = Path(path)
    if path.is_file():
        return _load_gguf(path)
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "tokenizer.json").exists():
        raise EncoderLoadError(f"{path}: a BERT folder needs *.safetensors and tokenizer.json")
    weights = {}
    for f in files:
        weights.update({_hf_name(k): v.float() for k, v in load_file(str(f)).items()})
    pooling = _folder_pooling(path, cfg, weights)
    limit = cfg["max_position_embeddings"]
    st_path = path / "sentence_bert_config.json"
    if st_path.exists():
        limit = min(limit, json.loads(st_path.read_text()).get("max_seq_length") or limit)
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.no_truncation()  # the file's own truncation would cut an input short silently: too long is a 400
    backend.no_padding()
    config = BertConfig(
        name=path.name, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], max_position_embeddings=cfg["max_position_embeddings"],
        type_vocab_size=cfg.get("type_vocab_size", 2), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        hidden_act=cfg.get("hidden_act", "gelu"), max_model_len=limit, pooling=pooling,
        sep_token_id=backend.token_to_id("[SEP]"))
    _check(config, path)
    return EncoderCheckpoint(config, weights, TextTokenizer(backend), path)


def _hf_name(name: str) -> str:
    name = name.removeprefix("bert.")
    return name.replace(".gamma", ".weight").replace(".beta", ".bias")


def _folder_pooling(path: Path, cfg: dict, weights: dict) -> Pooling:
    """What the folder says its output is: a sequence classifier with one label scores; else
    sentence-transformers' modules.json and its Pooling module's config (mean, CLS or last token, and
    whether a Normalize module follows); a bare BertModel without them: mean pooling, normalized."""
    if "classifier.weight" in weights:
        if weights["classifier.weight"].shape[0] != 1:
            raise EncoderLoadError(f"{path}: a classifier of {weights['classifier.weight'].shape[0]} labels "
                                   "(a reranker has one)")
        return Pooling("score", normalize=False)
    modules_path = path / "modules.json"
    if not modules_path.exists():
        return Pooling("mean")
    modules = json.loads(modules_path.read_text())
    types = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in types
    pool = types.get("Pooling")
    if pool is None:
        return Pooling("cls", normalize)
    pool_cfg = json.loads((path / pool["path"] / "config.json").read_text())
    modes = [m for m in ("mean_tokens", "cls_token", "lasttoken") if pool_cfg.get(f"pooling_mode_{m}")]
    others = [k for k, v in pool_cfg.items() if k.startswith("pooling_mode_") and v
              and k[len("pooling_mode_"):] not in ("mean_tokens", "cls_token", "lasttoken")]
    if len(modes) != 1 or others:
        raise EncoderLoadError(f"{path}: pooling {modes + others} (served: one of mean, CLS, last token)")
    return Pooling({"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last"}[modes[0]], normalize)


def _check(config: BertConfig, path: Path) -> None:
    if config.hidden_act not in ACTIVATIONS:
        raise EncoderLoadError(f"{path}: hidden_act {config.hidden_act!r} (served: {', '.join(ACTIVATIONS)})")
    if config.hidden_size % config.num_heads:
        raise EncoderLoadError(f"{path}: hidden_size {config.hidden_size} is not a multiple of the heads")


# ---- a GGUF from llama.cpp's converter --------------------------------------------------------------------
# GGUF tensor names (gguf-py's tensor_mapping for MODEL_ARCH.BERT) -> Hugging Face BERT names
_GGUF_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight", "token_embd_norm.bias": "embeddings.LayerNorm.bias",
    "cls.weight": "pooler.dense.weight", "cls.bias": "pooler.dense.bias",
    "cls.output.weight": "classifier.weight", "cls.output.bias": "classifier.bias",
}
_GGUF_LAYER = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER:
        return f"encoder.layer.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
    return None


def _load_gguf(path: Path) -> EncoderCheckpoint:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from stratum.models.loader import read_gguf_metadata

    reader = GGUFReader(str(path))
    meta = read_gguf_metadata(reader)
    if meta.get("general.architecture") != "bert":
        raise EncoderLoadError(f"{path}: architecture {meta.get('general.architecture')!r} is not bert")
    weights = {}
    for t in reader.tensors:
        name = _gguf_name(t.name)
        if name is None:
            raise EncoderLoadError(f"{path}: tensor {t.name} is not part of BERT as this runtime reads it")
        # gguf-py dequantizes any block format to float32, shaped as PyTorch's [out, in]
        weights[name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    pooling = GGUF_POOLING.get(meta.get("bert.pooling_type", 1))
    if pooling is None:
        raise EncoderLoadError(f"{path}: pooling type {meta.get('bert.pooling_type')} (served: mean, cls, last, rank)")
    tokenizer = tokenizer_from_bert_gguf(meta)
    word = weights["embeddings.word_embeddings.weight"]
    positions = meta["bert.context_length"]
    config = BertConfig(
        name=meta.get("general.name") or path.stem, vocab_size=word.shape[0], hidden_size=meta["bert.embedding_length"],
        num_layers=meta["bert.block_count"], num_heads=meta["bert.attention.head_count"],
        intermediate_size=meta["bert.feed_forward_length"], max_position_embeddings=positions,
        type_vocab_size=meta.get("tokenizer.ggml.token_type_count", 2),
        layer_norm_eps=float(meta.get("bert.attention.layer_norm_epsilon", 1e-12)), hidden_act="gelu",
        max_model_len=positions, pooling=Pooling(pooling, normalize=pooling != "score"),
        sep_token_id=meta.get("tokenizer.ggml.seperator_token_id"))
    _check(config, path)
    return EncoderCheckpoint(config, weights, tokenizer, path)


def tokenizer_from_bert_gguf(meta: dict) -> TextTokenizer:
    """The WordPiece tokenizer a bert GGUF describes. llama.cpp's converter writes the vocabulary in
    "phantom space" form (a word's first piece "▁word", a continuation "ing" for "##ing", control
    tokens as they are); read back, it is BERT's: lowercased where the file says, split on whitespace
    and punctuation, [CLS] A [SEP] (B [SEP]) around the pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "bert":
        raise EncoderLoadError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not bert (WordPiece)")
    control = 3  # llama.cpp's token type CONTROL
    vocab = {}
    for i, (tok, kind) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])):
        piece = tok if kind == control else tok[1:] if tok.startswith("\u2581") else "##" + tok
        vocab.setdefault(piece, i)
    tokens = meta["tokenizer.ggml.tokens"]
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 100)]
    cls_id, sep_id = meta.get("tokenizer.ggml.bos_token_id", 101), meta.get("tokenizer.ggml.seperator_token_id", 102)
    cls, sep = tokens[cls_id], tokens[sep_id]
    backend = Tokenizer(models.WordPiece(vocab, unk_token=unk.removeprefix("\u2581")))
    backend.normalizer = normalizers.BertNormalizer(lowercase=bool(meta.get("tokenizer.ggml.normalizer.lowercase",
                                                                              True)))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, cls_id), (sep, sep_id)])
    backend.decoder = decoders.WordPiece()
    specials = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == control]
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return TextTokenizer(backend)


# ---- the model --------------------------------------------------------------------------------------------
def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b over a row count padded to ROW_MULTIPLE: each row's bits do not depend on the batch."""
    n = x.shape[0]
    pad = -n % ROW_MULTIPLE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    y = F.linear(x, w, b)
    return y[:n] if pad else y


class BertEncoder:
    """BERT's encoder over packed sequences, its output pooled as the checkpoint's `Pooling` says.

    Args:
        checkpoint: its weights are taken (the checkpoint's dict is emptied of them).
    """

    def __init__(self, checkpoint: EncoderCheckpoint):
        cfg = self.config = checkpoint.config
        w = checkpoint.weights
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.word = w.pop("embeddings.word_embeddings.weight")
        self.position = w.pop("embeddings.position_embeddings.weight")
        self.token_type = w.pop("embeddings.token_type_embeddings.weight")
        self.embed_norm = (w.pop("embeddings.LayerNorm.weight"), w.pop("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            attn = p + "attention.self."
            qkv_w = torch.cat([w.pop(attn + n + ".weight") for n in ("query", "key", "value")])
            qkv_b = torch.cat([w.pop(attn + n + ".bias") for n in ("query", "key", "value")])
            names = ["attention.output.dense", "attention.output.LayerNorm", "intermediate.dense", "output.dense",
                     "output.LayerNorm"]
            self.layers.append((qkv_w, qkv_b, *[(w.pop(p + n + ".weight"), w.pop(p + n + ".bias")) for n in names]))
        self.pooler = self.classifier = None
        if cfg.pooling.kind == "score":
            if "pooler.dense.weight" not in w:
                raise EncoderLoadError(f"{cfg.name}: a sequence classifier without its pooler")
            self.pooler = (w.pop("pooler.dense.weight"), w.pop("pooler.dense.bias"))
            self.classifier = (w.pop("classifier.weight"), w.pop("classifier.bias"))

    def tensors(self) -> list[torch.Tensor]:
        """Every weight, once."""
        flat = [self.word, self.position, self.token_type, *self.embed_norm]
        for qkv_w, qkv_b, *pairs in self.layers:
            flat += [qkv_w, qkv_b, *(t for pair in pairs for t in pair)]
        for pair in (self.pooler, self.classifier):
            flat += list(pair or ())
        return flat

    def to(self, device: torch.device) -> None:
        move = lambda pair: None if pair is None else tuple(t.to(device) for t in pair)  # noqa: E731
        self.word, self.position, self.token_type = (t.to(device) for t in (self.word, self.position, self.token_type))
        self.embed_norm, self.pooler, self.classifier = move(self.embed_norm), move(self.pooler), move(self.classifier)
        self.layers = [(w.to(device), b.to(device), *map(move, pairs)) for w, b, *pairs in self.layers]

    @property
    def embedding_size(self) -> int:
        return 1 if self.config.pooling.kind == "score" else self.config.hidden_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """Args: input_ids, token_type_ids, positions [T], the sequences packed one after another, of
        `lengths` (sum T). Returns the last hidden states [T, hidden]."""
        cfg = self.config
        eps, heads, dim = cfg.layer_norm_eps, cfg.num_heads, cfg.head_dim
        # every row of the forward padded once to ROW_MULTIPLE (rows of token 0 at position 0, attended
        # by none and read by none), so that each matmul runs over it as it is
        pad = -input_ids.shape[0] % ROW_MULTIPLE
        if pad:
            input_ids, token_type_ids, positions = (F.pad(t, (0, pad)) for t in (input_ids, token_type_ids, positions))
        x = self.word[input_ids] + self.token_type[token_type_ids] + self.position[positions]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.embed_norm, eps)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        threads = torch.get_num_threads()
        for qkv_w, qkv_b, out, norm1, up, down, norm2 in self.layers:
            qkv = _linear(x, qkv_w, qkv_b)  # [T, 3 * hidden]
            ctx = torch.zeros_like(x)
            # attention within each sequence, none across, on one thread: a sequence's attention is too
            # small to share (32 texts of ~75 tokens, 2 threads on a loaded 2-core box: the forward took
            # 4.1-7.7 s so against 6.5-9.5 s threaded, the same bits); the matmuls keep every thread
            torch.set_num_threads(1)
            try:
                for a, b in zip(starts, starts[1:]):
                    # [3, 1, heads, L, dim]: four dimensions, so PyTorch takes its fused (flash) CPU kernel
                    q, k, v = qkv[a:b].view(1, b - a, 3, heads, dim).permute(2, 0, 3, 1, 4)
                    ctx[a:b] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(b - a, -1)
            finally:
                torch.set_num_threads(threads)
            x = F.layer_norm(x + _linear(ctx, *out), (cfg.hidden_size,), *norm1, eps)
            h = self.act(_linear(x, *up))
            x = F.layer_norm(x + _linear(h, *down), (cfg.hidden_size,), *norm2, eps)
        return x[: x.shape[0] - pad]

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[T, hidden] -> one vector per sequence [B, embedding_size]: its embedding, or its score."""
        kind = self.config.pooling.kind
        rows, a = [], 0
        for n in lengths:
            seq = hidden[a : a + n]
            rows.append(seq.mean(0) if kind == "mean" else seq[-1] if kind == "last" else seq[0])
            a += n
        pooled = torch.stack(rows)
        if kind == "score":  # BertForSequenceClassification: tanh(pooler(CLS)) -> one logit -> sigmoid
            return torch.sigmoid(_linear(torch.tanh(_linear(pooled, *self.pooler)), *self.classifier))
        return F.normalize(pooled, dim=-1) if self.config.pooling.normalize else pooled
