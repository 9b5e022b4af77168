"""The numerics rule (kernels/numerics.py): its result from its inputs alone, the record's key, and an
engine's numerics independent of what the kernel plan measured."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stratum.kernels import KernelPlan, PlanSource
from stratum.kernels import numerics as rule

Q4KM = ("Q4_K", "Q6_K")
INPUTS = rule.RuleInputs("cpu", "auto", None, None, Q4KM, None, True, ("avx2", "f16c", "fma"))


def test_a_quantized_file_runs_the_native_step_in_fp32():
    n = rule.choose_numerics(INPUTS, "file")
    assert (n.step, n.dtype, n.kv_dtype, n.low_latency_head) == ("native", "float32", "float32", None)
    assert dict(n.weights) == {"Q4_K": rule.AS_STORED, "Q6_K": rule.AS_STORED} and n.is_batch_invariant
    # the user's trade: KV only
    assert rule.choose_numerics(replace(INPUTS, dtype="bfloat16"), "file").kv_dtype == "bfloat16"


def test_the_pytorch_step_holds_blocks_as_stored_unless_told_otherwise():
    refused = replace(INPUTS, native_refusal="sliding-window attention")
    n = rule.choose_numerics(refused, "file")
    assert (n.step, n.dtype, n.attention) == ("pytorch", "float32", "native paged decode") and not n.is_batch_invariant
    assert set(dict(n.weights).values()) == {rule.PACKED}
    assert dict(rule.choose_numerics(replace(refused, int4_max_tokens=0), "file").weights) == {
        "Q4_K": "dense float32", "Q6_K": "dense float32"}  # the dequantized reference, when asked for
    asked = rule.choose_numerics(replace(refused, int4_max_tokens=64, dtype="bfloat16"), "file")
    assert dict(asked.weights) == {"Q4_K": rule.INT4, "Q6_K": rule.PACKED} and asked.low_latency_head == "int8"
    # no compiler: dense fp32, PyTorch attention
    bare = rule.choose_numerics(replace(refused, native_kernels=False), "file")
    assert set(dict(bare.weights).values()) == {"dense float32"} and bare.attention == "pytorch"


def test_the_rule_never_depends_on_anything_timed():
    """Whatever the plan measured, the same inputs give the same record and key; every field moves the key."""
    a, b = rule.choose_numerics(INPUTS, "file"), rule.choose_numerics(INPUTS, "file")
    assert a == b and a.key() == b.key() and len(a.key()) == 32
    for change in (dict(model="other"), dict(kv_dtype="bfloat16"), dict(step="pytorch"), dict(platform="torch x"),
                   dict(activations="int8"),
                   dict(version=a.version + 1), dict(weights=(("Q4_K", rule.INT4),))):
        assert replace(a, **change).key() != a.key(), change
    assert rule.Numerics.from_dict(a.describe()) == a


def test_int8_activations_are_the_users_choice_and_only_the_native_steps():
    """--activations int8 quantizes the native step's activation blocks as llama.cpp does: never the
    rule's default, a numerics of its own (its own key: KV saved under int16 is never read under int8),
    and refused with the reason where the start would run the PyTorch step."""
    default, asked = (rule.choose_numerics(INPUTS, "file"),
                      rule.choose_numerics(replace(INPUTS, activations="int8"), "file"))
    assert default.activations == "int16" and asked.activations == "int8" and asked.step == "native"
    assert asked.key() != default.key() and rule.Numerics.from_dict(asked.describe()) == asked
    for inputs, why in ((replace(INPUTS, device="cuda"), "on cuda"), (replace(INPUTS, native_step=False), "turned off"),
                        (replace(INPUTS, native_refusal="sliding-window attention"), "sliding-window attention"),
                        (replace(INPUTS, native_kernels=False), "not built")):
        with pytest.raises(ValueError, match=why):
            rule.choose_numerics(replace(inputs, activations="int8"), "file")
    with pytest.raises(ValueError, match="int16, int8"):
        rule.choose_numerics(replace(INPUTS, activations="int4"), "file")
    # a cold start's provisional step refuses what the native step it switches to would
    with pytest.raises(ValueError, match="sliding-window"):
        rule.provisional(replace(INPUTS, activations="int8", native_kernels=False, native_refusal="sliding-window"),
                         "file")
    assert rule.provisional(replace(INPUTS, activations="int8", native_kernels=False), "file").step == "pytorch"


def test_dense_files_cuda_and_the_provisional_step():
    # F32: nothing stored packed
    assert rule.choose_numerics(replace(INPUTS, tensor_types=()), "file").step == "pytorch"
    cuda = rule.choose_numerics(replace(INPUTS, device="cuda"), "file")
    assert (cuda.step, cuda.dtype) == ("pytorch", "bfloat16")
    p = rule.provisional(replace(INPUTS, tensor_types=("Q4_0", "Q8_0")), "file")
    assert (dict(p.weights) == {"Q4_0": rule.INT4, "Q8_0": "dense bfloat16"}
            and p.key() != rule.choose_numerics(INPUTS, "file").key())


def test_an_engines_numerics_do_not_follow_the_plans_threads(tmp_path, monkeypatch):
    from stratum.engine import builder
    from stratum.engine.config import EngineConfig
    from stratum.kernels import native
    from tests.factories import make_tiny_gguf

    if not native.available():
        pytest.skip(native.status())
    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    config = EngineConfig(model=str(path))
    keys = set()
    for threads in (1, 2):
        monkeypatch.setattr(builder, "select_plan",
                            lambda *a, t=threads, **k: KernelPlan("cpu", t, source=PlanSource.MEASURED))
        resolved = builder.resolve(config, builder.load(config))
        assert resolved.num_threads == threads and resolved.numerics.step == "native"
        keys.add(resolved.numerics.key())
    assert len(keys) == 1


def test_the_native_step_gives_the_same_bits_at_every_thread_count(tmp_path):
    """What lets the plan choose the native step's threads by speed: logits equal bit for bit."""
    import torch

    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams
    from stratum.kernels import native
    from tests.factories import make_tiny_gguf

    if not native.available():
        pytest.skip(native.status())
    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = []
    for threads in (1, 2):
        llm = LLM(str(path), num_threads=threads, prefill_threads=threads, num_kv_blocks=64, block_size=4)
        assert llm.engine.config.numerics.step == "native"
        out = [llm.engine.add_request(llm.engine.tokenizer.encode(p), params) for p in ("Hello there", "One two three")]
        while llm.engine.has_unfinished():
            llm.engine.step()
        runs.append([torch.stack([s.readouts.logits[p] for p in sorted(s.readouts.logits)]) for s in out])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
