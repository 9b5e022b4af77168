"""The native step compiled once per instruction set this machine can execute (portable C++, AVX2,
AVX-VNNI, AVX-512 without VNNI, the native build) runs the same forward to the same bits, in every
weight format it takes (Q4_0/Q4_1, Q8_0, Q5_0/Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16, and mixes of them).

Each variant is its own library (-march=..., kernels/native.py) and registers the same op names, so
each runs in a process of its own: each tiny GGUF model prefills three prompts in one batch and
decodes them greedily, and every variant must give the same tokens and the same logits. The bound
on the logits is zero: the projections' integer sums are exact and every path scales and adds them
by the same fused multiply-adds in the same order (csrc/step/numerics.h). The builds are cached in
pytest's cache folder, so only the first run compiles (about 15 s of one core per variant, the variants
built side by side on every core).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from stratum.kernels.cpu import cpu_flags
from tests.conftest import home_with_kernels
from tests.factories import PACKED_MIXES, make_family_dir, make_tiny_gguf, write_family_gguf

# -march, the path its build must choose, and the CPU flags it needs
X86_VARIANTS = [
    ("x86-64-v2", "portable", set()),
    ("haswell", "avx2", {"avx2", "fma", "f16c", "bmi2"}),
    ("alderlake", "avx-vnni", {"avx2", "fma", "f16c", "avx_vnni", "gfni", "vaes"}),
    ("skylake-avx512", "avx512bw", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
]

SCRIPT = r"""
import sys, torch
from stratum.kernels import native
native.build(native.STEP, native.build_dir(native.stratum_home(), native.STEP))
from stratum.engine.builder import attach_packed
from stratum.layers.attention import AttentionMetadata
from stratum.models.llama import LlamaForCausalLM
from stratum.models.loader import load_checkpoint

results = {"simd": torch.ops.stratum.packed_simd()}
for path in sys.argv[2:]:
    torch.manual_seed(0)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    model = LlamaForCausalLM(cfg, max_positions=256)
    model.load_weights(dict(ckpt.weights), held=set(ckpt.quantized))
    model.eval()
    assert attach_packed(model, ckpt.quantized)  # the embedding too, looked up from its blocks
    bs, blocks = 16, 32
    caches = [(torch.zeros(blocks * bs, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(blocks * bs, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    lengths = [5, 17, 40]  # within a block, across one, across two
    seqs = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in lengths]
    tables = torch.tensor([[s * 4 + j for j in range(4)] for s in range(len(seqs))])
    logits = []

    def run(rows):  # rows: (sequence, position) per row; returns the logits of every row
        ids = torch.tensor([seqs[s][p] for s, p in rows])
        pos = torch.tensor([p for _, p in rows])
        seq = torch.tensor([s for s, _ in rows])
        slots = tables[seq, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(slot_mapping=slots, block_size=bs, row_tables=tables, row_seq=seq)
        return model.compute_logits(model.forward(ids, pos, meta, caches))

    out = run([(s, p) for s, n in enumerate(lengths) for p in range(n)])  # one prefill of all three
    logits.append(out)
    last = torch.cumsum(torch.tensor(lengths), 0) - 1
    for s in range(len(seqs)):
        seqs[s].append(int(out[last[s]].argmax()))
    for _ in range(6):  # greedy decode, the three rows in one batch
        out = run([(s, len(seqs[s]) - 1) for s in range(len(seqs))])
        logits.append(out)
        for s in range(len(seqs)):
            seqs[s].append(int(out[s].argmax()))
    results[path] = {"tokens": seqs, "logits": logits}
torch.save(results, sys.argv[1])
"""


def _variants() -> list[tuple[str, str | None]]:
    flags = cpu_flags()
    if platform.machine() in ("x86_64", "AMD64"):
        ok = [(m, path) for m, path, needs in X86_VARIANTS if needs <= flags]
    else:
        ok = []
    return ok + [("native", None)]


def _run_variant(march: str, home: Path, models: list[Path], out: Path) -> dict:
    env = {**os.environ, "STRATUM_HOME": str(home), "STRATUM_MARCH": march, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), *map(str, models)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"-march={march}: {proc.stderr[-3000:]}"
    return torch.load(out)


@pytest.mark.skipif(os.environ.get("STRATUM_NATIVE", "1") == "0" or shutil.which("c++") is None,
                    reason="native kernels disabled, or no C++ compiler")
def test_every_simd_path_gives_the_same_tokens_and_logits(tmp_path, request):
    cache = getattr(request.config, "cache", None)  # kept between runs, so only the first compiles
    home = Path(cache.mkdir("simd-path-builds")) if cache is not None else tmp_path / "builds"
    home_with_kernels(home)  # the native variant is the suite's own build: linked, not compiled again
    models = [make_tiny_gguf(tmp_path / "tiny.gguf", hidden=256)]  # Q4_1; head size 64, two query heads per KV head
    # every other format the step takes (tests/factories.py PACKED_MIXES), on a Llama 3 model whose
    # inputs are multiples of 256
    folder = make_family_dir(tmp_path / "llama", "llama", hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    models += [write_family_gguf(folder, tmp_path / f"{name.replace('/', '-')}.gguf", **mix)
               for name, mix in PACKED_MIXES.items()]
    variants = _variants()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one compiler per core
        runs = [pool.submit(_run_variant, march, home, models, tmp_path / f"{march}.pt") for march, _ in variants]
        results = {march: run.result() for (march, _), run in zip(variants, runs)}
    for march, expected in variants:
        if expected is not None:
            assert results[march]["simd"] == expected, f"-march={march} built the {results[march]['simd']} path"
    reference_march, reference = next(iter(results.items()))
    for march, r in results.items():
        for model in map(str, models):
            where = f"{Path(model).name}: {march} ({r['simd']}) vs {reference_march} ({reference['simd']})"
            assert r[model]["tokens"] == reference[model]["tokens"], where
            for step, (a, b) in enumerate(zip(r[model]["logits"], reference[model]["logits"])):
                diff = float((a - b).abs().max())
                assert diff == 0.0, f"{where}, step {step}: differs by {diff}"
