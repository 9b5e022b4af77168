"""What a checkpoint is, in figures a client may be told (Ollama's `/api/show` and `/api/tags` read
them): its architecture and shape, its parameters counted from its tensors, its files' size and how
its weights are stored."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stratum.models.loader import Checkpoint

_DTYPE_NAMES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def model_facts(ck: Checkpoint) -> dict[str, Any]:
    """The checkpoint's facts, as plain data for `EngineInfo.model_facts`.

    num_parameters: every tensor's elements, counted once by name (a tied output projection is the
    embedding's, not a tensor of its own). quantization: the stored type holding the most parameters
    (Q8_0, Q4_K, BF16...). file_bytes, modified_at: the file's, or the folder's files', on disk.
    """
    c = ck.config
    by_type: Counter[str] = Counter()
    for name, t in ck.weights.items():
        if name not in ck.quantized:
            by_type[_DTYPE_NAMES.get(str(t.dtype), str(t.dtype))] += t.numel()
    for qt in ck.quantized.values():
        by_type[qt.qtype] += qt.shape[0] * qt.shape[1]
    path = Path(ck.path)
    try:  # (a checkpoint built in memory has no file)
        files = [p.stat() for p in path.iterdir() if p.is_file()] if path.is_dir() else [path.stat()]
    except OSError:
        files = []
    mtime = max((st.st_mtime for st in files), default=0.0)
    return {"architecture": c.architecture, "name": c.name,
            "format": "gguf" if path.suffix == ".gguf" else "safetensors", "num_parameters": sum(by_type.values()),
            "quantization": by_type.most_common(1)[0][0] if by_type else "unknown",
            "file_bytes": sum(st.st_size for st in files),
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_layers, "feed_forward_length": c.intermediate_size, "head_count": c.num_heads,
            "head_dim": c.head_dim, "head_count_kv": c.num_kv_heads, "vocab_size": c.vocab_size,
            "rope_freq_base": c.rope_theta, "layer_norm_rms_epsilon": c.rms_norm_eps}
