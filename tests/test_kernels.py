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

from stratum.kernels import PlanSource
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


SMALL = kernels.Shapes({"gate_up": (256, 64), "down": (64, 128)})
SMOLLM2 = kernels.Shapes.of(ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64))


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATUM_PLAN_DIR", str(tmp_path / "plans"))
    return tmp_path / "plans"


def _native():
    from stratum.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.status()}")


def test_plan_is_measured_once_then_cached_busy_or_not(tmp_path, plan_dir, monkeypatch):
    """Measured at the first call and cached, quiet or not; later calls read the cache and never
    measure again; `remeasure` does."""
    _native()
    first = kernels.select_plan(tmp_path, SMALL, 2)
    assert first.source in (PlanSource.MEASURED, PlanSource.DEFAULTS) and first.runs >= 1 and first.threads in (1, 2)
    assert set(first.timings_us) == {"native_1_threads", "native_2_threads"}
    assert all(t > 0 for v in first.timings_us.values() for t in v.values())
    files = list(plan_dir.glob("*.json"))
    written = json.loads(files[0].read_text())
    assert len(files) == 1 and written["threads"] == first.threads and written["source"] == first.source.value
    monkeypatch.setattr(kernels, "measure_plan", lambda *a, **k: pytest.fail("measured again at a later start"))
    second = kernels.select_plan(tmp_path, SMALL, 2)
    assert second.source is PlanSource.CACHE and second.threads == first.threads and second.quiet == first.quiet
    monkeypatch.undo()
    third = kernels.select_plan(tmp_path, SMALL, 2, remeasure=True)
    assert third.source in (PlanSource.MEASURED, PlanSource.DEFAULTS)


def test_the_plan_cache_reads_files_written_before(tmp_path, plan_dir):
    """A cached plan is plain JSON, its source a string: files written by earlier versions read back."""
    path = kernels.plan_cache_path(tmp_path, SMALL, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": "cpu", "threads": 1, "cpu": "x",
                                "timings_us": {"native_1_threads": {"1": 5.0}},
                                "source": "measured", "quiet": True, "runs": 2, "other_load": [0.0, 0.1],
                                "basis": "measured: 2 quiet runs of 2"}))
    plan = kernels.select_plan(tmp_path, SMALL, 2, measure=False)
    assert plan.source is PlanSource.CACHE and plan.threads == 1 and plan.timings_us == {"native_1_threads": {1: 5.0}}
    assert plan.describe()["source"] == "cache" and type(plan.describe()["source"]) is str


def test_without_a_measurement_the_plan_is_the_families_defaults(tmp_path, plan_dir):
    plan = kernels.select_plan(tmp_path, SMALL, 2, measure=False)
    assert plan.source is PlanSource.DEFAULTS and plan.threads == 2 and "not measured yet" in plan.basis
    assert not list(plan_dir.glob("*.json"))  # nothing cached: the next start that may measure does


def test_plan_key_covers_what_makes_a_measurement_stale(tmp_path, plan_dir):
    paths = {kernels.plan_cache_path(tmp_path, SMALL, 1), kernels.plan_cache_path(tmp_path, SMALL, 2),
             kernels.plan_cache_path(tmp_path, SMOLLM2, 1)}
    assert len(paths) == 3


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
    quantized = {f"model.layers.{i}.{p}.weight":
                 QuantizedTensor("Q6_K" if i == 0 and p in ("self_attn.v_proj", "mlp.down_proj") else "Q4_K",
                                 np.zeros((n, 1), np.uint8), (n, k))
                 for i in range(2) for p, (n, k) in shapes.items()}
    q4km = kernels.Shapes.of(cfg, quantized)
    assert q4km.segments("qkv") == {(("Q4_K", 384), ("Q6_K", 128)): 1, (("Q4_K", 512),): 1}
    assert q4km.segments("down") == {(("Q6_K", 256),): 1, (("Q4_K", 256),): 1}
    assert q4km.segments("o") == {(("Q4_K", 256),): 2}
    assert kernels.Shapes.of(cfg).segments("o") == {((kernels.STAND_IN, 256),): 1}  # no file: the stand-in
    assert kernels.plan_cache_path(tmp_path, q4km, 1) != kernels.plan_cache_path(tmp_path, kernels.Shapes.of(cfg), 1)
    if not native.available():
        return
    g = torch.Generator().manual_seed(0)
    for qtype in PACKED_QTYPES:  # each stand-in is in its own format, with finite weights
        w = kernels.stand_in(qtype, 32, 256, g)
        assert w.format == FORMATS[qtype] and torch.isfinite(w.matmul(torch.randn(2, 256, generator=g))).all(), qtype
    plan = kernels.measure_plan(q4km, 2, max_runs=1, budget_s=600)  # what is timed, however busy the machine
    assert {name: set(v) for name, v in plan.timings_us.items()} == {
        f"native_{t}_threads": set(kernels.ROWS) for t in (1, 2)}


def test_the_thread_count_needs_a_margin():
    """A near tie goes to the default (every core) however the noise falls."""
    t = {"native_1_threads": {1: 98.0, 16: 980.0}, "native_2_threads": {1: 100.0, 16: 1000.0}}  # 2% faster: not enough
    assert kernels.choose_threads(t, 2) == 2
    t["native_1_threads"] = {1: 80.0, 16: 800.0}
    assert kernels.choose_threads(t, 2) == 1
    assert kernels.thread_counts(6) == [1, 2, 4, 6] and kernels.thread_counts(1) == [1]


@contextlib.contextmanager
def busy_cores(n: int = 1):
    """Other processes spinning on n cores while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.3)
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_plan_measured_on_a_busy_machine_holds_the_defaults_and_is_not_measured_again(tmp_path, plan_dir,
                                                                                        monkeypatch):
    """The default model's shapes, with another core kept busy: the plan knows it was disturbed, holds
    the CPU family's defaults and says so; the next starts take it from the cache as it is."""
    _native()
    with busy_cores():
        busy = kernels.select_plan(tmp_path, SMOLLM2, 1)
    assert min(busy.other_load) > kernels.BUSY_CORES and not busy.quiet, busy.other_load
    assert busy.source is PlanSource.DEFAULTS and busy.threads == 1 and busy.basis.startswith("defaults for ")
    assert busy.other_load and busy.runs <= kernels.MAX_RUNS  # the loads that were not trusted, kept to show why
    monkeypatch.setattr(kernels, "measure_plan", lambda *a, **k: pytest.fail("measured again at a later start"))
    for _ in range(3):
        cached = kernels.select_plan(tmp_path, SMOLLM2, 1)
        assert cached.source is PlanSource.CACHE and cached.describe() == {**busy.describe(), "source": "cache"}


def test_a_measurement_never_runs_past_its_budget(tmp_path, plan_dir):
    """A start never waits on the plan: a measurement out of time (here a budget of 0 s: cut after its
    first call, as a busy machine's would be after MAX_SECONDS) holds the CPU family's defaults, says
    why, and is cached as such."""
    _native()
    plan = kernels.measure_plan(SMOLLM2, 2, budget_s=0.0)
    assert plan.source is PlanSource.DEFAULTS and plan.threads == 2 and not plan.quiet
    assert plan.runs == 0 and len(plan.other_load) == 1 and "ran past its 0 s" in plan.basis, plan.basis


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
    against the dequantized fp32 model, position by position: the goal is >= 99% top-1.

    Measured: 99.1% (325 positions) on AMD Zen 5; on an Intel AVX-512 machine 98.8%, and 99.4% once
    the embedding was looked up from the Q8_0 table as stored instead of a bf16 copy. With a bf16
    copy of the output projection it was 97.7-98.2%: bf16 rounding of the Q8_0 weights and of the
    logits flips near-tied tokens (the 4 flips seen had top-2 gaps of 0.004-0.06).

    The native step (int16 activations on the Q4_1 blocks, the Q8_0 head, bf16 KV): 325 of 325 on
    the Intel machine; with int8 activations, as llama.cpp quantizes them, it was 97.5%. The rule's
    default (the native step, fp32 KV) is held to the same bound. `--activations int8`, the user's
    trade of that agreement for speed, is held to 95%: measured 316 of 325 (97.2%) on a Zen 3 (AVX2,
    vpmaddubsw), which every SIMD family computes to the same bits (tests/test_step_driver.py).
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
        return [int(s.readouts.logits[p].argmax()) for s in seqs for p in sorted(s.readouts.logits)]

    reference = top1(dtype="float32", int4_max_tokens=0, native_step=False)
    for config in (dict(dtype="bfloat16", int4_max_tokens=1 << 20, native_step=False),  # every matmul on int4
                   dict(dtype="bfloat16", int4_max_tokens=0, native_step=True),  # the native step, bf16 KV
                   dict()):  # the numerics rule's default: the native step, fp32 KV
        packed = top1(**config)
        assert len(reference) == len(packed) >= 300
        agreement = sum(a == b for a, b in zip(reference, packed)) / len(reference)
        assert agreement >= 0.99, f"{config}: top-1 agreement {agreement:.4f} < 0.99 over {len(reference)} positions"
    int8 = top1(activations="int8")
    agreement = sum(a == b for a, b in zip(reference, int8)) / len(reference)
    assert len(int8) == len(reference) and agreement >= 0.95, (
        f"int8 activations: top-1 agreement {agreement:.4f} < 0.95")


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
    a, b = normal.readouts.logits[last], fast.readouts.logits[last]
    assert not torch.equal(a, b)  # a different kernel really ran
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
    for pos in range(last):  # positions that only record logits use the normal projection
        assert torch.equal(normal.readouts.logits[pos], fast.readouts.logits[pos])


def test_pull_prepares_the_kernels_and_the_plan_that_serve_then_loads(tmp_path, monkeypatch, capsys):
    """`stratum pull` builds the native kernels, measures the plan and repacks the weights, so the
    first `serve` only loads them: a second preparation finds the plan cached, however busy the
    machine was at the first."""
    from stratum.cli import prepare
    from stratum.kernels import native
    from tests.factories import make_tiny_gguf

    monkeypatch.setenv("STRATUM_PLAN_DIR", str(tmp_path / "plans"))
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    prepare(str(model))
    first = capsys.readouterr().out
    prepare(str(model))
    second = capsys.readouterr().out
    if native.available():
        assert "native step" in first and ("kernel plan (measured)" in first
                                           or "kernel plan (defaults)" in first), first
        assert len(list((tmp_path / "plans").glob("*.json"))) == 1
        assert "kernel plan (cache)" in second, second  # measured once, quietly or not
    assert f"kernels {native.status()}" in first and "ready to serve" in first


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
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.strip() == "False"  # the first may have built them; the second only loads



def test_roofline_pairs_each_round_of_steps_with_the_bandwidth_read_around_it(tmp_path):
    """`stratum bench roofline`'s paired figure: every round's ratio is the weights' bytes over the
    faster of the two reads around its steps, over the steps' median, and the request it decoded is
    run to its end."""
    from stratum.bench.roofline import decode_bytes, measure_paired
    from stratum.engine import EngineCore
    from stratum.engine.config import EngineConfig
    from tests.factories import make_tiny_gguf

    engine = EngineCore(EngineConfig(model=str(make_tiny_gguf(tmp_path / "tiny.gguf")), kv_disk_gb=0))
    weight_bytes = decode_bytes(engine)
    paired = measure_paired(engine, weight_bytes, rounds=3, steps=4, megabytes=16)
    ratios = paired["floor_over_step_by_round"]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)
    assert paired["floor_over_step_median"] == sorted(ratios)[1]
    assert weight_bytes > 0 and paired["read_gb_s_median"] > 0 and paired["decode_step_ms_median"] > 0
    assert not engine.has_unfinished()
