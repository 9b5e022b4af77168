"""GGUF tensor formats and what runs them: K-quant dequantization against gguf-py's reference, a
Q4_K_M-style file against its float model, unsupported types and architectures refused by name, and
the native step taken only by the families and formats it computes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stratum.engine import LLM
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.kernels import kquant, native
from stratum.kernels.packed import PACKED_QTYPES
from stratum.models.loader import ModelLoadError, load_checkpoint
from tests.factories import PACKED_MIXES, make_family_dir, write_family_gguf
from tests.kquants import quantize


pytestmark = pytest.mark.usefixtures("module_stratum_home")  # checkpoint caches of its own


# ---- K-quant blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_dequantize_is_bit_exact_with_gguf_reference(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    g = np.random.default_rng(7)
    weights = (g.standard_normal((48, 512)) * g.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    weights[3] = 0.0  # an all-zero block: zero scales
    weights[5, :256] = np.abs(weights[5, :256])  # a block with no negative weight: zero mins
    raw = quantize(weights, qtype)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(48, 512)
    ours = kquant.dequantize(qtype, raw, (48, 512)).numpy()
    assert np.array_equal(ours, ref)
    # and random bytes, every bit pattern of scales and quants (fp16 d kept finite)
    raw = g.integers(0, 256, raw.shape, dtype=np.uint8)
    at = 208 if qtype == "Q6_K" else 0
    blocks = raw.reshape(48, 2, -1)
    blocks[..., at : at + 2] = np.frombuffer(np.float16(0.03).tobytes(), np.uint8)
    if qtype != "Q6_K":
        blocks[..., 2:4] = np.frombuffer(np.float16(-0.02).tobytes(), np.uint8)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).reshape(48, 512)
    assert np.array_equal(kquant.dequantize(qtype, raw, (48, 512)).numpy(), ref)


def test_kquant_unpack_gives_the_affine_sub_block_form():
    raw = quantize(np.linspace(-1, 1, 2 * 256, dtype=np.float32).reshape(2, 256), "Q4_K")
    q, scale, offset, group = kquant.unpack("Q4_K", raw, (2, 256))
    assert (q.dtype, q.shape, scale.shape, offset.shape, group) == (torch.uint8, (2, 256), (2, 8), (2, 8), 32)
    assert int(q.max()) <= 15
    with pytest.raises(ValueError, match="Q4_0: not a K-quant"):
        kquant.unpack("Q4_0", raw, (2, 256))
    with pytest.raises(ValueError, match="do not hold"):
        kquant.unpack("Q4_K", raw, (4, 256))


# ---- a Q4_K_M-style file ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    # K-quant rows need 256 inputs: hidden 256, every projection's input a multiple of 256
    return make_family_dir(tmp_path_factory.mktemp("qwen-256"), "qwen2", hidden_size=256, intermediate_size=512,
                           num_attention_heads=8, num_key_value_heads=4)


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    engine = llm.engine
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, return_logits=True),
                             cache_policy=CachePolicy.bypass())
    while engine.has_unfinished():
        engine.step()
    return torch.stack([seq.readouts.logits[p] for p in range(len(ids))])


def test_q4_k_m_file_loads_runs_and_stays_close_to_the_float_model(qwen_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    # llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output projection and some ffn_down / attn_v tensors
    path = write_family_gguf(qwen_dir, tmp_path / "q4km.gguf", qtype="Q4_K", head_qtype="Q6_K",
                             qtypes={"blk.0.ffn_down": "Q6_K", "blk.0.attn_v": "Q6_K"})
    assert {q.qtype for q in load_checkpoint(path).quantized.values()} == {"Q4_K", "Q6_K"}
    quant = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, int4_max_tokens=0, native_step=False)
    assert quant.engine.kernel_choices["native_step_refused"] is None

    ids = quant.engine.tokenizer.encode("The capital of Japan is Tokyo. def add(a, b):\n    return a + b")
    ours = _logits(quant, ids)
    # exactly the file's weights: transformers reads the same GGUF, dequantized by gguf-py
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    assert (ours.log_softmax(-1) - expected.log_softmax(-1)).abs().max() <= 2e-4

    # close to the float model: between Q8_0 and Q4_0 of the same weights
    def error(llm: LLM) -> float:
        return float((_logits(llm, ids) - dense).pow(2).mean().sqrt() / dense.std())

    kw = dict(dtype="float32", device="cpu", num_kv_blocks=32, int4_max_tokens=0, native_step=False)
    dense = _logits(LLM(str(qwen_dir), **kw), ids)
    q8 = LLM(str(write_family_gguf(qwen_dir, tmp_path / "q8.gguf", qtype="Q8_0", head_qtype="Q8_0")), **kw)
    q4 = LLM(str(write_family_gguf(qwen_dir, tmp_path / "q4.gguf", qtype="Q4_0", head_qtype="Q4_0")), **kw)
    errors = {"Q8_0": error(q8), "Q4_K_M": error(quant), "Q4_K_M native": error(_native(path)), "Q4_0": error(q4)}
    assert errors["Q8_0"] < errors["Q4_K_M"] < errors["Q4_0"], errors
    assert errors["Q8_0"] < errors["Q4_K_M native"] < errors["Q4_0"], errors


def _native(path) -> LLM:
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, int4_max_tokens=0, native_step=True)
    assert llm.engine.kernel_choices["step"] == "native, packed blocks", llm.engine.kernel_choices
    return llm


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
@pytest.mark.parametrize("mix", list(PACKED_MIXES))
def test_native_step_runs_every_packed_format_as_the_pytorch_path_does(mix, qwen_dir, tmp_path):
    path = write_family_gguf(qwen_dir, tmp_path / "mix.gguf", **PACKED_MIXES[mix])
    native_engine = _native(path).engine
    assert native_engine.model.packed_head is not None  # the output projection as stored too
    torch_engine = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, int4_max_tokens=0,
                       native_step=False).engine
    assert_native_matches_pytorch(torch_engine, native_engine)


def assert_native_matches_pytorch(torch_engine, native_engine) -> None:
    """Greedy tokens equal, and logits within the bound of the native step's int16 activations (as
    tests/test_packed_step.py bounds them), on one prompt through each engine."""
    ids = native_engine.tokenizer.encode("The capital of Japan is Tokyo. def add(a, b):")
    outs = []
    for engine in (torch_engine, native_engine):
        seq = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                     return_logits=True),
                                 cache_policy=CachePolicy.bypass())
        while engine.has_unfinished():
            engine.step()
        outs.append(seq)
    a, b = outs
    assert a.output_token_ids == b.output_token_ids
    for p in a.readouts.logits:
        torch.testing.assert_close(b.readouts.logits[p], a.readouts.logits[p], rtol=1e-3,
                                   atol=1e-3 * float(a.readouts.logits[p].abs().max()))


def _is_mapped(a: np.ndarray) -> bool:
    """Whether an array is a view whose memory is a mapped file (through any chain of views)."""
    import mmap

    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def test_k_quant_file_is_mapped_and_held_quantized_never_dense(qwen_dir, tmp_path):
    """The loader maps the file and keeps its blocks; the checkpoint cache holds no tensor data; on
    the PyTorch path the Q4_K projections run on int4 copies of their blocks with no dense weight,
    and only what no kernel takes (the Q6_K parts) is dequantized, part by part."""
    from stratum.kernels.quant import Int4Weight, Parts
    from stratum.layers.linear import Linear

    path = write_family_gguf(qwen_dir, tmp_path / "q4km.gguf", qtype="Q4_K", head_qtype="Q6_K",
                             qtypes={"blk.0.ffn_down": "Q6_K", "blk.0.attn_v": "Q6_K"})
    for ck in (load_checkpoint(path), load_checkpoint(path)):  # converted, then from the cache
        assert ck.quantized and not set(ck.quantized) & set(ck.weights)  # no dense copy beside the blocks
        assert all(_is_mapped(q.data) for q in ck.quantized.values())  # views of the mapped file
    cache = sum(f.stat().st_size for f in ck.cache_dir.iterdir())
    assert cache < path.stat().st_size / 2  # metadata only (it was 8x the file: every tensor dense)

    kw = dict(device="cpu", num_kv_blocks=32, native_step=False, enable_prefix_cache=False)
    held = LLM(str(path), dtype="bfloat16", int4_max_tokens=1 << 20, **kw)
    model = held.engine.model
    for i, layer in enumerate(model.layers):
        for name, module in layer.named_modules():
            if not isinstance(module, Linear):
                continue
            if (i, name) == (0, "mlp.down_proj"):  # Q6_K: the native kernel's blocks where it takes them, else dense
                assert (module.quantized is not None) == ("Q6_K" in PACKED_QTYPES and native.available())
                continue
            assert module.weight.numel() == 0 and module.quantized is not None, (i, name)
            if (i, name) == (0, "self_attn.qkv_proj"):  # Q4_K q and k as int4, the Q6_K v on its own
                assert isinstance(module.quantized, Parts) and isinstance(module.quantized.parts[0], Int4Weight)
            else:
                assert isinstance(module.quantized, Int4Weight), (i, name)
    assert model.weight_forms["model.layers.1.mlp.down_proj.weight"] == "int4"
    # the held cache (int4 copies of the Q4_K blocks) is about the size of what it replaces
    assert sum(f.stat().st_size for f in ck.cache_dir.iterdir()) < 2 * path.stat().st_size

    # and it computes the file's model: close to the same file dequantized to fp32
    ids = held.engine.tokenizer.encode("The capital of Japan is Tokyo. def add(a, b):")
    reference = _logits(LLM(str(path), dtype="float32", int4_max_tokens=0, **kw), ids)
    error = float((_logits(held, ids) - reference).pow(2).mean().sqrt() / reference.std())
    assert error < 0.05, error


# ---- refused by name -------------------------------------------------------------------------------

def _rewrite_gguf(src_path, out, arch: str = "qwen2", q2k: str | None = None):
    """The GGUF at src_path written again as `arch`, with tensor `q2k` (a [512, 256] one) in Q2_K, a
    type gguf-py reads but this runtime does not load."""
    import gguf

    src = gguf.GGUFReader(str(src_path))
    writer = gguf.GGUFWriter(str(out), arch)
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        name = field.name.replace("qwen2.", f"{arch}.", 1)
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in src.tensors:
        array = np.array(tensor.data)
        if tensor.name == q2k:  # [512, 256] as Q2_K blocks (84 bytes per 256 weights)
            raw = np.zeros((512, 84), np.uint8)
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            writer.add_tensor(tensor.name, array.reshape([int(x) for x in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unsupported_tensor_type_and_architecture_are_errors_naming_them(qwen_dir, tmp_path, capsys):
    from stratum.cli import main

    f32 = write_family_gguf(qwen_dir, tmp_path / "f32.gguf")
    q2k = _rewrite_gguf(f32, tmp_path / "q2k.gguf", q2k="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match="blk.1.ffn_up.weight is Q2_K, a type this runtime does not load"):
        load_checkpoint(q2k)
    falcon = _rewrite_gguf(f32, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        load_checkpoint(falcon)
    # `stratum info` says the same, and exits non-zero, rather than describing a fallback
    for path, named in ((q2k, "Q2_K"), (falcon, "'falcon'")):
        assert main(["info", str(path), "--threads", "1"]) == 1
        out = capsys.readouterr()
        assert named in json.loads(out.out)["plan_error"] and named in out.err

    folder = make_family_dir(tmp_path / "falcon", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(ModelLoadError, match="model_type 'falcon' is not supported"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
    with pytest.raises(ModelLoadError, match="RoPE scaling 'longrope' is not supported"):
        load_checkpoint(folder)


def test_a_dense_fallback_is_never_silent(qwen_dir, tmp_path, caplog):
    """What runs dequantized, and a family the native step refuses, are said at load, by type and by reason."""
    import logging

    caplog.set_level(logging.WARNING, logger="stratum")
    path = write_family_gguf(qwen_dir, tmp_path / "q4k.gguf", qtype="Q4_K", head_qtype="Q6_K")
    LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, int4_max_tokens=0, native_step=False)
    said = [r.getMessage() for r in caplog.records if "dequantized to dense float32" in r.getMessage()]
    assert said and "Q4_K tensors" in said[0] and "Q6_K tensors" in said[0]

    caplog.clear()
    gemma = make_family_dir(tmp_path / "gemma2", "gemma2", hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    LLM(str(write_family_gguf(gemma, tmp_path / "gemma2.gguf", qtype="Q4_0", head_qtype="Q8_0")), dtype="float32",
        device="cpu", num_kv_blocks=32, int4_max_tokens=0, native_step=True)
    assert any("the native step does not run this model" in r.getMessage() and "gemma2" in r.getMessage()
               for r in caplog.records)


# ---- the native step: only where it computes the model -----------------------------------------------

NATIVE_FAMILIES = ["qwen2", "qwen3", "mistral", "phi3"]


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
@pytest.mark.parametrize("family", NATIVE_FAMILIES + ["gemma2", "gemma3", "phi3-window"])
def test_native_step_runs_only_the_families_it_computes(family, tmp_path):
    name = family.split("-")[0]
    folder = make_family_dir(tmp_path / family, name, **({"sliding_window": None} if family == "phi3" else {}))
    path = write_family_gguf(folder, tmp_path / f"{family}.gguf", qtype="Q4_0", head_qtype="Q8_0")
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=64, int4_max_tokens=0, enable_prefix_cache=False)
    native_engine = LLM(str(path), native_step=True, **kw).engine
    if family not in NATIVE_FAMILIES:
        assert native_engine.kernel_choices["step"] == "pytorch"
        assert native_engine.kernel_choices["native_step_refused"]
        return
    assert native_engine.kernel_choices["step"] == "native, packed blocks"
    torch_engine = LLM(str(path), native_step=False, **kw).engine
    assert_native_matches_pytorch(torch_engine, native_engine)


# ---- stratum info FILE ---------------------------------------------------------------------------------

def test_info_tells_architecture_tensor_types_and_what_runs_packed(qwen_dir, tmp_path, capsys):
    from stratum.cli import main

    gemma = make_family_dir(tmp_path / "gemma2", "gemma2", hidden_size=256, intermediate_size=512,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    path = write_family_gguf(gemma, tmp_path / "gemma2-q4km.gguf", qtype="Q4_K", head_qtype="Q6_K")
    assert main(["info", str(path), "--threads", "1"]) == 0
    info = json.loads(capsys.readouterr().out)
    ck = info["checkpoint"]
    assert ck["architecture"] == "gemma2"
    assert ck["features"]["attn_logit_softcap"] == 5.0 and ck["features"]["sliding_layers"] == [0]
    assert ck["tensor_types"] == {"F32": 1 + 2 * 4, "Q4_K": 2 * 7, "Q6_K": 1}  # norms; projections; tied embedding
    assert ck["step"] == "pytorch" and "not Llama-shaped" in ck["native_step_refused"]
    # the rule's default
    assert info["engine"]["dtype"] == "float32" and info["numerics"]["result"]["step"] == "pytorch"
    if native.available():  # every projection on the native kernel, as stored
        form = "packed kernel, as stored"
        assert ck["projections"] == {f"Q4_K: {form}": 2 * 4, f"output projection (Q6_K): {form}": 1}
        assert ck["quantized_tensors"] == {"Q4_K": {form: 2 * 7}, "Q6_K": {form: 1}}
        assert ck["dequantized_to_dense"] == []
    else:  # no kernel here takes the blocks: every one dequantized, and said so
        assert ck["projections"] == {"Q4_K: dense float32": 2 * 4, "output projection (Q6_K): dense float32": 1}
        assert ck["dequantized_to_dense"] == ["Q4_K", "Q6_K"]
    assert "masked" in ck["attention"]

    q4 = write_family_gguf(qwen_dir, tmp_path / "qwen-q4.gguf", qtype="Q4_0", head_qtype="Q8_0")
    assert main(["info", str(q4), "--threads", "1"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["tensor_types"]["Q4_0"] == 2 * 7 + 1 and ck["native_step_refused"] is None  # and the untied embedding
    # the untied Q4_0 embedding is looked up from its blocks, never held dense
    assert ck["quantized_tensors"]["Q4_0"]["rows dequantized at lookup"] == 1

    q4km = write_family_gguf(qwen_dir, tmp_path / "qwen-q4km.gguf", qtype="Q4_K", head_qtype="Q6_K",
                             qtypes={"blk.0.attn_v": "Q6_K"})
    assert main(["info", str(q4km), "--threads", "1"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["native_step_refused"] is None
    assert (ck["step"] != "pytorch") == native.available()  # the rule: the native step wherever it runs
    if native.available():  # each projection names its formats
        # layer 0's q, k (Q4_K) and v (Q6_K), one projection of two formats
        assert ck["projections"][
            "Q4_K: native step, as stored in q4k tiles + Q6_K: native step, as stored in q6k tiles"] == 1
        assert main(["info", str(q4km), "--threads", "1", "--activations", "int8"]) == 0  # the user's trade, said
        numerics = json.loads(capsys.readouterr().out)["numerics"]
        assert numerics["inputs"]["activations"] == numerics["result"]["activations"] == "int8"

    f32 = write_family_gguf(qwen_dir, tmp_path / "qwen-f32.gguf")
    assert main(["info", str(f32), "--threads", "1"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["step"] == "pytorch" and "projections stored as dense" in ck["native_step_refused"]
    assert main(["info", str(f32), "--threads", "1", "--activations", "int8"]) == 1  # no native step: refused, and why
    assert "--activations int8" in capsys.readouterr().err

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    assert main(["info", str(bad)]) == 1
    assert "not a readable GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K", "Q4_1"])
def test_recent_rows_give_the_tables_own_rows_and_keep_no_more_than_their_bound(qtype):
    """An embedding dequantized at lookup keeps recent rows for the next decode steps: the same fp32
    values as the table's own lookup, whether kept, evicted or looked up again, and at most its bound."""
    from stratum.kernels.quant import RecentRows
    from stratum.models.loader import QuantizedTensor

    n, k = 40, 256
    weights = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    table = QuantizedTensor(qtype, quantize(weights, qtype), (n, k))
    recent = RecentRows(table, max_bytes=6 * k * 4)  # six rows
    assert recent.capacity == 6
    for ids in ([5], [5], [7, 5, 7], [1, 2, 3, 4, 9, 10, 11], [5], list(range(n)) * 2, [39, 0]):
        ids = torch.tensor(ids)
        assert torch.equal(recent.rows(ids), table.rows(ids))
        assert len(recent._kept) <= recent.capacity


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_an_embedding_lookup_gives_the_rows_of_the_dense_tensor(qtype):
    """Rows are looked up by gguf-py's dequantization, the dense tensor by kernels.kquant's for the
    K-quants: the same fp32 values."""
    from stratum.models.loader import QuantizedTensor

    n, k = 24, 512
    weights = np.random.default_rng(4).standard_normal((n, k)).astype(np.float32) * 3
    table = QuantizedTensor(qtype, quantize(weights, qtype), (n, k))
    ids = torch.tensor([0, 23, 7, 7, 12])
    assert torch.equal(table.rows(ids), table.dense()[ids])
