"""Kernel choices: exact Q4 unpacking, the packed int4 matmul, plan caching, and the quality guard."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from stratum.kernels import plan as kernels
from stratum.kernels.quant import Int4Weight, dequantize_q4, unpack_q4
from stratum.models.config import ModelConfig


def _q4_1_rows(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_1 rows in llama.cpp's block layout, and their values computed independently."""
    blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (n, k // 32)).astype(np.float16)
    m = rng.uniform(-0.2, 0.0, (n, k // 32)).astype(np.float16)
    q = rng.integers(0, 16, (n, k // 32, 32))
    blocks[..., 0:2] = d[..., None].view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 2:4] = m[..., None].view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 4:] = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    values = q * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
    return blocks.reshape(n, -1), values.reshape(n, k)


def test_unpack_q4_1_is_exact():
    raw, values = _q4_1_rows(np.random.default_rng(0), 8, 64)
    q, scale, zero = unpack_q4("Q4_1", raw, (8, 64))
    assert torch.equal(dequantize_q4(q, scale, zero), torch.from_numpy(values.astype(np.float32)))


def test_int4_matmul_matches_dequantized_weights():
    raw, values = _q4_1_rows(np.random.default_rng(1), 64, 128)
    q, scale, zero = unpack_q4("Q4_1", raw, (64, 128))
    w = Int4Weight(q, scale, zero)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    ref = x.bfloat16().float() @ torch.from_numpy(values.astype(np.float32)).T
    got = w.matmul(x.bfloat16()).float()
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max().item(), rtol=0)


@pytest.mark.integration
def test_unpack_matches_gguf_dequantize(real_model_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(real_model_path))
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    shape = tuple(int(x) for x in reversed(tensor.shape))
    q, scale, zero = unpack_q4("Q4_1", np.array(tensor.data), shape)
    ref = dequantize(tensor.data, GGMLQuantizationType.Q4_1).reshape(shape)
    assert np.array_equal(dequantize_q4(q, scale, zero).numpy(), ref)


SMALL = kernels.Shapes({"gate_up": (256, 64), "down": (64, 128)}, (512, 64))
SMOLLM2 = kernels.Shapes.of(ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64))


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATUM_PLAN_DIR", str(tmp_path / "plans"))
    return tmp_path / "plans"


def test_plan_is_measured_once_then_cached(tmp_path, plan_dir):
    first = kernels.select_plan(tmp_path, SMALL, 1, can_pack=True)
    assert first.source == "measured" and first.dtype in ("float32", "bfloat16") and first.runs >= 1
    assert set(first.timings_us) >= {"dense_float32", "dense_bfloat16", "int4_bfloat16", "head_float32", "head_bfloat16"}
    assert all(t > 0 for v in first.timings_us.values() for t in v.values())
    files = list(plan_dir.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["dtype"] == first.dtype
    second = kernels.select_plan(tmp_path, SMALL, 1, can_pack=True)
    if first.quiet:
        assert second.source == "cache" and second.decision == first.decision
    third = kernels.select_plan(tmp_path, SMALL, 1, can_pack=True, remeasure=True)
    assert third.source == "measured"


def test_plan_without_packable_weights_never_packs(tmp_path, plan_dir):
    plan = kernels.select_plan(tmp_path, SMALL, 1, can_pack=False, dtype="bfloat16")
    assert plan.int4_max_tokens == 0 and "int4_bfloat16" not in plan.timings_us


def test_plan_key_covers_what_changes_the_answer(tmp_path, plan_dir):
    paths = {kernels.plan_cache_path(tmp_path, SMALL, 1, "auto", True),
             kernels.plan_cache_path(tmp_path, SMALL, 2, "auto", True),
             kernels.plan_cache_path(tmp_path, SMOLLM2, 1, "auto", True),
             kernels.plan_cache_path(tmp_path, SMALL, 1, "bfloat16", True),
             kernels.plan_cache_path(tmp_path, SMALL, 1, "auto", False)}
    assert len(paths) == 5


def test_plan_times_the_native_step_on_the_files_own_formats(tmp_path, plan_dir):
    """A Q4_K_M file's layers (Q4_K, with Q6_K for attn_v and ffn_down in some layers) are timed as
    they are stored, segment by segment, each layout weighted by its layers; not as stand-in Q4_1.
    The formats key the cached plan."""
    from stratum.kernels import native
    from stratum.kernels.packed import FORMATS, PACKED_QTYPES
    from stratum.models.loader import QuantizedTensor

    cfg = ModelConfig("qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    quantized = {f"model.layers.{i}.{p}.weight": QuantizedTensor("Q6_K" if i == 0 and p in ("self_attn.v_proj", "mlp.down_proj")
                                                                 else "Q4_K", np.zeros((n, 1), np.uint8), (n, k))
                 for i in range(2) for p, (n, k) in shapes.items()}
    quantized["model.embed_tokens.weight"] = QuantizedTensor("Q6_K", np.zeros((512, 1), np.uint8), (512, 256))
    q4km = kernels.Shapes.of(cfg, quantized)
    assert q4km.segments("qkv") == {(("Q4_K", 384), ("Q6_K", 128)): 1, (("Q4_K", 512),): 1}
    assert q4km.segments("down") == {(("Q6_K", 256),): 1, (("Q4_K", 256),): 1}
    assert q4km.segments("o") == {(("Q4_K", 256),): 2} and q4km.head_format == "Q6_K"
    assert kernels.Shapes.of(cfg).segments("o") == {((kernels.STAND_IN, 256),): 1}  # no file: the stand-in
    assert kernels.plan_cache_path(tmp_path, q4km, 1, "auto", True) != kernels.plan_cache_path(
        tmp_path, kernels.Shapes.of(cfg), 1, "auto", True)
    if not native.available():
        return
    g = torch.Generator().manual_seed(0)
    for qtype in PACKED_QTYPES:  # each stand-in is in its own format, with finite weights
        w = kernels.stand_in(qtype, 32, 256, g)
        assert w.format == FORMATS[qtype] and torch.isfinite(w.matmul(torch.randn(2, 256, generator=g))).all(), qtype
    plan = kernels.measure_plan(q4km, 1, can_pack=True, max_runs=1)
    assert set(plan.timings_us["packed"]) == set(kernels.BATCH_SIZES) and plan.timings_us["head_packed"]


def test_decisions_need_a_margin():
    """A near tie goes to the plain kernel however the noise falls."""
    t = {"dense_float32": {m: 100.0 for m in kernels.BATCH_SIZES},
         "dense_bfloat16": {m: 98.0 for m in kernels.BATCH_SIZES},  # 2% faster: not enough
         "int4_bfloat16": {m: 50.0 for m in kernels.BATCH_SIZES}}
    assert kernels.decide(t) == ("float32", 0, 0, False)
    t["dense_bfloat16"] = {m: 80.0 for m in kernels.BATCH_SIZES}
    t["head_bfloat16"] = {m: 100.0 for m in kernels.HEAD_BATCH_SIZES}
    t["head_q8"] = {1: 60.0, 2: 97.0, 4: 200.0, 8: 400.0, 16: 800.0}
    assert kernels.decide(t) == ("bfloat16", 128, 1, False)
    t["packed"] = {1: 48.0}  # the native step against the fastest PyTorch layer at one row (int4, 50)
    assert kernels.decide(t)[3] is False
    t["packed"] = {1: 40.0}
    assert kernels.decide(t)[3] is True
    assert not kernels.is_plausible({"x": {1: 100.0, 2: 40.0}}) and kernels.is_plausible({"x": {1: 100.0, 2: 70.0}})


@contextlib.contextmanager
def busy_core():
    """Another process spinning on a core while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def test_a_plan_measured_on_a_busy_machine_is_measured_again(tmp_path, plan_dir, monkeypatch):
    """The default model's shapes, one thread, with another core kept busy: the plan knows it was
    disturbed, and the next starts measure it again (merging the figures) until one is quiet, or up
    to MAX_REMEASURES starts; then the cached plan is used. On a machine quiet enough for both, the
    merged plan decides as a quiet measurement does.

    Needs no idle machine: other load only makes the first plan busier, and the later starts are
    checked for what they must do either way."""
    with busy_core():
        busy = kernels.select_plan(tmp_path, SMOLLM2, 1, can_pack=True)
    assert min(busy.other_load) > kernels.BUSY_CORES and not busy.quiet, busy.other_load
    plan = busy
    for start in range(1, kernels.MAX_REMEASURES + 1):  # later starts
        plan = kernels.select_plan(tmp_path, SMOLLM2, 1, can_pack=True)
        assert plan.source == "measured" and plan.remeasured == start
        assert plan.runs > busy.runs and len(plan.other_load) == plan.runs  # the runs of every start, merged
        if plan.quiet:
            break
    cached = kernels.select_plan(tmp_path, SMOLLM2, 1, can_pack=True)
    assert cached.source == "cache" and cached.remeasured == plan.remeasured  # measured no more
    if plan.quiet:
        quiet = kernels.measure_plan(SMOLLM2, 1, can_pack=True)
        if quiet.quiet:
            # Each choice is one the quiet figures make at a margin within 15 points of ours: two quiet
            # measurements differ by noise only where a candidate is within that of the margin (seen:
            # the Q8_0 head's 1 or 2 rows, apart by more than 5 points on a CI machine), while busy
            # runs skewing the merge move figures by 2x and more.
            choices = [set() for _ in plan.decision]
            for margin in np.linspace(kernels.MARGIN - 0.15, min(kernels.MARGIN + 0.15, 1.0), 21):
                monkeypatch.setattr(kernels, "MARGIN", float(margin))
                for chosen, value in zip(choices, kernels.decide(quiet.timings_us)):
                    chosen.add(value)
            assert all(v in c for v, c in zip(plan.decision, choices)), (plan.decision, choices, plan.timings_us,
                                                                         quiet.timings_us)


QUALITY_CORPUS = [
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise "
    "until it doubles in size, shape the loaf, let it rise again and bake it in a hot oven until the crust is brown.",
    "Machine learning models learn patterns from data. A language model predicts the next token given the previous "
    "ones, and a serving runtime batches many such predictions together so that the hardware stays busy while each "
    "user still sees tokens arrive quickly.",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal "
    "type with an oil-based ink and a wooden press adapted from those used to make wine, changing how books were made.",
    "The capital of Japan is Tokyo. The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint(",
    "Once upon a time, in a small village at the foot of the mountains, there lived an old baker who",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to",
    "To install the package, run pip install and then import it in your script. The first step is",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the boiling point is",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the alphabet and",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission,",
]


@pytest.mark.integration
def test_quality_guard_int4_agrees_with_fp32_reference(real_model_path):
    """The packed path (int4 projections, bf16 activations, the Q8_0 output projection as stored)
    against the dequantized fp32 model, position by position: the issue's goal is >= 99% top-1.

    Measured: 99.1% (325 positions) on AMD Zen 5; on an Intel AVX-512 machine 98.8%, and 99.4% once
    the embedding was looked up from the Q8_0 table as stored instead of a bf16 copy. With a bf16
    copy of the output projection it was 97.7-98.2%: bf16 rounding of the Q8_0 weights and of the
    logits flips near-tied tokens (the 4 flips seen had top-2 gaps of 0.004-0.06).

    The native step (int16 activations on the Q4_1 blocks, the Q8_0 head, bf16 KV): 325 of 325 on
    the Intel machine; with int8 activations, as llama.cpp quantizes them, it was 97.5%.
    """
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)

    def top1(**config) -> list[int]:
        llm = LLM(str(real_model_path), num_kv_blocks=256, enable_prefix_cache=False, **config)
        ids = [llm.engine.tokenizer.encode(p) for p in QUALITY_CORPUS]
        seqs = [llm.engine.add_request(x, params, request_id=f"q{i}") for i, x in enumerate(ids)]
        while llm.engine.has_unfinished():
            llm.engine.step()
        return [int(s.logits[p].argmax()) for s in seqs for p in sorted(s.logits)]

    reference = top1(dtype="float32", int4_max_tokens=0, native_step=False)
    for config in (dict(dtype="bfloat16", int4_max_tokens=1 << 20, native_step=False),  # every matmul on int4
                   dict(dtype="bfloat16", int4_max_tokens=0, native_step=True)):  # the native step, bf16 KV
        packed = top1(**config)
        assert len(reference) == len(packed) >= 300
        agreement = sum(a == b for a, b in zip(reference, packed)) / len(reference)
        assert agreement >= 0.99, f"{config}: top-1 agreement {agreement:.4f} < 0.99 over {len(reference)} positions"


def test_low_latency_requests_sample_from_the_int8_output_projection(tiny_model_dir):
    """Only a request that asked for latency over accuracy gets the lossy int8 logits."""
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="bfloat16", int4_max_tokens=0, num_threads=1)
    engine = llm.engine
    assert engine.kernel_choices["low_latency_lm_head"] == "int8"
    ids = engine.tokenizer.encode("The capital of Japan is Tokyo.")
    params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    normal = engine.add_request(ids, params, request_id="normal")
    fast = engine.add_request(ids, params, request_id="fast", low_latency=True)
    while engine.has_unfinished():
        engine.step()
    last = len(ids) - 1
    a, b = normal.logits[last], fast.logits[last]
    assert not torch.equal(a, b)  # a different kernel really ran
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
    for pos in range(last):  # positions that only record logits use the normal projection
        assert torch.equal(normal.logits[pos], fast.logits[pos])


def test_pull_prepares_the_kernels_and_the_plan_that_serve_then_loads(tmp_path, monkeypatch, capsys):
    """`stratum pull` builds the native kernels, measures the plan and repacks the weights, so the
    first `serve` only loads them: a second preparation finds the plan cached."""
    from stratum.cli import prepare
    from stratum.kernels import native
    from tests.factories import make_tiny_gguf

    monkeypatch.setenv("STRATUM_PLAN_DIR", str(tmp_path / "plans"))
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    prepare(str(model))
    first = capsys.readouterr().out
    prepare(str(model))
    second = capsys.readouterr().out
    assert "kernel plan (measured)" in first and f"kernels {native.status()}" in first and "ready to serve" in first
    plans = [json.loads(p.read_text()) for p in (tmp_path / "plans").glob("*.json")]  # one per thread count weighed
    assert plans
    if all(p["quiet"] for p in plans):  # a plan measured on a busy machine is measured again, by design
        assert "kernel plan (cache)" in second, second


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_build_killed_midway_does_not_hang_the_next():
    """torch's build guard is a `lock` file, which a build killed midway (a timeout, kill -9) leaves
    behind; every later load of the kernels then waited on it forever. Such a file is now cleared
    under a lock the kernel releases with its holder."""
    if os.environ.get("STRATUM_NATIVE", "1") == "0":
        pytest.skip("native kernels disabled")
    script = ("from stratum.kernels import native\n"
              "d = native.build_dir(native.stratum_home(), native.STEP)\n"
              "d.mkdir(parents=True, exist_ok=True)\n"
              "(d / 'lock').touch()\n"  # what a killed build leaves
              "native.build(native.STEP, d)\n"
              "assert not (d / 'lock').exists()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_finished_build_loads_without_the_build_tooling():
    """A warm start loads the libraries as they are: torch's build tooling (setuptools, ninja's check)
    cost 0.13 s only to find a finished build current."""
    if os.environ.get("STRATUM_NATIVE", "1") == "0":
        pytest.skip("native kernels disabled")
    script = ("import sys\nfrom stratum.kernels import native\nassert native.available(), native.status()\n"
              "print('torch.utils.cpp_extension' in sys.modules)\n")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.strip() == "False"  # the first may have built them; the second only loads

