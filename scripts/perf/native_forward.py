"""The native step's forward on one checkout: a `context`-token prefill (best of PREFILLS, default 2) and 1-row
decodes at the context's last position (median). ROPE_SCALING=linear|yarn: a context beyond the trained one.
Usage: python scripts/perf/native_forward.py MODEL CONTEXT CALLS [int16|int8] [PREFILLS]"""
import os
import json
import statistics
import sys
import time

import torch

from stratum.engine import LLM
from stratum.layers.attention import AttentionMetadata

model_name, context, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
activations = sys.argv[4] if len(sys.argv) > 4 else "int16"
prefills = int(sys.argv[5]) if len(sys.argv) > 5 else 2
engine = LLM(model_name, native_step=True, dtype="float32", int4_max_tokens=0,
             num_kv_blocks=(prefills * context + 256) // 16 + 8,
             enable_prefix_cache=False, kv_disk_gb=0, activations=activations,
             **({"max_model_len": context, "rope_scaling": os.environ["ROPE_SCALING"]} if os.environ.get("ROPE_SCALING")
                else {})).engine
assert engine.kernel_choices["step"].startswith("native"), engine.kernel_choices
model, caches, bs = engine.model, engine.runner.kv_caches, engine.config.block_size
per_seq = (context + 128) // bs
tables = torch.arange(prefills * per_seq).view(prefills, per_seq)
g = torch.Generator().manual_seed(0)

def forward(rows):
    seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    ids = torch.randint(0, model.config.vocab_size, (len(rows),), generator=g)
    meta = AttentionMetadata(slot_mapping=tables[seq, pos // bs] * bs + pos % bs, block_size=bs, row_tables=tables,
                             row_seq=seq)
    t = time.perf_counter()
    with torch.inference_mode():
        model.forward(ids, pos, meta, caches)
    return time.perf_counter() - t

forward([(0, p) for p in range(16)])  # warm: weights read once
prefill = min(forward([(s, p) for p in range(context)]) for s in range(prefills))
decode = statistics.median(forward([(0, context - 1)]) for _ in range(calls))
print(json.dumps({"simd": torch.ops.stratum.packed_simd(), "activations": activations,
                  "threads": torch.get_num_threads(), "context": context,
                  "prefill_ms": round(prefill * 1e3, 1), "prefill_tok_s": round(context / prefill, 1),
                  "decode_1_ms": round(decode * 1e3, 2),
                  "kernel_choices": {k: str(v) for k, v in engine.kernel_choices.items()}}))
